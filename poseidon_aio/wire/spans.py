"""Arrays that lie back to back in memory, seen as one array: a frame then lands in all of them
with one receive, and nothing is scattered afterwards.

The trainer keeps the results of a step in one buffer per dtype, parameter after parameter (as
DDP's ``gradient_as_bucket_view`` does), so a merged message's keys, which are consecutive slices
of consecutive parameters, are consecutive bytes too. Received through a staging buffer instead,
a merged message costs a fresh buffer (a page fault per 4 KiB) and a copy of its bytes at the
end of every step, on the critical path.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
from numpy.lib.stride_tricks import as_strided


def spanning(arrays: Sequence[np.ndarray]) -> Optional[np.ndarray]:
    """One writeable 1-D view over ``arrays`` if each is C-contiguous and writeable, all have one
    dtype, and each starts at the byte where the one before ends; else ``None``.

    The view holds only the first non-empty array's memory alive: keep every array referenced
    while it is written (two allocations can happen to be adjacent; the bytes still land where
    each array has them).

    >>> buf = np.zeros(6, dtype=np.float32)
    >>> view = spanning([buf[0:2], buf[2:5]])
    >>> view[:] = 1; buf.tolist()
    [1.0, 1.0, 1.0, 1.0, 1.0, 0.0]
    >>> spanning([buf[0:2], buf[3:5]]) is None
    True
    """
    dtype, anchor, end, total = arrays[0].dtype, arrays[0], None, 0
    for a in arrays:
        if a.dtype != dtype or not a.flags.c_contiguous or not a.flags.writeable:
            return None
        if not a.size:  # holds no bytes (and NumPy gives an empty slice its base's address)
            continue
        start = a.__array_interface__["data"][0]
        if end is None:
            anchor = a
        elif start != end:
            return None
        end = start + a.nbytes
        total += a.size
    return as_strided(anchor.reshape(-1), shape=(total,), strides=(dtype.itemsize,))
