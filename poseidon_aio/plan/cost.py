"""The communication cost model and BestScheme (ATC'17 Table 1 and Algorithm 1; 2015 §4.3.1).

Floats moved to synchronize one M×N weight, with P1 workers, P2 parameter-server shards and K rows
in each worker's batch (all leading dimensions of the layer's input):

=========================  ==========================================================
PS, a worker node          2MN                      (push MN, pull MN)
PS, a server node          2 P1 MN / P2
PS, worker + server node   2MN (P1 + P2 - 2) / P2   (co-located shards: Poseidon's layout)
SFB, a worker node         2K (P1 - 1)(M + N)       (send K(M+N) to each peer, receive theirs)
Adam, a worker node        K(M + N) + MN            (push factors, pull the full matrix)
all-reduce, a worker node  4MN (P1 - 1) / P1        (reduce-scatter + all-gather, in and out)
=========================  ==========================================================

Every row counts floats in *and* out of a node, as Table 1 does. A ring all-reduce moves
2MN(P-1)/P each way: with co-located, balanced shards (P1 = P2 = P) the PS moves exactly the
same bytes; what differs is how evenly they spread over the links (a small layer's keys sit on
one shard) and how many messages they take.

Cluster totals as the 2015 paper counts them: PS 2 P MN, SFB (P - 1)^2 K (M + N),
Adam P K (M + N) + P MN.

BestScheme (Algorithm 1): a fully-connected layer goes by SFB when 2K(P1-1)(M+N) <=
2MN(P1+P2-2)/P2 (ties go to SFB, as Algorithm 1 writes it); every other layer goes by PS.

HybComm with a link (:func:`hybcomm_choice`): every candidate's predicted time on a worker's
link, ``messages x alpha + bytes each way x beta``, with the PS's bytes on the busiest node for
the shards the layer's keys actually occupy; the least wins, a tie goes to Algorithm 1's choice,
so with the paper's assumptions (a layer spread over every shard, bytes only) the paper's cases
come out as the paper says. Pure functions: no torch, no I/O.

Hosts of several workers (:class:`Hosts`, P_h hosts of L workers): the busiest link is a host's,
which its L workers share. Every scheme goes by host (``sync.hierarchical*``, the mesh's
all-gather): the PS pushes once per host and message, its network term the flat one's with P_h
for P1 and for the shards (a host's shards are one node to the others), the all-reduce's a
ring's over P_h hosts, ``2b (P_h - 1) / P_h`` each way, SFB's ``K L (M + N) (P_h - 1)`` floats
each way (the per-host K·L in its break-even) and rows' ``K L (N + 1) (P_h - 1)``, each plus a
term inside the host on the host's own link (the slices to and from the host's speakers or
owners; every other local rank's factors or rows). The lossy schemes go by host too
(``plan.lossy`` weighs them over P_h hosts); Project Adam's factors still come from every worker,
L flows on the host's link.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import Optional

from ..errors import ConfigError


class Scheme(str, enum.Enum):
    """How a layer's gradient is synchronized."""

    PS = "ps"  # the sharded parameter server
    SFB = "sfb"  # sufficient factor broadcasting over the worker mesh
    ADAM = "adam"  # Project Adam: factors to the PS, full matrices back
    ALLREDUCE = "allreduce"  # reduce-scatter + all-gather over the worker mesh
    ROWS = "rows"  # an embedding's touched rows, all-gathered (exact: the rows no token touched are zero)
    # Lossy (sync/compress.py): opt-in with Trainer(compression=...); their time model, which
    # adds measured compute to alpha and beta, is plan/lossy.py's.
    FP16 = "fp16"  # all-reduce with scaled half-precision payloads, fp32 sums
    POWERSGD = "powersgd"  # rank-r PowerSGD with error feedback (Vogels et al. 2019)
    TOPK = "topk"  # each rank's k largest entries, error feedback, all-gathered

    @property
    def captures_factors(self) -> bool:
        """Its layers' backward keeps the sufficient factors ``(u, v)``, not the weight gradient."""
        return self in FACTOR_SCHEMES

    @property
    def mergeable(self) -> bool:
        """MG-WFBP may merge consecutive layers of this scheme into one message."""
        return self in MERGEABLE_SCHEMES

    @property
    def rounds(self) -> int:
        """Rounds of messages one sync runs one after the other: MG-WFBP charges that many start-ups."""
        return ROUNDS.get(self, 1)


