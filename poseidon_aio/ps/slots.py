"""Receive slots and reply buffers, reused clock after clock.

A fresh NumPy array per clock costs a page fault (and the kernel zeroing the page) per 4 KiB
touched: ~80 MiB of receive slots and 16 MiB of replies per shard per step for a 64 MiB model on
4 workers. Both pools hand out arrays made once per message.
"""

from __future__ import annotations

import sys
from typing import Optional

import numpy as np


class SlotPool:
    """One ``(workers, numel)`` array per message and clock in flight: row ``r`` receives rank
    ``r``'s push (the kernel writes it there, zero copy)."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self._free: dict = {}

    def take(self, mid: int, numel: int, dtype: np.dtype) -> np.ndarray:
        free = self._free.get(mid)
        return free.pop() if free else np.empty((self.workers, numel), dtype=dtype)

    def give(self, mid: int, slots: np.ndarray) -> None:
        """Return ``slots`` once no frame is still being written into them."""
        self._free.setdefault(mid, []).append(slots)


class ReplyBuffers:
    """Reply buffers reused once no send still reads them.

    A reply is sent to every worker straight from its buffer, and a transport may hold the buffer
    until the kernel has taken the bytes; nothing tells us when. A buffer only the pool still
    references (CPython's reference count) is free. At most 4 per message are kept.
    """

    def __init__(self) -> None:
        self._free: dict = {}

    def take(self, mid: int, numel: int, dtype: np.dtype) -> np.ndarray:
        pool = self._free.setdefault(mid, [])
        for buf in pool:
            if sys.getrefcount(buf) == 3:  # the list, the loop variable and getrefcount's argument
                return buf
        buf = np.empty(numel, dtype=dtype)
        if len(pool) < 4:
            pool.append(buf)
        return buf


def reduce_mean(slots: np.ndarray, contributors: list, out: Optional[np.ndarray] = None, weight: int = 1) -> np.ndarray:
    """Mean of ``slots[r]`` over ``contributors``, summed in the given (sorted) order; each slot
    the sum of ``weight`` workers' gradients (a host's push), so the sum is divided by
    ``weight * len(contributors)``.

    The order is fixed, so the result's bits do not depend on which push arrived first.
    """
    first = slots[contributors[0]]
    if len(contributors) == 1:
        if out is None:
            out = first.copy()
        else:
            np.copyto(out, first)
        if weight != 1:
            np.divide(out, out.dtype.type(weight), out=out)
        return out
    # The first sum writes ``out``: a pass over the bytes fewer than copying the first row in.
    out = np.add(first, slots[contributors[1]], out=out)
    for r in contributors[2:]:
        np.add(out, slots[r], out=out)
    np.divide(out, out.dtype.type(weight * len(contributors)), out=out)
    return out


class Pending:
    """A message's clock in flight: who has pushed, into what, since when."""

    __slots__ = ("slots", "have", "landing", "first_at", "timers", "deadline_passed")

    def __init__(self, slots) -> None:
        self.slots = slots  # (workers, numel) array of pushes, or {rank: (u, v)} of factors
        self.have: set = set()
        self.landing: set = set()  # ranks whose push the kernel is still writing into its slot
        self.first_at = 0.0
        self.timers: list = []
        self.deadline_passed = False
