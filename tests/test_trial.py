"""The merge trial's controller, driven with given step times: no processes, no sockets."""

from __future__ import annotations

import statistics
from unittest.mock import patch

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from poseidon_aio.errors import LocalProtocolError
from poseidon_aio.sync.trial import TRANSITIONS, Due, Event, MergeTrial, Phase, Trial, candidate_plans, rank_sum_p

STEPS = 3  # MergeConfig.trial


def _warm_up(trial: MergeTrial, times, first_clock: int = 0, cpu=None) -> int:
    for clock, seconds in enumerate(times, first_clock):
        spent = cpu[clock - first_clock] if cpu is not None else None
        assert trial.step_done(clock, seconds, warm=True, cpu=spent) is Due.NOTHING
    return first_clock + len(times)


def _run_trials(trial: MergeTrial, times_per_plan, clock: int, cpu_per_plan=None) -> list:
    """Feed each plan's step times (and CPU); returns what each trial's last step asked for."""
    asked = []
    for i, times in enumerate(times_per_plan):
        for j, seconds in enumerate(times):
            spent = cpu_per_plan[i][j] if cpu_per_plan is not None else None
            due = trial.step_done(clock, seconds, warm=False, cpu=spent)
            clock += 1
            if j < len(times) - 1:
                assert due is Due.NOTHING
        asked.append(due)
        if due is Due.NEXT_TRIAL:
            assert trial.next_trial(clock) == trial.trials[i + 1].plan
    return asked


def test_candidate_plans_one_per_planner_in_order_and_only_plans_that_merge():
    groups = {"ps": [[0], [1], [2]], "allreduce": [[3], [4]]}
    candidates = {
        "ps": [("greedy", [[0, 1], [2]]), ("exact", [[0, 1, 2]]), ("single", [[0, 1, 2]])],
        "allreduce": [("greedy", [[3], [4]]), ("buckets", [[3, 4]])],
    }
    trials = candidate_plans(groups, candidates)
    # planners in the order they first appear; a scheme without a planner's candidate keeps its first
    assert [t.planner for t in trials] == ["greedy", "exact", "buckets"]  # "single" is the same plan as "exact"
    assert trials[0].plan == {"ps": [[0, 1], [2]], "allreduce": [[3], [4]]}
    assert trials[2].plan == {"ps": [[0, 1], [2]], "allreduce": [[3, 4]]}
    # a candidate that merges nothing is not tried
    assert candidate_plans({"ps": [[0], [1]]}, {"ps": [("greedy", [[0], [1]])]}) == []


def test_the_trials_run_in_order_and_the_fastest_plan_that_beats_one_message_per_layer_is_kept():
    trial = MergeTrial(STEPS)
    clock = _warm_up(trial, [0.05, 0.010, 0.010])
    plans = [Trial("greedy", "A"), Trial("exact", "B"), Trial("tapered", "C")]
    assert trial.planned(plans, clock) == "A" and trial.phase is Phase.TRYING
    asked = _run_trials(trial, [[0.02, 0.009, 0.009], [0.02, 0.007, 0.007], [0.02, 0.008, 0.008]], clock)
    assert asked == [Due.NEXT_TRIAL, Due.NEXT_TRIAL, Due.JUDGMENT]
    assert [t.times for t in trial.trials] == [[0.02, 0.009, 0.009], [0.02, 0.007, 0.007], [0.02, 0.008, 0.008]]
    verdict = trial.judge({0: trial.figures()})
    assert verdict.kept and verdict.trial.plan == "B" and verdict.figures["planner"] == "exact"
    assert verdict.rebuild  # C runs now: B must be rebuilt
    assert verdict.figures["tried"] == {"greedy": 0.009, "exact": 0.007, "tapered": 0.008}
    assert trial.phase is Phase.SETTLED
    assert trial.step_done(99, 1.0, warm=False) is Due.NOTHING  # settled: steps no longer count


