"""The lossy schemes without sockets: error feedback's promises (hypothesis, pure), the syncers
over an in-process mesh (every replica the same bits, the pure arithmetic's bits), malformed
payloads through a syncer, the planner's rule, the settings, explain."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from poseidon_aio.errors import CheckpointError, ConfigError, RemoteProtocolError, SyncTimeout
from poseidon_aio.net import LocalLink
from poseidon_aio.plan import (
    CompressionConfig,
    ComputeCosts,
    LayerShape,
    Link,
    LossyPlanner,
    Mode,
    PlanLayer,
    Scheme,
    choose_schemes,
)
from poseidon_aio.plan.lossy import lossy_time, topk_count, unsuited
from poseidon_aio.sync import Bucket, Feedback, SyncContext, syncer_class
from poseidon_aio.sync.compress import PowerSGDStep, TopKStep, orthonormalize, rank_order_mean
from poseidon_aio.sync.exchange import frame_key
from poseidon_aio.wire import DType, Kind

EPS = float(np.finfo(np.float32).eps)


def _gradients(seed: int, world: int, steps: int, shapes, scale: float = 1.0) -> list:
    rng = np.random.default_rng(seed)
    return [
        [[(scale * rng.standard_normal(s)).astype(np.float32) for s in shapes] for _ in range(world)]
        for _ in range(steps)
    ]


def _simulate(make_step, grads_by_step, world: int):
    """Run a lossy scheme's pure steps on ``world`` workers, the mesh replaced by its arithmetic
    (rank_order_mean); return each step's result (asserting every replica's is the same bits)
    and the workers' Feedback."""
    feedback = [Feedback() for _ in range(world)]
    results = []
    for grads in grads_by_step:
        steps = [make_step(grads[w], feedback[w]) for w in range(world)]
        if isinstance(steps[0], TopKStep):
            parts = [s.begin() for s in steps]
            outs = [s.finish(parts) for s in steps]
        else:
            p = rank_order_mean([s.begin() for s in steps])
            q = rank_order_mean([s.middle(p) for s in steps])
            outs = [s.finish(q) for s in steps]
        for w in range(1, world):
            assert all(a.tobytes() == b.tobytes() for a, b in zip(outs[0], outs[w])), "replicas differ"
        results.append(outs[0])
    return results, feedback


# -- error feedback: the property tests ----------------------------------------------------------

shapes_of = st.tuples(st.integers(2, 12), st.integers(2, 12), st.booleans())


@settings(max_examples=40, deadline=None)
@given(
    dims=shapes_of,
    world=st.integers(1, 4),
    steps=st.integers(1, 12),
    ratio=st.floats(0.05, 1.0),
    seed=st.integers(0, 10_000),
    scale=st.sampled_from([1e-4, 1.0, 1e3]),
)
def test_topk_error_feedback_tracks_the_true_gradient_sum_with_a_bounded_residual(
    dims, world, steps, ratio, seed, scale
):
    """Sum of applied updates - sum of true mean gradients == -(mean of the final errors), and
    each error stays under G sqrt(d) / (1 - sqrt(d)), d = 1 - k/size, G the largest gradient norm:
    the k largest of M carry at least k/size of its squared norm, so
    |E'| = |M - top_k(M)| <= sqrt(d) |M| <= sqrt(d) (G + |E|), and the bound follows by induction."""
    m, n, bias = dims
    shapes = [(m, n), (m,)] if bias else [(m, n)]
    grads = _gradients(seed, world, steps, shapes, scale)
    results, feedback = _simulate(lambda g, fb: TopKStep("fc", g, ratio, fb), grads, world)
    applied = sum(r[0].astype(np.float64) for r in results)
    true = sum(rank_order_mean([g[w][0] for w in range(world)]).astype(np.float64) for g in grads)
    errors = [fb.entry("fc")["error"].reshape(m, n).astype(np.float64) for fb in feedback]
    residual = applied - true
    biggest = max(float(np.abs(g[w][0]).max()) for g in grads for w in range(world))
    bound_e = None
    k = topk_count(m * n, ratio)
    delta = np.sqrt(1 - k / (m * n))
    g_norm = max(float(np.linalg.norm(g[w][0])) for g in grads for w in range(world))
    bound_e = g_norm * delta / (1 - delta) if delta < 1 else float("inf")
    # float32 rounding: M = G + E once per step, the rank-order sum and the division once
    tol = 8 * steps * EPS * (biggest + bound_e if np.isfinite(bound_e) else biggest * steps)
    np.testing.assert_allclose(residual, -sum(errors) / world, rtol=0, atol=tol)
    for e in errors:
        assert float(np.linalg.norm(e)) <= bound_e * (1 + 1e-5) + tol
    if bias:  # the bias travels exact: its mean, every step
        for r, g in zip(results, grads):
            assert r[1].tobytes() == rank_order_mean([g[w][1] for w in range(world)]).tobytes()


