"""A bucket's arrays as one flat sequence, cut for an all-reduce: each owner's slice, its chunks,
and where a chunk's elements lie in the arrays; and the copies and sums over those pieces that
move a chunk without joining the arrays first."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..errors import ConfigError
from ..wire import DTYPE_BY_NAME, wire_dtype
from .bucket import Bucket

CHUNKS_PER_LAYER = 1 << 16


class Layout:
    """A bucket's arrays as one flat sequence: owners' slices, their chunks, and where each chunk's
    bytes lie in the arrays (``[(array index, start, stop)]``, element offsets)."""

    def __init__(self, sizes: Sequence[int], world: int, chunk_items: int) -> None:
        total = sum(sizes)
        self.starts = np.cumsum([0, *sizes])
        base, extra = divmod(total, world)
        bounds = [0]
        for r in range(world):
            bounds.append(bounds[-1] + base + (1 if r < extra else 0))
        self._bounds = np.array(bounds)
        self.chunks = []  # (owner, start, stop) in flat elements
        for owner in range(world):
            lo, hi = bounds[owner], bounds[owner + 1]
            while lo < hi:
                self.chunks.append((owner, lo, min(hi, lo + chunk_items)))
                lo = min(hi, lo + chunk_items)
        if len(self.chunks) > CHUNKS_PER_LAYER:
            raise ConfigError(f"a bucket of {total} elements makes {len(self.chunks)} chunks; raise the chunk size")
        self._pieces: dict = {}  # (start, stop) -> pieces: the same few ranges, step after step

    def ring_chunks(self, chunk_items: int):
        """``chunks[c][j] = (start, stop)``: slice ``j`` cut into the same number of chunks of at
        most ``chunk_items``, so chunk ``c`` of every slice walks the ring together; None where a
        chunk would be empty (fewer elements than ranks: go direct)."""
        sizes = np.diff(self._bounds)
        count = max(1, int(-(-int(sizes.max()) // chunk_items)))
        if int(sizes.min()) < count:
            return None
        return [
            [
                (int(lo + size * c // count), int(lo + size * (c + 1) // count))
                for lo, size in zip(self._bounds[:-1], sizes)
            ]
            for c in range(count)
        ]

    def pieces(self, start: int, stop: int) -> list:
        """``[(array, lo, hi)]`` covering flat elements ``[start, stop)``."""
        out = self._pieces.get((start, stop))
        if out is None:
            out = self._pieces[(start, stop)] = self._cut(start, stop)
        return out

    def _cut(self, start: int, stop: int) -> list:
        out = []
        i = int(np.searchsorted(self.starts, start, side="right")) - 1
        while start < stop:
            a_lo = self.starts[i]
            a_hi = self.starts[i + 1]
            hi = min(stop, a_hi)
            if hi > start:
                out.append((i, int(start - a_lo), int(hi - a_lo)))
            start = hi
            i += 1
        return out


def gathered(arrays: list, pieces: list) -> np.ndarray:
    """The flat elements ``pieces`` (``Layout.pieces``) name: a view where they lie in one array."""
    if len(pieces) == 1:
        i, lo, hi = pieces[0]
        return arrays[i][lo:hi]
    return np.concatenate([arrays[i][lo:hi] for i, lo, hi in pieces])


def add_into(acc: np.ndarray, arrays: list, pieces: list) -> None:
    """``acc += `` the flat elements ``pieces`` name, piece by piece: the same float32 additions as
    adding their concatenation, without making it."""
    offset = 0
    for i, lo, hi in pieces:
        part = acc[offset : offset + hi - lo]
        np.add(part, arrays[i][lo:hi], out=part)
        offset += hi - lo


def scatter(flat: np.ndarray, arrays: list, pieces: list) -> None:
    """Copy ``flat`` into the places ``pieces`` name in ``arrays``."""
    offset = 0
    for i, lo, hi in pieces:
        arrays[i][lo:hi] = flat[offset : offset + hi - lo]
        offset += hi - lo


def layout_of(cache: dict, bucket: Bucket, owners: int, chunk_bytes: int, itemsize: int) -> Layout:
    """The bucket's :class:`Layout` over ``owners`` slices, made once per bucket shape (``cache``)."""
    sizes = (bucket.flat[0].size,) if bucket.flat is not None else tuple(g.size for g in bucket.grads)
    key = (bucket.layers, sizes)
    layout = cache.get(key)
    if layout is None:
        layout = cache[key] = Layout(sizes, owners, max(1, chunk_bytes // itemsize))
    return layout


def flat_arrays(bucket: Bucket) -> tuple:
    """``(grads, outs, dtype, wire dtype)``: the bucket's arrays flattened, of one dtype.

    Raises:
        ConfigError: the bucket mixes dtypes, or holds one with no wire type.
    """
    if bucket.flat is not None:  # one buffer each way: no pass per parameter
        grads, outs = [bucket.flat[0]], [bucket.flat[1]]
    else:
        grads = [g.reshape(-1) for g in bucket.grads]
        outs = [o.reshape(-1) for o in bucket.outs]
    dtype = grads[0].dtype
    if any(g.dtype != dtype for g in grads):
        raise ConfigError(
            f"bucket {bucket.label} mixes dtypes {sorted({str(g.dtype) for g in grads})}: "
            "all-reduce one dtype at a time"
        )
    wire = wire_dtype(dtype)
    if wire is None:
        raise ConfigError(
            f"bucket {bucket.label} holds {dtype} arrays, which have no wire type: "
            f"all-reduce {', '.join(DTYPE_BY_NAME)}"
        )
    return grads, outs, dtype, wire
