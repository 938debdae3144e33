"""The MG-WFBP runtime: calibrate the link, measure warm-up steps, refit, plan once, agree.

At start-up the ranks time push/reply round trips of several sizes around a ring and fit
``T(p) = a + b p`` (:func:`calibrate`; HybComm's link, :func:`link_of`, comes from the same fit).
For ``MergeConfig.after`` steps the trainer reports, per mergeable scheme (PS, all-reduce,
PowerSGD, top-k), each step's forward time, when each of its layers' gradient was ready, and the
intervals its syncs ran; then rank 0 refits the per-byte cost from those syncs, plans
(``mgwfbp.merge_plan``, ``mgwfbp.optimal_plan`` or, for ``best``, both and
``mgwfbp.single_plan``), publishes the plans, and every rank checks their hash before adopting
them. Each plan that merges then runs for ``MergeConfig.trial`` steps, one after the other, and
the fastest is kept only if the job's step got faster than in the warm-up (:func:`judge_trial`);
otherwise every layer goes back to its own message.
"""

from __future__ import annotations

import asyncio
import enum
import json
import statistics
import time
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

import numpy as np

from ..errors import ConfigError, SyncTimeout
from ..wire import Kind
from .cost import Link, Scheme
from .mgwfbp import CommModel, bucket_plan, fit, merge_plan, optimal_plan, single_plan, tapered_plan
from .syncer import syncer_class

CALIBRATION_SIZES = (4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20)
# Mesh frames of the calibration: keys no layer reaches, clocks far past any training clock.
_CALIBRATION_KEY = 7
_CALIBRATION_CLOCK = 1 << 61
# What ``best`` plans and tries, in this order (the first of equals is kept).
BEST_PLANNERS = ("algorithm1", "optimal", "single", "buckets", "tapered")


class MergeKind(str, enum.Enum):
    NONE = "none"  # every layer its own message
    ALGORITHM1 = "algorithm1"  # MG-WFBP's greedy Algorithm 1
    OPTIMAL = "optimal"  # the exact O(L^2) dynamic program over the same timeline
    # Both planners' plans, one message after the backward, DDP's buckets and the tapered ones,
    # each tried on the job, the fastest kept (Algorithm 1's on a tie and without a trial). The
    # buckets are there because a plan the model did not make can still win on the job: near a
    # saturated link the planners' plans are good only with the link's per-byte cost within ~10 %
    # (ResNet-152 at 8 emulated workers: the link calibrated 1.5-1.7 x slower than training's rings
    # ran, their plans ran 17-21 % slower than one message a layer; DDP's buckets 1.4 % faster,
    # the tapered ones 2.9 %). The exact plan is exact on the planners'
    # model only: simulated, it lost to Algorithm 1's in 330 of 2 000 cases and won in 354, and a
    # ring all-reduce's 2 (P - 1) start-ups a message, which the model charges as two, make one
    # message beat both plans from 128 workers on (bench/RESULTS.md); the job's step times decide.
    BEST = "best"
    SINGLE = "single"  # every PS layer in one message after the backward (SyncEASGD)
    BUCKETS = "buckets"  # DistributedDataParallel's buckets: 1 MiB first, then 25 MiB, from the output
    # DDP's buckets with the one nearest the input cut so that at most the first bucket's bytes
    # wait for the end of the backward (mgwfbp.tapered_plan)
    TAPERED = "tapered"