# What the planners know of a scheme beyond its bytes. The syncers take these from here
# (``sync.syncer.Syncer``), so the plan and the runtime cannot disagree.
FACTOR_SCHEMES = frozenset({Scheme.SFB, Scheme.ADAM})
# fp16 stays out: its scale is its chunk's largest value, and a layer of small gradients merged
# with a large one would lose its low bits. PowerSGD and top-k keep their state per layer inside
# the message, so merging only saves messages.
MERGEABLE_SCHEMES = frozenset({Scheme.PS, Scheme.ALLREDUCE, Scheme.POWERSGD, Scheme.TOPK})
ROUNDS = {Scheme.POWERSGD: 2}  # P, then Q from it

PAPER_SCHEMES = (Scheme.PS, Scheme.SFB)  # what ATC'17's HybComm chooses between
HYBCOMM_SCHEMES = (Scheme.PS, Scheme.SFB, Scheme.ALLREDUCE, Scheme.ROWS)
LOSSY_SCHEMES = (Scheme.FP16, Scheme.POWERSGD, Scheme.TOPK)


class LayerKind(str, enum.Enum):
    """What the cost model knows of a layer: only fully-connected ones have sufficient factors,
    only embeddings a gradient whose rows are zero but for the tokens the batch holds."""

    FC = "fc"
    CONV = "conv"
    EMBEDDING = "embedding"
    OTHER = "other"


@dataclass(frozen=True)
class LayerShape:
    """What the cost model needs of a layer: its kind and matrix shape.

    ``m`` is the output size and ``n`` the input size of a fully-connected layer (weight M×N),
    the vocabulary and the width of an embedding (weight M×N); for other layers ``m * n`` is the
    parameter count. ``rows`` is K per worker: an FC layer's input rows, an embedding's distinct
    tokens (the rows its gradient can have).
    ``bias`` adds M floats synchronized with the weight.
    """

    name: str
    kind: LayerKind
    m: int
    n: int
    rows: int = 0
    bias: bool = False

    @property
    def params(self) -> int:
        return self.m * self.n + (self.m if self.bias else 0)

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", LayerKind(self.kind))

    def with_rows(self, rows: int) -> "LayerShape":
        return LayerShape(self.name, self.kind, self.m, self.n, rows=rows, bias=self.bias)


@dataclass(frozen=True)
class Cost:
    """Floats for one layer: per worker node for each scheme, and cluster totals (2015)."""

    ps_worker: float
    ps_server: float
    ps_combined: float
    sfb: float
    adam: float
    allreduce: float
    cluster_ps: float
    cluster_sfb: float
    cluster_adam: float
    rows: float = float("inf")  # an embedding's touched rows and their indices, in and out


def layer_cost(layer: LayerShape, workers: int, servers: int) -> Cost:
    """The cost model for one layer.

    >>> c = layer_cost(LayerShape("fc", "fc", 4096, 4096, rows=32), workers=8, servers=8)
    >>> round(c.sfb / 1e6, 2), round(c.ps_worker / 1e6, 1)
    (3.67, 33.6)
    """
    p1, p2 = workers, servers
    mn = layer.params
    k, m, n = layer.rows, layer.m, layer.n
    ps_worker = 2.0 * mn
    ps_server = 2.0 * p1 * mn / p2
    ps_combined = 2.0 * mn * (p1 + p2 - 2) / p2
    fc = layer.kind == "fc"
    sfb = 2.0 * k * (p1 - 1) * (m + n) if fc else float("inf")
    adam = k * (m + n) + mn if fc else float("inf")
    return Cost(
        ps_worker=ps_worker,
        ps_server=ps_server,
        ps_combined=ps_combined,
        sfb=sfb,
        adam=adam,
        allreduce=4.0 * mn * (p1 - 1) / p1,
        cluster_ps=2.0 * p1 * mn,
        cluster_sfb=float((p1 - 1) ** 2 * k * (m + n)) if fc else float("inf"),
        cluster_adam=float(p1 * k * (m + n) + p1 * mn) if fc else float("inf"),
        rows=2.0 * min(k, m) * (n + 1) * (p1 - 1) if layer.kind == "embedding" else float("inf"),
    )


