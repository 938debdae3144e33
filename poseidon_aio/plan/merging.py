"""MG-WFBP's plan from measured steps: the merge settings, the samples of the warm-up, the refit
link model, and every planner's candidate plan.

At start-up the ranks time push/reply round trips of several sizes (``sync.runtime.calibrate``);
:func:`link_of` turns them into HybComm's link. For ``MergeConfig.after`` steps the trainer
records, per mergeable scheme (PS, all-reduce, PowerSGD, top-k), each step's forward time, when
each of its layers' gradient was ready, and the intervals its syncs ran
(:meth:`MergePlanner.record`); then the per-byte cost is refit from those syncs
(:meth:`MergePlanner.comm_model`) and the planners of ``mgwfbp`` plan
(:meth:`MergePlanner.plan`). Pure: numbers in, plans out; agreeing on them is the runtime's
(``sync.runtime.MergeRuntime``), and so is trying them on the job.
"""

from __future__ import annotations

import enum
import statistics
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

from ..errors import ConfigError
from .cost import Link, Scheme
from .mgwfbp import CommModel, bucket_plan, fit, merge_plan, optimal_plan, single_plan, tapered_plan

CALIBRATION_SIZES = (4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20)
# What ``best`` plans and tries, in this order (the first of equals is kept).
BEST_PLANNERS = ("algorithm1", "optimal", "single", "buckets", "tapered")


