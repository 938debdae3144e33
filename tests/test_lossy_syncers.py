"""The lossy syncers over an in-process mesh: every replica the same bits, the pure arithmetic's
bits, merged layers as their own syncs, clocks in order, and malformed payloads and silent peers
through a syncer."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from poseidon_aio.errors import RemoteProtocolError, SyncTimeout
from poseidon_aio.net import LocalLink
from poseidon_aio.plan import CompressionConfig, Scheme
from poseidon_aio.plan.lossy import topk_count
from poseidon_aio.sync import Bucket, Feedback, SyncContext, syncer_class
from poseidon_aio.sync.compress import PowerSGDStep, TopKStep, rank_order_mean
from poseidon_aio.sync.exchange import frame_key
from poseidon_aio.wire import DType, Kind

from .support.compression import _gradients, _simulate, layer_shapes

# -- the syncers over an in-process mesh ---------------------------------------------------------


def _mesh(world: int) -> dict:
    links = {r: {} for r in range(world)}
    for a in range(world):
        for b in range(a + 1, world):
            links[a][b], links[b][a] = LocalLink.pair(a, b)
    return links


def _syncers(scheme: Scheme, world: int, config: CompressionConfig, links=None, timeout: float = 10.0):
    links = links or _mesh(world)
    feedback = [Feedback() for _ in range(world)]
    syncers = [
        syncer_class(scheme).build(
            SyncContext(r, world, links[r], timeout, chunk_bytes=64, compression=config, feedback=feedback[r])
        )
        for r in range(world)
    ]
    return syncers, feedback, links


SHAPES = [(6, 2, 3, 3), (6,)]  # a convolution: PowerSGD reads its kernel as 6 x 18


@pytest.mark.parametrize("scheme", [Scheme.FP16, Scheme.POWERSGD, Scheme.TOPK])
@pytest.mark.parametrize("world", [2, 3])
async def test_every_rank_gets_the_same_bits_and_the_pure_arithmetic_s(scheme, world):
    config = CompressionConfig(scheme.value, rank=2, ratio=0.2)
    syncers, feedback, _ = _syncers(scheme, world, config)
    grads_by_step = _gradients(7, world, 3, SHAPES)
    make = {
        Scheme.POWERSGD: lambda g, fb: PowerSGDStep("conv", g, config.rank, fb),
        Scheme.TOPK: lambda g, fb: TopKStep("conv", g, config.ratio, fb),
    }.get(scheme)
    pure = _simulate(make, grads_by_step, world)[0] if make else None
    for clock, grads in enumerate(grads_by_step):
        outs = [[np.empty(s, np.float32) for s in SHAPES] for _ in range(world)]
        async with asyncio.timeout(30):
            results = await asyncio.gather(
                *(syncers[r].start(Bucket("conv", [1], [0, 1], outs[r], grads=grads[r]), clock) for r in range(world))
            )
        for r in range(1, world):
            assert all(a.tobytes() == b.tobytes() for a, b in zip(outs[0], outs[r])), f"rank {r} differs"
        assert all(res.bytes_sent > 0 and res.bytes_received > 0 for res in results)
        exact = [rank_order_mean([grads[r][i] for r in range(world)]) for i in range(2)]
        if pure is not None:  # the mesh computes exactly what the property tests check
            assert all(a.tobytes() == b.tobytes() for a, b in zip(outs[0], pure[clock]))
            assert outs[0][1].tobytes() == exact[1].tobytes()  # the bias, exact
        else:  # fp16: two roundings of float16, 2^-10 relative to the chunk's largest at worst
            for o, e in zip(outs[0], exact):
                assert np.abs(o - e).max() <= 2**-10 * max(np.abs(g[i]).max() for g in grads for i in range(2)) * 2


@settings(max_examples=25, deadline=None)
@given(
    layers=layer_shapes,
    world=st.integers(2, 3),
    steps=st.integers(1, 3),
    ratio=st.sampled_from([0.05, 0.2, 0.5]),
    seed=st.integers(0, 10_000),
)
def test_topk_merged_layers_give_each_layer_its_own_bits_and_state(layers, world, steps, ratio, seed):
    """An MG-WFBP group of top-k layers (one all-gather, the payloads back to back) yields every
    layer's result and error-feedback state bit for bit as its own sync would: each layer is
    selected on its own, with its own k and error."""
    from .support.memtransport import run_async

    names = [f"l{i}" for i in range(len(layers))]
    config = CompressionConfig("topk", ratio=ratio)
    grads = _gradients(seed, world, steps, [s for layer in layers for s in layer])

    def buckets(r: int, grads_r: list, outs_r: list) -> list:
        out, first = [], 0
        for i, (name, layer) in enumerate(zip(names, layers)):
            params = list(range(first, first + len(layer)))
            out.append(Bucket(name, [i], params, [outs_r[p] for p in params], grads=[grads_r[p] for p in params]))
            first += len(layer)
        return out

    async def scenario():
        merged, merged_fb, _ = _syncers(Scheme.TOPK, world, config)
        alone, alone_fb, _ = _syncers(Scheme.TOPK, world, config)
        for clock, grads_t in enumerate(grads):
            outs = {
                (how, r): [np.empty(g.shape, np.float32) for g in grads_t[r]]
                for how in ("merged", "alone")
                for r in range(world)
            }
            syncs = [
                merged[r].start(Bucket.merged(buckets(r, grads_t[r], outs[("merged", r)])), clock) for r in range(world)
            ]
            syncs += [
                alone[r].start(b, clock) for r in range(world) for b in buckets(r, grads_t[r], outs[("alone", r)])
            ]
            await asyncio.gather(*syncs)
            for r in range(world):
                assert [a.tobytes() for a in outs[("merged", r)]] == [a.tobytes() for a in outs[("alone", r)]], (
                    f"rank {r}, clock {clock}"
                )
        for a, b in zip(merged_fb, alone_fb):
            sa, sb = a.state(), b.state()
            assert sorted(sa) == sorted(sb) and all(sa[k].tobytes() == sb[k].tobytes() for k in sa)

    run_async(scenario())


async def test_a_merged_top_k_payload_with_one_layer_s_section_wrong_names_that_layer():
    links = _mesh(2)
    syncer = _syncers(Scheme.TOPK, 2, CompressionConfig("topk", ratio=0.2), links=links)[0][0]
    grads = _gradients(1, 1, 1, SHAPES + SHAPES)[0][0]
    outs = [np.empty(g.shape, np.float32) for g in grads]
    bucket = Bucket.merged(
        [
            Bucket("conv1", [3], [0, 1], outs[:2], grads=grads[:2]),
            Bucket("conv2", [4], [2, 3], outs[2:], grads=grads[2:]),
        ]
    )
    k = topk_count(6 * 2 * 3 * 3, 0.2)  # 22 of 108
    first = [np.zeros(6, np.float32), np.arange(k, dtype=np.uint32), np.ones(k, np.float32)]
    second = [np.zeros(6, np.float32), np.arange(k, dtype=np.uint32)[::-1].copy(), np.ones(k, np.float32)]  # decreasing
    async with asyncio.timeout(30):
        task = syncer.start(bucket, 2)
        await links[1][0].send(Kind.PUSH, first + second, key=frame_key(3, 2, 0), clock=2, dtype=DType.BYTES)
        with pytest.raises(
            RemoteProtocolError,
            match="rank 1 sent indices that do not strictly increase for the top-k values of layer conv2..conv1 "
            "at clock 2 \\(its layer conv2\\)",
        ):
            await task


async def test_a_layer_s_next_clock_waits_for_its_last_one_as_error_feedback_needs():
    # Under SSP a layer's clock t + 1 may start before clock t is done: its M needs clock t's error.
    world = 2
    config = CompressionConfig("topk", ratio=0.2)
    syncers, feedback, _ = _syncers(Scheme.TOPK, world, config)
    grads = _gradients(3, world, 2, SHAPES)
    outs = {(r, t): [np.empty(s, np.float32) for s in SHAPES] for r in range(world) for t in range(2)}
    async with asyncio.timeout(30):
        tasks = [
            syncers[r].start(Bucket("conv", [1], [0, 1], outs[(r, t)], grads=grads[t][r]), t)
            for t in range(2)
            for r in range(world)
        ]
        await asyncio.gather(*tasks)
    pure = _simulate(lambda g, fb: TopKStep("conv", g, config.ratio, fb), grads, world)[0]
    for t in range(2):
        assert all(a.tobytes() == b.tobytes() for a, b in zip(outs[(0, t)], pure[t]))


@pytest.mark.parametrize("scheme,phase", [(Scheme.TOPK, 2), (Scheme.FP16, 0), (Scheme.POWERSGD, 0)])
async def test_a_malformed_payload_from_a_peer_fails_the_sync_naming_layer_and_rank(scheme, phase):
    links = _mesh(2)
    syncer = _syncers(scheme, 2, CompressionConfig(scheme.value, rank=2), links=links)[0][0]
    grads = _gradients(1, 1, 1, SHAPES)[0][0]
    outs = [np.empty(s, np.float32) for s in SHAPES]
    async with asyncio.timeout(30):
        task = syncer.start(Bucket("blocks.3.conv", [4], [0, 1], outs, grads=grads), 9)
        # Rank 1 answers with 5 junk bytes where a payload of this layer's shape belongs.
        await links[1][0].send(Kind.PUSH, b"\x01" * 5, key=frame_key(4, phase, 0), clock=9, dtype=DType.BYTES)
        with pytest.raises(
            RemoteProtocolError, match="rank 1 sent 5 bytes of BYTES for .*layer blocks.3.conv at clock 9"
        ):
            await task


async def test_a_silent_peer_is_a_sync_timeout_naming_it():
    syncer = _syncers(Scheme.TOPK, 3, CompressionConfig("topk"), timeout=0.2)[0][0]
    grads = _gradients(1, 1, 1, SHAPES)[0][0]
    with pytest.raises(
        SyncTimeout, match="rank 0: the top-k values of layer conv at clock 0: nothing from ranks \\[1, 2\\]"
    ):
        async with asyncio.timeout(30):
            await syncer.start(Bucket("conv", [1], [0, 1], [np.empty(s, np.float32) for s in SHAPES], grads=grads), 0)
