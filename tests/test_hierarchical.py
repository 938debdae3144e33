"""The schemes between hosts of several workers, over in-memory connections (issue 44, part 2).

The hierarchical all-reduce: every rank ends with the same bits, the mean of every rank's
gradients, and each rank sends across hosts only its 1/L share of a ring all-reduce's bytes over
the hosts. SFB between hosts: every rank rebuilds the same bits, the mean over every rank's
factors, and each host's stacked factors cross the network once a peer host.
"""

from __future__ import annotations

import asyncio

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from poseidon_aio.cluster.topology import Topology
from poseidon_aio.errors import SyncTimeout
from poseidon_aio.sync import AllReduceSyncer, HierarchicalAllReduce, HierarchicalSFB, SFBSyncer, SyncContext
from poseidon_aio.sync.bucket import Bucket

from .support.memtransport import run_async
from .test_allreduce import MAX_CHUNKS, mesh

LAYOUTS = [(1, 2), (2, 2), (2, 3), (3, 1), (3, 2)]  # hosts x local workers


def topology(hosts: int, local: int, interleaved: bool) -> Topology:
    """Ranks in blocks by host (torchrun's order), or dealt round the hosts (any launcher's)."""
    if interleaved:
        return Topology(tuple(tuple(range(h, hosts * local, hosts)) for h in range(hosts)))
    return Topology(tuple(tuple(range(h * local, (h + 1) * local)) for h in range(hosts)))


