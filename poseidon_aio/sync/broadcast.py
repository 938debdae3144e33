"""Rank 0's arrays to every rank over the worker mesh (parameters at start, buffers each step)."""

from __future__ import annotations

import asyncio
from typing import Mapping, Sequence

import numpy as np

from ..errors import SyncTimeout
from ..wire import DType, Kind, wire_dtype


async def parameters(rank: int, peers: Mapping[int, object], arrays: Sequence[np.ndarray], timeout: float) -> None:
    """Rank 0's parameters (and buffers) to every rank, at start."""
    await broadcast(rank, peers, arrays, Kind.PARAMS, 0, timeout, what="parameters and buffers")


async def buffers(
    rank: int, peers: Mapping[int, object], arrays: Sequence[np.ndarray], clock: int, timeout: float
) -> None:
    """Rank 0's buffers (BatchNorm statistics) to every rank, at the end of step ``clock``: one
    frame per peer and dtype, not one per buffer (a ResNet-20 has 45, mostly a few hundred
    bytes)."""
    groups: dict = {}  # dtype -> indices of the arrays of that dtype, in order
    for i, array in enumerate(arrays):
        groups.setdefault(array.dtype, []).append(i)
    if rank == 0:  # (broadcast copies these again: a few KiB)
        flats = [np.concatenate([arrays[i].reshape(-1) for i in members]) for members in groups.values()]
    else:
        flats = [np.empty(sum(arrays[i].size for i in members), dtype=dtype) for dtype, members in groups.items()]
    await broadcast(rank, peers, flats, Kind.DATA, clock, timeout, what="buffers")
    if rank != 0:
        for flat, members in zip(flats, groups.values()):
            offset = 0
            for i in members:
                n = arrays[i].size
                np.copyto(arrays[i], flat[offset : offset + n].reshape(arrays[i].shape))
                offset += n


async def broadcast(
    rank: int,
    peers: Mapping[int, object],
    arrays: Sequence[np.ndarray],
    kind: Kind,
    clock: int,
    timeout: float,
    *,
    what: str,
) -> None:
    """Make every rank's ``arrays`` equal rank 0's: rank 0 sends, the others receive in place.

    Rank 0 sends copies: a send may still hold the bytes when the caller changes an array
    (the next forward updates BatchNorm statistics in place).

    Raises:
        SyncTimeout: rank 0's arrays did not arrive within ``timeout`` (``what`` names them).
    """
    if not peers:
        return
    if rank == 0:
        sends = []
        for key, array in enumerate(arrays):
            payload = array.copy()
            dtype = wire_dtype(payload.dtype, DType.BYTES)
            for conn in peers.values():
                sends.append(conn.send(kind, payload, key=key, clock=clock, dtype=dtype))
        await asyncio.gather(*sends)
        return
    conn = peers[0]
    waits = [conn.expect(kind, key, clock, into=array) for key, array in enumerate(arrays)]
    try:
        await asyncio.wait_for(asyncio.gather(*waits), timeout)
    except TimeoutError:
        raise SyncTimeout(f"rank {rank}: rank 0's {what} for clock {clock} did not arrive within {timeout} s") from None
