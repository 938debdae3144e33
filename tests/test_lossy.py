"""Error feedback, the lossy schemes' promises without sockets: the property tests on the pure
steps (hypothesis), merged layers' bits and state, and the state a checkpoint keeps. Beside it:
test_lossy_syncers.py (the syncers over an in-process mesh), test_lossy_planner.py (the planner's
rule, the settings, explain), test_lossy_codecs.py (the payloads' codecs)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from poseidon_aio.errors import CheckpointError, ConfigError
from poseidon_aio.plan.lossy import topk_count
from poseidon_aio.sync import Feedback
from poseidon_aio.sync.compress import PowerSGDStep, TopKStep, orthonormalize, rank_order_mean

from .support.compression import _gradients, _simulate, layer_shapes

EPS = float(np.finfo(np.float32).eps)

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