@settings(max_examples=30, deadline=None)
@given(
    dims=shapes_of,
    world=st.integers(1, 4),
    steps=st.integers(1, 10),
    rank=st.integers(1, 4),
    seed=st.integers(0, 10_000),
)
def test_powersgd_error_feedback_tracks_the_true_gradient_sum_and_never_grows_an_error(dims, world, steps, rank, seed):
    """Sum of applied updates - sum of true mean gradients == -(mean of the final errors)
    (P_hat Q_mean^T = mean_w P_hat Q_w^T and E_w' = M_w - P_hat Q_w^T telescope), and each step's
    new error is M's part outside span(P_hat), a projection's residual: no larger than M."""
    m, n, bias = dims
    shapes = [(m, n), (m,)] if bias else [(m, n)]
    grads = _gradients(seed, world, steps, shapes)
    feedback = [Feedback() for _ in range(world)]
    applied = np.zeros((m, n))
    for grads_t in grads:
        ms = [g[0] + fb.entry("fc").get("error.0", 0) for g, fb in zip(grads_t, feedback)]
        steps_t = [PowerSGDStep("fc", g, rank, fb) for g, fb in zip(grads_t, feedback)]
        p = rank_order_mean([s.begin() for s in steps_t])
        q = rank_order_mean([s.middle(p) for s in steps_t])
        outs = [s.finish(q) for s in steps_t]
        assert all(o[0].tobytes() == outs[0][0].tobytes() for o in outs)
        for mat, fb in zip(ms, feedback):
            assert np.linalg.norm(fb.entry("fc")["error.0"]) <= np.linalg.norm(mat) * (1 + 1e-4) + 1e-6
        applied += outs[0][0]
        if bias:
            assert outs[0][1].tobytes() == rank_order_mean([g[1] for g in grads_t]).tobytes()
    true = sum(rank_order_mean([g[w][0] for w in range(world)]).astype(np.float64) for g in grads)
    errors = sum(fb.entry("fc")["error.0"].astype(np.float64) for fb in feedback) / world
    scale = max(1.0, float(np.abs(errors).max()), float(np.abs(true).max()))
    np.testing.assert_allclose(applied - true, -errors, rtol=0, atol=1e-4 * steps * scale)


@settings(max_examples=30, deadline=None)
@given(
    m=st.integers(4, 16),
    n=st.integers(4, 16),
    world=st.integers(1, 4),
    steps=st.integers(1, 8),
    rank=st.integers(1, 4),
    seed=st.integers(0, 10_000),
)
def test_powersgd_reproduces_gradients_that_stay_in_one_rank_r_subspace(m, n, world, steps, rank, seed):
    """Gradients A C_t B^T in a fixed subspace of rank s <= r (A, B orthonormal, C_t with
    singular values in [1, 2], the same on every worker): P = M Q spans A, the warm-started Q spans B, so the
    result is the mean gradient and the error holds nothing but rounding, step after step. (Where the row space
    turns every step, one power iteration from the last Q is only as good as their overlap: the
    error then carries the rest, which the telescoping test above bounds.)"""
    rng = np.random.default_rng(seed)
    s = min(rank, m, n)
    a = np.linalg.qr(rng.standard_normal((m, s)))[0]
    b = np.linalg.qr(rng.standard_normal((n, s)))[0]

    def coefficients():
        u, v = np.linalg.qr(rng.standard_normal((s, s)))[0], np.linalg.qr(rng.standard_normal((s, s)))[0]
        return u @ np.diag(rng.uniform(1.0, 2.0, s)) @ v.T

    grads = []
    for _ in range(steps):
        g = (a @ coefficients() @ b.T).astype(np.float32)
        grads.append([[g] for _ in range(world)])
    results, feedback = _simulate(lambda g, fb: PowerSGDStep("fc", g, rank, fb), grads, world)
    # Gradients of size 1-2: 1e-3 is float32 precision lost orthonormalizing P = M Q with the
    # random first Q, whose s x s overlap with B is as ill-conditioned as a Gaussian matrix gets
    # (condition numbers of 10^2-10^3 are common); a subspace missed would be off by O(1).
    for r, g in zip(results, grads):
        np.testing.assert_allclose(r[0], g[0][0], rtol=0, atol=1e-3)
    for fb in feedback:
        assert float(np.abs(fb.entry("fc")["error.0"]).max()) <= 1e-3


