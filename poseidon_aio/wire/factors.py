"""The sufficient-factor payload: one codec for the SFB syncer and the Project-Adam shard.

A FACTORS frame for a fully-connected layer with an M×N weight carries one rank's K rows of
``u`` (the output's gradient, K×M) followed by its K rows of ``v`` (the layer's input, K×N), both
float32, row-major, back to back: ``4 K (M + N)`` bytes, K >= 0 (a rank that did not use the
layer in a step sends K = 0). K is not in the payload; it follows from the length.
"""

from __future__ import annotations

import numpy as np

from ..errors import LocalProtocolError, RemoteProtocolError
from .layout import DType, Frame

DTYPE = DType.FLOAT32


def encode(u: np.ndarray, v: np.ndarray) -> list:
    """The payload parts of ``u`` (K×M) and ``v`` (K×N): gathered by the sender, not copied."""
    if u.dtype != np.float32 or v.dtype != np.float32 or u.shape[0] != v.shape[0]:
        raise LocalProtocolError(
            f"factors must be float32 with as many rows: u {u.shape} {u.dtype}, v {v.shape} {v.dtype}"
        )
    return [np.ascontiguousarray(u), np.ascontiguousarray(v)]


def nbytes(rows: int, m: int, n: int) -> int:
    """Payload bytes of ``rows`` rows of factors for an M×N layer."""
    return 4 * rows * (m + n)


def decode(frame: Frame, m: int, n: int, *, what: str) -> tuple:
    """``(u, v)`` views of a FACTORS frame's payload for an M×N layer (no copy).

    Args:
        what: names the layer and clock in the error message.
    Raises:
        RemoteProtocolError: the payload is not K rows of M + N float32 (the ranks build
            different models, or a peer is broken).
    """
    floats = frame.header.length // 4
    if frame.header.dtype is not DTYPE or frame.header.length % 4 or floats % (m + n):
        raise RemoteProtocolError(
            f"rank {frame.rank} sent {frame.header.length} bytes of {frame.header.dtype.name} factors for {what} "
            f"({m}x{n}): not K rows of {m}+{n} float32 — do the ranks build the same model?"
        )
    k = floats // (m + n)
    flat = np.frombuffer(frame.payload, dtype=np.float32)
    return flat[: k * m].reshape(k, m), flat[k * m :].reshape(k, n)
