"""A discrete-event simulator of one training iteration, on the trainer's own plans.

Nothing here re-derives a decision the trainer makes: the schemes come from
:func:`~poseidon_aio.sync.plan.choose_schemes` (HybComm on the link the trainer would measure),
the parameter server's keys, shards and messages from the real
:class:`~poseidon_aio.cluster.book.InformationBook`, the merge groups from the trainer's own
:class:`~poseidon_aio.sync.runtime.MergeRuntime` (start-up calibration, one measured warm-up step,
then ``merge_plan`` or ``optimal_plan``). What is simulated is time.

Compute. Every worker runs the same trace at ``rate`` FLOP/s: the forward, then the backward from
the output, a layer's backward taking twice its forward (a layer synchronized by SFB computes its
input's gradient only, once its forward: the trainer skips the weight gradient, which the
reconstruction yields). A layer's synchronization starts when its gradient is ready (WFBP; an SFB
layer as soon as its output's gradient is: the factors are ready before its backward), or, in
mode ``naive``, all after the backward, output layer first. A merge group starts when its last
member (the one nearest the input) is ready. ``layer_overhead`` adds the framework's cost of a
layer to each of its passes, forward and backward, whatever its FLOPs (a real framework's
dispatch and hooks, a replay's timers): measured, e.g. from one worker's iteration, it is what
separates a model of 300 small layers from its FLOPs.

Network. ``P`` workers, each with a full-duplex NIC: an up-link and a down-link, each a FIFO
server. A message of ``n`` bytes takes ``alpha + n * beta`` of its sender's up-link (``alpha``:
the per-message start-up, what the shaper's ``message_cost`` emulates) and ``n * beta`` of its
receiver's down-link; it is delivered when both are done. What one event sends at once is one
batch per link: a payload to every peer (a shard's reply, a worker's factors, an owner's reduced
chunk), the P - 1 pushes of one message arriving at a shard; a batch's messages share the link and
finish together (fair sharing, as concurrent TCP streams do). A worker's pushes of one layer queue
one after another, in message order. A push to the worker's own shard, and anything a worker sends
itself, costs nothing (the trainer's in-process link). Schemes:

* PS: every worker pushes each message to its shard; the shard replies to every worker once all
  P - 1 pushes are in; a layer is done at a worker when all its messages' replies are there.
* SFB: every worker sends its K(M + N) floats to each peer; once a worker has all of them it
  rebuilds the gradient, ``2 P K M N`` FLOPs at ``rate`` on a thread of its own (it overlaps
  the backward; one reconstruction at a time, in the order the layers started).
* all-reduce (``sync.allreduce``), ``ring`` (``auto`` from slices of 64 KiB up): 2 (P - 1) steps, in each of
  which every worker sends a slice of b / P (in chunks of at most ``chunk_bytes``, a message each)
  to the next; a step starts once the last one is in everywhere (the chunks' pipelining inside a
  step is not modelled). ``direct``: P - 1 reduce-scatter parts of b / P to their owners, then
  each owner's P - 1 all-gather messages as soon as its parts are in.
* DDP, for comparison: gloo's ring all-reduce over DDP's buckets (1 MiB first, then 25 MiB, in
  reverse parameter order); a bucket goes when its last gradient is ready, one bucket at a time,
  2 (P - 1) steps of b / P each, every step ``alpha + (b / P) beta``.

Latency (``latency``, 0 by default) is time in flight that occupies no link, added to every
delivery: messages sent together overlap it, a chain of them (a ring's steps) pays it each step.
By default all of a message's start-up is ``alpha``, which occupies its sender's up-link (what
``bench mgwfbp``'s shaper emulates): pessimistic for fan-outs, whose latencies really overlap.

Fan-in (``efficiency``, ideal by default). A down-link fed by ``n`` senders at once may deliver
less than its rate: TCP streams converging on one capped link overflow its queue and back off
(incast). :class:`FlowEfficiency` is that loss as measured (``bench patterns``: a ring's one flow
each way, an all-to-all's P - 1), the fraction of its rate a down-link delivers with ``n``
senders; a delivery then takes ``bytes * beta / efficiency(n)`` of its down-link, ``n`` being the
pattern's senders into it: P - 1 for an SFB exchange or a direct all-reduce's parts, the shards
a PS message spans for a worker's replies, one for a ring's step and DDP's. A shard's pushes:
(P - 1) / k, at least one, where the layer's (or merge group's) messages span k shards. Each
worker pushes to the k shards at once, its up-link shared k ways, so a shard's down-link is fed
by P - 1 senders at 1 / k of the rate each, as by (P - 1) / k at full rate. Validated by
``bench paper`` (2026-11-26, bench/RESULTS.md): with P - 1 for every push, VGG19-22K's WFBP, its
FC layers spread over every shard, came out 11.7 % and 19.7 % slower than emulated at 8 and 16
workers; with (P - 1) / k, 1.3 % and 5.6 %, and every other point of three models within 5 %.
The same rule for the replies (a worker fed by k shards, each sharing its up-link P - 1 ways)
put the naive PS at 16 workers 11.8 % fast: their fan-outs start together, as the pushes' do not.
In mode ``naive`` every layer's replies come at the end of the same backward, from every shard at
once, so a worker's down-link takes them as from P - 1 senders (bench/RESULTS.md, 2026-11-26
night: Inception-V3's naive PS at 16 from 9.4 % to 4.0 %, every point still within 9.6 %); its
pushes keep the (P - 1) / k rule (P - 1 for them fitted eight VGG points worse, 2026-11-26 late).

What it ignores: TCP dynamics (slow start, losses, incast collapse: unless ``efficiency`` states
what they cost), CPU contention between the
compute thread, the event loop and the shard, the shard's summation and the owner's reduction
(memory-bound, milliseconds where the network takes tens), the trainer's priority order among
frames waiting for the link (FIFO here), stragglers. A down-link serves messages in the order
they were sent, so when one sender's up-link lags the others' it may count that sender's bytes
as received before they were sent: optimistic by at most that message's ``n * beta``; exact when
the senders are in step, as identical workers mostly are. FIFO links are not monotone in every
case: a faster network can enqueue a shard's reply fan-out ahead of a push it used to follow,
and the push then waits for P - 1 replies (``tests/test_simulate.py`` keeps one such case; none
shows on the papers' models at 2 to 1024 workers).

Scale. Workers are identical, so every operation is one vector operation over the P nodes: a
PS message costs O(P), an all-to-all (SFB, reduce-scatter) O(P) — the O(P^2) messages it stands
for are accounted per link exactly (bytes, messages, busy time), not one by one. VGG19 by PS at
1024 workers (1 300 messages, 2.7 M with their copies) takes a fifth of a second.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np

from ..cluster.book import DEFAULT_CHUNK_BYTES, InformationBook, spread_bytes_for
from ..cluster.manifest import Manifest, ParamSpec
from ..cluster.models import Trace
from ..errors import ConfigError
from ..wire import Kind, factors
from .cost import ALLREDUCE_ALGORITHMS, HYBCOMM_SCHEMES, LayerKind, LayerShape, Link, Scheme, goes_round_ring
from .mgwfbp import ddp_buckets
from .plan import Mode, PlanLayer, choose_schemes
from .runtime import BEST_PLANNERS, CALIBRATION_SIZES, MergeConfig, MergeKind, MergeRuntime, link_of
from .syncer import syncer_class

DDP = "ddp"
MODES = (Mode.NAIVE.value, Mode.WFBP.value, Mode.MGWFBP.value, Mode.POSEIDON.value, DDP)
# DistributedDataParallel's defaults: bucket_cap_mb=25 and a first bucket of 1 MiB, so the
# output layers' gradients start moving before 25 MiB of them are ready.
DDP_BUCKET_BYTES = 25 * (1 << 20)
DDP_FIRST_BUCKET_BYTES = 1 << 20
ITEMSIZE = 4  # float32 everywhere


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


class FlowEfficiency:
    """The fraction of its rate a down-link delivers when ``n`` senders feed it at once.

    Built from measured points ``{n: fraction}`` (``bench patterns``: a ring's one sender, an
    all-to-all's P - 1); linear between them, the nearest point's value outside them (beyond the
    largest fan-in measured the loss stays what it was there: measure the fan-in you plan for).
    ``FlowEfficiency()`` is the ideal link: 1 for every ``n``.

    Raises:
        ConfigError: a fan-in below 1 or a fraction outside (0, 1].

    >>> eff = FlowEfficiency({1: 0.95, 15: 0.65})
    >>> eff(1), round(eff(8), 3), eff(31)
    (0.95, 0.8, 0.65)
    """

    def __init__(self, points: Optional[dict] = None) -> None:
        points = dict(points or {1: 1.0})
        for n, fraction in points.items():
            if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
                raise ConfigError(f"efficiency: a fan-in is a whole number of senders >= 1, got {n!r}")
            if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
                raise ConfigError(f"efficiency: the fraction of the rate delivered with {n} senders must be in (0, 1], got {fraction!r}")
        self.points = {int(n): float(f) for n, f in sorted(points.items())}
        self._n = np.array(list(self.points), dtype=float)
        self._f = np.array(list(self.points.values()))
        self.ideal = bool((self._f == 1.0).all())

    @classmethod
    def parse(cls, text: str) -> "FlowEfficiency":
        """``"1:0.95,15:0.66"`` (senders:fraction, comma-separated) as a :class:`FlowEfficiency`."""
        try:
            points = {int(n): float(f) for n, f in (item.split(":") for item in text.split(",") if item.strip())}
        except ValueError:
            raise ConfigError(f"efficiency: expected 'senders:fraction,...' (e.g. '1:0.95,15:0.66'), got {text!r}") from None
        return cls(points)

    def __call__(self, senders):
        """The fraction for ``senders`` (a number, or an array of them: an array back)."""
        out = np.interp(np.maximum(senders, 1), self._n, self._f)
        return float(out) if np.ndim(out) == 0 else out

    def __repr__(self) -> str:
        return f"FlowEfficiency({self.points})"


class _Links:
    """The P nodes' up- and down-links as FIFO servers, one vector each (see the module doc).

    Each operation takes the time its messages are enqueued (never earlier than the previous
    operation's: the event loop runs in time order) and returns when they are delivered.
    """

    def __init__(
        self, nodes: int, link: Link, costed: Optional[frozenset], ingress: bool = True, latency: float = 0.0, efficiency: Optional[FlowEfficiency] = None
    ) -> None:
        self.nodes = nodes
        self.alpha, self.beta = link.alpha, link.beta
        self.latency = latency  # in flight, occupying no link: added to every delivery
        # Without ingress, a down-link never limits (an egress-only shaper, as bench mgwfbp has).
        self.beta_in = link.beta if ingress else 0.0
        self.efficiency = efficiency if efficiency is not None else FlowEfficiency()
        self.costed = costed
        self.up = np.zeros(nodes)
        self.down = np.zeros(nodes)
        self.up_bytes = np.zeros(nodes)
        self.down_bytes = np.zeros(nodes)
        self.sent = np.zeros(nodes, dtype=np.int64)

    def startup(self, kind: Kind) -> float:
        return self.alpha if self.costed is None or kind in self.costed else 0.0

    def beta_down(self, senders):
        """Seconds a byte takes a down-link that ``senders`` feed at once (a number or an array)."""
        return self.beta_in if self.efficiency.ideal else self.beta_in / self.efficiency(senders)

    def gather(self, t: float, dest: int, nbytes: int, kind: Kind, senders: Optional[float] = None) -> float:
        """Every node but ``dest`` sends it one message of ``nbytes``: when the last is in.
        ``senders``: the fan-in its down-link sees (default P - 1; see the module doc)."""
        if self.nodes < 2:
            return t
        keep = self.up[dest]
        np.maximum(self.up, t, out=self.up)
        self.up += self.startup(kind) + nbytes * self.beta
        self.up[dest] = -math.inf
        last = float(self.up.max())
        self.up[dest] = keep
        self.down[dest] = max(t, self.down[dest]) + (self.nodes - 1) * nbytes * self.beta_down(self.nodes - 1 if senders is None else senders)
        self.up_bytes += nbytes
        self.up_bytes[dest] -= nbytes
        self.sent += 1
        self.sent[dest] -= 1
        self.down_bytes[dest] += (self.nodes - 1) * nbytes
        return max(last, float(self.down[dest])) + self.latency

    def fan_out(self, t: float, src: int, nbytes: int, kind: Kind, senders: int = 1) -> np.ndarray:
        """``src`` sends one message of ``nbytes`` to every other node (a shard's reply), while
        ``senders`` nodes in all do the same (the shards one PS message spans).

        Returns when each node has it (``src`` itself: ``t``).
        """
        if self.nodes < 2:
            return np.full(self.nodes, t)
        end = max(t, float(self.up[src])) + (self.nodes - 1) * (self.startup(kind) + nbytes * self.beta)
        self.up[src] = end
        self.up_bytes[src] += (self.nodes - 1) * nbytes
        self.sent[src] += self.nodes - 1
        keep = self.down[src]
        np.maximum(self.down, t, out=self.down)
        self.down += nbytes * self.beta_down(senders)
        self.down[src] = keep
        self.down_bytes += nbytes
        self.down_bytes[src] -= nbytes
        out = np.maximum(self.down, end) + self.latency
        out[src] = t
        return out

    def scatter(self, t: float, srcs: np.ndarray, nbytes: np.ndarray, count: np.ndarray, kind: Kind) -> np.ndarray:
        """Each node in ``srcs`` sends ``nbytes[i]`` (``count[i]`` messages) to every other node.

        Returns when each node has all of it (a source does not wait for its own).
        """
        out = np.full(self.nodes, t)
        if self.nodes < 2 or len(srcs) == 0:
            return out
        per_peer = count * self.startup(kind) + nbytes * self.beta
        ends = np.maximum(self.up[srcs], t) + (self.nodes - 1) * per_peer
        self.up[srcs] = ends
        self.up_bytes[srcs] += (self.nodes - 1) * nbytes
        self.sent[srcs] += (self.nodes - 1) * count
        incoming = np.full(self.nodes, float(nbytes.sum()))
        incoming[srcs] -= nbytes
        receiving = incoming > 0
        senders = np.full(self.nodes, len(srcs))
        senders[srcs] -= 1  # a source does not feed its own down-link
        self.down[receiving] = np.maximum(self.down[receiving], t) + incoming[receiving] * self.beta_down(senders[receiving])
        self.down_bytes += incoming
        out[receiving] = np.maximum(self.down[receiving], _max_of_others(ends, srcs, self.nodes)[receiving]) + self.latency
        return out

    def ring(self, t: float, nbytes: float, count: int, kind: Kind) -> float:
        """Every node sends ``nbytes`` (``count`` messages) to the next: when all have theirs."""
        np.maximum(self.up, t, out=self.up)
        self.up += count * self.startup(kind) + nbytes * self.beta
        np.maximum(self.down, t, out=self.down)
        self.down += nbytes * self.beta_down(1)
        self.up_bytes += nbytes
        self.down_bytes += nbytes
        self.sent += count
        return max(float(self.up.max()), float(self.down.max())) + self.latency

    def exchange(self, t: float, nbytes: np.ndarray, count: np.ndarray, kind: Kind) -> np.ndarray:
        """Every node sends ``nbytes[o]`` (``count[o]`` messages) to every other node ``o``.

        Returns when each node has all its P - 1 parts.
        """
        out = np.full(self.nodes, t)
        if self.nodes < 2:
            return out
        to = count * self.startup(kind) + nbytes * self.beta
        busy = float(to.sum()) - to  # a node sends to everyone but itself
        sending = busy > 0
        self.up[sending] = np.maximum(self.up[sending], t) + busy[sending]
        self.up_bytes += float(nbytes.sum()) - nbytes
        self.sent += int(count.sum()) - count
        incoming = (self.nodes - 1) * nbytes
        receiving = incoming > 0
        feeding = int(sending.sum()) - sending  # every sender but the node itself
        self.down[receiving] = np.maximum(self.down[receiving], t) + incoming[receiving] * self.beta_down(feeding[receiving])
        self.down_bytes += incoming
        senders = np.flatnonzero(sending)
        if len(senders):
            out[receiving] = np.maximum(self.down[receiving], _max_of_others(self.up[senders], senders, self.nodes)[receiving]) + self.latency
        return out

    def busiest(self) -> tuple:
        """``(bytes, "up-link of worker 3")`` of the link direction that carried the most."""
        if self.nodes < 2:
            return 0.0, "none"
        up, down = int(np.argmax(self.up_bytes)), int(np.argmax(self.down_bytes))
        if self.up_bytes[up] >= self.down_bytes[down]:
            return float(self.up_bytes[up]), f"up-link of worker {up}"
        return float(self.down_bytes[down]), f"down-link of worker {down}"


def _max_of_others(values: np.ndarray, at: np.ndarray, nodes: int) -> np.ndarray:
    """For every node ``y``: the largest of ``values`` (indexed by nodes ``at``) not at ``y``."""
    first = int(np.argmax(values))
    top = float(values[first])
    values[first] = -math.inf
    second = float(values.max()) if len(values) > 1 else -math.inf
    values[first] = top
    out = np.full(nodes, top)
    out[at[first]] = second
    return out


class _Layer:
    """A trace layer as the simulation sees it."""

    __slots__ = ("index", "name", "shape", "factorable", "nbytes", "params", "shapes", "flops_s", "overhead", "forward", "backward", "ready", "scheme")

    def __init__(
        self, index: int, name: str, shape: LayerShape, factorable: bool, params: tuple, shapes: tuple, forward: float, overhead: float = 0.0
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
        self.backward = 2 * forward + overhead  # _timeline sets it once the scheme is known
        self.ready = 0.0
        self.scheme = Scheme.PS


def _layers(trace: Trace, rows: int, rate: float, overhead: float = 0.0) -> list:
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
        out.append(_Layer(i, layer.name, shape, factorable, trace.param_names(i), layer.shapes, layer.flops / rate, overhead))
    return out


def _timeline(layers: list) -> tuple:
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


class _Simulation:
    """One iteration's events, in time order, over :class:`_Links`."""

    def __init__(self, layers: list, workers: int, rate: float, net: tuple, chunk_bytes: int, allreduce: str = "auto", naive: bool = False) -> None:
        self.layers = layers
        self.P = workers
        self.naive = naive  # every PS message at the end of the backward: the replies' fan-in is every shard
        self.rate = rate
        self.chunk_bytes = chunk_bytes
        self.algorithm = allreduce
        self.links = _Links(workers, *net)
        self.unit_done = np.zeros((len(layers), workers))  # per unit (what travels together)
        self.unit_of = np.zeros(len(layers), dtype=np.int64)
        self._units = 0
        self._events: list = []
        self._seq = 0
        self._gemm = np.zeros(workers)

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
        np.maximum(self.unit_done[unit], when, out=self.unit_done[unit])

    # -- PS -------------------------------------------------------------------------------------

    def ps(self, t: float, unit: int, messages: list) -> None:
        shards = len({shard for shard, _ in messages})  # they reply to every worker at once
        fan_in = max(1.0, (self.P - 1) / shards)  # each worker's up-link shared by the shards at once
        for shard, nbytes in messages:  # one after another on the up-link, in message order
            self.at(self.links.gather(t, shard, nbytes, Kind.PUSH, senders=fan_in), self._reply, unit, shard, nbytes, shards)

    def _reply(self, t: float, unit: int, shard: int, nbytes: int, shards: int) -> None:
        senders = self.P - 1 if self.naive else min(shards, self.P - 1)
        self._finish(unit, self.links.fan_out(t, shard, nbytes, Kind.AGGREGATE, senders=senders))

    # -- all-reduce -----------------------------------------------------------------------------

    def allreduce(self, t: float, unit: int, members: tuple) -> None:
        # sync.allreduce's layout: the bucket's elements cut into P nearly equal owner slices,
        # each sent in chunks of at most chunk_bytes.
        elements = sum(self.layers[i].nbytes for i in members) // ITEMSIZE
        if goes_round_ring(elements * ITEMSIZE, self.P, self.algorithm) and elements >= self.P:
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
        size = float(factors.nbytes(shape.rows, shape.m, shape.n))
        arrived = self.links.exchange(t, np.full(self.P, size), np.ones(self.P, dtype=np.int64), Kind.FACTORS)
        # One GEMM over all ranks' rows: (P K x M)^T (P K x N).
        gemm = 2.0 * self.P * shape.rows * shape.m * shape.n / self.rate
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


def _ddp_buckets(layers: list) -> list:
    """DDP's buckets over parameters in reverse order (``mgwfbp.ddp_buckets``, the trainer's
    ``buckets`` plan): ``[(layer indices, bytes, ready)]``."""
    out = []
    for group in ddp_buckets([layer.nbytes for layer in layers], DDP_FIRST_BUCKET_BYTES, DDP_BUCKET_BYTES):
        members = tuple(l - 1 for l in group)
        out.append((members, sum(layers[i].nbytes for i in members), max(layers[i].ready for i in members)))
    return out


def _ps_messages(layers: list, groups: list, workers: int, chunk_bytes: int, spread_bytes: int) -> list:
    """Per PS group, its messages ``[(shard, bytes)]`` from the information book the trainer
    builds: the PS layers' parameters in model order, multi-layer merge groups passed as groups
    and spread over the shards in runs of ``spread_bytes`` or more."""
    on_ps = [layer for layer in layers if layer.scheme is Scheme.PS]
    if not on_ps:
        return [[] for _ in groups]
    specs, owner = [], {}
    for layer in on_ps:
        for name, shape in zip(layer.params, layer.shapes):
            owner[len(specs)] = layer.index
            specs.append(ParamSpec(name, shape))
    names = [[n for i in g for n in layers[i].params] for g in groups if len(g) > 1]
    book = InformationBook(Manifest(specs), workers=workers, shards=workers, chunk_bytes=chunk_bytes, groups=names or None, spread_bytes=spread_bytes)
    group_of = {i: g for g, members in enumerate(groups) for i in members}
    out = [[] for _ in groups]
    for m in book.messages:
        out[group_of[owner[book.pairs[m.keys[0]].param]]].append((m.shard, m.nbytes))
    return out


class Simulator:
    """One model on one cluster in one mode: the schemes, the compute timeline and the trainer's
    warm-up step are worked out once; :meth:`run` then simulates an iteration under a merge plan.

    Args:
        trace: the model (``cluster.models.trace``), at the per-worker batch.
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
    Raises:
        ConfigError: a number out of range, an unknown mode or scheme, an empty trace.

    >>> from poseidon_aio.cluster.models import trace
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
    ) -> None:
        if not isinstance(trace, Trace):
            raise ConfigError("the simulator takes a Trace: cluster.models.trace(name, batch) or trace_of(model, layers, batch)")
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
            raise ConfigError(f"efficiency must be a FlowEfficiency (e.g. FlowEfficiency({{1: 0.95, 15: 0.66}})), got {efficiency!r}")
        self.net = (link, costed, bool(ingress), float(latency), efficiency)
        self.layer_overhead = float(layer_overhead)
        self.layers = _layers(trace, self.rows, self.rate, self.layer_overhead)
        self.calibration = _calibration(self.net) if self.workers > 1 else []
        measured = link_of(self.calibration)
        # The trainer spreads its merge groups over the shards by its measured link.
        self.spread_bytes = spread_bytes_for(measured.alpha, measured.beta, self.workers)
        if self.workers > 1 and mode != DDP:
            chosen = choose_schemes(
                [PlanLayer(layer.shape, layer.factorable) for layer in self.layers],
                {layer.name: self.rows for layer in self.layers if layer.factorable},
                mode=Mode(mode), workers=self.workers, shards=self.workers,
                link=measured, candidates=self.hybcomm, chunk_bytes=chunk_bytes,
            )
            for layer in self.layers:
                layer.scheme = Scheme(chosen[layer.name])
        self.forward, self.compute = _timeline(self.layers)
        used = {layer.scheme for layer in self.layers}
        self.mergeable = [s for s in Scheme if s in used and syncer_class(s).mergeable] if mode != DDP else []
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
            sim = _Simulation(layers, self.workers, self.rate, self.net, self.chunk_bytes)
            sim.ddp(_ddp_buckets(layers))
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
                runtime = MergeRuntime(MergeConfig(kind, after=1), 0, self.workers, self.workers, s, self.calibration)
                spans = [(layer.ready, float(warm[layer.index][0])) for layer in members]
                indices = [layer.index for layer in members]
                runtime.record(self.forward, self.forward, ready, indices, spans, sum(layer.nbytes for layer in members))
                info = runtime.plan(indices, [layer.name for layer in members], [layer.nbytes for layer in members])
                by_name = {layer.name: layer.index for layer in members}
                groups[s] = [tuple(sorted(by_name[n] for n in g)) for g in info["groups"]]
                plans[s.value] = info
        key = tuple((s.value, tuple(gs)) for s, gs in groups.items())
        if key not in self._runs:  # two planners often agree: simulate each plan once
            self._runs[key] = _run(layers, self.workers, self.rate, self.net, self.chunk_bytes, self.mode, groups, self.spread_bytes, self.allreduce)
        sim = self._runs[key]
        return self._result(sim, groups, plans, sim.done)

    def _warm_up(self, groups: dict) -> "_Simulation":
        if self._unmerged is None:
            self._unmerged = _run(self.layers, self.workers, self.rate, self.net, self.chunk_bytes, self.mode, groups, self.spread_bytes, self.allreduce)
        return self._unmerged

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

    >>> from poseidon_aio.cluster.models import trace
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
        raise ConfigError(f"mode {mode!r} does not merge layers (merge={kind.value!r}); use mode 'mgwfbp' or 'poseidon'")
    return kind


def _calibration(net: tuple) -> list:
    """The trainer's start-up calibration on this network: a push out and a reply back of each
    size on idle links (``runtime.calibrate``), three times each."""
    samples = []
    for size in CALIBRATION_SIZES:
        pair = _Links(2, *net)
        back = pair.gather(0.0, 1, size, Kind.PUSH)
        rtt = float(pair.scatter(back, np.array([1]), np.array([float(size)]), np.array([1]), Kind.AGGREGATE)[0])
        samples += [(size, rtt)] * 3
    return samples


def _run(layers: list, workers: int, rate: float, net: tuple, chunk_bytes: int, mode: str, groups: dict, spread_bytes: int, allreduce: str = "auto") -> _Simulation:
    sim = _Simulation(layers, workers, rate, net, chunk_bytes, allreduce, naive=mode == Mode.NAIVE.value)
    ps_groups = groups.get(Scheme.PS, [])
    messages = _ps_messages(layers, ps_groups, workers, chunk_bytes, spread_bytes)
    end_of_backward = sum(layer.forward + layer.backward for layer in layers)
    starts = []  # (ready, order, fn, args)
    for g, members in enumerate(ps_groups):
        starts.append((max(layers[i].ready for i in members), -min(members), sim.ps, (sim.unit(members), messages[g])))
    for members in groups.get(Scheme.ALLREDUCE, []):
        starts.append((max(layers[i].ready for i in members), -min(members), sim.allreduce, (sim.unit(members), tuple(members))))
    for layer in layers:
        if layer.scheme is Scheme.SFB:
            starts.append((layer.ready, -layer.index, sim.sfb, (sim.unit((layer.index,)), layer.index)))
    # Backward order (output first) among equal times; naive: everything once the backward is over.
    for ready, order, fn, args in sorted(starts, key=lambda s: (s[0], s[1])):
        sim.at(end_of_backward if mode == Mode.NAIVE.value else ready, fn, *args)
    sim.run()
    return sim