def test_the_running_plan_is_kept_without_a_rebuild_and_a_slower_one_is_dropped():
    trial = MergeTrial(2)
    clock = _warm_up(trial, [0.02, 0.010])
    trial.planned([Trial("greedy", "A"), Trial("exact", "B")], clock)
    _run_trials(trial, [[0.02, 0.009], [0.02, 0.008]], clock)
    verdict = trial.judge({0: trial.figures()})
    assert verdict.kept and verdict.trial.plan == "B" and not verdict.rebuild

    slower = MergeTrial(2)
    clock = _warm_up(slower, [0.02, 0.010])
    slower.planned([Trial("greedy", "A")], clock)
    _run_trials(slower, [[0.02, 0.011]], clock)
    verdict = slower.judge({0: slower.figures()})
    assert not verdict.kept and verdict.rebuild  # back to one message per layer


def test_nothing_to_try_settles_at_once_and_forgets_the_warm_up():
    trial = MergeTrial(STEPS)
    clock = _warm_up(trial, [0.01, 0.01])
    assert trial.planned([], clock) is None
    assert trial.phase is Phase.SETTLED and trial.warm == []


def test_only_measured_steps_count_in_the_warm_up():
    trial = MergeTrial(STEPS)
    assert trial.step_done(0, 0.5, warm=False) is Due.NOTHING
    assert trial.warm == []


@settings(max_examples=50, deadline=None)
@given(
    ranks=st.integers(1, 4),
    plans=st.integers(1, 3),
    steps=st.integers(1, 4),
    data=st.data(),
)
def test_every_rank_reaches_the_same_verdict_from_the_agreed_figures(ranks, plans, steps, data):
    seconds = st.floats(0.001, 1.0, allow_nan=False)
    controllers = {}
    for rank in range(ranks):  # each rank its own times: the verdict is on everyone's
        trial = MergeTrial(steps)
        warm = data.draw(st.lists(seconds, min_size=1, max_size=4))
        clock = _warm_up(trial, warm, cpu=data.draw(st.lists(seconds, min_size=len(warm), max_size=len(warm))))
        trial.planned([Trial(f"p{i}", i) for i in range(plans)], clock)
        each = st.lists(seconds, min_size=steps, max_size=steps)
        _run_trials(trial, [data.draw(each) for _ in range(plans)], clock, [data.draw(each) for _ in range(plans)])
        controllers[rank] = trial
    figures = {rank: trial.figures() for rank, trial in controllers.items()}
    shuffled = dict(reversed(list(figures.items())))  # the exchange's order is not the ranks'
    verdicts = [trial.judge(figures if rank % 2 else shuffled) for rank, trial in controllers.items()]
    assert all(
        (v.kept, v.trial.plan, v.rebuild, v.figures)
        == (verdicts[0].kept, verdicts[0].trial.plan, verdicts[0].rebuild, verdicts[0].figures)
        for v in verdicts
    )


WARM = [0.05, 0.010, 0.011, 0.009, 0.010]  # median 10 ms, noise (median absolute deviation) 0.5 ms
TRIED = 5  # MergeConfig.trial's default: 4 steps counted, enough for the rank-sum test to tell


def _run(first: float, then: float) -> list:
    """A phase's step times (or CPU): its first step, then ``then`` for the rest of the trial."""
    return [first] + [then] * (TRIED - 1)


def _verdict(plan_s, warm_cpu=None, plan_cpu=None, ranks=1):
    figures = {}
    for rank in range(ranks):
        trial = MergeTrial(TRIED)
        clock = _warm_up(trial, WARM, cpu=warm_cpu)
        trial.planned([Trial("greedy", "A")], clock)
        _run_trials(trial, [_run(0.02, plan_s)], clock, None if plan_cpu is None else [_run(0.02, plan_cpu)])
        figures[rank] = trial.figures()
    return trial.judge(figures)


