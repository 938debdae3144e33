"""The MG-WFBP merge trial as a state machine: which plan runs, and which one is kept.

The planners' timeline is a model; on a host whose cores the workers share, what a merged message
costs the backward it waits on is not in it. So each candidate plan runs for a few steps (its
trial) and the job keeps the fastest one only if it beat the warm-up's one message per layer, or,
as fast within the noise or by chance (the rank-sum test), one that clearly spent less CPU, else
the least time plus CPU. One message per layer runs again after the trials (the control): its
steps and the warm-up's bracket the trials, so a host that got slower or faster meanwhile shows
as noise instead of deciding.

The controller does no I/O and knows nothing of torch: the trainer feeds it step times and the
figures every rank agreed on, and carries out what it answers (rebuild the syncers with a plan,
exchange the figures). Its phases, one table::

    measuring --planned--> trying --tried--> trying --last-tried--> judging --judged--> settled
        \\--untried--> settled

Every rank feeds the same clocks and, to judge, the same agreed figures, so every rank reaches
the same verdict.
"""

from __future__ import annotations

import enum
import itertools
import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

from ..errors import LocalProtocolError

# Phases within this fraction of the fastest's step are as fast, whatever the warm-up's noise: a
# trial of a few steps does not resolve less, and at 100 Mbit, where the link sets a step, the
# warm-up's jitter is a tenth of a millisecond and 0.2 % decided for 50 % more CPU (bench/RESULTS.md).
TIE_FRACTION = 0.02

# A phase slower past the noise is slower only where its steps lie above the fastest's more
# consistently than chance orders them (the rank-sum test at this level): a trial's first steps
# after a rebuild run slow, and two such steps of four dropped plans that spent a quarter less
# CPU a step (bench/RESULTS.md). The CPU alone decides only where the same test tells it apart:
# 3 % less of it by the median chose a plan 15 % slower.
ALPHA = 0.05
EXACT_SPLITS = 20_000  # the rank-sum test counts every split up to this many, else the normal approximation


def rank_sum_p(fast: Sequence[float], slow: Sequence[float]) -> float:
    """The one-sided p-value of the rank-sum (Mann-Whitney) test that ``fast``'s values lie
    below ``slow``'s: the share of the splits of the pooled values into groups of those sizes
    whose first group's rank sum is at most ``fast``'s, tied values at their mean rank. Exact
    up to ``EXACT_SPLITS`` splits, the normal approximation beyond; 1.0 where either is empty."""
    pooled = sorted([*fast, *slow])
    n, total = len(fast), len(pooled)
    if not n or n == total:
        return 1.0
    twice_rank: dict = {}  # each value's mean rank, doubled: an integer
    for value, run in itertools.groupby(enumerate(pooled, 1), key=lambda pair: pair[1]):
        ranks = [rank for rank, _ in run]
        twice_rank[value] = ranks[0] + ranks[-1]
    observed = sum(twice_rank[v] for v in fast)
    if math.comb(total, n) <= EXACT_SPLITS:
        sums = [sum(split) for split in itertools.combinations([twice_rank[v] for v in pooled], n)]
        return sum(s <= observed for s in sums) / len(sums)
    mean, sd = n * (total + 1), 2 * math.sqrt(n * (total - n) * (total + 1) / 12)
    return 0.5 * math.erfc(-(observed + 1 - mean) / sd / math.sqrt(2))  # +1: half a rank, doubled


