"""Fault injection: what the parameter server does with repeated, delayed or lost bytes.

Starts with a shard fed a repeated push without sockets; the proxy-driven cases follow.
"""

from __future__ import annotations

import asyncio

import numpy as np

from poseidon_aio.cluster import InformationBook, Manifest, ParamSpec
from poseidon_aio.net import LocalLink
from poseidon_aio.ps import KVShard, PSConfig
from poseidon_aio.wire import DType, Kind


async def test_a_push_repeated_while_its_clock_finalizes_is_discarded_not_left_pending():
    """Seen with the fault proxy's whole-frame duplicates in a 3-worker job: a repeat of the push
    that completes a clock, read in the same batch as the original (uvloop reads on while the
    socket has bytes), reached the shard after it had scheduled the finalization but before that
    ran, and opened a new pending entry for the clock: never finalized, reported as stalled after
    sync_timeout / 2, its receive slots never reused. A LocalLink hands frames over synchronously,
    which gives that order every time."""
    book = InformationBook(Manifest([ParamSpec("w", (64,))]), workers=2, shards=1)
    shard = KVShard(0, book, PSConfig())
    links = []
    for rank in range(2):
        worker_end, shard_end = LocalLink.pair(rank, 99)
        shard.attach(shard_end)
        links.append(worker_end)
    grads = [np.full(64, rank + 1.0, np.float32) for rank in range(2)]
    waits = [link.expect(Kind.AGGREGATE, 0, 0) for link in links]
    await links[0].send(Kind.PUSH, grads[0], key=0, clock=0, dtype=DType.FLOAT32)
    await links[1].send(Kind.PUSH, grads[1], key=0, clock=0, dtype=DType.FLOAT32)
    await links[1].send(Kind.PUSH, grads[1], key=0, clock=0, dtype=DType.FLOAT32)
    async with asyncio.timeout(10):
        frames = await asyncio.gather(*waits)
    assert all(np.all(np.frombuffer(f.payload, np.float32) == 1.5) for f in frames)
    assert shard.pending_ranks() == {} and shard.stats.late_discarded == 1
    await shard.close()