def test_a_plan_as_fast_within_the_noise_is_kept_where_it_spent_less_cpu():
    # 10.2 ms against 10.0: slower, but within the warm-up's 0.5 ms of noise, on 5 ms of CPU a step against 8.
    v = _verdict(0.0102, warm_cpu=[0.03] + [0.008] * 4, plan_cpu=0.005)
    assert v.kept and v.trial.plan == "A" and v.figures["by"] == "cpu"
    assert v.figures["noise_s"] == pytest.approx(0.0005)
    assert v.figures["unmerged_cpu_s"] == pytest.approx(0.008) and v.figures["trials_cpu_s"] == [pytest.approx(0.005)]
    # Summed over the ranks, compared alike.
    v = _verdict(0.0102, warm_cpu=[0.03] + [0.008] * 4, plan_cpu=0.005, ranks=3)
    assert v.kept and v.figures["unmerged_cpu_s"] == pytest.approx(0.024)
    # Without CPU figures the time alone decides, as before: not kept.
    v = _verdict(0.0102)
    assert not v.kept and v.figures["by"] == "time" and v.figures["trials_cpu_s"] is None
    # Past the noise, every step slower, the time decides whatever the CPU.
    v = _verdict(0.0115, warm_cpu=[0.03] + [0.008] * 4, plan_cpu=0.001)
    assert not v.kept and v.figures["by"] == "time"


def _controlled(warm, plan, control, warm_cpu, plan_cpu, control_cpu):
    trial = MergeTrial(TRIED)
    clock = _warm_up(trial, warm, cpu=warm_cpu)
    assert trial.planned([Trial("greedy", "A")], clock, control="unmerged") == "A"
    asked = _run_trials(trial, [plan, control], clock, [plan_cpu, control_cpu])
    assert asked == [Due.NEXT_TRIAL, Due.JUDGMENT]  # the control runs after the candidates
    assert trial.trials[-1].plan == "unmerged"
    return trial.judge({0: trial.figures()})


def test_a_plan_slower_past_the_noise_by_a_few_slow_steps_is_as_fast_and_the_cpu_decides():
    # bench train's ResNet-20 x2 at 1 Gbit (job steps and CPU of a run that dropped the plan): its
    # median 8.3 ms against 7.0 unmerged, noise 0.6, but its steps and one message per layer's
    # interleave too much for the rank-sum test (p 0.09), and on 7.0 ms of CPU a step against
    # 10.8 the plan is kept.
    warm, warm_cpu = [0.012, 0.0067, 0.0078], [0.0369, 0.0108, 0.0115]
    control, control_cpu = [0.0171, 0.008, 0.006, 0.0071, 0.0063], [0.0291, 0.0115, 0.0091, 0.011, 0.0097]
    plan_cpu = [0.0297, 0.0089, 0.0065, 0.0072, 0.0068]
    v = _controlled(warm, [0.0099, 0.0097, 0.0063, 0.0087, 0.0079], control, warm_cpu, plan_cpu, control_cpu)
    assert v.kept and v.figures["by"] == "cpu"
    assert v.figures["trials_s"][0] - v.figures["unmerged_s"] > v.figures["noise_s"]  # past the noise all the same
    # The same plan with every step slower than every one of one message per layer's: dropped by time.
    v = _controlled(warm, [0.0099, 0.0097, 0.0091, 0.0087, 0.0089], control, warm_cpu, plan_cpu, control_cpu)
    assert not v.kept and v.figures["by"] == "time"


def test_less_cpu_decides_only_where_every_step_tells_it_apart():
    # bench train's transformer x2 at 1 Gbit, real compute: one plan 27.5 ms by the median, another
    # 31.5, their steps interleaved (as fast by chance), the second's CPU 3 % less by the median
    # but interleaved too: the fastest is kept, not the one of least CPU by the median.
    warm, warm_cpu = [0.05, 0.031, 0.030, 0.032, 0.029], [0.05, 0.038, 0.039, 0.037, 0.038]
    a, a_cpu = [0.05, 0.025, 0.029, 0.026, 0.034], [0.03, 0.036, 0.037, 0.035, 0.036]
    b, b_cpu = [0.05, 0.030, 0.033, 0.028, 0.036], [0.03, 0.035, 0.036, 0.034, 0.037]

    def judged(b_cpu):
        trial = MergeTrial(TRIED)
        clock = _warm_up(trial, warm, cpu=warm_cpu)
        trial.planned([Trial("algorithm1", "A"), Trial("optimal", "B")], clock, control="unmerged")
        _run_trials(trial, [a, b, warm], clock, [a_cpu, b_cpu, warm_cpu])
        return trial.judge({0: trial.figures()})

    v = judged(b_cpu)
    assert v.figures["trials_cpu_s"][1] < v.figures["trials_cpu_s"][0]  # less by the median ...
    assert v.trial.plan == "A" and v.figures["by"] == "time"  # ... not on every step: the time decides
    # Every one of B's steps spent less CPU than every one of A's: B, as fast by chance, is kept.
    v = judged([0.03, 0.031, 0.030, 0.032, 0.031])
    assert v.trial.plan == "B" and v.figures["by"] == "cpu"