def judge_trial(
    warm: Mapping[int, Sequence[float]],
    *trials: Mapping[int, Sequence[float]],
    cpu: Optional[Sequence[Mapping[int, Sequence[float]]]] = None,
    control: Optional[Mapping[int, Sequence[float]]] = None,
) -> dict:
    """Which merge plan to keep, if any, from every rank's step times (seconds) in the warm-up
    (one message per layer) and in each plan's trial: the same answer on every rank given the
    same figures.

    The planner's timeline is a model: on a host whose cores the workers share, what a merged
    message costs the backward it waits on is not in it, and a plan predicted faster can run
    slower (bench/RESULTS.md, "Training step time vs DDP: the plan's trial, and every row with
    repeats"). The trial is the measurement.

    A step ends for the job when its slowest rank's does, so each step counts at its slowest
    rank; each phase's first step is left out where it has others (the warm-up's first starts
    the parameter server and faults buffers in, a trial's first starts the plan's). ``control``:
    one message per layer's steps after the trials: timed on both sides of the trials, one
    message per layer counts at the midpoint of the two medians. The fastest phase is kept,
    unless others are as fast within the noise: the warm-up steps' median absolute deviation
    from their median or, where larger, half the drift from the warm-up to the control, and at
    least ``TIE_FRACTION`` of the fastest's step (a trial of a few steps cannot tell a 1 %
    difference from the host's jitter, and took the plan one way or the other by chance), or
    slower past it but not by the rank-sum test at ``ALPHA`` (one message per layer's steps: the
    warm-up's and the control's). Of those, the ones whose steps spent less CPU than the
    fastest's by the same test are preferred, the fastest of them (``cpu``: every rank's CPU
    seconds a step, the warm-up's, each trial's, then the control's where there is one; a step's
    CPU is the ranks' sum): where cores are shared that CPU is another rank's time. Where none
    did, the one of least time plus CPU, each relative to the fastest's: neither a few per cent
    of CPU buys a much slower step, nor a tenth of a millisecond a few per cent more CPU.
    Returns ``{"kept", "best", "unmerged_s", "planned_s", "trials_s", "noise_s", "unmerged_cpu_s",
    "trials_cpu_s", "control_s", "by"}``: whether a plan is kept, the index of the kept (else the
    fastest) trial, the medians compared, the noise, the job's CPU a step of each, the control's
    median alone (``None`` without one), and ``"time"`` or ``"cpu"``: what decided.
    """

    def past_first(steps: Sequence[float]) -> list:
        return list(steps[1:] if len(steps) > 1 else steps)

    def job_steps(times: Mapping[int, Sequence[float]]) -> list:
        return past_first([max(ts) for ts in zip(*times.values())])

    def job_median(times: Mapping[int, Sequence[float]]) -> float:
        steps = job_steps(times)
        return float(statistics.median(steps)) if steps else float("inf")

    def job_cpu(*phases: Mapping[int, Sequence[float]]) -> float:
        # The job's CPU a step: every rank's median over the phases (each one's first step left
        # out), summed in rank order: every rank adds the same floats the same way.
        each = [[past_first(p.get(r, [])) for p in phases] for r in sorted(phases[0])]
        if not each or not all(all(steps) for steps in each):
            return float("inf")  # a rank without figures
        return float(sum(statistics.median(sum(steps, [])) for steps in each))

    def job_cpu_steps(*phases: Mapping[int, Sequence[float]]) -> list:
        # The job's CPU each step, the ranks' summed in rank order (each phase's first left out).
        ranks = sorted(phases[0])
        return [sum(step) for p in phases for step in zip(*(past_first(p.get(r, [])) for r in ranks))]

    if not trials:
        raise ValueError("judge_trial needs one trial or more")
    unmerged = job_median(warm)
    steps = job_steps(warm)
    noise = float(statistics.median(abs(s - unmerged) for s in steps)) if len(steps) > 1 else 0.0
    after = job_median(control) if control else None
    if after is not None:  # one message per layer at the trials' time: midway, give or take half the drift
        unmerged, noise = (unmerged + after) / 2, max(noise, abs(after - unmerged) / 2)
    medians = [job_median(trial) for trial in trials]
    cpus, cpu_runs = [], []
    if cpu is not None and len(cpu) == len(trials) + 1 + bool(control):
        # Phase 0, one message per layer, is the warm-up's and the control's steps together.
        each = [(cpu[0], *cpu[len(trials) + 1 :]), *((c,) for c in cpu[1 : len(trials) + 1])]
        cpus, cpu_runs = [job_cpu(*p) for p in each], [job_cpu_steps(*p) for p in each]
    cpus = cpus if all(c < float("inf") for c in cpus) else []  # a rank without figures: time alone
    runs = [steps + (job_steps(control) if control else []), *(job_steps(t) for t in trials)]
    fastest = min(range(len(medians)), key=lambda i: (medians[i], i))
    # Phase 0 is the warm-up, then the trials in order: the fastest (the warm-up on a tie) ...
    phases = [unmerged, *medians]
    chosen = fastest + 1 if medians[fastest] < unmerged else 0
    if cpus:
        # ... or, of those as fast (within the noise or by chance), the fastest that clearly spent
        # less CPU; where none did, the least time and CPU together, each relative to the fastest's.
        band = max(noise, TIE_FRACTION * phases[chosen])
        fast = chosen
        ties = [
            i
            for i, t in enumerate(phases)
            if i != fast and (t <= phases[fast] + band or rank_sum_p(runs[fast], runs[i]) >= ALPHA)
        ]
        frugal = [i for i in ties if rank_sum_p(cpu_runs[i], cpu_runs[fast]) < ALPHA]
        if frugal:
            chosen = min(frugal, key=lambda i: (phases[i], i))
        else:  # t_i / t_fast + c_i / c_fast, multiplied out
            chosen = min([fast, *ties], key=lambda i: (phases[i] * cpus[fast] + cpus[i] * phases[fast], i != fast, i))
    by = "time" if phases[chosen] == min(phases) else "cpu"
    return {
        "kept": chosen != 0,
        "best": chosen - 1 if chosen else fastest,
        "unmerged_s": unmerged,
        "planned_s": medians[chosen - 1 if chosen else fastest],
        "trials_s": medians,
        "noise_s": noise,
        "unmerged_cpu_s": cpus[0] if cpus else None,
        "trials_cpu_s": cpus[1:] if cpus else None,
        "control_s": after,
        "by": by,
    }