@dataclass
class MergeConfig:
    """MG-WFBP merging.

    Args:
        kind: the planner; ``None`` picks ``best`` in modes ``mgwfbp`` and ``poseidon``,
            ``none`` otherwise. ``algorithm1`` is the paper's (MG-WFBP), ``optimal`` the exact
            planner, ``buckets`` DDP's buckets (``bucket_bytes``), ``tapered`` DDP's buckets
            with at most the first bucket's bytes after the backward, ``best`` tries both
            planners, one message after the backward and both kinds of buckets, and keeps the
            fastest.
        after: measured steps before the plan is made.
        calibration_sizes: message sizes (bytes) timed at start-up to fit alpha and beta.
        trial: steps a plan that merges runs before it is judged against the warm-up's steps
            (one message per layer); it is kept only if the job's step got faster. With ``best``
            each distinct plan has its trial, one after the other. 0 keeps every plan untried
            (the paper's runtime; ``best`` then keeps Algorithm 1's).
        bucket_bytes: ``(first, then)``: the bucket sizes of the ``buckets`` and ``tapered``
            plans, DDP's 1 MiB and 25 MiB by default (a bench that scales a model's bytes
            scales these too).
    """

    kind: Optional[MergeKind] = None
    after: int = 3
    calibration_sizes: tuple = CALIBRATION_SIZES
    trial: int = 3
    bucket_bytes: tuple = (1 << 20, 25 << 20)

    def __post_init__(self) -> None:
        if self.kind is not None:
            try:
                self.kind = MergeKind(self.kind)
            except ValueError:
                raise ConfigError(f"MergeConfig.kind must be one of {[k.value for k in MergeKind]}, got {self.kind!r}") from None
        if self.after < 1:
            raise ConfigError("MergeConfig.after must be >= 1 measured step")
        if self.trial < 0:
            raise ConfigError("MergeConfig.trial must be >= 0 steps (0: keep the plan untried)")
        self.calibration_sizes = tuple(int(s) for s in self.calibration_sizes)
        try:
            first, then = (int(b) for b in self.bucket_bytes)
        except (TypeError, ValueError):
            raise ConfigError(f"MergeConfig.bucket_bytes is (first, then) in bytes, got {self.bucket_bytes!r}") from None
        if first < 1 or then < 1:
            raise ConfigError(f"MergeConfig.bucket_bytes must be positive byte counts, got {self.bucket_bytes!r}")
        self.bucket_bytes = (first, then)
        if self.planned and len(self.calibration_sizes) < 2:
            raise ConfigError("MergeConfig.calibration_sizes needs two sizes or more to fit alpha and beta")

    @property
    def planned(self) -> bool:
        """Whether the plan is made by the runtime after the measured steps (Algorithm 1, the
        exact planner, DDP's buckets, tapered or not, or ``best``), rather than at start
        (``single``, ``none``)."""
        return self.kind in (MergeKind.ALGORITHM1, MergeKind.OPTIMAL, MergeKind.BEST, MergeKind.BUCKETS, MergeKind.TAPERED)


@dataclass
class _Samples:
    forward: list = field(default_factory=list)
    backward: dict = field(default_factory=dict)  # layer -> [seconds]
    ps: list = field(default_factory=list)  # (syncs, bytes, busy seconds)
    cpu: list = field(default_factory=list)  # the loop's CPU seconds per message, per step
    serial: list = field(default_factory=list)  # of it, what the backward lost, per message, per step


async def calibrate(rank: int, world: int, peers: Mapping[int, object], sizes: Sequence[int], timeout: float, cpu: Optional[list] = None) -> list:
    """Round trips around the ring of ranks shaped like a PS sync (a PUSH out, an AGGREGATE of
    the same size back), three per size, while the links are idle: ``[(bytes, seconds)]``.

    ``cpu``: where given, gets ``(bytes, seconds)`` of this thread's (the event loop's) CPU for
    each round trip, which moves its size through this loop four times (out, in, out, in)."""
    nxt, prv = peers[(rank + 1) % world], peers[(rank - 1) % world]
    samples = []
    for i, size in enumerate(sizes):
        payload = np.zeros(size, dtype=np.uint8)
        # The ranks leave the start-up broadcast at different times, so the very first round trip
        # waits for a neighbour (4 KiB ones of 11-63 ms, against 0.3-0.9 ms after, at 4 workers on
        # 2 cores): it lines the ring up and is not timed.
        for rep in range(4 if i == 0 else 3):
            clock = _CALIBRATION_CLOCK + 10 * i + rep
            back = nxt.expect(Kind.AGGREGATE, _CALIBRATION_KEY, clock)
            incoming = prv.expect(Kind.PUSH, _CALIBRATION_KEY, clock)
            started, cpu_started = time.perf_counter(), time.thread_time()
            await nxt.send(Kind.PUSH, payload, key=_CALIBRATION_KEY, clock=clock)
            try:
                await asyncio.wait_for(incoming, timeout)
                await prv.send(Kind.AGGREGATE, payload, key=_CALIBRATION_KEY, clock=clock)
                await asyncio.wait_for(back, timeout)
            except TimeoutError:
                raise SyncTimeout(
                    f"rank {rank}: a calibration message of {size} bytes did not come back from rank {nxt.peer_rank} within {timeout} s"
                ) from None
            if i == 0 and rep == 0:
                continue
            samples.append((size, time.perf_counter() - started))
            if cpu is not None:
                cpu.append((size, time.thread_time() - cpu_started))
    return samples


def loop_cpu_per_byte(cpu: Sequence[tuple]) -> float:
    """The event loop's CPU seconds per byte it sends or receives, from :func:`calibrate`'s
    ``cpu`` samples (0 without two sizes)."""
    if len({size for size, _ in cpu}) < 2:
        return 0.0
    return fit(*zip(*cpu)).b / 4


def link_of(calibration: Sequence[tuple], flop: float = 0.0) -> Link:
    """HybComm's link from the round trips: a round trip is two messages, one each way, so alpha
    and beta are half its fitted start-up and per-byte cost. ``flop``: the measured seconds per
    FLOP of the sufficient-factor kernel."""
    if len(calibration) < 2:
        return Link(flop=flop) if flop else Link()
    round_trip = fit(*zip(*calibration))
    return Link(alpha=round_trip.a / 2, beta=max(round_trip.b / 2, 1e-12), flop=flop)


