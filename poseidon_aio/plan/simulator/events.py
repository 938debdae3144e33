"""The simulator's events: one iteration's compute and every scheme's messages, in time order.

Compute. Every worker runs the same trace at ``rate`` FLOP/s: the forward, then the backward from
the output, a layer's backward taking twice its forward (a layer synchronized by SFB computes its
input's gradient only, once its forward: the trainer skips the weight gradient, which the
reconstruction yields). A layer's synchronization starts when its gradient is ready (WFBP; an SFB
layer as soon as its output's gradient is: the factors are ready before its backward), or, in
mode ``naive``, all after the backward, output layer first. A merge group starts when its last
member (the one nearest the input) is ready. ``layer_overhead`` adds the framework's cost of a
layer to each of its passes, forward and backward, whatever its FLOPs (a real framework's
dispatch and hooks, a replay's timers): it is what separates a model of 300 small layers from its
FLOPs.

Messages go over :class:`~poseidon_aio.plan.simulator.network.Links`. A worker's pushes of one
layer queue one after another, in message order; a push to the worker's own shard costs nothing.
Schemes:

* PS: every worker pushes each message to its shard; the shard replies to every worker once all
  P - 1 pushes are in; a layer is done at a worker when all its messages' replies are there.
* SFB: every worker sends its K(M + N) floats to each peer; once a worker has all of them it
  rebuilds the gradient, ``2 P K M N`` FLOPs at ``rate`` on a thread of its own (it overlaps
  the backward; one reconstruction at a time, in the order the layers started).
* all-reduce (``sync.allreduce``), ``ring`` (``auto`` from slices of 64 KiB up): 2 (P - 1) steps,
  in each of which every worker sends a slice of b / P (in chunks of at most ``chunk_bytes``, a
  message each) to the next; a step starts once the last one is in everywhere (the chunks'
  pipelining inside a step is not modelled). ``direct``: P - 1 reduce-scatter parts of b / P to
  their owners, then each owner's P - 1 all-gather messages as soon as its parts are in.
* DDP, for comparison: gloo's ring all-reduce over DDP's buckets (1 MiB first, then 25 MiB, in
  reverse parameter order); a bucket goes when its last gradient is ready, one bucket at a time,
  2 (P - 1) steps of b / P each, every step ``alpha + (b / P) beta``.

Hosts of L workers each (``hosts``): the links are the hosts', and each scheme crosses them as
the syncers by host do, as H workers would: the PS one push and reply per host and message (the
book's shards those of H nodes), the all-reduce the hosts' ring or direct pattern on the whole
bucket (L rings on 1/L of it share the host's link), SFB a host's K L stacked rows once to every
peer host, rebuilt from all P K rows. Before its network part a unit pays the reduce inside the
host, after it the gather there (``cost.predicted_time``'s terms inside the host on ``inside``).

Fan-in, the senders ``n`` a pattern feeds a down-link with: P - 1 for an SFB exchange or a direct
all-reduce's parts, one for a ring's step and DDP's. A shard's pushes: (P - 1) / k, at least one,
where the layer's (or merge group's) messages span k shards: each worker pushes to the k shards at
once, its up-link shared k ways, so a shard's down-link is fed by P - 1 senders at 1 / k of the
rate each, as by (P - 1) / k at full rate. A worker's replies: the k shards, each at full rate
(their fan-outs start together, as the pushes' do not). In mode ``naive`` every layer's replies
come at the end of the same backward, from every shard at once, so a worker's down-link takes them
as from P - 1 senders; its pushes keep the (P - 1) / k rule. Each rule is the one that matched the
emulation (bench/RESULTS.md, "bench paper's keys cut as at full size; ..." and "Where the 4-worker
steps go; the naive PS's replies in the simulator; ...").

FIFO links are not monotone in every case: a faster network can enqueue a shard's reply fan-out
ahead of a push it used to follow, and the push then waits for P - 1 replies
(``tests/test_simulate.py`` keeps one such case).
"""

from __future__ import annotations

import heapq
import math
from typing import Callable, Optional, Sequence

import numpy as np

from ...cluster.book import InformationBook
from ...cluster.manifest import Manifest, ParamSpec
from ...wire import Kind, factors
from ..cost import Hosts, LayerKind, LayerShape, Link, Scheme, goes_round_ring
from ..hybcomm import Mode
from ..mgwfbp import ddp_buckets
from ..models import Trace
from .network import Links

# DistributedDataParallel's defaults: bucket_cap_mb=25 and a first bucket of 1 MiB, so the
# output layers' gradients start moving before 25 MiB of them are ready.
DDP_BUCKET_BYTES = 25 * (1 << 20)
DDP_FIRST_BUCKET_BYTES = 1 << 20
ITEMSIZE = 4  # float32 everywhere