class Phase(enum.Enum):
    MEASURING = "measuring"  # one message per layer: the runtimes measure, the step times are the baseline
    TRYING = "trying"  # a candidate plan runs its trial
    JUDGING = "judging"  # every trial is over: the ranks' figures go round
    SETTLED = "settled"  # a plan is in force for good


class Event(enum.Enum):
    PLANNED = "planned"  # the candidate plans are agreed; the first one's trial starts
    UNTRIED = "untried"  # the agreed plan is adopted as it is (no candidate merges, or no trials)
    TRIED = "tried"  # a trial is over and another plan's starts
    LAST_TRIED = "last-tried"  # the last plan's trial is over
    JUDGED = "judged"  # the verdict is in


TRANSITIONS = {
    (Phase.MEASURING, Event.PLANNED): Phase.TRYING,
    (Phase.MEASURING, Event.UNTRIED): Phase.SETTLED,
    (Phase.TRYING, Event.TRIED): Phase.TRYING,
    (Phase.TRYING, Event.LAST_TRIED): Phase.JUDGING,
    (Phase.JUDGING, Event.JUDGED): Phase.SETTLED,
}


class Due(enum.Enum):
    """What the trainer must do after a step."""

    NOTHING = "nothing"
    NEXT_TRIAL = "next-trial"  # rebuild with :attr:`MergeTrial.running`'s plan, from the next clock
    JUDGMENT = "judgment"  # exchange :meth:`MergeTrial.figures` and call :meth:`MergeTrial.judge`


@dataclass
class Trial:
    """One candidate plan: the planner that made it, its groups (opaque here), its step times."""

    planner: str
    plan: Any
    times: list = field(default_factory=list)
    cpu: list = field(default_factory=list)  # this rank's CPU seconds each step


@dataclass
class Verdict:
    """The outcome of the trials.

    Attributes:
        kept: whether the fastest plan beat one message per layer.
        trial: the fastest trial (kept or not).
        rebuild: whether the plan running now is not the one to keep in force (the trainer
            rebuilds with ``trial.plan`` if ``kept``, else with one message per layer).
        figures: ``judge_trial``'s figures, the planner and every trial's median by planner.
    """

    kept: bool
    trial: Trial
    rebuild: bool
    figures: dict


def candidate_plans(groups: Mapping, candidates: Mapping[Any, Sequence[tuple]]) -> list:
    """The plans to try, in order: one per planner (in the order they first appear), a scheme
    with fewer candidates keeping its first; only plans that merge, each once.

    Args:
        groups: the plan in force for every mergeable scheme, ``{scheme: [[layer, ...], ...]}``.
        candidates: for the schemes that were planned, ``{scheme: [(planner, groups), ...]}``.
    """
    planners = dict.fromkeys(planner for cands in candidates.values() for planner, _ in cands)
    trials: list = []
    for planner in planners:
        plan = dict(groups)
        for scheme, cands in candidates.items():
            plan[scheme] = next((g for p, g in cands if p == planner), cands[0][1])
        if any(len(g) > 1 for gs in plan.values() for g in gs) and all(plan != t.plan for t in trials):
            trials.append(Trial(planner, plan))
    return trials