def judge_trial(warm: Mapping[int, Sequence[float]], *trials: Mapping[int, Sequence[float]]) -> dict:
    """Which merge plan to keep, if any, from every rank's step times (seconds) in the warm-up
    (one message per layer) and in each plan's trial: the same answer on every rank given the
    same figures.

    The planner's timeline is a model: on a host whose cores the workers share, what a merged
    message costs the backward it waits on is not in it (a 2-worker transformer's plan predicted
    31.5 ms against 38.9 unmerged and ran 48.5 against 36.9). The trial is the measurement.

    A step ends for the job when its slowest rank's does, so each step counts at its slowest
    rank; each phase's first step is left out where it has others (the warm-up's first starts
    the parameter server and faults buffers in, a trial's first starts the plan's). The fastest
    trial (the first of equals) is kept if it beat the warm-up.
    Returns ``{"kept", "best", "unmerged_s", "planned_s", "trials_s"}``: whether a plan is kept,
    the index of the fastest trial, the medians compared, and every trial's median.
    """

    def job_median(times: Mapping[int, Sequence[float]]) -> float:
        steps = [max(ts) for ts in zip(*times.values())]
        steps = steps[1:] if len(steps) > 1 else steps
        return float(statistics.median(steps)) if steps else float("inf")

    if not trials:
        raise ValueError("judge_trial needs one trial or more")
    unmerged = job_median(warm)
    medians = [job_median(trial) for trial in trials]
    best = min(range(len(medians)), key=lambda i: (medians[i], i))
    return {"kept": medians[best] < unmerged, "best": best, "unmerged_s": unmerged, "planned_s": medians[best], "trials_s": medians}


