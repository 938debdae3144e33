"""MG-WFBP at run time: measure the warm-up's steps, agree the merge plans, try them and keep the
fastest one that beats one message per layer (the decisions are :class:`MergeTrial`'s)."""

from __future__ import annotations

import json
import logging
import time
from typing import Awaitable, Callable

from ..plan import Scheme
from ..sync import MergeRuntime
from ..sync.trial import Due, MergeTrial, candidate_plans
from . import compression as lossy
from .planning import Planning
from .settings import Settings
from .step import StepState

log = logging.getLogger("poseidon_aio.train")


class MergeTuning:
    """Drives the merge plans of one job from the trainer's steps.

    Args:
        settings: the trainer's resolved settings.
        planning: the scheme plan, the syncers and the calibration.
        rebuild: ``await rebuild(groups)`` restarts the syncers with ``{Scheme: groups}`` from
            the next clock (steps in flight are applied first).
        merge_info: the plan in force when a checkpoint was taken (``{}``: none).
        first_clock: the first step it sees (the planning step before it, whose syncs waited for
            the plan, is no sample of anything).
    """

    def __init__(
        self,
        settings: Settings,
        planning: Planning,
        rebuild: Callable[[dict], Awaitable[None]],
        merge_info: dict,
        first_clock: int,
    ) -> None:
        self.settings = settings
        self.first_clock = first_clock
        self.planning = planning
        self.rebuild = rebuild
        #: The merge plan in force: groups of layer names, the fitted model, the predicted times.
        self.info = merge_info
        self.runtimes: dict = {}  # mergeable Scheme -> MergeRuntime, while measuring
        self.trial = MergeTrial(settings.merge.trial)
        self._measuring = False
        self._loop_cpu = self._loop_waited = 0.0
        self._cpu_at = time.process_time()  # this rank's CPU (every thread) at the last step's end

    def start(self, saved: dict) -> None:
        """Measure the schemes with more than one layer whose plan no checkpoint ``saved``."""
        p, merge = self.planning, self.settings.merge
        if merge.planned and p.world > 1:
            shards = self.settings.ps.shards_for(p.world)
            self.runtimes = {
                scheme: MergeRuntime(merge, p.rank, p.world, shards, scheme, p.calibration, self.first_clock)
                for scheme in p.plan.mergeable()
                if len(p.plan.layers_of(scheme)) > 1 and not saved.get(scheme.value)
            }

    def begin(self, clock: int) -> None:
        """Before step ``clock``: a measured step samples the event loop's CPU and wait."""
        self._measuring = bool(self.runtimes) and any(r.measuring(clock) for r in self.runtimes.values())
        self._loop_cpu = time.thread_time()  # this (the event loop's) thread
        self._loop_waited = runqueue_wait() if self._measuring else 0.0  # a file read: warm-up steps only

    async def end(self, state: StepState, clock: int) -> None:
        """After step ``state`` (``clock``: the next step's): record it, and re-plan, move to the
        next trial or judge where that is due."""
        if state.clock < self.first_clock:
            return
        cpu, self._cpu_at = time.process_time() - self._cpu_at, time.process_time()
        due = self.trial.step_done(state.clock, state.done - state.started, warm=self._measuring, cpu=cpu)
        if self._measuring:
            self._record(state, time.thread_time() - self._loop_cpu, runqueue_wait() - self._loop_waited)
            if any(r.due(state.clock) for r in self.runtimes.values()):
                await self._replan(clock)  # the new syncers (and parameter server) start at the next clock
        elif due is Due.NEXT_TRIAL:
            await self.rebuild(self.trial.next_trial(clock))
        elif due is Due.JUDGMENT:
            await self._judge()

    def _record(self, state: StepState, loop_cpu: float, loop_waited: float) -> None:
        # What a message costs the host: the loop's CPU for it plus the time the loop, ready to
        # run it, waited for a core. Where the workers share fewer cores than they have busy
        # threads, that time is taken from some rank's backward, and merging gives it back.
        # The backward is charged at most twice the wait: where the loop has a core of its own
        # it runs beside the backward and hardly waits.
        # Only what a message costs as a message counts: the loop's CPU for the step's bytes
        # (``loop_cpu_per_byte``, timed at start-up) is the same however the layers are grouped,
        # and the wait is shared in proportion.
        p = self.planning
        messages = max(1, len(state.spans))
        moved = sum(state.bytes.values())  # sent and received, every scheme
        fixed = max(0.0, loop_cpu - p.loop_cpu_per_byte * moved)
        waited = loop_waited * (fixed / loop_cpu if loop_cpu > 0 else 1.0)
        per_message = (fixed + waited) / messages
        serial = min(fixed + waited, 2.0 * waited) / messages
        compression = self.settings.compression
        for scheme, runtime in self.runtimes.items():
            layers = [layer.index for layer in p.plan.layers_of(scheme)]
            spans = [(s.start, s.end) for s in state.spans if s.scheme is scheme and s.end]
            nbytes = sum(lossy.message_bytes(p.layers[i], scheme, compression) for i in layers)
            runtime.record(
                state.forward_end - state.started,
                state.forward_end,
                state.ready_at,
                layers,
                spans,
                nbytes,
                per_message,
                serial,
            )

    async def _replan(self, clock: int) -> None:
        """Adopt the merge plans every rank agreed on (with trials: the first plan to try): the
        syncers (and the parameter server) restart with them."""
        p = self.planning
        groups, infos, candidates = {}, {}, {}
        warm = {scheme: p.groups_in_force(scheme) for scheme in p.plan.mergeable()}  # the trials' control
        for scheme in p.plan.mergeable():
            layers = p.plan.layers_of(scheme)
            runtime = self.runtimes.get(scheme)
            if runtime is None:
                groups[scheme] = warm[scheme]
                continue
            sizes = [lossy.message_bytes(layer, scheme, self.settings.compression) for layer in layers]
            info = await runtime.agree(
                p.job.rendezvous,
                p.generation,
                [layer.index for layer in layers],
                [layer.name for layer in layers],
                sizes,
            )
            by_name = {layer.name: layer.index for layer in layers}
            # Layers 1..L run from the input: group members are listed input side first; keep the
            # model's order inside each group.
            groups[scheme] = self._indices(by_name, info["groups"])
            candidates[scheme] = [(c["planner"], self._indices(by_name, c["groups"])) for c in info["candidates"]]
            infos[scheme.value] = info
        self.runtimes = {}
        trials = candidate_plans(groups, candidates) if self.settings.merge.trial else []
        await self.rebuild(trials[0].plan if trials else groups)
        self._set_info(infos)
        log.info(
            "rank %d: merge plans %s", p.rank, {k: [c["groups"] for c in v["candidates"]] for k, v in infos.items()}
        )
        self.trial.planned(trials, clock, control=warm)

    @staticmethod
    def _indices(by_name: dict, groups: list) -> list:
        return [sorted(by_name[n] for n in group) for group in groups]

    async def _judge(self) -> None:
        """Every rank's step times and CPU go round and each rank reaches the same verdict
        (:func:`~poseidon_aio.sync.trial.judge_trial`): the fastest plan if it made the step
        faster than the warm-up's one message per layer, or of those as fast within the noise or
        by chance one that clearly spent less CPU, else the least time plus CPU; otherwise one
        message per layer."""
        p = self.planning
        mine = json.dumps(self.trial.figures())
        seen = await p.job.rendezvous.exchange(f"merge-trial/{p.generation}", mine, range(p.world))
        verdict = self.trial.judge({r: json.loads(text) for r, text in seen.items()})
        planner, plan, figures = verdict.trial.planner, verdict.trial.plan, verdict.figures
        infos = self.info.get("schemes", {})
        for name, info in infos.items():
            info["groups"], info["planner"] = [[p.layers[i].name for i in g] for g in plan[Scheme(name)]], planner
        if verdict.kept:
            if verdict.rebuild:  # the fastest is not the one running now
                await self.rebuild(plan)
            self._set_info(infos, trial=figures)
            log.info(
                "rank %d: merge plan (%s) kept: %.1f ms a step against %.1f unmerged%s",
                p.rank,
                planner,
                figures["planned_s"] * 1e3,
                figures["unmerged_s"] * 1e3,
                _by_cpu(figures, figures["trials_cpu_s"][figures["best"]] if figures["trials_cpu_s"] else None),
            )
            return
        # One message per layer is running already: the control ran it last.
        for name, info in infos.items():
            info["rejected_groups"], info["groups"] = (
                info["groups"],
                [[layer.name] for layer in p.plan.layers_of(Scheme(name))],
            )
        self._set_info(infos, trial=figures)
        log.warning(
            "rank %d: the fastest merge plan (%s) ran %.1f ms a step against %.1f with one message per layer%s; "
            "back to one per layer",
            p.rank,
            planner,
            figures["planned_s"] * 1e3,
            figures["unmerged_s"] * 1e3,
            _by_cpu(figures, figures["unmerged_cpu_s"]),
        )

    def _set_info(self, infos: dict, **extra) -> None:
        # The plan of the scheme with the most layers leads (``merge_info`` of a PS-only model is
        # the PS plan); every scheme's is kept under its name.
        lead = max(infos, key=lambda name: len(infos[name]["groups"]), default=None)
        self.info = {**(infos[lead] if lead else {}), "schemes": infos, **extra}


def _by_cpu(figures: dict, cpu) -> str:
    """The log line's reason where the CPU decided the verdict (``cpu``: the kept phase's), else
    ``""``: its CPU against the fastest phase's, the one it was kept over (the least CPU of all
    need not be the kept phase's since the CPU decides only where it tells phases apart)."""
    if figures.get("by") != "cpu" or cpu is None:
        return ""
    times = (figures["unmerged_s"], *figures["trials_s"])
    fastest = (figures["unmerged_cpu_s"], *figures["trials_cpu_s"])[times.index(min(times))]
    return (
        f" (as fast within the noise, {figures['noise_s'] * 1e3:.1f} ms, or by chance; "
        f"the job's CPU {cpu * 1e3:.1f} ms a step against {fastest * 1e3:.1f} for the fastest)"
        if fastest is not None
        else ""
    )


def runqueue_wait() -> float:
    """Seconds this thread has spent runnable but waiting for a core (Linux's schedstat; 0.0
    where there is none)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) * 1e-9
    except (OSError, ValueError, IndexError):
        return 0.0
