"""The simulator's entry: one model on one cluster in one mode, planned as the trainer plans.

Nothing here re-derives a decision the trainer makes: the schemes come from
:func:`~poseidon_aio.plan.hybcomm.choose_schemes` (HybComm on the link the trainer would measure),
the parameter server's keys, shards and messages from the real
:class:`~poseidon_aio.cluster.book.InformationBook`, the merge groups from the trainer's own
:class:`~poseidon_aio.plan.merging.MergePlanner` (start-up calibration, one measured warm-up step,
then ``merge_plan`` or ``optimal_plan``). What is simulated is time (``simulator.events`` over
``simulator.network``).

What it ignores: TCP dynamics (slow start, losses, incast collapse: unless ``efficiency`` states
what they cost), CPU contention between the compute thread, the event loop and the shard, the
shard's summation and the owner's reduction (memory-bound, far shorter than the network's
transfers), the trainer's priority order among frames waiting for the link (FIFO here),
stragglers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from ...cluster.book import DEFAULT_CHUNK_BYTES, pipeline_bytes_for, spread_bytes_for
from ...errors import ConfigError
from ...wire import Kind
from ..cost import ALLREDUCE_ALGORITHMS, HYBCOMM_SCHEMES, Hosts, Link, Scheme
from ..hybcomm import Mode, PlanLayer, choose_schemes
from ..merging import BEST_PLANNERS, CALIBRATION_SIZES, MergeConfig, MergeKind, MergePlanner, link_of
from ..models import Trace
from .events import Simulation, compute_timeline, ddp_bucket_layers, layers_of, run_plan
from .network import FlowEfficiency, Links

DDP = "ddp"
MODES = (Mode.NAIVE.value, Mode.WFBP.value, Mode.MGWFBP.value, Mode.POSEIDON.value, DDP)


@dataclass(frozen=True)
class Iteration:
    """One simulated iteration.

    Attributes:
        time: seconds, the slowest worker's (the next forward waits for every aggregate).
        compute: forward + backward seconds of one worker.
        schemes: ``{layer: scheme}`` (``"ddp"`` for DDP).
        groups: ``{scheme: ((layer, ...), ...)}``: what travelled as one message (a layer alone
            when not merged), per mergeable scheme.
        link_bytes: bytes on the busiest link direction (``busiest`` says which).
        messages: messages on the network, all nodes together.
        link_messages: the most messages one node sent.
        layer_done: per layer (forward order), when its aggregate was in at the slowest worker.
        plans: per merged scheme, the trainer's plan record (groups, alpha, beta, predictions).
    """

    model: str
    workers: int
    mode: str
    time: float
    compute: float
    schemes: dict
    groups: dict
    link_bytes: float
    busiest: str
    messages: int
    link_messages: int
    layer_done: tuple
    plans: dict

    @property
    def exposed(self) -> float:
        """Communication the compute did not hide: ``time - compute``."""
        return self.time - self.compute

    def speedup(self, single: "Iteration") -> float:
        """Throughput over ``single`` (one worker): ``P * t(1) / t(P)``, the batch per worker fixed."""
        return self.workers * single.time / self.time


class Simulator:
    """One model on one cluster in one mode: the schemes, the compute timeline and the trainer's
    warm-up step are worked out once; :meth:`run` then simulates an iteration under a merge plan.

    Args:
        trace: the model (``plan.models.trace``), at the per-worker batch.
        workers: P, 1 or more; every worker hosts one PS shard (the trainer's layout).
        rate: FLOP/s of each worker's device.
        link: ``Link(alpha, beta)``: seconds of start-up per message, seconds per byte, per
            direction of every worker's NIC (``Link.of_bandwidth(10e9 / 8, 45e-6)``: 10 GbE).
        mode: ``naive``, ``wfbp``, ``mgwfbp``, ``poseidon`` (the trainer's modes) or ``ddp``.
        hybcomm: the schemes mode ``poseidon`` weighs (the trainer's ``hybcomm``).
        costed: the frame kinds that pay ``alpha`` (default: all; ``[Kind.PUSH]`` is what
            ``bench mgwfbp`` emulates). DDP's ring steps count as pushes.
        ingress: whether down-links limit too (a NIC's receive side); ``False`` models an
            egress-only shaper, where only senders are limited.
        latency: seconds every message is in flight on top of ``alpha``, occupying no link
            (``alpha`` is then the sender's per-message overhead only): messages sent together
            overlap their latency, a chain of them (a ring's steps) pays it at every step.
        chunk_bytes: the PS's key-value pair size and all-reduce's chunk (the trainer's 2 MiB).
        allreduce: the all-reduce algorithm, ``"auto"``, ``"ring"`` or ``"direct"`` (``PSConfig.allreduce``).
        rows: K, the rows of each FC layer's factors (default: the trace's batch).
        efficiency: :class:`FlowEfficiency`, what a down-link delivers with ``n`` senders at once
            (default: all of its rate, however many).
        layer_overhead: seconds every layer's forward, and its backward, take beyond its FLOPs at
            ``rate`` (the framework's per-layer cost: hooks, dispatch, a replay's timer): what makes
            a model of 300 small layers slower than its FLOPs say (default 0).
        hosts: :class:`~poseidon_aio.plan.cost.Hosts` of several workers each (``hosts.workers``
            must be ``workers``): ``link`` is then a host's, and every scheme crosses it once per
            host, as the trainer's syncers by host do (``simulator.events``); HybComm weighs them
            so. DDP's ring over all ``workers`` in rank order crosses a host's link once a step,
            as a flat job's does.
    Raises:
        ConfigError: a number out of range, an unknown mode or scheme, an empty trace.

    >>> from poseidon_aio.plan.models import trace
    >>> sim = Simulator(trace("resnet50"), 16, rate=8e12, link=Link.of_bandwidth(10e9 / 8, 45e-6), mode="mgwfbp")
    >>> wfbp, merged = sim.run("none"), sim.run("algorithm1")
    >>> merged.time < wfbp.time, len(merged.groups["ps"]) < len(wfbp.groups["ps"])
    (True, True)
    """

    def __init__(
        self,
        trace: Trace,
        workers: int,
        *,
        rate: float,
        link: Link,
        mode: str = Mode.POSEIDON.value,
        hybcomm=HYBCOMM_SCHEMES,
        costed: Optional[Sequence[Kind]] = None,
        ingress: bool = True,
        latency: float = 0.0,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        allreduce: str = "auto",
        rows: Optional[int] = None,
        efficiency: Optional[FlowEfficiency] = None,
        layer_overhead: float = 0.0,
        hosts: Optional[Hosts] = None,
    ) -> None:
        if not isinstance(trace, Trace):
            raise ConfigError(
                "the simulator takes a Trace: plan.models.trace(name, batch) or trace_of(model, layers, batch)"
            )
        if isinstance(workers, bool) or int(workers) != workers or workers < 1:
            raise ConfigError(f"workers must be a whole number >= 1, got {workers!r}")
        if not (isinstance(rate, (int, float)) and math.isfinite(rate) and rate > 0):
            raise ConfigError(f"rate must be a positive, finite number of FLOP/s, got {rate!r}")
        if not (math.isfinite(link.alpha) and math.isfinite(link.beta) and link.alpha >= 0 and link.beta >= 0):
            raise ConfigError(f"link alpha and beta must be finite and >= 0, got {link}")
        if mode not in MODES:
            raise ConfigError(f"mode must be one of {list(MODES)}, got {mode!r}")
        if chunk_bytes < 64:
            raise ConfigError(f"chunk_bytes must be at least 64, got {chunk_bytes}")
        if allreduce not in ALLREDUCE_ALGORITHMS:
            raise ConfigError(f"allreduce must be one of {ALLREDUCE_ALGORITHMS}, got {allreduce!r}")
        if not (math.isfinite(latency) and latency >= 0):
            raise ConfigError(f"latency must be finite and >= 0 seconds, got {latency!r}")
        if not (isinstance(layer_overhead, (int, float)) and math.isfinite(layer_overhead) and layer_overhead >= 0):
            raise ConfigError(f"layer_overhead must be finite and >= 0 seconds, got {layer_overhead!r}")
        if not len(trace):
            raise ConfigError("the trace has no layers")
        if hosts is not None and (not isinstance(hosts, Hosts) or hosts.workers != workers):
            raise ConfigError(f"hosts must be a Hosts of {workers} workers in all, got {hosts!r}")
        try:
            self.hybcomm = tuple(Scheme(c) for c in hybcomm)
            costed = frozenset(Kind(k) for k in costed) if costed is not None else None
        except ValueError as exc:
            raise ConfigError(f"simulator: {exc}") from None
        self.trace = trace
        self.workers = int(workers)
        self.rate = float(rate)
        self.mode = mode
        self.chunk_bytes = chunk_bytes
        self.allreduce = allreduce
        self.rows = trace.batch if rows is None else int(rows)
        if efficiency is not None and not isinstance(efficiency, FlowEfficiency):
            raise ConfigError(
                f"efficiency must be a FlowEfficiency (e.g. FlowEfficiency({{1: 0.95, 15: 0.66}})), got {efficiency!r}"
            )
        self.net = (link, costed, bool(ingress), float(latency), efficiency)
        self.layer_overhead = float(layer_overhead)
        self.hosts = hosts if hosts is not None and hosts.local > 1 else None
        # The nodes on the network: the hosts where they run several workers each.
        self.nodes = self.hosts.hosts if self.hosts is not None else self.workers
        self.layers = layers_of(trace, self.rows, self.rate, self.layer_overhead)
        self.calibration = _calibration(self.net) if self.nodes > 1 else []
        measured = link_of(self.calibration)
        # The trainer spreads its merge groups over the shards by its measured link.
        self.spread_bytes = spread_bytes_for(measured.alpha, measured.beta, self.nodes)
        self.pipeline_bytes = pipeline_bytes_for(measured.beta, self.spread_bytes)
        if self.workers > 1 and mode != DDP:
            chosen = choose_schemes(
                [PlanLayer(layer.shape, layer.factorable) for layer in self.layers],
                {layer.name: self.rows for layer in self.layers if layer.factorable},
                mode=Mode(mode),
                workers=self.workers,
                shards=self.workers,
                link=measured,
                candidates=self.hybcomm,
                chunk_bytes=chunk_bytes,
                hosts=self.hosts,
                merged=True,  # as the trainer plans with its default merging (best)
            )
            for layer in self.layers:
                layer.scheme = Scheme(chosen[layer.name])
        self.forward, self.compute = compute_timeline(self.layers)
        used = {layer.scheme for layer in self.layers}
        self.mergeable = [s for s in Scheme if s in used and s.mergeable] if mode != DDP else []
        self._unmerged = None
        self._runs: dict = {}
        self._iterations: dict = {}  # MergeKind -> Iteration: a kind is planned and simulated once

    def run(self, merge: Optional[str] = None) -> Iteration:
        """One iteration under the trainer's ``MergeConfig.kind`` ``merge`` (``None``: ``best`` in
        modes ``mgwfbp`` and ``poseidon``, no merging otherwise). ``best`` is what the trainer's
        trials keep on a noiseless job: the fastest of Algorithm 1's plan, the exact one, one
        message after the backward, DDP's buckets and the tapered ones, or one message per layer if
        none is faster.

        Raises:
            ConfigError: an unknown kind, or merging in a mode that does not merge.
        """
        kind = _merge_kind(self.mode, merge)
        if kind not in self._iterations:
            self._iterations[kind] = self._iteration(kind)
        return self._iterations[kind]

    def _iteration(self, kind: MergeKind) -> Iteration:
        layers = self.layers
        if self.workers == 1:
            return self._result(None, {}, {}, np.full((len(layers), 1), self.compute))
        if self.mode == DDP:
            # gloo's ring over every rank: on one host it never leaves it.
            net = (self.hosts.inside, *self.net[1:]) if self.hosts is not None and self.nodes == 1 else self.net
            sim = Simulation(layers, self.workers, self.rate, net, self.chunk_bytes)
            sim.ddp(ddp_bucket_layers(layers))
            return self._result(sim, {}, {}, sim.done)
        groups = {s: [(layer.index,) for layer in layers if layer.scheme is s] for s in self.mergeable}
        if kind is MergeKind.BEST:
            # the first of equals: a plan is kept only if faster than none, Algorithm 1's on a tie
            tried = [self.run(k) for k in (MergeKind.NONE.value, *BEST_PLANNERS)]
            return min(tried, key=lambda it: it.time)
        if kind is MergeKind.NONE:
            sim = self._warm_up(groups)
            return self._result(sim, groups, {}, sim.done)
        plans = {}
        if kind is MergeKind.SINGLE:
            groups = {s: [tuple(i for g in gs for i in g)] for s, gs in groups.items()}
        else:
            # The trainer's way: its `after` warm-up steps run unmerged and are measured (here one:
            # every simulated step is the same), then rank 0 plans each mergeable scheme.
            warm = self._warm_up(groups).done
            ready = {layer.index: layer.ready for layer in layers}
            for s in self.mergeable:
                members = [layer for layer in layers if layer.scheme is s]
                if len(members) < 2:
                    continue
                planner = MergePlanner(MergeConfig(kind, after=1), self.workers, self.workers, s, self.calibration)
                spans = [(layer.ready, float(warm[layer.index][0])) for layer in members]
                indices = [layer.index for layer in members]
                planner.record(
                    self.forward, self.forward, ready, indices, spans, sum(layer.nbytes for layer in members)
                )
                info = planner.plan(indices, [layer.name for layer in members], [layer.nbytes for layer in members])
                by_name = {layer.name: layer.index for layer in members}
                groups[s] = [tuple(sorted(by_name[n] for n in g)) for g in info["groups"]]
                plans[s.value] = info
        key = tuple((s.value, tuple(gs)) for s, gs in groups.items())
        if key not in self._runs:  # two planners often agree: simulate each plan once
            self._runs[key] = self._run(layers, groups)
        sim = self._runs[key]
        return self._result(sim, groups, plans, sim.done)

    def _warm_up(self, groups: dict) -> "Simulation":
        if self._unmerged is None:
            self._unmerged = self._run(self.layers, groups)
        return self._unmerged

    def _run(self, layers: list, groups: dict) -> "Simulation":
        """One iteration of ``layers`` with these merge ``groups``, on this simulator's cluster."""
        return run_plan(
            layers,
            self.nodes,
            self.rate,
            self.net,
            self.chunk_bytes,
            self.mode,
            groups,
            self.spread_bytes,
            self.allreduce,
            self.hosts,
            pipeline_bytes=self.pipeline_bytes,
        )

    def _result(self, sim, groups: dict, plans: dict, done: np.ndarray) -> Iteration:
        layers = self.layers
        ends = np.maximum(done.max(axis=0), self.compute)
        link_bytes, busiest = sim.links.busiest() if sim is not None else (0.0, "none")
        return Iteration(
            model=getattr(self.trace, "model", "trace"),
            workers=self.workers,
            mode=self.mode,
            time=float(ends.max()),
            compute=self.compute,
            schemes={layer.name: (DDP if self.mode == DDP else layer.scheme.value) for layer in layers},
            groups={s.value: tuple(tuple(layers[i].name for i in g) for g in gs) for s, gs in groups.items()},
            link_bytes=link_bytes,
            busiest=busiest,
            messages=int(sim.links.sent.sum()) if sim is not None else 0,
            link_messages=int(sim.links.sent.max()) if sim is not None else 0,
            layer_done=tuple(float(x) for x in done.max(axis=1)),
            plans=plans,
        )


def simulate(trace: Trace, workers: int, *, merge: Optional[str] = None, **settings) -> Iteration:
    """One iteration of ``trace`` on ``workers`` workers: ``Simulator(trace, workers, **settings).run(merge)``.

    Args:
        trace, workers, settings: as :class:`Simulator` (``rate`` and ``link`` are required).
        merge: the trainer's ``MergeConfig.kind`` (``None``: its default for the mode).
    Returns:
        :class:`Iteration`.
    Raises:
        ConfigError: see :class:`Simulator` and :meth:`Simulator.run`.

    >>> from poseidon_aio.plan.models import trace
    >>> tenGbE = Link.of_bandwidth(10e9 / 8, alpha=45e-6)
    >>> one = simulate(trace("vgg19"), 1, rate=6e12, link=tenGbE)
    >>> eight = simulate(trace("vgg19"), 8, rate=6e12, link=tenGbE, mode="poseidon")
    >>> eight.schemes["fc6"], eight.schemes["conv1_1"]
    ('sfb', 'allreduce')
    >>> round(eight.speedup(one), 2)   # the SFB layers skip their weight gradient: over 8
    8.01
    """
    return Simulator(trace, workers, **settings).run(merge)


def _merge_kind(mode: str, merge) -> MergeKind:
    if merge is None:
        return MergeKind.BEST if mode in (Mode.MGWFBP.value, Mode.POSEIDON.value) else MergeKind.NONE
    try:
        kind = MergeKind(merge)
    except ValueError:
        raise ConfigError(f"merge must be one of {[k.value for k in MergeKind]}, got {merge!r}") from None
    if kind is not MergeKind.NONE and mode in (Mode.NAIVE.value, Mode.WFBP.value, DDP):
        raise ConfigError(
            f"mode {mode!r} does not merge layers (merge={kind.value!r}); use mode 'mgwfbp' or 'poseidon'"
        )
    return kind


def _calibration(net: tuple) -> list:
    """The trainer's start-up calibration on this network: a push out and a reply back of each
    size on idle links (``sync.runtime.calibrate``), three times each."""
    samples = []
    for size in CALIBRATION_SIZES:
        pair = Links(2, *net)
        back = pair.gather(0.0, 1, size, Kind.PUSH)
        rtt = float(pair.scatter(back, np.array([1]), np.array([float(size)]), np.array([1]), Kind.AGGREGATE)[0])
        samples += [(size, rtt)] * 3
    return samples