layer_shapes = st.lists(
    st.tuples(st.integers(2, 12), st.integers(2, 12), st.booleans()).map(
        lambda d: [(d[0], d[1]), (d[0],)] if d[2] else [(d[0], d[1])]
    ),
    min_size=2,
    max_size=4,
)


@settings(max_examples=30, deadline=None)
@given(
    layers=layer_shapes,
    world=st.integers(1, 4),
    steps=st.integers(1, 5),
    rank=st.integers(1, 4),
    seed=st.integers(0, 10_000),
)
def test_powersgd_merged_layers_give_each_layer_its_own_bits_and_state(layers, world, steps, rank, seed):
    """An MG-WFBP group of PowerSGD layers (one P and one Q all-reduce for all) yields every
    layer's result and error-feedback state bit for bit as its own sync would: state is kept per
    layer, and each element of the concatenated all-reduces is summed in rank order either way."""
    names = [f"l{i}" for i in range(len(layers))]
    shapes = [s for layer in layers for s in layer]
    members = [(name, len(layer)) for name, layer in zip(names, layers)]
    grads = _gradients(seed, world, steps, shapes)
    merged_fb, alone_fb = [Feedback() for _ in range(world)], [Feedback() for _ in range(world)]
    for grads_t in grads:
        merged = [PowerSGDStep("l0..", g, rank, fb, members) for g, fb in zip(grads_t, merged_fb)]
        p = rank_order_mean([s.begin() for s in merged])
        q = rank_order_mean([s.middle(p) for s in merged])
        merged_out = [s.finish(q) for s in merged]
        first, alone_out = 0, [[] for _ in range(world)]
        for name, layer in zip(names, layers):
            alone = [PowerSGDStep(name, g[first : first + len(layer)], rank, fb) for g, fb in zip(grads_t, alone_fb)]
            p = rank_order_mean([s.begin() for s in alone])
            q = rank_order_mean([s.middle(p) for s in alone])
            for w, s in enumerate(alone):
                alone_out[w] += s.finish(q)
            first += len(layer)
        for w in range(world):
            assert [a.tobytes() for a in merged_out[w]] == [a.tobytes() for a in alone_out[w]]
    for a, b in zip(merged_fb, alone_fb):
        sa, sb = a.state(), b.state()
        assert sorted(sa) == sorted(sb) and all(sa[k].tobytes() == sb[k].tobytes() for k in sa)


def test_powersgd_step_rejects_members_that_do_not_cover_its_arrays():
    with pytest.raises(ConfigError, match="members name 3 arrays, it holds 2"):
        PowerSGDStep("a..b", [np.zeros((4, 4), np.float32)] * 2, 2, Feedback(), [("a", 1), ("b", 2)])
    with pytest.raises(ConfigError, match="layer b has no matrix parameter"):
        PowerSGDStep(
            "a..b", [np.zeros((4, 4), np.float32), np.zeros(4, np.float32)], 2, Feedback(), [("a", 1), ("b", 1)]
        )


def test_orthonormalize_zeroes_dependent_columns_and_keeps_a_projection():
    p = np.float32([[1, 2, 0.5], [1, 2, 0.0], [0, 0, 1.0]])  # the second column is twice the first
    q = orthonormalize(p)
    assert np.all(q[:, 1] == 0)  # in the first one's span: dropped, not amplified noise
    np.testing.assert_allclose(q[:, [0, 2]].T @ q[:, [0, 2]], np.eye(2), atol=1e-6)
    assert np.all(orthonormalize(np.zeros((4, 2), np.float32)) == 0)
    assert np.isnan(orthonormalize(np.float32([[np.nan], [1.0]]))).any()  # a diverged step stays visible


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