async def reduce_all(topo, sizes, chunk_bytes, algorithm, seed, clocks=2, timeout=30.0):
    world = topo.world
    peers = await mesh(world, seed)
    syncers = [
        HierarchicalAllReduce.build(
            SyncContext(r, world, peers[r], timeout, chunk_bytes=chunk_bytes, allreduce=algorithm, topology=topo)
        )
        for r in range(world)
    ]
    results, sent = [], []
    for clock in range(clocks):  # a second clock over the same syncers and connections
        grads = [
            [
                np.random.default_rng([seed, clock, r, i]).standard_normal(n).astype(np.float32)
                for i, n in enumerate(sizes)
            ]
            for r in range(world)
        ]
        outs = [[np.full(n, np.nan, dtype=np.float32) for n in sizes] for _ in range(world)]
        buckets = [Bucket("b", [3, 4], list(range(len(sizes))), outs[r], grads=grads[r]) for r in range(world)]
        done = await asyncio.gather(*(syncers[r].start(buckets[r], clock) for r in range(world)))
        results.append((grads, outs))
        sent.append([d.bytes_sent for d in done])
    for side in peers:
        for conn in side.values():
            conn.abort()
    return syncers, results, sent


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    layout=st.sampled_from(LAYOUTS),
    interleaved=st.booleans(),
    sizes=st.lists(st.integers(1, 300), min_size=1, max_size=4),
    chunk_items=st.integers(1, 64),
    algorithm=st.sampled_from(["ring", "direct", "auto"]),
    seed=st.integers(0, 10_000),
)
def test_every_rank_gets_the_same_bits_the_mean_and_sends_its_share_across_hosts(
    layout, interleaved, sizes, chunk_items, algorithm, seed
):
    hosts, local = layout
    topo = topology(hosts, local, interleaved)
    chunk_items = max(chunk_items, -(-sum(sizes) // MAX_CHUNKS))
    syncers, results, sent = run_async(reduce_all(topo, sizes, 4 * chunk_items, algorithm, seed))
    flat = local == 1
    assert all(isinstance(s, AllReduceSyncer if flat else HierarchicalAllReduce) for s in syncers)
    for grads, outs in results:
        for i in range(len(sizes)):
            for r in range(1, topo.world):
                assert outs[r][i].tobytes() == outs[0][i].tobytes(), f"array {i}: rank {r} differs from rank 0"
            mean = np.mean([g[i].astype(np.float64) for g in grads], axis=0)
            np.testing.assert_allclose(outs[0][i], mean, rtol=1e-5, atol=1e-6)
    # Across hosts each rank sends a ring all-reduce's bytes over H hosts of its 1/L slice, so
    # a host sends 2 (H - 1) / H of the bucket, once, to within the slices' rounding.
    total = 4 * sum(sizes)
    for per_rank in sent:
        host_bytes = [sum(per_rank[r] for r in members) for members in topo.hosts]
        for b in host_bytes:
            assert abs(b - 2 * total * (hosts - 1) / hosts) <= 2 * 4 * (hosts - 1) * local, (b, total, topo.hosts)


def test_a_local_rank_that_never_starts_ends_in_a_timeout_that_names_it():
    async def go():
        topo = Topology(((0, 1), (2, 3)))
        peers = await mesh(4, 2)
        syncers = [HierarchicalAllReduce(r, topo, peers[r], 0.5, 64) for r in range(4)]
        bucket = lambda r: Bucket("fc1", [1], [0], [np.empty(96, np.float32)], grads=[np.ones(96, np.float32)])  # noqa: E731
        # Rank 1 never starts: rank 0, on its host, waits for its part.
        return await asyncio.gather(*(syncers[r].start(bucket(r), 7) for r in (0, 2, 3)), return_exceptions=True)

    first = run_async(go())[0]
    assert isinstance(first, SyncTimeout), first
    assert "rank 0: all-reduce of fc1 at clock 7: the parts of its host's ranks from rank(s) [1]" in str(first)


async def sfb_all(topo, ks, m, n, seed, clocks=2, timeout=30.0):
    import torch

    from poseidon_aio.kernels.cpu import reconstruct

    world = topo.world
    peers = await mesh(world, seed)
    syncers = [
        HierarchicalSFB.build(SyncContext(r, world, peers[r], timeout, reconstruct=reconstruct, topology=topo))
        for r in range(world)
    ]
    results, sent = [], []
    for clock in range(clocks):
        rng = np.random.default_rng([seed, clock])
        fs = [
            (rng.standard_normal((ks[r], m)).astype(np.float32), rng.standard_normal((ks[r], n)).astype(np.float32))
            for r in range(world)
        ]
        outs = [(torch.full((m, n), float("nan")), torch.full((m,), float("nan"))) for _ in range(world)]
        buckets = [Bucket("fc", [5], [0, 1], list(outs[r]), factors=fs[r], shape=(m, n)) for r in range(world)]
        done = await asyncio.gather(*(syncers[r].start(buckets[r], clock) for r in range(world)))
        results.append((fs, outs))
        sent.append([d.bytes_sent for d in done])
    for side in peers:
        for conn in side.values():
            conn.abort()
    return syncers, results, sent


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    layout=st.sampled_from(LAYOUTS + [(4, 2), (5, 2)]),
    interleaved=st.booleans(),
    k=st.integers(0, 4),
    m=st.integers(1, 12),
    n=st.integers(1, 12),
    seed=st.integers(0, 10_000),
)
def test_sfb_between_hosts_rebuilds_the_same_bits_everywhere_sending_each_stack_once_a_host(
    layout, interleaved, k, m, n, seed
):
    hosts, local = layout
    topo = topology(hosts, local, interleaved)
    ks = [k + (r % 2) for r in range(topo.world)]  # uneven batches: a stack's rows are not L x K
    syncers, results, sent = run_async(sfb_all(topo, ks, m, n, seed))
    assert all(isinstance(s, SFBSyncer if local == 1 else HierarchicalSFB) for s in syncers)
    for fs, outs in results:
        for r in range(1, topo.world):
            for a, b in zip(outs[r], outs[0]):
                assert a.numpy().tobytes() == b.numpy().tobytes(), f"rank {r} differs from rank 0"
        u = np.concatenate([f[0] for f in fs]).astype(np.float64)
        v = np.concatenate([f[1] for f in fs]).astype(np.float64)
        np.testing.assert_allclose(outs[0][0].numpy(), u.T @ v / topo.world, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(outs[0][1].numpy(), u.sum(0) / topo.world, rtol=1e-4, atol=1e-5)
    if local > 1:  # each host's stack crosses the network once a peer host
        for per_rank in sent:
            for members in topo.hosts:
                rows = sum(ks[r] for r in members)
                assert sum(per_rank[r] for r in members) == 4 * rows * (m + n) * (hosts - 1)


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    layout=st.sampled_from(LAYOUTS + [(4, 3)]),
    interleaved=st.booleans(),
    sizes=st.lists(st.integers(0, 40), min_size=12, max_size=12),
    seed=st.integers(0, 10_000),
)
def test_the_all_gather_by_host_hands_every_rank_every_payload_each_host_s_bundle_crossing_once(
    layout, interleaved, sizes, seed
):
    # The lossy schemes' and rows' all-gather (MeshExchange): payloads of any length, zero
    # included, arrive whole from every rank, as the flat all-gather gives them.
    from poseidon_aio.sync.exchange import MeshExchange
    from poseidon_aio.wire import DType

    hosts, local = layout
    topo = topology(hosts, local, interleaved)
    world = topo.world

    async def go():
        peers = await mesh(world, seed)
        ex = [MeshExchange(r, world, peers[r], 30.0, topology=topo) for r in range(world)]
        payloads = [np.random.default_rng([seed, r]).standard_normal(sizes[r]).astype(np.float32) for r in range(world)]
        got = await asyncio.gather(
            *(
                ex[r].allgather([payloads[r]], DType.FLOAT32, layer=7, phase=1, clock=3, what="layer emb")
                for r in range(world)
            )
        )
        for side in peers:
            for conn in side.values():
                conn.abort()
        return payloads, got

    payloads, got = run_async(go())
    for r, (frames, sent, _) in enumerate(got):
        assert sorted(frames) == [q for q in range(world) if q != r]
        for q, frame in frames.items():
            assert frame.header.dtype is DType.FLOAT32 and frame.header.rank == q
            assert bytes(frame.payload) == payloads[q].tobytes(), (r, q)
    if local > 1:
        for members in topo.hosts:
            bundle = 8 * local + sum(payloads[q].nbytes for q in members)
            assert sum(got[r][1] for r in members) == bundle * (hosts - 1)


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    layout=st.sampled_from(LAYOUTS),
    interleaved=st.booleans(),
    n=st.integers(1, 200),
    chunk=st.sampled_from([8, 64, 4096]),
    half=st.booleans(),
    seed=st.integers(0, 10_000),
)
def test_the_codec_all_reduce_by_host_gives_every_rank_the_same_bits_near_the_mean(
    layout, interleaved, n, chunk, half, seed
):
    # fp16's and PowerSGD's all-reduce (MeshExchange): summed inside the host in float32, through
    # the codec across hosts, every replica the same bits; with the fp32 codec, the exact mean.
    from poseidon_aio.sync.exchange import MeshExchange
    from poseidon_aio.wire import DType
    from poseidon_aio.wire import half as fp16_codec

    class Exact:  # float32 through unchanged
        DTYPE = DType.FLOAT32
        ITEM_BYTES = 4

        @staticmethod
        def encode(x):
            return [np.ascontiguousarray(x, np.float32)]

        @staticmethod
        def expand(parts):
            return parts[0]

        @staticmethod
        def decode(frame, count, *, what):
            return np.frombuffer(frame.payload, np.float32, count)

    codec = fp16_codec if half else Exact
    hosts, local = layout
    topo = topology(hosts, local, interleaved)
    world = topo.world

    async def go():
        peers = await mesh(world, seed)
        ex = [MeshExchange(r, world, peers[r], 30.0, chunk_bytes=chunk, topology=topo) for r in range(world)]
        xs = [np.random.default_rng([seed, r]).standard_normal(n).astype(np.float32) for r in range(world)]
        got = []
        for clock in range(2):
            got.append(
                await asyncio.gather(
                    *(
                        ex[r].allreduce(xs[r], codec, layer=4, phase=1, clock=clock, what="layer fc")
                        for r in range(world)
                    )
                )
            )
        for side in peers:
            for conn in side.values():
                conn.abort()
        return xs, got

    xs, got = run_async(go())
    mean = np.mean(np.array(xs, np.float64), axis=0)
    for outs in got:
        for r in range(1, world):
            assert outs[r][0].tobytes() == outs[0][0].tobytes(), f"rank {r} differs from rank 0"
        np.testing.assert_allclose(outs[0][0], mean, rtol=1e-2 if half else 1e-5, atol=1e-2 if half else 1e-6)
