"""The top-k payload: one codec for the top-k scheme's sender and receiver.

One rank's contribution to a layer, all-gathered to every peer, is three sections back to back,
little-endian (payload dtype ``BYTES``):

1. ``e`` float32: the layer's 1-D parameters (its bias), dense and exact: a few hundred values
   that top-k would starve (k of 1 % of 128 is 2);
2. ``k`` uint32: indices into the layer's matrix parameters flattened and concatenated in
   parameter order, strictly increasing, each below ``d`` (their element count);
3. ``k`` float32: the values at those indices.

``4e + 8k`` bytes. ``e``, ``k`` and ``d`` follow from the model and the job's top-k ratio, which
every rank agrees on (the compression settings' digest), so none is sent. A message of several
layers (an MG-WFBP group) carries their sections back to back in model order, each layer with
its own ``e``, ``k`` and ``d`` (:func:`decode_layers`). A receiver refuses a
payload of another length, an index at or past ``d``, and indices that are not strictly
increasing (a repeated index would count a value twice); values are not refused (a diverged
step's inf or nan reaches every replica, as an exact scheme would carry it).
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from ..errors import LocalProtocolError, RemoteProtocolError
from .layout import DType, Frame

DTYPE = DType.BYTES


def nbytes(dense: int, k: int) -> int:
    """Payload bytes of ``dense`` exact values and ``k`` index-value pairs."""
    return 4 * dense + 8 * k


def encode(dense: np.ndarray, indices: np.ndarray, values: np.ndarray) -> list:
    """The payload parts (gathered by the sender, not copied).

    >>> parts = encode(np.zeros(2, np.float32), np.array([3, 9], np.uint32), np.ones(2, np.float32))
    >>> sum(p.nbytes for p in parts) == nbytes(2, 2)
    True

    Raises:
        LocalProtocolError: wrong dtypes or lengths (a bug on this side).
    """
    if (
        dense.dtype != np.float32
        or indices.dtype != np.uint32
        or values.dtype != np.float32
        or indices.shape != values.shape
    ):
        raise LocalProtocolError(
            f"top-k payload: dense float32, indices uint32 and as many float32 values, got {dense.dtype}, "
            f"{indices.dtype} {indices.shape}, {values.dtype} {values.shape}"
        )
    return [np.ascontiguousarray(dense), np.ascontiguousarray(indices), np.ascontiguousarray(values)]


def decode(frame: Frame, dense: int, k: int, size: int, *, what: str) -> tuple:
    """``(dense values, indices, values)`` of a received payload (views of it, no copy).

    Args:
        dense, k: how many exact values and index-value pairs the layer's payload holds.
        size: ``d``, the element count of the layer's matrix parameters (indices are below it).
        what: names the layer and clock in the error message.
    Raises:
        RemoteProtocolError: a payload of another length or dtype, an index out of range, or
            indices not strictly increasing.
    """
    return decode_layers(frame, [(dense, k, size)], what=what)[0]


def decode_layers(frame: Frame, layouts: Sequence[tuple], *, what: str, names: Optional[Sequence[str]] = None) -> list:
    """Each layer's ``(dense values, indices, values)`` of a payload holding several layers'
    sections back to back (views of it, no copy).

    Args:
        layouts: ``(dense, k, size)`` of each layer, in the order sent (model order).
        what: names the message and clock in the error message.
        names: each layer's name, for an error in its section.
    Raises:
        RemoteProtocolError: as :func:`decode`, naming the layer whose section is wrong.
    """
    length, expected = frame.header.length, sum(nbytes(dense, k) for dense, k, _ in layouts)
    if frame.header.dtype is not DTYPE or length != expected:
        counts = " and ".join(f"{dense} exact values and {k} index-value pairs" for dense, k, _ in layouts)
        raise RemoteProtocolError(
            f"rank {frame.rank} sent {length} bytes of {frame.header.dtype.name} for {what}: "
            f"expected {counts} ({expected} bytes of BYTES) "
            "— do the ranks build the same model with the same top-k ratio?"
        )
    raw = np.frombuffer(frame.payload, dtype=np.uint8)
    out, at = [], 0
    for n, (dense, k, size) in enumerate(layouts):
        where = what if names is None or len(layouts) == 1 else f"{what} (its layer {names[n]})"
        exact = raw[at : at + 4 * dense].view(np.float32)
        indices = raw[at + 4 * dense : at + 4 * dense + 4 * k].view(np.uint32)
        values = raw[at + 4 * dense + 4 * k : at + nbytes(dense, k)].view(np.float32)
        at += nbytes(dense, k)
        if k:
            top = int(indices.max())
            if top >= size:
                raise RemoteProtocolError(
                    f"rank {frame.rank} sent the index {top} for {where}, whose matrices hold {size} values"
                )
            if k > 1 and not bool(np.all(indices[1:] > indices[:-1])):
                i = int(np.argmin(indices[1:] > indices[:-1]))
                raise RemoteProtocolError(
                    f"rank {frame.rank} sent indices that do not strictly increase for {where} (position {i + 1}: "
                    f"{int(indices[i])} then {int(indices[i + 1])}): a repeated index would count a value twice"
                )
        out.append((exact, indices, values))
    return out