def test_feedback_state_round_trips_and_a_mismatched_shape_is_a_checkpoint_error():
    fb = Feedback()
    grads = _gradients(2, 1, 1, [(4, 5)])[0][0]
    step = TopKStep("fc.a", grads, 0.2, fb)
    step.finish([step.begin()])
    saved = fb.state()
    again = Feedback()
    again.load(saved)
    assert {k: v.tobytes() for k, v in again.state().items()} == {k: v.tobytes() for k, v in saved.items()}
    with pytest.raises(
        CheckpointError,
        match="layer fc.a: the error-feedback state error has shape \\(20,\\), this model needs \\(30,\\)",
    ):
        TopKStep("fc.a", _gradients(2, 1, 1, [(5, 6)])[0][0], 0.2, again).begin()
    with pytest.raises(CheckpointError):
        Feedback().load({"noslash": np.zeros(1)})


# -- the planner ----------------------------------------------------------------------------------


def _conv(name: str, out: int, cin: int, k: int = 3) -> PlanLayer:
    params = ((out, cin, k, k), (out,))
    return PlanLayer(LayerShape(name, "conv", out * cin * k * k + out, 1), False, params=params)


def _fc(name: str, m: int, n: int) -> PlanLayer:
    return PlanLayer(LayerShape(name, "fc", m, n, bias=True), True, params=((m, n), (m,)))


NORM = PlanLayer(LayerShape("bn", "other", 128, 1), False, params=((64,), (64,)))
SLOW = Link.of_bandwidth(12.5e6, 1e-4)  # 100 Mbit, 100 us a round


def test_lossy_times_follow_the_documented_model():
    layer = _conv("conv", 256, 256)  # 589 824 matrix elements, 256 bias
    costs = ComputeCosts({"fp16": (1e-5, 1e-9), "powersgd": (2e-5, 2e-9), "topk": (3e-5, 3e-9)})
    config = CompressionConfig("auto", rank=4, ratio=0.01)
    d, e, p = 589_824, 256, 4
    beta, alpha = SLOW.beta, SLOW.alpha
    assert lossy_time(layer, Scheme.FP16, p, SLOW, config, costs) == pytest.approx(
        2 * alpha + beta * 1.5 * 2 * (d + e) + 1e-5 + 1e-9 * (d + e)
    )
    floats = 4 * (256 + 2304) + e
    assert lossy_time(layer, Scheme.POWERSGD, p, SLOW, config, costs) == pytest.approx(
        4 * alpha + beta * 1.5 * 4 * floats + 2e-5 + 2e-9 * d
    )
    k = 5899
    assert lossy_time(layer, Scheme.TOPK, p, SLOW, config, costs) == pytest.approx(
        alpha + beta * 3 * (4 * e + 8 * k) + 3e-5 + 3e-9 * d
    )


def test_what_suits_a_lossy_scheme():
    config = CompressionConfig("auto", rank=4)
    assert unsuited(NORM, Scheme.TOPK, config) == "no matrix parameter (a bias, a norm)"
    assert unsuited(_conv("c1", 16, 3), Scheme.FP16, config) == "432 matrix elements, under 16384"
    assert unsuited(_conv("c1", 16, 3), Scheme.FP16, config, forced=True) is None
    assert (
        unsuited(
            PlanLayer(LayerShape("x", "fc", 512, 512), True, params=((512, 512),), float32=False), Scheme.FP16, config
        )
        == "not float32"
    )
    # 10 x 4096 at rank 4: 16 424 floats of factors against 40 960: suited; at rank 8 it is not
    # cheaper than a third... and a 128 x 128 matrix at rank 64 moves as much as it holds.
    assert unsuited(_fc("head", 10, 4096), Scheme.POWERSGD, config) is None
    assert "no fewer than the 16384" in unsuited(_fc("sq", 128, 128), Scheme.POWERSGD, CompressionConfig(rank=64))