class MergeRuntime:
    """Measures and plans the merging of one scheme's layers.

    Args:
        config: :class:`MergeConfig` (a planned kind).
        rank, world, shards: this worker, P1 and P2.
        scheme: the mergeable scheme whose layers it merges (PS, all-reduce, PowerSGD, top-k).
        calibration: the start-up round trips (:func:`calibrate`), shared by every scheme.
    """

    def __init__(self, config: MergeConfig, rank: int, world: int, shards: int, scheme: Scheme = Scheme.PS, calibration: Sequence[tuple] = ()) -> None:
        self.config = config
        self.rank = rank
        self.world = world
        self.shards = shards
        self.scheme = scheme
        self.calibration = list(calibration)  # (bytes, round-trip seconds)
        self._samples = _Samples()

    # -- measurement ------------------------------------------------------------------------

    def measuring(self, clock: int) -> bool:
        return clock < self.config.after

    def due(self, clock: int) -> bool:
        """Whether the plan is made after the step of ``clock``."""
        return clock == self.config.after - 1

    def record(
        self,
        forward_s: float,
        forward_end: float,
        ready: Mapping[int, float],
        layers: Sequence[int],
        spans: Sequence[tuple],
        nbytes: int,
        cpu_per_message: float = 0.0,
        serial_per_message: float = 0.0,
    ) -> None:
        """One warm-up step.

        Args:
            forward_s: its forward time.
            forward_end: when the forward ended (the clock ``ready`` is on).
            ready: layer index -> when its gradient was ready.
            layers: this scheme's layers, in model order.
            spans: ``(start, end)`` of each of the step's syncs of this scheme.
            nbytes: bytes of those layers' parameters.
            cpu_per_message: the event loop's CPU seconds this step, per message it sent.
            serial_per_message: of that, the seconds the backward lost to it (0 where the loop
                has a core of its own; see ``Trainer._measure``).
        """
        s = self._samples
        s.forward.append(forward_s)
        previous = forward_end
        for layer in reversed(layers):  # backward order: each layer's time is since the one above
            at = ready.get(layer, previous)
            s.backward.setdefault(layer, []).append(max(0.0, at - previous))
            previous = max(previous, at)
        # The PS link's busy time: the union of the sync intervals (syncs overlap and queue behind
        # one another, so their own durations would count the same second several times).
        busy, reach = 0.0, float("-inf")
        for start, end in sorted(spans):
            busy += max(0.0, end - max(start, reach))
            reach = max(reach, end)
        s.ps.append((len(spans), nbytes, busy))
        if cpu_per_message:
            s.cpu.append(cpu_per_message)
            s.serial.append(serial_per_message)

    def comm_model(self) -> CommModel:
        """Message time ``a + b p``: the per-byte cost from the ring calibration (the link's rate,
        measured while idle), the start-up refit from training's own syncs."""
        round_trip = fit(*zip(*self.calibration)) if len(self.calibration) >= 2 else CommModel(0.0, 0.0)
        # A sync is a round of sends and a round of replies, like the calibration's round trip.
        # Its bytes cross the busiest link (P1 + P2 - 2) / P2 times over each way for the PS
        # (ATC'17 Table 1, per node), 2 (P - 1) / P times for all-reduce, P - 1 times for top-k's
        # all-gather (every peer gets the whole payload); the round trip's once.
        if self.scheme is Scheme.PS:
            spread = (self.world + self.shards - 2) / self.shards
        elif self.scheme is Scheme.TOPK:
            spread = self.world - 1
        else:
            spread = 2 * (self.world - 1) / self.world
        b = round_trip.b / 2 * spread
        # The start-up: the calibration's round trip, or what a message costs the event loop's
        # CPU in training, if more. On a host whose backward wants the same cores, that CPU is
        # taken from the compute, and it is what merging saves: on 2 cores with 2 workers a
        # ResNet-20's 31 messages took ~1 ms of the loop's CPU each against a 0.13 ms round trip
        # idle. (The syncs' own durations cannot tell: they include waiting for slower peers.)
        # A message of a scheme whose sync runs rounds one after the other starts up that often.
        a = round_trip.a * syncer_class(self.scheme).rounds
        # (a job's first step starts the parameter server and faults its buffers in: not a
        # message's cost)
        cpu, serial = (xs[1:] if len(xs) > 1 else xs for xs in (self._samples.cpu, self._samples.serial))
        if cpu:
            a = max(a, statistics.median(cpu))
        return CommModel(a, b, statistics.median(serial) if serial else 0.0)

    # -- the plan ---------------------------------------------------------------------------

    def plan(self, layers: Sequence[int], names: Sequence[str], sizes: Sequence[int]) -> dict:
        """Rank 0's plan from its measurements: ``{"groups": [[name, ...], ...], ...}``, with
        ``"candidates"``: each planner's distinct plan (``{"planner", "groups", "predicted_s"}``),
        the first being ``"groups"``'s (Algorithm 1's where it is one of them); ``best`` adds one
        message of every layer (``"single"``), DDP's buckets (``"buckets"``) and those with a small
        last bucket (``"tapered"``)."""
        median = lambda xs: float(statistics.median(xs)) if xs else 0.0  # noqa: E731
        model = self.comm_model()
        t_b = [median(self._samples.backward.get(layer, [])) for layer in layers]
        # The warm-up sent every layer as its own message, each as the layer below began its
        # backward: what those took from it is in the measured time, and the plan puts back what
        # its own messages take (mgwfbp.with_launches).
        t_b = [max(0.0, t - model.serial) for t in t_b[:-1]] + t_b[-1:]
        first, then = self.config.bucket_bytes
        buckets = lambda *args: bucket_plan(*args, first_bytes=first, bucket_bytes=then)  # noqa: E731
        tapered = lambda *args: tapered_plan(*args, first_bytes=first, bucket_bytes=then)  # noqa: E731
        every = {"algorithm1": merge_plan, "optimal": optimal_plan, "single": single_plan, "buckets": buckets, "tapered": tapered}
        kinds = BEST_PLANNERS if self.config.kind in (None, MergeKind.BEST) else (self.config.kind.value,)
        planners = [(kind, every[kind]) for kind in kinds]
        candidates = []
        for name, planner in planners:
            plan = planner(median(self._samples.forward), t_b, sizes, model)
            groups = [[names[i - 1] for i in group] for group in plan.groups]
            if all(c["groups"] != groups for c in candidates):  # the planners often agree: one trial
                candidates.append({"planner": name, "groups": groups, "predicted_s": plan.t_iter})
        lead = candidates[0]
        predicted = {"wfbp": plan.t_iter_wfbp, "single": plan.t_iter_single}  # the same for every plan
        return {
            "groups": lead["groups"], "alpha_s": model.a, "beta_s_per_byte": model.b, "serial_s": model.serial,
            "planner": lead["planner"], "predicted_s": {"plan": lead["predicted_s"], **predicted},
            "candidates": candidates,
        }

    async def agree(self, rdzv, generation: int, layers: Sequence[int], names: Sequence[str], sizes: Sequence[int]) -> dict:
        """Rank 0 plans and publishes; every rank reads the plan and checks its hash.

        Raises:
            ManifestMismatch: a rank computed another plan (different code or settings).
            PeerTimeout: rank 0 did not publish one.
        """
        key = f"merge-plan/{self.scheme.value}/{generation}"
        if self.rank == 0:
            await rdzv.publish(key, json.dumps(self.plan(layers, names, sizes)))
        text = await rdzv.read(key, who="rank 0")
        await rdzv.check_digest(f"{self.scheme.value} merge plan {generation}", text)
        return json.loads(text)
