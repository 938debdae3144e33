"""The all-reduce scheme's two algorithms over in-memory connections: every rank ends with the
same bits, the mean of the ranks' gradients, whatever the sizes, chunks and delivery order."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from poseidon_aio.errors import ConfigError, SyncTimeout
from poseidon_aio.sync import AllReduceSyncer
from poseidon_aio.sync.bucket import Bucket

from .support.memtransport import connected_pair, run_async
from .support.procs import net_config


async def mesh(world: int, seed: int) -> list:
    """``peers[r] = {q: connection at r to q}``, one in-memory pair per two ranks."""
    peers = [{} for _ in range(world)]
    for i in range(world):
        for j in range(i + 1, world):
            a, b = await connected_pair(
                net_config(), net_config(), seed=seed * 100 + i * 10 + j, client_rank=i, server_rank=j
            )
            peers[i][j], peers[j][i] = a, b
    return peers


async def reduce_all(world, sizes, chunk_bytes, algorithm, seed, clocks=2, timeout=30.0, order=()):
    """Every rank's all-reduce of ``clocks`` buckets; ``order``: ranks that start late, one after
    another with the loop run between, so the frames of the ranks ahead wait in their inboxes."""
    peers = await mesh(world, seed)
    syncers = [AllReduceSyncer(r, world, peers[r], timeout, chunk_bytes, algorithm) for r in range(world)]
    results, sent = [], []
    for clock in range(clocks):  # a second clock reuses the receive buffers the first gave back
        grads = [
            [
                np.random.default_rng([seed, clock, r, i]).standard_normal(n).astype(np.float32)
                for i, n in enumerate(sizes)
            ]
            for r in range(world)
        ]
        outs = [[np.full(n, np.nan, dtype=np.float32) for n in sizes] for _ in range(world)]
        buckets = [Bucket("b", [3, 4], list(range(len(sizes))), outs[r], grads=grads[r]) for r in range(world)]
        late = [r for r in dict.fromkeys(order) if r < world]
        started = {r: syncers[r].start(buckets[r], clock) for r in range(world) if r not in late}
        for r in late:
            await asyncio.sleep(0.002)
            started[r] = syncers[r].start(buckets[r], clock)
        done = await asyncio.gather(*(started[r] for r in range(world)))
        results.append((grads, outs))
        sent.append([d.bytes_sent for d in done])
    for side in peers:
        for conn in side.values():
            conn.abort()
    return results, sent


MAX_CHUNKS = 32


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    world=st.integers(2, 5),
    sizes=st.lists(st.integers(1, 300), min_size=1, max_size=4),
    chunk_items=st.integers(1, 64),
    algorithm=st.sampled_from(["ring", "direct", "auto"]),
    seed=st.integers(0, 10_000),
    order=st.lists(st.integers(0, 4), max_size=4),
)
def test_every_rank_gets_the_same_bits_the_mean_of_the_gradients(world, sizes, chunk_items, algorithm, seed, order):
    """Whatever the order the ranks start in: a late rank's receives land inside its start()."""
    # At most MAX_CHUNKS chunks a bucket: enough to cross every array boundary and interleave the
    # walks, and a bounded amount of work per case. One-element chunks of 1 200 elements over 5
    # ranks made ~15 000 frames, which beside two CPU hogs in asyncio's debug mode outlasted
    # run_async's 30 s.
    chunk_items = max(chunk_items, -(-sum(sizes) // MAX_CHUNKS))
    results, sent = run_async(reduce_all(world, sizes, 4 * chunk_items, algorithm, seed, order=order))
    for grads, outs in results:
        for i in range(len(sizes)):
            for r in range(1, world):
                assert outs[r][i].tobytes() == outs[0][i].tobytes(), f"array {i}: rank {r} differs from rank 0"
            mean = np.mean([g[i].astype(np.float64) for g in grads], axis=0)
            np.testing.assert_allclose(outs[0][i], mean, rtol=1e-5, atol=1e-6)
    # Either way every rank sends a ring all-reduce's bytes: 2 (P - 1) / P of the bucket, to
    # within a slice's rounding.
    total = 4 * sum(sizes)
    for per_rank in sent:
        for b in per_rank:
            assert abs(b - 2 * total * (world - 1) / world) <= 2 * 4 * (world - 1), (b, total, world)


async def _rank_2_never_starts(algorithm: str, tag: int) -> list:
    """Ranks 0 and 1 of 3 all-reduce fc1 at clock 7 (a 0.5 s timeout); their errors."""
    peers = await mesh(3, tag)
    syncers = [AllReduceSyncer(r, 3, peers[r], 0.5, 64, algorithm) for r in range(3)]
    bucket = lambda r: Bucket("fc1", [1], [0], [np.empty(96, np.float32)], grads=[np.ones(96, np.float32)])  # noqa: E731
    return await asyncio.gather(*(syncers[r].start(bucket(r), 7) for r in (0, 1)), return_exceptions=True)


def test_a_rank_that_never_starts_ends_the_ring_in_a_timeout_that_names_step_chunk_and_rank():
    # Rank 0 waits for rank 2's parts (rank 2 is rank 0's predecessor).
    first, _ = run_async(_rank_2_never_starts("ring", 0))
    assert isinstance(first, SyncTimeout)
    assert "rank 0: all-reduce of fc1 at clock 7: reduce-scatter step 0 of chunk 0 from rank 2" in str(first)


def test_a_rank_that_never_starts_ends_the_direct_all_reduce_in_a_timeout_that_names_it():
    # Ranks 0 and 1 wait for rank 2's parts of the chunks they own.
    for rank, error in enumerate(run_async(_rank_2_never_starts("direct", 2))):
        assert isinstance(error, SyncTimeout), repr(error)
        assert f"rank {rank}: all-reduce of fc1 at clock 7: the other ranks' parts from rank(s) [2]" in str(error)


def test_a_direct_all_reduce_given_up_leaves_nothing_waiting():
    async def go():
        peers = await mesh(2, 3)
        syncer = AllReduceSyncer(0, 2, peers[0], 30.0, 64, "direct")
        sync = syncer.start(Bucket("fc3", [5], [0], [np.empty(40, np.float32)], grads=[np.ones(40, np.float32)]), 1)
        await asyncio.sleep(0)
        sync.cancel()
        await asyncio.sleep(0.01)
        waiting = list(peers[0][1]._expected)  # the receives it registered, forgotten once cancelled
        for side in peers:
            for conn in side.values():
                conn.abort()
        return sync.cancelled(), waiting

    cancelled, waiting = run_async(go())
    assert cancelled and waiting == []


@pytest.mark.parametrize("algorithm", ["ring", "direct"])
def test_an_empty_bucket_completes_at_once(algorithm):
    # A hierarchical all-reduce's rank whose share inside its host is empty still runs the hosts'.
    async def go():
        peers = await mesh(3, 4)
        syncers = [AllReduceSyncer(r, 3, peers[r], 30.0, 64, algorithm) for r in range(3)]
        bucket = Bucket("empty", [6], [0], [np.empty(0, np.float32)], grads=[np.empty(0, np.float32)])
        done = await asyncio.gather(*(s.start(bucket, 0) for s in syncers))
        for side in peers:
            for conn in side.values():
                conn.abort()
        return done

    assert [(d.bytes_sent, d.bytes_received) for d in run_async(go())] == [(0, 0)] * 3


def test_an_unknown_algorithm_is_a_config_error():
    with pytest.raises(ConfigError, match="'tree'"):
        AllReduceSyncer(0, 2, {}, 1.0, 1024, "tree")


@pytest.mark.parametrize("algorithm", ["ring", "direct"])
def test_a_peer_lost_mid_sync_ends_every_chunk_in_connection_lost_not_a_hang(algorithm):
    from poseidon_aio.errors import ConnectionLost

    async def go():
        peers = await mesh(3, 1)
        syncers = [AllReduceSyncer(r, 3, peers[r], 30.0, 64, algorithm) for r in range(3)]
        bucket = lambda r: Bucket("fc2", [2], [0], [np.empty(600, np.float32)], grads=[np.ones(600, np.float32)])  # noqa: E731
        # Ranks 0 and 1 start (10 chunks each); rank 2 is gone: its links break.
        started = [syncers[r].start(bucket(r), 3) for r in (0, 1)]
        for conn in peers[2].values():
            conn.abort()
        return await asyncio.gather(*started, return_exceptions=True)

    for error in run_async(go()):
        assert isinstance(error, ConnectionLost), repr(error)


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 50), min_size=1, max_size=5), data=st.data())
def test_adding_piece_by_piece_gives_the_bits_of_adding_the_concatenation(sizes, data):
    from poseidon_aio.sync.slices import Layout, add_into

    rng = np.random.default_rng(len(sizes) * 1000 + sum(sizes))
    arrays = [rng.standard_normal(n).astype(np.float32) for n in sizes]
    total = sum(sizes)
    start = data.draw(st.integers(0, total - 1))
    stop = data.draw(st.integers(start + 1, total))
    pieces = Layout(tuple(sizes), 2, total).pieces(start, stop)
    acc = rng.standard_normal(stop - start).astype(np.float32)
    expected = acc + np.concatenate(arrays)[start:stop]
    add_into(acc, arrays, pieces)
    assert acc.tobytes() == expected.tobytes()