def best_scheme(layer: LayerShape, workers: int, servers: int) -> Scheme:
    """Algorithm 1 (BestScheme): SFB for an FC layer whose SFB cost is at most PS's, else PS.

    >>> best_scheme(LayerShape("fc7", "fc", 4096, 4096, rows=32), workers=8, servers=8)
    <Scheme.SFB: 'sfb'>
    >>> best_scheme(LayerShape("conv1", "conv", 64, 27), workers=8, servers=8)
    <Scheme.PS: 'ps'>
    """
    if layer.kind != "fc" or workers < 2:
        return Scheme.PS
    cost = layer_cost(layer, workers, servers)
    return Scheme.SFB if cost.sfb <= cost.ps_combined else Scheme.PS


@dataclass(frozen=True)
class Link:
    """A worker's link as HybComm sees it: ``alpha`` seconds of start-up per message (round of
    messages), ``beta`` seconds per byte in each direction (full duplex).

    ``flop`` seconds per floating-point operation of the sufficient-factor kernel as measured on
    this device (0: compute not counted): SFB rebuilds every rank's M x N gradient from P K rows,
    where the other schemes only need autograd's local one from K rows.

    ``Link()`` (alpha 0, beta 1 s/byte) compares bytes only, as the paper does.
    """

    alpha: float = 0.0
    beta: float = 1.0
    flop: float = 0.0

    @classmethod
    def of_bandwidth(cls, bytes_per_s: float, alpha: float = 0.0) -> "Link":
        return cls(alpha, 1.0 / bytes_per_s)


@dataclass(frozen=True)
class Hosts:
    """The job's hosts as the cost model counts them: ``hosts`` (P_h) of ``local`` (L) workers
    each, and ``inside``, the link between two workers of one host (loopback or shared memory:
    ``Link(0, 0)`` counts it free).

    >>> Hosts(2, 4).shared(Link(0.0, 1e-8)).beta
    4e-08
    """

    hosts: int
    local: int
    inside: Link = Link(0.0, 0.0)

    def __post_init__(self) -> None:
        if self.hosts < 1 or self.local < 1:
            raise ConfigError(f"Hosts needs at least one host of one worker, got {self.hosts} x {self.local}")

    @property
    def workers(self) -> int:
        return self.hosts * self.local

    def shared(self, link: Link) -> Link:
        """``link`` as one of L workers' flat flows sees the host's link it shares."""
        return Link(link.alpha, link.beta * self.local, link.flop)