class MergeTrial:
    """The trials of one re-plan, driven by step times.

    Args:
        steps: steps each plan runs before the next (``MergeConfig.trial``).

    >>> trial = MergeTrial(steps=2)
    >>> trial.step_done(0, 0.010, warm=True)
    <Due.NOTHING: 'nothing'>
    >>> trial.planned([Trial("greedy", "plan-a")], clock=3)
    'plan-a'
    """

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.phase = Phase.MEASURING
        self.warm: list = []  # this rank's step seconds with one message per layer
        self.warm_cpu: list = []  # and its CPU seconds each of those steps
        self.trials: list = []  # the candidates', then the control's where there is one
        self.control = False  # whether the last trial is one message per layer again
        self.at = 0  # the trial running now
        self.since: Optional[int] = None  # the clock of its first step

    @property
    def running(self) -> Trial:
        return self.trials[self.at]

    def step_done(self, clock: int, seconds: float, warm: bool, cpu: Optional[float] = None) -> Due:
        """Record step ``clock``'s time and this rank's CPU seconds in it (``warm``: a measured
        step of the warm-up)."""
        if self.phase is Phase.MEASURING and warm:
            self.warm.append(seconds)
            if cpu is not None:
                self.warm_cpu.append(cpu)
        elif self.phase is Phase.TRYING:
            self.running.times.append(seconds)
            if cpu is not None:
                self.running.cpu.append(cpu)
            if clock == self.since + self.steps - 1:
                return Due.NEXT_TRIAL if self.at + 1 < len(self.trials) else Due.JUDGMENT
        return Due.NOTHING

    def planned(self, trials: Sequence[Trial], clock: int, control: Optional[Any] = None) -> Optional[Any]:
        """The agreed candidates are in: the plan to run from ``clock`` (the first trial's), or
        ``None`` where there is nothing to try and the agreed plan stays in force. ``control``:
        the warm-up's plan, run again for as many steps after the candidates (see
        :func:`judge_trial`)."""
        if not trials:
            self._move(Event.UNTRIED)
            self.warm, self.warm_cpu = [], []
            return None
        self._move(Event.PLANNED)
        self.control = control is not None
        self.trials = [*trials, *([Trial("unmerged", control)] if self.control else [])]
        self.at, self.since = 0, clock
        return self.running.plan

    def next_trial(self, clock: int) -> Any:
        """The running trial is over: the next plan, to run from ``clock``."""
        self._move(Event.TRIED)
        self.at += 1
        self.since = clock
        return self.running.plan

    def figures(self) -> dict:
        """This rank's step times and CPU, for every rank to judge on (plain JSON)."""
        if self.phase is Phase.TRYING:
            self._move(Event.LAST_TRIED)
        return {
            "warm": list(self.warm),
            "trials": [list(t.times) for t in self.trials],
            "warm_cpu": list(self.warm_cpu),
            "trials_cpu": [list(t.cpu) for t in self.trials],
        }

    def judge(self, figures: Mapping[int, Mapping]) -> Verdict:
        """The verdict from every rank's :meth:`figures` (the same on every rank)."""
        self._move(Event.JUDGED)
        ran = len(self.trials)
        candidates = range(ran - self.control)
        cpu = [{r: f.get("warm_cpu", []) for r, f in figures.items()}]
        cpu += [{r: f.get("trials_cpu", [[]] * ran)[i] for r, f in figures.items()} for i in range(ran)]
        found = judge_trial(
            {r: f["warm"] for r, f in figures.items()},
            *({r: f["trials"][i] for r, f in figures.items()} for i in candidates),
            cpu=cpu,
            control={r: f["trials"][-1] for r, f in figures.items()} if self.control else None,
        )
        trial = self.trials[found["best"]]
        found["planner"] = trial.planner
        found["tried"] = {t.planner: s for t, s in zip(self.trials, found["trials_s"])}
        # The plan running now: the last candidate's, or one message per layer after the control.
        running = None if self.control else len(candidates) - 1
        rebuild = (found["best"] if found["kept"] else None) != running
        self.warm, self.warm_cpu, self.since = [], [], None
        return Verdict(found["kept"], trial, rebuild, found)

    def _move(self, event: Event) -> None:
        after = TRANSITIONS.get((self.phase, event))
        if after is None:
            raise LocalProtocolError(f"illegal merge-trial transition: {event.value} in phase {self.phase.value}")
        self.phase = after
