"""The rows payload: one codec for the rows scheme's sender and receiver.

An embedding's weight gradient is zero but in the rows of the tokens its batch holds. One rank's
contribution, all-gathered to every peer, is two sections back to back, little-endian (payload
dtype ``BYTES``):

1. ``k`` uint32: the indices of the rows sent, strictly increasing, each below the vocabulary;
2. ``k x n`` float32: those rows, in that order.

``4 k (n + 1)`` bytes; ``k`` varies with the batch, so it is the payload's length that says it
(``n`` and the vocabulary follow from the model, which every rank agrees on). A receiver refuses
a length that is not a whole number of rows, more rows than the vocabulary, an index at or past
it, and indices that are not strictly increasing (a repeated row would count twice); values are
not refused (a diverged step's inf or nan reaches every replica, as a dense scheme would carry it).
"""

from __future__ import annotations

import numpy as np

from ..errors import LocalProtocolError, RemoteProtocolError
from .layout import DType, Frame

DTYPE = DType.BYTES


def nbytes(k: int, width: int) -> int:
    """Payload bytes of ``k`` rows of ``width`` floats and their indices."""
    return 4 * k * (width + 1)


def touched(grad: np.ndarray) -> tuple:
    """``(indices, rows)``: the rows of a ``vocab x width`` gradient that are not all zero, in
    increasing order (the rows a copy, the gradient may be reused before they are sent).

    >>> g = np.zeros((5, 2), np.float32); g[3, 1] = 1.0; g[1, 0] = -2.0
    >>> idx, rows = touched(g); idx.tolist(), rows.tolist()
    ([1, 3], [[-2.0, 0.0], [0.0, 1.0]])
    """
    indices = np.flatnonzero(grad.any(axis=1)).astype(np.uint32)
    return indices, grad[indices]


def encode(indices: np.ndarray, rows: np.ndarray) -> list:
    """The payload parts (gathered by the sender, not copied).

    >>> parts = encode(np.array([0, 4], np.uint32), np.ones((2, 3), np.float32))
    >>> sum(p.nbytes for p in parts) == nbytes(2, 3)
    True

    Raises:
        LocalProtocolError: wrong dtypes or shapes (a bug on this side).
    """
    if indices.dtype != np.uint32 or rows.dtype != np.float32 or rows.ndim != 2 or indices.shape != (rows.shape[0],):
        raise LocalProtocolError(
            "rows payload: uint32 indices and as many float32 rows, "
            f"got {indices.dtype} {indices.shape} and {rows.dtype} {rows.shape}"
        )
    return [np.ascontiguousarray(indices), np.ascontiguousarray(rows)]


def decode(frame: Frame, vocab: int, width: int, *, what: str) -> tuple:
    """``(indices, rows)`` of a received payload (views of it, no copy).

    Args:
        vocab, width: the embedding's weight shape (``vocab x width``).
        what: names the layer and clock in the error message.
    Raises:
        RemoteProtocolError: a payload of another dtype or of a length that is not a whole
            number of rows, more rows than ``vocab``, an index out of range, or indices not
            strictly increasing.
    """
    length, row = frame.header.length, nbytes(1, width)
    if frame.header.dtype is not DTYPE or length % row or length // row > vocab:
        raise RemoteProtocolError(
            f"rank {frame.rank} sent {length} bytes of {frame.header.dtype.name} for {what}: "
            "expected a whole number of rows "
            f"of {row} bytes of BYTES (a uint32 index and {width} float32 each), at most {vocab} of them "
            "— do the ranks build the same model?"
        )
    k = length // row
    raw = np.frombuffer(frame.payload, dtype=np.uint8)
    indices = raw[: 4 * k].view(np.uint32)
    rows = raw[4 * k : length].view(np.float32).reshape(k, width)
    if k:
        top = int(indices.max())
        if top >= vocab:
            raise RemoteProtocolError(
                f"rank {frame.rank} sent the row {top} for {what}, whose vocabulary is {vocab} rows"
            )
        if k > 1 and not bool(np.all(indices[1:] > indices[:-1])):
            i = int(np.argmin(indices[1:] > indices[:-1]))
            raise RemoteProtocolError(
                f"rank {frame.rank} sent rows that do not strictly increase for {what} (position {i + 1}: "
                f"{int(indices[i])} then {int(indices[i + 1])}): a repeated row would count twice"
            )
    return indices, rows