class MergeKind(str, enum.Enum):
    NONE = "none"  # every layer its own message
    ALGORITHM1 = "algorithm1"  # MG-WFBP's greedy Algorithm 1
    OPTIMAL = "optimal"  # the exact O(L^2) dynamic program over the same timeline
    # Both planners' plans, one message after the backward, DDP's buckets and the tapered ones,
    # each tried on the job, the fastest kept (Algorithm 1's on a tie and without a trial). The
    # buckets are there because a plan the model did not make can still win on the job: near a
    # saturated link the planners' plans are only as good as the per-byte cost they are given.
    # The exact plan is exact on the planners' model only, and a ring all-reduce's 2 (P - 1)
    # start-ups a message, which the model charges as two, can make one message beat both plans;
    # the job's step times decide (bench/RESULTS.md, "MG-WFBP: the default tries both planners and
    # one message" and "Tapered buckets: ...").
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
            each distinct plan has its trial, one after the other; then one message per layer
            runs as many steps again, the control that the host's drift over the trials is
            measured by. 0 keeps every plan untried (the paper's runtime; ``best`` then keeps
            Algorithm 1's).
        bucket_bytes: ``(first, then)``: the bucket sizes of the ``buckets`` and ``tapered``
            plans, DDP's 1 MiB and 25 MiB by default (a bench that scales a model's bytes
            scales these too).
    """

    kind: Optional[MergeKind] = None
    after: int = 3
    calibration_sizes: tuple = CALIBRATION_SIZES
    trial: int = 5
    bucket_bytes: tuple = (1 << 20, 25 << 20)

    def __post_init__(self) -> None:
        if self.kind is not None:
            try:
                self.kind = MergeKind(self.kind)
            except ValueError:
                raise ConfigError(
                    f"MergeConfig.kind must be one of {[k.value for k in MergeKind]}, got {self.kind!r}"
                ) from None
        if self.after < 1:
            raise ConfigError("MergeConfig.after must be >= 1 measured step")
        if self.trial < 0:
            raise ConfigError("MergeConfig.trial must be >= 0 steps (0: keep the plan untried)")
        self.calibration_sizes = tuple(int(s) for s in self.calibration_sizes)
        try:
            first, then = (int(b) for b in self.bucket_bytes)
        except (TypeError, ValueError):
            raise ConfigError(
                f"MergeConfig.bucket_bytes is (first, then) in bytes, got {self.bucket_bytes!r}"
            ) from None
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
        return self.kind in (
            MergeKind.ALGORITHM1,
            MergeKind.OPTIMAL,
            MergeKind.BEST,
            MergeKind.BUCKETS,
            MergeKind.TAPERED,
        )


@dataclass
class _Samples:
    forward: list = field(default_factory=list)
    backward: dict = field(default_factory=dict)  # layer -> [seconds]
    ps: list = field(default_factory=list)  # (syncs, bytes, busy seconds)
    cpu: list = field(default_factory=list)  # the loop's CPU seconds per message, per step
    serial: list = field(default_factory=list)  # of it, what the backward lost, per message, per step


def link_of(calibration: Sequence[tuple], flop: float = 0.0) -> Link:
    """HybComm's link from the round trips: a round trip is two messages, one each way, so alpha
    and beta are half its fitted start-up and per-byte cost. ``flop``: the measured seconds per
    FLOP of the sufficient-factor kernel."""
    if len(calibration) < 2:
        return Link(flop=flop) if flop else Link()
    round_trip = fit(*zip(*calibration))
    return Link(alpha=round_trip.a / 2, beta=max(round_trip.b / 2, 1e-12), flop=flop)


class MergePlanner:
    """Records the warm-up steps of one scheme's layers and plans their merging.

    Args:
        config: :class:`MergeConfig` (a planned kind).
        world, shards: P1 and P2.
        scheme: the mergeable scheme whose layers it merges (PS, all-reduce, PowerSGD, top-k).
        calibration: the start-up round trips ``[(bytes, seconds)]``, shared by every scheme.

    >>> planner = MergePlanner(MergeConfig("algorithm1"), 4, 4, Scheme.PS, [(4096, 0.02), (1 << 20, 0.03)])
    >>> planner.record(0.01, 0.01, {0: 0.012, 1: 0.011}, [0, 1], [(0.011, 0.031), (0.012, 0.032)], 8192)
    >>> planner.plan([0, 1], ["fc1", "fc2"], [4096, 4096])["groups"]   # a 20 ms start-up: one message
    [['fc1', 'fc2']]
    """

    def __init__(
        self,
        config: MergeConfig,
        world: int,
        shards: int,
        scheme: Scheme = Scheme.PS,
        calibration: Sequence[tuple] = (),
    ) -> None:
        self.config = config
        self.world = world
        self.shards = shards
        self.scheme = scheme
        self.calibration = list(calibration)  # (bytes, round-trip seconds)
        self._samples = _Samples()

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
        # taken from the compute, and it is what merging saves; it can be several times an idle
        # round trip. (The syncs' own durations cannot tell: they include waiting for slower
        # peers.) A message of a scheme whose sync runs rounds one after the other starts up that
        # often.
        a = round_trip.a * self.scheme.rounds
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

        def median(xs):
            return float(statistics.median(xs)) if xs else 0.0

        model = self.comm_model()
        t_b = [median(self._samples.backward.get(layer, [])) for layer in layers]
        # The warm-up sent every layer as its own message, each as the layer below began its
        # backward: what those took from it is in the measured time, and the plan puts back what
        # its own messages take (mgwfbp.with_launches).
        t_b = [max(0.0, t - model.serial) for t in t_b[:-1]] + t_b[-1:]
        first, then = self.config.bucket_bytes

        def buckets(*args):
            return bucket_plan(*args, first_bytes=first, bucket_bytes=then)

        def tapered(*args):
            return tapered_plan(*args, first_bytes=first, bucket_bytes=then)

        every = {
            "algorithm1": merge_plan,
            "optimal": optimal_plan,
            "single": single_plan,
            "buckets": buckets,
            "tapered": tapered,
        }
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
            "groups": lead["groups"],
            "alpha_s": model.a,
            "beta_s_per_byte": model.b,
            "serial_s": model.serial,
            "planner": lead["planner"],
            "predicted_s": {"plan": lead["predicted_s"], **predicted},
            "candidates": candidates,
        }