def test_where_neither_figure_tells_the_phases_apart_time_and_cpu_weigh_together():
    # bench train's CNN x2 at 100 Mbit, replayed: the link sets the step, the plan 0.2 ms slower
    # by the median (1 %) on 5 % less CPU, neither by the rank-sum test: the plan is kept.
    warm, warm_cpu = [0.03, 0.0219, 0.0218, 0.0221], [0.01, 0.0064, 0.0060, 0.0068]
    plan, plan_cpu = [0.03, 0.0221, 0.0220, 0.0222, 0.0219], [0.01, 0.0061, 0.0065, 0.0058, 0.0061]
    v = _controlled(warm, plan, [0.03, 0.0218, 0.0220, 0.0219, 0.0222], warm_cpu, plan_cpu, _run(0.01, 0.0064))
    assert v.figures["trials_s"][0] > v.figures["unmerged_s"]
    assert v.kept and v.figures["by"] == "cpu"
    # 10 % slower by the median for the same 5 %: one message per layer stays.
    v = _controlled(warm, [0.03, 0.0239, 0.0210, 0.0245, 0.0241], [0.03, 0.0218, 0.0220, 0.0219, 0.0222],
                    warm_cpu, plan_cpu, _run(0.01, 0.0064))  # fmt: skip
    assert not v.kept


@pytest.mark.parametrize(
    "fast, slow, p",
    [
        ([1, 2], [3, 4, 5, 6], 1 / 15),  # the lowest rank sum of 15 splits
        ([1, 2, 3, 4], [5, 6, 7, 8], 1 / 70),
        ([5, 6, 7, 8], [1, 2, 3, 4], 1.0),
        ([1, 1], [1, 1], 1.0),  # all tied: every split's sum is the same
        ([], [1.0], 1.0),
    ],
)
def test_rank_sum_p_counts_the_splits_at_most_as_low(fast, slow, p):
    assert rank_sum_p(fast, slow) == pytest.approx(p)


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.integers(0, 20), min_size=1, max_size=7),
    st.lists(st.integers(0, 20), min_size=1, max_size=7),
)
def test_rank_sum_p_is_exact_by_counting_and_close_by_the_normal_approximation(fast, slow):
    from itertools import combinations

    pooled = sorted(fast + slow)

    def rank_sum(group):  # each value at its pooled mean rank
        return sum(statistics.mean(i + 1 for i, v in enumerate(pooled) if v == x) for x in group)

    splits = [rank_sum([pooled[i] for i in c]) for c in combinations(range(len(pooled)), len(fast))]
    exact = sum(s <= rank_sum(fast) + 1e-9 for s in splits) / len(splits)
    assert rank_sum_p(fast, slow) == pytest.approx(exact)
    if min(len(fast), len(slow)) >= 4 and len(set(pooled)) == len(pooled):
        with patch("poseidon_aio.sync.trial.EXACT_SPLITS", 0):
            assert rank_sum_p(fast, slow) == pytest.approx(exact, abs=0.05)


