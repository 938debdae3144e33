"""The communication cost model and BestScheme (ATC'17 Table 1 and Algorithm 1; 2015 §4.3.1).

Floats moved to synchronize one M×N weight, with P1 workers, P2 parameter-server shards and K rows
in each worker's batch (all leading dimensions of the layer's input):

=========================  ==========================================================
PS, a worker node          2MN                      (push MN, pull MN)
PS, a server node          2 P1 MN / P2
PS, worker + server node   2MN (P1 + P2 - 2) / P2   (co-located shards: Poseidon's layout)
SFB, a worker node         2K (P1 - 1)(M + N)       (send K(M+N) to each peer, receive theirs)
Adam, a worker node        K(M + N) + MN            (push factors, pull the full matrix)
=========================  ==========================================================

Cluster totals as the 2015 paper counts them: PS 2 P MN, SFB (P - 1)^2 K (M + N),
Adam P K (M + N) + P MN.

BestScheme: a fully-connected layer goes by SFB when 2K(P1-1)(M+N) <= 2MN(P1+P2-2)/P2 (ties go to
SFB, as Algorithm 1 writes it); every other layer goes by PS. Pure functions: no torch, no I/O.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional


class Scheme(str, enum.Enum):
    """How a layer's gradient is synchronized."""

    PS = "ps"  # the sharded parameter server
    SFB = "sfb"  # sufficient factor broadcasting over the worker mesh
    ADAM = "adam"  # Project Adam: factors to the PS, full matrices back


class LayerKind(str, enum.Enum):
    """What the cost model knows of a layer: only fully-connected ones have sufficient factors."""

    FC = "fc"
    CONV = "conv"
    OTHER = "other"


@dataclass(frozen=True)
class LayerShape:
    """What the cost model needs of a layer: its kind and matrix shape.

    ``m`` is the output size and ``n`` the input size of a fully-connected layer (weight M×N);
    for other layers ``m * n`` is the parameter count. ``rows`` is K per worker (FC only).
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
    cluster_ps: float
    cluster_sfb: float
    cluster_adam: float


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
        cluster_ps=2.0 * p1 * mn,
        cluster_sfb=float((p1 - 1) ** 2 * k * (m + n)) if fc else float("inf"),
        cluster_adam=float(p1 * k * (m + n) + p1 * mn) if fc else float("inf"),
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


def layers_of_manifest(specs, rows: Optional[int] = None) -> list:
    """Cost-model layers from a shapes-only manifest (``cluster.models``): 2-D ``.weight`` is FC."""
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