class SimLayer:
    """A trace layer as the simulation sees it."""

    __slots__ = (
        "index",
        "name",
        "shape",
        "factorable",
        "nbytes",
        "params",
        "shapes",
        "flops_s",
        "overhead",
        "forward",
        "backward",
        "ready",
        "scheme",
    )

    def __init__(
        self,
        index: int,
        name: str,
        shape: LayerShape,
        factorable: bool,
        params: tuple,
        shapes: tuple,
        forward: float,
        overhead: float = 0.0,
    ) -> None:
        self.index = index
        self.name = name
        self.shape = shape
        self.factorable = factorable
        self.params = params  # full parameter names
        self.shapes = shapes
        self.nbytes = sum(math.prod(s) for s in shapes) * ITEMSIZE
        self.flops_s = forward  # the forward's FLOPs at the device's rate
        self.overhead = overhead  # seconds a pass of this layer costs beyond its FLOPs
        self.forward = forward + overhead
        self.backward = 2 * forward + overhead  # compute_timeline sets it once the scheme is known
        self.ready = 0.0
        self.scheme = Scheme.PS


def layers_of(trace: Trace, rows: int, rate: float, overhead: float = 0.0) -> list:
    out = []
    for i, layer in enumerate(trace):
        if layer.fully_connected:
            m, n = layer.shapes[0]
            shape = LayerShape(layer.name, LayerKind.FC, m, n, rows=rows, bias=len(layer.shapes) > 1)
        else:
            kind = LayerKind.CONV if len(layer.shapes[0]) == 4 else LayerKind.OTHER
            shape = LayerShape(layer.name, kind, layer.params, 1)
        # An FC layer's factors are a weight and an optional bias of M (what the trainer factors).
        factorable = layer.fully_connected and (len(layer.shapes) == 1 or layer.shapes[1] == (layer.shapes[0][0],))
        out.append(
            SimLayer(i, layer.name, shape, factorable, trace.param_names(i), layer.shapes, layer.flops / rate, overhead)
        )
    return out


def compute_timeline(layers: list) -> tuple:
    """Forward, then backward from the output: each layer's ready time; ``(forward, compute)``."""
    t_f = sum(layer.forward for layer in layers)
    t = t_f
    for layer in reversed(layers):
        # SFB layers compute their input's gradient only (one GEMM, as long as the forward's).
        layer.backward = layer.flops_s * (1 if layer.scheme is Scheme.SFB else 2) + layer.overhead
        # SFB's factors: u is the output's gradient, there as the layer's backward begins.
        layer.ready = t if layer.scheme is Scheme.SFB else t + layer.backward
        t += layer.backward
    return t_f, t


