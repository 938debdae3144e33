"""The MG-WFBP planner as pure functions, against the paper's cases."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from poseidon_aio.errors import ConfigError
from poseidon_aio.plan import MergeConfig
from poseidon_aio.plan.cost import Scheme
from poseidon_aio.plan.mgwfbp import (
    CommModel,
    bucket_plan,
    fit,
    groups_of,
    iteration_time,
    merge_plan,
    optimal_plan,
    tapered_plan,
    timeline,
    with_launches,
)


def test_case_1_communication_hidden_nothing_merged():
    # t_c^(l) <= t_b^(l-1) everywhere, and every t_b beats the start-up: no layer is worth merging.
    t_b, sizes = [10e-3] * 4, [1e5] * 4
    model = CommModel(a=1e-3, b=1e-8)  # 2 ms per layer message
    plan = merge_plan(5e-3, t_b, sizes, model)
    assert plan.merged == ()
    assert plan.t_iter == pytest.approx(5e-3 + sum(t_b) + model.time(1e5))  # Eq. 11


def test_case_2_a_slow_layer_absorbed_later_costs_nothing_extra():
    # Layer 4's message outlasts layer 3's backward, but layers 3..2 give it room (Eq. 12).
    t_b, sizes = [10e-3, 10e-3, 2e-3, 1e-3], [1e4, 1e4, 1e4, 8e5]
    model = CommModel(a=0.5e-3, b=1e-8)  # layer 4: 8.5 ms, others 0.6 ms
    _, _, wfbp = timeline(0.0, t_b, [model.time(s) for s in sizes])
    assert wfbp == pytest.approx(sum(t_b) + model.time(1e4))
    assert merge_plan(0.0, t_b, sizes, model).t_iter <= wfbp + 1e-12


def test_case_3_start_up_dominates_merging_shortens_the_iteration():
    # Many small layers whose messages each cost more than the next layer's backward (Fig. 3c, 4).
    t_b, sizes = [0.2e-3] * 20, [4e3] * 20
    model = CommModel(a=0.6e-3, b=1e-9)
    plan = merge_plan(1e-3, t_b, sizes, model)
    assert plan.merged and plan.t_iter < plan.t_iter_wfbp
    assert plan.t_iter <= plan.t_iter_single + 1e-12


def _brute_force(t_f, t_b, sizes, model):
    L = len(t_b)
    return min(
        iteration_time(t_f, t_b, sizes, model, groups_of(L, {layer for layer, m in zip(range(2, L + 1), bits) if m}))
        for bits in itertools.product([0, 1], repeat=L - 1)
    )


@settings(max_examples=300, deadline=None)
@given(
    t_b=st.lists(st.floats(1e-5, 5e-3), min_size=2, max_size=7),
    data=st.data(),
    a=st.floats(1e-5, 2e-3),
    b=st.floats(1e-11, 1e-8),
    serial=st.one_of(st.just(0.0), st.floats(1e-6, 3e-3)),  # 0: the paper's model
)
def test_theorem_1_condition_and_never_worse_than_wfbp_or_one_message(t_b, data, a, b, serial):
    sizes = data.draw(st.lists(st.floats(1e2, 1e7), min_size=len(t_b), max_size=len(t_b)))
    model = CommModel(a, b, serial)
    plan = merge_plan(1e-3, t_b, sizes, model)
    assert plan.t_iter <= plan.t_iter_wfbp + 1e-12
    assert plan.t_iter <= plan.t_iter_single + 1e-12
    # Against every one of the 2^(L-1) ways to merge consecutive layers: the dynamic program is
    # exact (with serial > 0 it also counts messages); Algorithm 1 is greedy and only bounded by
    # it (see the next test).
    best = _brute_force(1e-3, t_b, sizes, model)
    exact = optimal_plan(1e-3, t_b, sizes, model)
    assert exact.t_iter == pytest.approx(best, rel=1e-12, abs=1e-15)
    assert best <= plan.t_iter + 1e-15


def test_algorithm_1_is_greedy_where_the_dynamic_program_is_exact():
    # Found by sampling: Algorithm 1 merges layer 3 into 2 (groups (1), (2, 3)); sending layer 3
    # alone while layer 2 still computes, then (1, 2) together, ends 1 us sooner. On random
    # 2-8 layer cases the gap reached 23 %.
    t_b, sizes, model = [0.001953125, 6.103515625e-05, 0.00390625], [100.0] * 3, CommModel(0.001953125, 8.72e-09)
    greedy, exact = merge_plan(1e-3, t_b, sizes, model), optimal_plan(1e-3, t_b, sizes, model)
    assert greedy.groups == ((1,), (2, 3)) and exact.groups == ((1, 2), (3,))
    assert exact.t_iter < greedy.t_iter


def test_each_merge_met_the_theorem_1_condition_when_made():
    t_b, sizes = [0.3e-3, 0.1e-3, 2e-3, 0.1e-3, 0.1e-3], [5e3, 2e3, 3e6, 1e3, 1e3]
    model = CommModel(a=0.5e-3, b=2e-9)
    plan = merge_plan(0.5e-3, t_b, sizes, model)
    t_c = [model.time(s) for s in sizes]
    p = list(sizes)
    for layer in sorted(plan.merged, reverse=True):
        tau_b, tau_c, _ = timeline(0.5e-3, t_b, t_c)
        assert tau_b[layer - 2] - tau_c[layer] < model.a
        p[layer - 2] += p[layer - 1]
        p[layer - 1] = 0
        t_c[layer - 1], t_c[layer - 2] = 0.0, model.time(p[layer - 2])


def test_fit_recovers_alpha_and_beta():
    sizes = [4096 * 2**i for i in range(12)]
    model = fit(sizes, [91e-6 + 8e-10 * s for s in sizes])
    assert model.a == pytest.approx(91e-6, rel=1e-6) and model.b == pytest.approx(8e-10, rel=1e-6)
    with pytest.raises(ValueError):
        fit([1.0], [1.0])


def test_fit_takes_the_start_up_from_the_small_messages():
    # 0.3 ms round trips of 4 KiB; the 4 MiB ones 3 % off the line either way, as at 1 Gbit
    # through tbf: a least-squares intercept would be milliseconds, which no small message takes.
    sizes = [4096, 65536, 1 << 20, 4 << 20] * 3
    times = [3e-4 + 16e-9 * s * (1 + (0.03 if s == 4 << 20 and i % 2 else 0.0)) for i, s in enumerate(sizes)]
    model = fit(sizes, times)
    assert model.a == pytest.approx(3e-4 - 16e-9 * 4096 * (model.b / 16e-9 - 1), rel=1e-3)
    assert model.a < 0.5e-3 and model.b == pytest.approx(16e-9, rel=0.05)


def test_loop_cpu_per_byte_is_the_slope_over_the_four_crossings():
    from poseidon_aio.sync.runtime import loop_cpu_per_byte

    assert loop_cpu_per_byte(
        [(4096, 1e-4 + 4 * 4096 * 2e-10), (1 << 20, 1e-4 + 4 * (1 << 20) * 2e-10)]
    ) == pytest.approx(2e-10)
    assert loop_cpu_per_byte([(4096, 1e-4)]) == 0.0


# -- a message's cost to the backward (serial > 0: several workers share the host's cores) --------


def test_serial_cost_charges_each_message_sent_during_the_backward():
    # Three layers, nothing to send: only the backward's delays count. Two messages are sent
    # before the backward ends (layers 3 and 2), the last one after it.
    t_b, sizes = [1e-3, 1e-3, 1e-3], [0.0, 0.0, 0.0]
    model = CommModel(0.0, 0.0, 0.5e-3)
    assert iteration_time(2e-3, t_b, sizes, model, ((1,), (2,), (3,))) == pytest.approx(5e-3 + 2 * 0.5e-3)
    assert iteration_time(2e-3, t_b, sizes, model, ((1, 2, 3),)) == pytest.approx(5e-3)
    assert with_launches(t_b, ((1,), (2, 3)), 0.5e-3) == [1.5e-3, 1e-3, 1e-3]


def test_serial_cost_merges_what_the_paper_keeps_apart():
    # Long backward gaps hide every message (the paper's case 1: nothing merged); when each
    # message also takes 2 ms from the backward, merging pays, and the exact planner sends few.
    t_b, sizes = [10e-3] * 8, [3e4] * 8
    paper = CommModel(a=1e-3, b=1e-8)
    shared = CommModel(a=1e-3, b=1e-8, serial=2e-3)
    assert merge_plan(5e-3, t_b, sizes, paper).merged == ()
    greedy, exact = merge_plan(5e-3, t_b, sizes, shared), optimal_plan(5e-3, t_b, sizes, shared)
    assert len(greedy.groups) < 8 and greedy.t_iter < greedy.t_iter_wfbp
    assert len(exact.groups) <= len(greedy.groups) and exact.t_iter <= greedy.t_iter


def test_runtime_takes_the_serial_cost_out_of_the_measured_backward_and_plans_with_it():
    from poseidon_aio.plan.merging import MergeConfig, MergePlanner

    calibration = [(s, 2 * (1e-4 + 1e-8 * s)) for s in (4096, 65536, 1 << 20)]
    layers, sizes = list(range(8)), [3e4] * 8

    def plan(serial):
        runtime = MergePlanner(
            MergeConfig(kind="algorithm1"), world=4, shards=4, scheme=Scheme.ALLREDUCE, calibration=calibration
        )
        for _ in range(3):
            # The warm-up: each layer's gradient 10 ms after the one above (its own message's
            # serial cost included), ~0.2 ms of loop CPU a message.
            ready = {layer: 0.1 + 0.01 * (8 - layer) for layer in layers}
            runtime.record(0.05, 0.1, ready, layers, [], 0, 0.2e-3, serial)
        return runtime.plan(layers, [f"l{i}" for i in layers], sizes)

    alone, shared = plan(0.0), plan(8e-3)
    assert alone["serial_s"] == 0.0 and len(alone["groups"]) == 8  # the paper's plan: nothing merged
    assert shared["serial_s"] == pytest.approx(8e-3) and len(shared["groups"]) < 8
    assert shared["predicted_s"]["plan"] < shared["predicted_s"]["wfbp"]


def test_a_lossy_message_s_start_up_spread_and_size_for_mg_wfbp():
    from poseidon_aio.plan import CompressionConfig
    from poseidon_aio.plan.lossy import message_bytes
    from poseidon_aio.plan.merging import MergeConfig, MergePlanner

    calibration = [(s, 2 * (1e-4 + 1e-8 * s)) for s in (4096, 65536, 1 << 20)]
    models = {
        s: MergePlanner(MergeConfig(kind="algorithm1"), 4, 4, s, calibration).comm_model()
        for s in (Scheme.ALLREDUCE, Scheme.POWERSGD, Scheme.TOPK)
    }
    # P, then Q from it: two rounds a message; the bytes cross the link alike
    assert (
        models[Scheme.POWERSGD].a == pytest.approx(2 * models[Scheme.ALLREDUCE].a)
        and models[Scheme.POWERSGD].b == models[Scheme.ALLREDUCE].b
    )
    # a 512 x 4608 convolution at rank 4: 4 x (512 + 4608) floats, not 512 x 4608
    assert message_bytes([(512, 512, 3, 3), (512,)], Scheme.POWERSGD, CompressionConfig(rank=4)) == 4 * (
        4 * (512 + 4608) + 512
    )
    # top-k: one round; its payload goes whole to each of the P - 1 = 3 peers, against an
    # all-reduce's 2 (P - 1) / P = 1.5 of its vector
    assert models[Scheme.TOPK].a == pytest.approx(models[Scheme.ALLREDUCE].a) and models[
        Scheme.TOPK
    ].b == pytest.approx(2 * models[Scheme.ALLREDUCE].b)
    assert (
        message_bytes([(512, 512, 3, 3), (512,)], Scheme.TOPK, CompressionConfig(ratio=0.01)) == 4 * 512 + 8 * 23593
    )  # k = ceil(1 % of 2 359 296)
    with pytest.raises(ConfigError, match="allreduce is not a lossy scheme"):
        message_bytes([(64, 64)], Scheme.ALLREDUCE, CompressionConfig())


def test_a_merge_plan_is_kept_only_if_the_slowest_ranks_step_got_faster():
    from poseidon_aio.sync.trial import judge_trial

    # Each phase's first step is left out; a step counts at its slowest rank.
    warm = {0: [9.0, 0.040, 0.050], 1: [9.0, 0.045, 0.041]}  # steps 0.045, 0.050: median 0.0475
    faster = {0: [5.0, 0.030, 0.046], 1: [5.0, 0.031, 0.032]}  # 0.031, 0.046: 0.0385
    slower = {0: [5.0, 0.030, 0.030], 1: [5.0, 0.060, 0.060]}  # rank 1 is the step: 0.060
    verdict = judge_trial(warm, faster)
    assert verdict == {
        "kept": True,
        "best": 0,
        "unmerged_s": pytest.approx(0.0475),
        "planned_s": pytest.approx(0.0385),
        "trials_s": [pytest.approx(0.0385)],
        "noise_s": pytest.approx(0.0025),  # the warm-up steps' median absolute deviation
        "unmerged_cpu_s": None,  # no CPU figures: the time alone decides
        "trials_cpu_s": None,
        "control_s": None,
        "by": "time",
    }
    assert judge_trial(warm, slower)["kept"] is False
    assert judge_trial(warm, warm)["kept"] is False  # no gain, no merge: one message per layer stays
    assert judge_trial({0: [0.05]}, {0: [0.04]})["kept"] is True  # one step each: nothing to leave out
    # Several plans on trial (``best``): the fastest is kept, the first of equals.
    assert judge_trial(warm, slower, faster)["best"] == 1 and judge_trial(warm, slower, faster)["kept"] is True
    assert judge_trial(warm, faster, faster)["best"] == 0
    with pytest.raises(ValueError):
        judge_trial(warm)


@given(
    st.lists(st.lists(st.floats(1e-3, 1.0), min_size=3, max_size=3), min_size=2, max_size=4),
    st.lists(
        st.lists(st.lists(st.floats(1e-3, 1.0), min_size=3, max_size=3), min_size=2, max_size=4), min_size=1, max_size=3
    ),
)
@settings(max_examples=200, deadline=None)
def test_every_rank_reaches_the_same_verdict_and_it_is_the_fastest_plan_if_any_beat_the_warm_up(warm_rows, trial_rows):
    from poseidon_aio.sync.trial import judge_trial

    ranks = min(len(warm_rows), *(len(t) for t in trial_rows))
    warm = {r: warm_rows[r] for r in range(ranks)}
    trials = [{r: t[r] for r in range(ranks)} for t in trial_rows]
    verdict = judge_trial(warm, *trials)
    # The same figures arriving in another rank order (the exchange's dict) give the same verdict.
    assert (
        judge_trial(dict(reversed(list(warm.items()))), *(dict(reversed(list(t.items()))) for t in trials)) == verdict
    )

    def job(times):  # each step at its slowest rank, the phase's first left out
        steps = [max(times[r][i] for r in times) for i in range(1, 3)]
        return sum(steps) / 2

    medians = [job(t) for t in trials]
    assert verdict["planned_s"] == pytest.approx(min(medians)) and medians.index(min(medians)) == verdict["best"]
    assert verdict["kept"] == (min(medians) < job(warm))


def test_best_plans_with_both_planners_and_one_message_and_lists_each_distinct_plan_once():
    from poseidon_aio.plan.merging import MergeConfig, MergePlanner

    calibration = [(s, 2 * (1e-4 + 1e-8 * s)) for s in (4096, 65536, 1 << 20)]
    layers = list(range(12))

    def plans(kind, sizes, serial):
        runtime = MergePlanner(
            MergeConfig(kind=kind), world=4, shards=4, scheme=Scheme.ALLREDUCE, calibration=calibration
        )
        for _ in range(3):
            ready = {layer: 0.1 + 0.004 * (12 - layer) for layer in layers}
            runtime.record(0.05, 0.1, ready, layers, [], 0, 1e-3, serial)
        return runtime.plan(layers, [f"l{i}" for i in layers], sizes)

    for sizes in ([3e4] * 12, [1e3, 4e5, 2e3, 8e5, 1e3, 3e4, 5e5, 1e3, 2e4, 9e5, 1e3, 1e4]):
        for serial in (0.0, 2e-3):
            best = plans("best", sizes, serial)
            greedy, exact, buckets, tapered = (
                plans(k, sizes, serial)["groups"] for k in ("algorithm1", "optimal", "buckets", "tapered")
            )
            single = [[f"l{i}" for i in layers]]
            want = [
                ("algorithm1", greedy),
                ("optimal", exact),
                ("single", single),
                ("buckets", buckets),
                ("tapered", tapered),
            ]
            want = [(name, g) for i, (name, g) in enumerate(want) if all(g != other for _, other in want[:i])]
            assert best["groups"] == greedy and best["planner"] == "algorithm1"
            assert [(c["planner"], c["groups"]) for c in best["candidates"]] == want


def test_bucket_plan_fills_ddp_s_buckets_from_the_output_by_hand():
    model = CommModel(a=1e-3, b=1e-9)
    # From the output (layer 5): 0.6 MB, then 0.6 -> 1.2 MB reaches the 1 MiB first bucket; then
    # 25 MiB buckets: 3 + 30 reaches it; layer 1 alone.
    sizes = [0.5e6, 30e6, 3e6, 0.6e6, 0.6e6]
    plan = bucket_plan(0.0, [1e-3] * 5, sizes, model)
    assert plan.groups == ((1,), (2, 3), (4, 5))
    assert plan.t_iter == iteration_time(0.0, [1e-3] * 5, sizes, model, plan.groups)
    assert bucket_plan(0.0, [1e-3] * 5, sizes, model, first_bytes=1, bucket_bytes=1).groups == tuple(
        (layer,) for layer in range(1, 6)
    )
    assert bucket_plan(0.0, [1e-3] * 5, sizes, model, first_bytes=1e9, bucket_bytes=1e9).groups == ((1, 2, 3, 4, 5),)
    with pytest.raises(ConfigError, match="positive"):
        bucket_plan(0.0, [1e-3], [1.0], model, bucket_bytes=0)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    sizes=st.lists(st.integers(1, 1 << 22), min_size=1, max_size=40),
    first=st.integers(1, 1 << 21),
    then=st.integers(1, 1 << 23),
)
def test_bucket_plan_partitions_the_layers_and_every_bucket_but_the_input_side_one_reaches_its_cap(sizes, first, then):
    groups = bucket_plan(
        0.0, [1e-4] * len(sizes), sizes, CommModel(1e-4, 1e-9), first_bytes=first, bucket_bytes=then
    ).groups
    assert [layer for g in groups for layer in g] == list(range(1, len(sizes) + 1))
    assert all(list(g) == list(range(g[0], g[-1] + 1)) for g in groups)
    for k, g in enumerate(reversed(groups)):  # from the output, as DDP fills them
        total = sum(sizes[layer - 1] for layer in g)
        cap = first if k == 0 else then
        if k < len(groups) - 1:
            assert total >= cap and total - sizes[min(g) - 1] < cap  # its last layer closed it
        else:
            assert total - sizes[min(g) - 1] < cap


def test_tapered_plan_cuts_the_input_side_bucket_to_the_first_bucket_s_bytes_by_hand():
    model = CommModel(a=1e-3, b=1e-9)
    t_b = [1e-3] * 6
    # DDP's buckets from the output: (6) reaches 1 MiB alone; then 0.4 + 0.3 + 0.4 + 0.2 + 0.3 MB
    # (layers 5..1) stay under 25 MiB: one bucket (1..5), all of it after layer 1's backward.
    sizes = [0.3e6, 0.2e6, 0.4e6, 0.3e6, 0.4e6, 2e6]
    assert bucket_plan(0.0, t_b, sizes, model).groups == ((1, 2, 3, 4, 5), (6,))
    # Tapered: from the input, 0.3 + 0.2 + 0.4 = 0.9 MB fit in 1 MiB, layer 4 would not: (1, 2, 3)
    # go last, (4, 5) as soon as layer 4 is ready.
    plan = tapered_plan(0.0, t_b, sizes, model)
    assert plan.groups == ((1, 2, 3), (4, 5), (6,))
    assert plan.t_iter == iteration_time(0.0, t_b, sizes, model, plan.groups)
    # A first layer over the cap still goes alone; a bucket already small enough is not cut.
    assert tapered_plan(0.0, t_b, [5e6, *sizes[1:]], model).groups == ((1,), (2, 3, 4, 5), (6,))
    assert (
        tapered_plan(0.0, t_b, sizes, model, first_bytes=2e6).groups
        == bucket_plan(0.0, t_b, sizes, model, first_bytes=2e6).groups
    )


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    sizes=st.lists(st.integers(1, 1 << 22), min_size=1, max_size=40),
    first=st.integers(1, 1 << 21),
    then=st.integers(1, 1 << 23),
)
def test_tapered_plan_is_ddp_s_buckets_with_at_most_the_first_bucket_s_bytes_after_the_backward(sizes, first, then):
    t_b, model = [1e-4] * len(sizes), CommModel(1e-4, 1e-9)
    ddp = bucket_plan(0.0, t_b, sizes, model, first_bytes=first, bucket_bytes=then).groups
    groups = tapered_plan(0.0, t_b, sizes, model, first_bytes=first, bucket_bytes=then).groups
    assert [layer for g in groups for layer in g] == list(range(1, len(sizes) + 1))
    assert groups[-len(ddp) + 1 :] == ddp[1:] or len(ddp) == 1  # every bucket but the input side's as DDP's
    tail = sum(sizes[layer - 1] for layer in groups[0])
    assert len(groups[0]) == 1 or tail <= first  # what waits for the end of the backward
    assert len(groups) - len(ddp) in (0, 1)
    if len(groups) == len(ddp):  # not cut: already small enough
        assert groups == ddp and (len(ddp[0]) == 1 or sum(sizes[layer - 1] for layer in ddp[0]) <= first)


def test_merge_config_rejects_bad_bucket_sizes():
    for bad in ((0, 1), (1, -5), (1,), "big"):
        with pytest.raises(ConfigError, match="bucket_bytes"):
            MergeConfig(bucket_bytes=bad)
    assert MergeConfig(bucket_bytes=(65536.0, 1 << 20)).bucket_bytes == (65536, 1 << 20)


def test_merge_config_rejects_a_negative_trial():
    with pytest.raises(ConfigError, match="trial"):
        MergeConfig(trial=-1)