def test_auto_takes_the_least_predicted_time_and_small_layers_stay_exact():
    layers = [_conv("conv1", 16, 3), NORM, _conv("conv5", 512, 512), _fc("head", 10, 512)]
    planner = LossyPlanner(CompressionConfig("auto"), ComputeCosts())
    report: dict = {}
    plan = choose_schemes(
        layers, {"head": 32}, mode=Mode.POSEIDON, workers=4, shards=4, link=SLOW, compression=planner, report=report
    )
    assert (
        plan["conv1"] in (Scheme.PS, Scheme.ALLREDUCE)
        and plan["bn"] in (Scheme.PS, Scheme.ALLREDUCE)
        and plan["head"] in (Scheme.PS, Scheme.ALLREDUCE, Scheme.SFB)
    )
    assert plan["conv5"] in (Scheme.POWERSGD, Scheme.TOPK)
    w = report["conv5"]
    assert w.choice.value == min(w.times, key=w.times.get) and set(w.times) >= {
        "ps",
        "allreduce",
        "fp16",
        "powersgd",
        "topk",
    }
    assert report["conv1"].why.startswith("exact: ") and "fp16" not in report["conv1"].times
    # A fast link with costly compute: nothing lossy pays.
    dear = LossyPlanner(CompressionConfig("auto"), ComputeCosts({s: (1.0, 0.0) for s in ("fp16", "powersgd", "topk")}))
    fast = choose_schemes(
        layers,
        {"head": 32},
        mode=Mode.POSEIDON,
        workers=4,
        shards=4,
        link=Link.of_bandwidth(1.25e9, 1e-5),
        compression=dear,
    )
    assert not {s for s in fast.values()} & {Scheme.FP16, Scheme.POWERSGD, Scheme.TOPK}


def test_a_tie_stays_exact():
    layer = _conv("conv5", 512, 512)
    exact_t = 2 * SLOW.alpha + SLOW.beta * 2 * layer.shape.params * 4 * 3 / 4
    # Compute that makes every lossy scheme exactly as slow as the exact all-reduce.
    planner = LossyPlanner(CompressionConfig("fp16"), ComputeCosts())
    fp16_t = lossy_time(layer, Scheme.FP16, 4, SLOW, planner.config, planner.costs)
    extra = exact_t - fp16_t
    while fp16_t + extra < exact_t:  # float rounding: make it a tie, not a win by one ulp
        extra = float(np.nextafter(extra, np.inf))
    tied = LossyPlanner(
        CompressionConfig("auto"), ComputeCosts({"fp16": (extra, 0.0), "powersgd": (100.0, 0.0), "topk": (100.0, 0.0)})
    )
    w = tied.weigh(layer, 0, Scheme.ALLREDUCE, (Scheme.ALLREDUCE,), 4, 4, SLOW)
    assert w.times["fp16"] == pytest.approx(w.times["allreduce"], rel=1e-12) and w.choice is Scheme.ALLREDUCE


def test_one_named_method_goes_wherever_it_suits_and_exact_elsewhere():
    layers = [_conv("conv1", 16, 3), _conv("conv5", 512, 512), _fc("sq", 128, 128)]
    fast = Link.of_bandwidth(1.25e10, 0.0)  # even where the link would not need it
    for method in ("fp16", "topk", "powersgd"):
        plan = choose_schemes(
            layers,
            {},
            mode=Mode.POSEIDON,
            workers=4,
            shards=4,
            link=fast,
            compression=LossyPlanner(CompressionConfig(method, rank=64)),
        )
        assert plan["conv5"] is Scheme(method) and plan["conv1"] in (Scheme.PS, Scheme.ALLREDUCE)
        # 128 x 128 at rank 64: PowerSGD no cheaper than exact; the others suit it.
        assert (plan["sq"] is Scheme(method)) == (method != "powersgd")
    assert (
        choose_schemes(
            layers, {}, mode=Mode.POSEIDON, workers=1, shards=1, compression=LossyPlanner(CompressionConfig("fp16"))
        )["conv5"]
        is Scheme.PS
    )


