"""The user's own collectives over the worker mesh: a metric reduced over every rank, a barrier.

Every rank sends its array to every other, one frame a peer, and reduces the P arrays itself in
rank order: every rank then holds the same bits. That is P - 1 times a ring's bytes, and one round
instead of 2 (P - 1): the right trade for what these are for, a loss or an accuracy count of a
few values. Gradients go by the schemes.

Collectives are numbered by the order they are called in (the frames' clock), as
``torch.distributed``'s are: every rank must call them in the same order.
"""

from __future__ import annotations

import asyncio
from typing import Mapping

import numpy as np

from ..net.endpoint import silence
from ..errors import ConfigError, RemoteProtocolError, SyncTimeout, WorkerLeft
from ..wire import Kind, wire_dtype
from ..wire.layout import ITEMSIZE

OPS = ("sum", "mean", "max", "min")
_KEY = 0  # one collective in flight at a time per trainer: the clock tells them apart


def check_op(op: str, dtype: np.dtype) -> None:
    """Raises ConfigError where ``op`` is unknown or cannot be taken of ``dtype``."""
    if op not in OPS:
        raise ConfigError(f"all_reduce(op={op!r}): op is one of {', '.join(OPS)}")
    if op == "mean" and not np.issubdtype(dtype, np.floating):
        raise ConfigError(f"all_reduce(op='mean') of a {dtype} tensor: give a float tensor, or op='sum'")
    if wire_dtype(dtype) is None:
        raise ConfigError(f"all_reduce of a {dtype} tensor: give a float32/64, float16, int32/64, int8 or uint8 one")


async def all_reduce(
    rank: int, peers: Mapping[int, object], array: np.ndarray, op: str, seq: int, timeout: float, departures=None
) -> np.ndarray:
    """Every rank's ``array`` reduced by ``op`` in rank order: a new array, the same bits on
    every rank. ``seq``: the collective's number (every rank the same). ``departures``: a
    :class:`~poseidon_aio.cluster.departures.Departures`; a peer that finishes training before
    its part came ends the wait at once (its frames come in order: none will).

    Raises:
        SyncTimeout: some rank's array did not arrive within ``timeout`` (names the ranks).
        WorkerLeft: a rank finished training without calling it.
        RemoteProtocolError: a rank sent another dtype or size (another call at that place).
        ConnectionLost: a link broke.
    """
    check_op(op, array.dtype)
    flat = np.ascontiguousarray(array).reshape(-1)
    parts = {rank: flat}
    if peers:
        dtype = wire_dtype(flat.dtype)
        payload = flat.copy()  # a send holds its bytes until they are out; the caller may reuse its tensor
        waits = {q: conn.expect(Kind.COLLECTIVE, _KEY, seq) for q, conn in peers.items()}
        sends = [
            asyncio.ensure_future(conn.send(Kind.COLLECTIVE, payload, key=_KEY, clock=seq, dtype=dtype))
            for conn in peers.values()
        ]
        gathered = asyncio.gather(*waits.values(), *sends)
        left = asyncio.get_running_loop().create_future()

        def finished(q: int) -> None:
            if not waits[q].done() and not left.done():
                left.set_exception(
                    WorkerLeft(
                        f"rank {rank}: collective {seq}: rank {q} finished training ({departures.finished[q]} steps) "
                        "without calling it; every rank must call all_reduce and barrier the same number of times"
                    )
                )

        unlisten = departures.listen(finished) if departures is not None else None
        try:
            await asyncio.wait([gathered, left], timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if left.done():
                left.result()
            if not gathered.done():
                missing = sorted(q for q, fut in waits.items() if not fut.done())
                raise SyncTimeout(
                    f"rank {rank}: collective {seq} (all_reduce or barrier) heard nothing from rank(s) {missing} "
                    f"within {timeout} s; every rank must call all_reduce and barrier the same number of times, "
                    "in the same order"
                )
            gathered.result()  # a broken link ends it here
        finally:
            if unlisten is not None:
                unlisten()
            gathered.cancel()
            gathered.add_done_callback(silence)
            left.cancel()
        for q, fut in waits.items():
            frame = fut.result()
            got = frame.header.dtype, frame.header.length
            if got != (dtype, flat.nbytes):
                n = frame.header.length // ITEMSIZE[frame.header.dtype]
                raise RemoteProtocolError(
                    f"rank {rank}: collective {seq}: rank {q} sent {n} {frame.header.dtype.name.lower()} values, this "
                    f"rank {flat.size} {dtype.name.lower()}; every rank must all_reduce a tensor of the same shape "
                    "and dtype at the same place"
                )
            parts[q] = np.frombuffer(frame.payload, dtype=flat.dtype)
    ordered = [parts[q] for q in sorted(parts)]
    if op == "max":
        out = np.maximum.reduce(ordered)
    elif op == "min":
        out = np.minimum.reduce(ordered)
    else:
        out = ordered[0].copy()
        for part in ordered[1:]:
            out += part
        if op == "mean":
            out /= len(ordered)
    return out.reshape(array.shape)