class Simulation:
    """One iteration's events, in time order, over :class:`Links`."""

    def __init__(
        self,
        layers: list,
        workers: int,
        rate: float,
        net: tuple,
        chunk_bytes: int,
        allreduce: str = "auto",
        naive: bool = False,
        hosts: Optional[Hosts] = None,
    ) -> None:
        self.layers = layers
        self.P = workers  # the nodes on the network: workers, or hosts where they run several each
        # Hosts of L workers: a host's aggregate crosses its link once (the syncers by host), on
        # either side a term inside the host (``_inside``); the SFB rebuild takes every worker's rows.
        self.local = hosts.local if hosts is not None else 1
        self.inside = hosts.inside if hosts is not None else Link(0.0, 0.0)
        self.naive = naive  # every PS message at the end of the backward: the replies' fan-in is every shard
        self.rate = rate
        self.chunk_bytes = chunk_bytes
        self.algorithm = allreduce
        self.links = Links(workers, *net)
        self.unit_done = np.zeros((len(layers), workers))  # per unit (what travels together)
        self.unit_of = np.zeros(len(layers), dtype=np.int64)
        self._units = 0
        self._events: list = []
        self._seq = 0
        self._gemm = np.zeros(workers)
        self._after: dict = {}  # unit -> seconds inside the host after its network part

    def at(self, t: float, fn: Callable, *args) -> None:
        heapq.heappush(self._events, (t, self._seq, fn, args))
        self._seq += 1

    def run(self) -> None:
        while self._events:
            t, _, fn, args = heapq.heappop(self._events)
            fn(t, *args)

    def unit(self, members: Sequence[int]) -> int:
        """A new unit of layers that travel together; returns its id."""
        self.unit_of[list(members)] = self._units
        self._units += 1
        return self._units - 1

    @property
    def done(self) -> np.ndarray:
        """Per layer and worker, when its aggregate was in."""
        return self.unit_done[self.unit_of]

    def _finish(self, unit: int, when: np.ndarray) -> None:
        np.maximum(self.unit_done[unit], when + self._after.get(unit, 0.0), out=self.unit_done[unit])

    def inside_terms(self, unit: int, scheme: Scheme, members: Sequence[int]) -> float:
        """Seconds a unit spends inside the host before its network part (returned) and after it
        (kept for :meth:`_finish`): ``cost.predicted_time``'s terms inside the host, halved
        between a reduce before and a gather after (SFB: the host's own factors before, the other
        hosts' stacks after)."""
        if self.local == 1:
            return 0.0
        L, alpha, beta = self.local, self.inside.alpha, self.inside.beta
        if scheme is Scheme.SFB:
            shape = self.layers[members[0]].shape
            rows = float(factors.nbytes(shape.rows, shape.m, shape.n))
            before, after = alpha + beta * rows * (L - 1), alpha + beta * rows * (L - 1) * (self.P - 1)
        else:  # PS and all-reduce: a reduce-scatter inside the host, an all-gather after
            nbytes = sum(self.layers[i].nbytes for i in members)
            before = after = alpha + beta * nbytes * (L - 1) / L
        self._after[unit] = after
        return before

    # -- PS -------------------------------------------------------------------------------------

    def ps(self, t: float, unit: int, messages: list) -> None:
        shards = len({shard for shard, _ in messages})  # they reply to every worker at once
        fan_in = max(1.0, (self.P - 1) / shards)  # each worker's up-link shared by the shards at once
        for shard, nbytes in messages:  # one after another on the up-link, in message order
            self.at(
                self.links.gather(t, shard, nbytes, Kind.PUSH, senders=fan_in), self._reply, unit, shard, nbytes, shards
            )

    def _reply(self, t: float, unit: int, shard: int, nbytes: int, shards: int) -> None:
        senders = self.P - 1 if self.naive else min(shards, self.P - 1)
        self._finish(unit, self.links.fan_out(t, shard, nbytes, Kind.AGGREGATE, senders=senders))

    # -- all-reduce -----------------------------------------------------------------------------

    def allreduce(self, t: float, unit: int, members: tuple) -> None:
        # sync.allreduce's layout: the bucket's elements cut into P nearly equal owner slices,
        # each sent in chunks of at most chunk_bytes.
        elements = sum(self.layers[i].nbytes for i in members) // ITEMSIZE
        # By host, each of the L local ranks runs the hosts' ring on 1/L of the bucket; their L
        # rings share the host's link, as one ring of the whole bucket does.
        if goes_round_ring(elements * ITEMSIZE // self.local, self.P, self.algorithm) and elements >= self.P:
            share = -(-elements // self.P) * ITEMSIZE
            self._ring_step(t, unit, 0, float(share), -(-share // self.chunk_bytes))
            return
        base, extra = divmod(elements, self.P)
        items = np.full(self.P, base, dtype=np.int64)
        items[:extra] += 1
        chunk_items = max(1, self.chunk_bytes // ITEMSIZE)
        count = -(-items // chunk_items)
        nbytes = (items * ITEMSIZE).astype(float)
        parts_in = self.links.exchange(t, nbytes, count, Kind.PUSH)
        owners = np.flatnonzero(items > 0)
        for when in np.unique(parts_in[owners]):  # owners whose parts are in at the same time
            self.at(float(when), self._allgather, unit, owners[parts_in[owners] == when], nbytes, count)

    def _ring_step(self, t: float, unit: int, step: int, share: float, count: int) -> None:
        when = self.links.ring(t, share, count, Kind.PUSH if step < self.P - 1 else Kind.AGGREGATE)
        if step + 1 < 2 * (self.P - 1):
            self.at(when, self._ring_step, unit, step + 1, share, count)
        else:
            self._finish(unit, np.full(self.P, when))

    def _allgather(self, t: float, unit: int, owners: np.ndarray, nbytes: np.ndarray, count: np.ndarray) -> None:
        self._finish(unit, self.links.scatter(t, owners, nbytes[owners], count[owners], Kind.AGGREGATE))

    # -- SFB ------------------------------------------------------------------------------------

    def sfb(self, t: float, unit: int, index: int) -> None:
        shape = self.layers[index].shape
        # By host, a host's L workers' factors go stacked, K L rows.
        size = float(factors.nbytes(shape.rows * self.local, shape.m, shape.n))
        arrived = self.links.exchange(t, np.full(self.P, size), np.ones(self.P, dtype=np.int64), Kind.FACTORS)
        # One GEMM over all ranks' rows: (P K x M)^T (P K x N).
        gemm = 2.0 * self.P * self.local * shape.rows * shape.m * shape.n / self.rate
        self._gemm = np.maximum(self._gemm, arrived) + gemm
        self._finish(unit, self._gemm)

    # -- DDP ------------------------------------------------------------------------------------

    def ddp(self, buckets: list) -> None:
        """gloo's ring over DDP's buckets, one at a time; symmetric, so one worker's clock is all."""
        free = 0.0
        step_startup = self.links.startup(Kind.PUSH)
        for members, nbytes, ready in buckets:
            share = nbytes / self.P
            steps = 2 * (self.P - 1)
            # Each step waits for the previous one's chunk: latency is paid 2 (P - 1) times.
            # A step: its up-link's start-up and bytes, or one sender's bytes into a down-link.
            step = max(step_startup + share * self.links.beta, share * self.links.beta_down(1))
            free = max(free, ready) + steps * (step + self.links.latency)
            self.links.up_bytes += steps * share
            self.links.down_bytes += steps * share
            self.links.sent += steps
            self._finish(self.unit(members), np.full(self.P, free))


def ddp_bucket_layers(layers: list) -> list:
    """DDP's buckets over parameters in reverse order (``mgwfbp.ddp_buckets``, the trainer's
    ``buckets`` plan): ``[(layer indices, bytes, ready)]``."""
    out = []
    for group in ddp_buckets([layer.nbytes for layer in layers], DDP_FIRST_BUCKET_BYTES, DDP_BUCKET_BYTES):
        members = tuple(number - 1 for number in group)
        out.append((members, sum(layers[i].nbytes for i in members), max(layers[i].ready for i in members)))
    return out


def _ps_messages(
    layers: list, groups: list, workers: int, chunk_bytes: int, spread_bytes: int, pipeline_bytes: Optional[int]
) -> list:
    """Per PS group, its messages ``[(shard, bytes)]`` from the information book the trainer
    builds: the PS layers' parameters in model order, multi-layer merge groups passed as groups
    and spread over the shards in runs of ``spread_bytes`` or more (past one a shard, of
    ``pipeline_bytes``)."""
    on_ps = [layer for layer in layers if layer.scheme is Scheme.PS]
    if not on_ps:
        return [[] for _ in groups]
    specs, owner = [], {}
    for layer in on_ps:
        for name, shape in zip(layer.params, layer.shapes):
            owner[len(specs)] = layer.index
            specs.append(ParamSpec(name, shape))
    names = [[n for i in g for n in layers[i].params] for g in groups if len(g) > 1]
    book = InformationBook(
        Manifest(specs),
        workers=workers,
        shards=workers,
        chunk_bytes=chunk_bytes,
        groups=names or None,
        spread_bytes=spread_bytes,
        pipeline_bytes=pipeline_bytes,
    )
    group_of = {i: g for g, members in enumerate(groups) for i in members}
    out = [[] for _ in groups]
    for m in book.messages:
        out[group_of[owner[book.pairs[m.keys[0]].param]]].append((m.shard, m.nbytes))
    return out


def run_plan(
    layers: list,
    workers: int,
    rate: float,
    net: tuple,
    chunk_bytes: int,
    mode: str,
    groups: dict,
    spread_bytes: int,
    allreduce: str = "auto",
    hosts: Optional[Hosts] = None,
    pipeline_bytes: Optional[int] = None,
) -> Simulation:
    """One iteration of ``layers`` (scheme and ready times set) with each of ``groups``
    (``{scheme: [(layer index, ...), ...]}``) travelling as one message; ``mode`` as the trainer's.
    ``workers``: the nodes on the network (the hosts, with ``hosts`` of several workers each)."""
    sim = Simulation(layers, workers, rate, net, chunk_bytes, allreduce, naive=mode == Mode.NAIVE.value, hosts=hosts)
    ps_groups = groups.get(Scheme.PS, [])
    messages = _ps_messages(layers, ps_groups, workers, chunk_bytes, spread_bytes, pipeline_bytes)
    end_of_backward = sum(layer.forward + layer.backward for layer in layers)
    starts = []  # (ready, order, seconds inside the host first, fn, args)

    def start(members: Sequence[int], scheme: Scheme, fn: Callable, *args) -> None:
        unit = sim.unit(members)
        ready = max(layers[i].ready for i in members)
        starts.append((ready, -min(members), sim.inside_terms(unit, scheme, members), fn, (unit, *args)))

    for g, members in enumerate(ps_groups):
        start(members, Scheme.PS, sim.ps, messages[g])
    for members in groups.get(Scheme.ALLREDUCE, []):
        start(members, Scheme.ALLREDUCE, sim.allreduce, tuple(members))
    for layer in layers:
        if layer.scheme is Scheme.SFB:
            start((layer.index,), Scheme.SFB, sim.sfb, layer.index)
    # Backward order (output first) among equal times; naive: everything once the backward is over.
    for ready, order, first, fn, args in sorted(starts, key=lambda s: (s[0], s[1])):
        sim.at((end_of_backward if mode == Mode.NAIVE.value else ready) + first, fn, *args)
    sim.run()
    return sim