def test_lossy_overrides_need_a_matrix_and_mode_poseidon():
    layers = [NORM, _conv("conv1", 16, 3)]
    assert (
        choose_schemes(layers, {}, mode=Mode.POSEIDON, workers=2, shards=2, overrides={"conv1": "powersgd"})["conv1"]
        is Scheme.POWERSGD
    )
    with pytest.raises(ConfigError, match="bn cannot go by topk: no matrix parameter"):
        choose_schemes(layers, {}, mode=Mode.POSEIDON, workers=2, shards=2, overrides={"bn": "topk"})
    with pytest.raises(ConfigError, match="mode 'wfbp' syncs every layer by PS"):
        choose_schemes(layers, {}, mode=Mode.WFBP, workers=2, shards=2, overrides={"conv1": "fp16"})


def test_compression_settings_are_validated_and_agreed_on():
    assert CompressionConfig.of(None) is None and CompressionConfig.of("topk").method.value == "topk"
    for bad in (
        dict(method="zip"),
        dict(rank=0),
        dict(ratio=0.0),
        dict(ratio=1.5),
        dict(min_elements=0),
        dict(link=Link(0.0, 0.0)),
    ):
        with pytest.raises(ConfigError):
            CompressionConfig(**bad)
    with pytest.raises(ConfigError):
        CompressionConfig.of(3)
    assert CompressionConfig("auto", rank=2).settings() != CompressionConfig("auto", rank=4).settings()
    costs = ComputeCosts({"topk": (1e-5, 2e-9)})
    assert ComputeCosts.from_json(costs.to_json()) == costs


def test_the_trainer_refuses_compression_outside_mode_poseidon():
    import torch

    from poseidon_aio import Trainer

    model = torch.nn.Linear(4, 2)
    with pytest.raises(ConfigError, match="use mode 'poseidon', not 'wfbp'"):
        Trainer(
            model,
            torch.optim.SGD(model.parameters(), 0.1),
            torch.nn.functional.mse_loss,
            mode="wfbp",
            compression="topk",
        )
    with pytest.raises(ConfigError, match="compression must be one of"):
        Trainer(model, torch.optim.SGD(model.parameters(), 0.1), torch.nn.functional.mse_loss, compression="zip")


def test_explain_prints_every_candidate_s_predicted_time_and_the_choice():
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "poseidon_aio.cli",
            "explain",
            "--model",
            "resnet50",
            "--workers",
            "4",
            "--bandwidth",
            "100mbit",
            "--alpha",
            "100",
            "--compression",
            "auto",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=root,
    )
    out = json.loads(done.stdout)
    rows = {r["name"]: r for r in out["layers"]}
    assert out["compression"]["method"] == "auto" and set(out["compute"]) == {"fp16", "powersgd", "topk"}
    for r in rows.values():
        assert r["choice"] == min(r["predicted_s"], key=r["predicted_s"].get) or (
            r["choice"] == r["exact"] and r["why"].startswith("exact")
        )
    assert (
        rows["bn1"]["choice"] in ("ps", "allreduce") and "topk" not in rows["bn1"]["predicted_s"]
    )  # a norm stays exact
    assert rows["layer4.0.conv2"]["choice"] in ("fp16", "powersgd", "topk")  # 2.4 M elements at 100 Mbit
    text = subprocess.run(
        [
            sys.executable,
            "-m",
            "poseidon_aio.cli",
            "explain",
            "--fc",
            "4096x4096",
            "--workers",
            "8",
            "--compression",
            "powersgd",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=root,
    ).stdout
    assert "powersgd named, and the layer suits it" in text and "1gbit links" in text


def test_a_link_with_a_flop_rate_charges_the_weight_gradient_to_lossy_schemes_too():
    # Where the link carries the device's seconds per FLOP, the exact schemes count an FC layer's
    # weight gradient (2 K M N FLOPs); a lossy scheme compresses that same gradient.
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Measured:
        alpha: float = 1e-4
        beta: float = 8e-8
        flop: float = 1e-10

    layer, config = _fc("fc", 512, 1024), CompressionConfig("auto")
    plain = lossy_time(layer, Scheme.TOPK, 4, Link(1e-4, 8e-8), config, ComputeCosts(), rows=32)
    assert lossy_time(layer, Scheme.TOPK, 4, Measured(), config, ComputeCosts(), rows=32) == pytest.approx(
        plain + 2 * 32 * 512 * 1024 * 1e-10
    )
