"""The PowerSGD payload: one codec for the low-rank scheme's sender and receiver.

PowerSGD (Vogels et al. 2019) all-reduces two small matrices per layer and step: ``P = M Q``
(with the layer's 1-D parameters, its bias, appended: they travel exact) and then
``Q = M^T P_hat``. Each is flattened (row-major, the layer's matrices in parameter order) and
all-reduced over the worker mesh in chunks; a chunk of ``n`` values is ``n`` float32,
little-endian (``4n`` bytes, payload dtype ``FLOAT32``). The sums are exact float32 in rank order,
so this codec only checks that a chunk is the one expected: no value is refused (a diverged
step's inf or nan reaches every replica, as an exact scheme would carry it).
"""

from __future__ import annotations

import numpy as np

from ..errors import LocalProtocolError, RemoteProtocolError
from .layout import DType, Frame

DTYPE = DType.FLOAT32
ITEM_BYTES = 4


def nbytes(n: int) -> int:
    """Payload bytes of a chunk of ``n`` values."""
    return ITEM_BYTES * n


def encode(x: np.ndarray) -> list:
    """The payload parts of float32 values ``x`` (1-D): the values themselves, not copied.

    >>> expand(encode(np.ones(3, dtype=np.float32))).tolist()
    [1.0, 1.0, 1.0]

    Raises:
        LocalProtocolError: ``x`` is not 1-D float32 (a bug on this side).
    """
    if x.dtype != np.float32 or x.ndim != 1:
        raise LocalProtocolError(f"the low-rank codec takes 1-D float32 values, got {x.dtype} {x.shape}")
    return [np.ascontiguousarray(x)]


def expand(parts: list) -> np.ndarray:
    """The values of an encoded chunk, as a receiver reads them (exact: the values sent)."""
    return parts[0]


def decode(frame: Frame, n: int, *, what: str) -> np.ndarray:
    """Float32 values of a received chunk of ``n`` values (a view of the payload, no copy).

    Args:
        what: names the layer, clock, matrix (P or Q) and chunk in the error message.
    Raises:
        RemoteProtocolError: the payload is not ``n`` float32 values (the ranks build different
            models or use another PowerSGD rank, or a peer is broken).
    """
    if frame.header.dtype is not DTYPE or frame.header.length != nbytes(n):
        raise RemoteProtocolError(
            f"rank {frame.rank} sent {frame.header.length} bytes of {frame.header.dtype.name} for {what}: expected {n} "
            f"float32 ({nbytes(n)} bytes) — do the ranks build the same model with the same PowerSGD rank?"
        )
    return np.frombuffer(frame.payload, dtype=np.float32)