@pytest.mark.parametrize("plan_s, kept", [(0.0589, True), (0.0615, False)])
def test_without_noise_two_percent_of_the_step_is_still_a_tie(plan_s, kept):
    # A link-bound warm-up is regular to a tenth of a millisecond (bench train's ResNet-20 at
    # 100 Mbit: 58.5 ms, noise 0.1): a plan 0.7 % slower on 16 ms of CPU a step against 24 is as
    # fast; 5 % slower on every step, the time decides.
    trial = MergeTrial(TRIED)
    clock = _warm_up(trial, [0.07, 0.0585, 0.0585, 0.0585, 0.0585], cpu=[0.03] + [0.024] * 4)
    trial.planned([Trial("greedy", "A")], clock)
    _run_trials(trial, [_run(0.07, plan_s)], clock, [_run(0.03, 0.016)])
    v = trial.judge({0: trial.figures()})
    assert v.figures["noise_s"] == 0.0
    assert v.kept is kept and v.figures["by"] == ("cpu" if kept else "time")


def test_a_plan_faster_within_the_noise_that_spent_more_cpu_is_dropped():
    v = _verdict(0.0098, warm_cpu=[0.03] + [0.008] * 4, plan_cpu=0.012)
    assert not v.kept and v.figures["by"] == "cpu"
    v = _verdict(0.0085, warm_cpu=[0.03] + [0.008] * 4, plan_cpu=0.012)
    assert v.kept and v.figures["by"] == "time"  # 1.5 ms faster on every step: past the noise


def test_a_host_that_got_slower_over_the_trials_does_not_decide_against_the_plan():
    # One message per layer at 7.3 ms in the warm-up and 9.8 ms after the trials (bench train's
    # ResNet-20 x2 at 1 Gbit on a host that slowed down): the plan's 8.8 ms lies between, as
    # fast within the drift, on 9.8 ms of CPU a step against 12.8. Without the control the
    # warm-up's 7.3 ms decided by time and one message per layer stayed.
    warm, warm_cpu = [0.05, 0.0073, 0.0073, 0.0072, 0.0074], [0.03] + [0.0128] * 4
    plan, plan_cpu = _run(0.02, 0.0088), _run(0.03, 0.0098)
    v = _controlled(warm, plan, _run(0.02, 0.0098), warm_cpu, plan_cpu, _run(0.03, 0.0128))
    assert v.kept and v.trial.plan == "A" and v.figures["by"] == "cpu"
    assert v.figures["control_s"] == pytest.approx(0.0098) and v.figures["noise_s"] > 0.001
    assert v.rebuild  # the control runs now: the kept plan is built again
    assert v.figures["tried"] == {"greedy": pytest.approx(0.0088)}  # the control is no candidate
    # The same figures with no control: the warm-up alone, and the time decides against the plan.
    trial = MergeTrial(TRIED)
    clock = _warm_up(trial, warm, cpu=warm_cpu)
    trial.planned([Trial("greedy", "A")], clock)
    _run_trials(trial, [plan], clock, [plan_cpu])
    assert not trial.judge({0: trial.figures()}).kept


def test_a_plan_slower_than_both_sides_of_the_control_is_dropped_without_a_rebuild():
    warm, control, cpu = _run(0.05, 0.010), _run(0.02, 0.010), _run(0.03, 0.008)
    v = _controlled(warm, _run(0.02, 0.013), control, cpu, _run(0.03, 0.005), cpu)
    assert not v.kept and v.figures["by"] == "time"
    assert not v.rebuild  # one message per layer is what the control left running
    # The CPU of one message per layer: the warm-up's and the control's steps together.
    v = _controlled(warm, _run(0.02, 0.013), control, cpu, cpu, _run(0.03, 0.004))
    assert v.figures["unmerged_cpu_s"] == pytest.approx(0.006)


def test_an_illegal_transition_names_the_event_and_the_phase():
    trial = MergeTrial(STEPS)
    with pytest.raises(LocalProtocolError, match="judged in phase measuring"):
        trial.judge({0: {"warm": [], "trials": []}})
    trial.planned([], 0)
    with pytest.raises(LocalProtocolError, match="tried in phase settled"):
        trial.next_trial(1)


def test_the_table_covers_every_phase_and_every_event():
    assert {before for before, _ in TRANSITIONS} | set(TRANSITIONS.values()) == set(Phase)
    assert {event for _, event in TRANSITIONS} == set(Event)