def predicted_time(
    layer: LayerShape,
    scheme: Scheme,
    workers: int,
    servers: int,
    link: Link,
    *,
    chunk_bytes: int = 2 << 20,
    itemsize: int = 4,
    hosts: Optional[Hosts] = None,
) -> float:
    """Seconds ``scheme`` takes to sync ``layer`` on the busiest worker link (inf if it cannot).

    PS: a push and a reply; the layer's keys occupy ``s = min(P2, ceil(bytes / chunk))`` shards,
    so a node hosting one of them sends ``b (s - 1) / s`` of pushes and ``(P1 - 1) b / s`` of
    replies (for s = P2 = P1 = P that is Table 1's ``2b (P - 1) / P`` each way). All-reduce:
    ``2b (P - 1) / P`` each way in two phases (reduce-scatter, all-gather), whichever the
    algorithm (:func:`goes_round_ring`): both send 2 (P - 1) messages a worker, and a ring's
    P - 1 steps in a row per phase are latency that other layers' transfers overlap. SFB: one
    round, ``K (M + N) (P - 1)`` floats each way. Rows (an embedding): one round, each worker's K
    touched rows of N floats and their K indices to every peer, ``K (N + 1) (P - 1)`` each way.
    With ``link.flop``, an FC layer's weight gradient counts too: ``2 K M N`` FLOPs in autograd
    for PS and all-reduce, ``2 P K M N`` in SFB's rebuild. With ``hosts`` of several workers,
    see the module's text.
    """
    if workers < 2:
        return 0.0
    if hosts is not None and hosts.local > 1:
        return _by_host(layer, scheme, workers, servers, link, chunk_bytes, itemsize, hosts)
    p1, p2 = workers, servers
    b = layer.params * itemsize
    # The weight gradient: autograd's from K rows for a gradient scheme, the rebuild from P K
    # rows for SFB (its layers compute none in autograd).
    gemm = 2.0 * layer.rows * layer.m * layer.n * link.flop if layer.kind is LayerKind.FC else 0.0
    if scheme is Scheme.PS:
        s = min(p2, max(1, -(-b // chunk_bytes)))
        return 2 * link.alpha + link.beta * b * (s - 1 + p1 - 1) / s + gemm
    if scheme is Scheme.ALLREDUCE:
        return 2 * link.alpha + link.beta * 2 * b * (p1 - 1) / p1 + gemm
    if scheme is Scheme.SFB:
        if layer.kind is not LayerKind.FC or not layer.rows:
            return float("inf")
        return link.alpha + link.beta * itemsize * layer.rows * (layer.m + layer.n) * (p1 - 1) + p1 * gemm
    if scheme is Scheme.ROWS:
        if layer.kind is not LayerKind.EMBEDDING or not layer.rows:
            return float("inf")
        # float32 rows and uint32 indices, whatever ``itemsize``: the scheme takes float32 only.
        return link.alpha + link.beta * 4 * min(layer.rows, layer.m) * (layer.n + 1) * (p1 - 1)
    raise ConfigError(f"no time model for scheme {scheme.value!r}")


def _by_host(layer, scheme, workers, servers, link, chunk_bytes, itemsize, hosts: Hosts) -> float:
    """:func:`predicted_time` where each host runs ``hosts.local`` workers."""
    if workers != hosts.workers:
        raise ConfigError(f"{workers} workers on {hosts.hosts} hosts of {hosts.local}")
    H, L, inside = hosts.hosts, hosts.local, hosts.inside
    b = layer.params * itemsize
    gemm = 2.0 * layer.rows * layer.m * layer.n * link.flop if layer.kind is LayerKind.FC else 0.0
    if scheme is Scheme.ALLREDUCE:
        across = 2 * link.alpha + link.beta * 2 * b * (H - 1) / H if H > 1 else 0.0
        return across + 2 * inside.alpha + inside.beta * 2 * b * (L - 1) / L + gemm
    if scheme is Scheme.SFB:
        if layer.kind is not LayerKind.FC or not layer.rows:
            return float("inf")
        rows = itemsize * layer.rows * (layer.m + layer.n)
        across = link.alpha + link.beta * rows * L * (H - 1) if H > 1 else 0.0
        return across + 2 * inside.alpha + inside.beta * rows * (L - 1) * H + workers * gemm
    if scheme is Scheme.PS:  # one push and reply per host and message, the shards as P_h hosts'
        s = min(H, max(1, -(-b // chunk_bytes)))
        across = 2 * link.alpha + link.beta * b * (s - 1 + H - 1) / s if H > 1 else 0.0
        return across + 2 * inside.alpha + inside.beta * 2 * b * (L - 1) / L + gemm
    if scheme is Scheme.ROWS:  # each host's rows and indices, bundled, once to every peer host
        if layer.kind is not LayerKind.EMBEDDING or not layer.rows:
            return float("inf")
        rows = 4 * min(layer.rows, layer.m) * (layer.n + 1)
        across = link.alpha + link.beta * rows * L * (H - 1) if H > 1 else 0.0
        return across + 2 * inside.alpha + inside.beta * rows * (L - 1) * H
    return predicted_time(
        layer, scheme, workers, servers, hosts.shared(link), chunk_bytes=chunk_bytes, itemsize=itemsize
    )


# The smallest slice (bytes per rank) that the ``auto`` all-reduce sends round a ring: from here
# up one flow each way beats the direct pattern's P - 1 sharing a link; below it the ring's
# 2 (P - 1) steps in a row buy nothing (bench/RESULTS.md, "All-reduce: ring or direct").
RING_MIN_SLICE_BYTES = 64 << 10
ALLREDUCE_ALGORITHMS = ("auto", "ring", "direct")


def goes_round_ring(nbytes: float, workers: int, algorithm: str = "auto") -> bool:
    """Whether an all-reduce of ``nbytes`` among ``workers`` goes round a ring (else direct).

    A function of the bucket alone, never of a measurement: every rank decides the same, and a
    resumed run the same as the run it resumes.

    >>> goes_round_ring(64 << 20, 4), goes_round_ring(128 << 10, 4), goes_round_ring(64 << 20, 2)
    (True, False, False)
    """
    if workers < 3 or algorithm == "direct":
        return False
    return algorithm == "ring" or nbytes / workers >= RING_MIN_SLICE_BYTES


def hybcomm_choice(
    layer: LayerShape,
    workers: int,
    servers: int,
    *,
    link: Link = Link(),
    candidates=HYBCOMM_SCHEMES,
    chunk_bytes: int = 2 << 20,
    hosts: Optional[Hosts] = None,
    merged: bool = False,
) -> Scheme:
    """The candidate with the least :func:`predicted_time`; a tie goes to Algorithm 1's choice.

    ``merged``: MG-WFBP will merge small consecutive layers of a mergeable scheme into one
    message (the trainer's default). Such a layer's start-ups are then its group's, not its own,
    so a mergeable candidate is weighed on its bytes alone and a scheme that cannot merge (SFB,
    rows) still pays its start-up: a small FC head goes with the PS message of the layers before
    it rather than as a message of its own. A large layer travels alone, but there ``alpha`` is
    too small beside its bytes to change the choice.

    >>> hybcomm_choice(LayerShape("fc7", "fc", 4096, 4096, rows=32), 8, 8)
    <Scheme.SFB: 'sfb'>
    >>> hybcomm_choice(LayerShape("conv1", "conv", 64, 27), 8, 8)   # one shard holds it all
    <Scheme.ALLREDUCE: 'allreduce'>
    >>> hybcomm_choice(LayerShape("conv1", "conv", 64, 27), 8, 8, candidates=PAPER_SCHEMES)
    <Scheme.PS: 'ps'>
    """
    paper = best_scheme(layer, workers, servers)
    shared_link = replace(link, alpha=0.0)
    shared_hosts = replace(hosts, inside=replace(hosts.inside, alpha=0.0)) if hosts is not None else None

    def time_of(c) -> float:
        if merged and Scheme(c).mergeable:  # the group's start-ups, not this layer's
            return predicted_time(layer, c, workers, servers, shared_link, chunk_bytes=chunk_bytes, hosts=shared_hosts)
        return predicted_time(layer, c, workers, servers, link, chunk_bytes=chunk_bytes, hosts=hosts)

    times = {c: time_of(c) for c in candidates}
    best = min(times.values())
    if paper in times and times[paper] <= best:
        return paper
    return min(times, key=lambda c: (times[c], HYBCOMM_SCHEMES.index(c) if c in HYBCOMM_SCHEMES else 99))


def layers_of_manifest(specs, rows: Optional[int] = None) -> list:
    """Cost-model layers from a shapes-only manifest (``plan.models``): 2-D ``.weight`` is FC."""
    out, by_prefix = [], {}
    for spec in specs:
        prefix, _, leaf = spec.name.rpartition(".")
        by_prefix.setdefault(prefix, {})[leaf] = spec
    for prefix, leaves in by_prefix.items():
        w = leaves.get("weight")
        if w is not None and len(w.shape) == 2:
            out.append(LayerShape(prefix, "fc", w.shape[0], w.shape[1], rows=rows or 0, bias="bias" in leaves))
        else:
            total = sum(s.numel for s in leaves.values())
            kind = "conv" if w is not None and len(w.shape) == 4 else "other"
            out.append(LayerShape(prefix, kind, total, 1))
    return out
