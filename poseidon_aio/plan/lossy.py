"""The planner's side of compression: its settings, what a lossy scheme costs a layer, and when it wins.

Predicted seconds to sync one layer on a worker's link (``Link``: alpha per round of messages,
beta per byte each way; P workers; the layer's matrices m_i x n_i with d = sum m_i n_i elements,
e elements in 1-D parameters):

==========  ====================================================================  ==================
scheme      alpha x rounds + beta x bytes each way                                 + compute
==========  ====================================================================  ==================
fp16        2 alpha + beta 2 (P - 1)/P x 2 (d + e)                                 c_fp16(d + e)
powersgd    4 alpha + beta 2 (P - 1)/P x 4 (sum r_i m_i + e + sum r_i n_i)         c_powersgd(d)
topk        alpha + beta (P - 1) x (4 e + 8 k),  k = ceil(ratio d)                 c_topk(d)
==========  ====================================================================  ==================

(r_i = min(r, m_i, n_i).) The exact schemes' times are ``cost.predicted_time``'s, with no
compute term: their one float32 addition per value is also in every lossy scheme's. The compute
``c(x) = a + b x`` is measured once at start-up on this machine (``sync.compress.measure_compute``:
a small encode and decode per scheme at two sizes), rank 0's measurement shared with every rank
so every rank makes the same plan.

The rule (:meth:`LossyPlanner.weigh`): a layer is *suited* to a lossy scheme when its
parameters are float32, it has matrix parameters with at least ``min_elements`` (16384) elements
in all, and, for PowerSGD, its rank-r factors are fewer floats than its matrices
(sum r_i (m_i + n_i) < d, the "no cheaper than exact" test of DDP's PowerSGD hook at a minimum
compression rate of 1). With ``compression="auto"`` the layer takes the least predicted time of
the exact schemes' choice and every suited lossy scheme; a tie stays exact. With one named
method, the layer takes it where suited, the exact choice elsewhere.
"""

from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

from ..errors import ConfigError
from ..wire import half, sparse
from .cost import LOSSY_SCHEMES, LayerKind, Link, Scheme, predicted_time


class Compression(str, enum.Enum):
    """What ``Trainer(compression=...)`` asks for."""

    AUTO = "auto"  # the planner weighs every lossy scheme beside the exact ones, per layer
    FP16 = "fp16"
    POWERSGD = "powersgd"
    TOPK = "topk"


# 16384 elements (64 KiB of float32). Below it a layer stays exact, for accuracy, not for time:
# such layers are the ones that move a model most per element (the first convolution, small
# heads; biases and norms have no matrix at all), and top-k at 1 % would keep fewer than 164 of
# their values a step. The time given up is not nothing on a slow link: a 64 KiB layer's exact
# ring all-reduce moves 2(P - 1)/P x 64 KiB each way, 7.9 ms at 100 Mbit and 0.8 ms at 1 Gbit
# with 4 workers, of which a lossy scheme could save most; ``min_elements`` lowers the bar. A
# bias inside a larger layer stays exact too (it rides uncompressed in PowerSGD's and top-k's
# messages).
MIN_ELEMENTS = 16384


@dataclass
class CompressionConfig:
    """Lossy gradient compression, chosen per layer (opt-in; ``None`` keeps every layer exact).

    Args:
        method: ``"auto"`` (the planner weighs fp16, PowerSGD and top-k beside the exact schemes
            by predicted time, per layer), or one method, used on every layer it suits (at least
            ``min_elements`` elements of matrices, float32; PowerSGD only where its rank-r factors
            are fewer floats than the matrix) and the exact schemes elsewhere.
        rank: PowerSGD's rank r (Vogels et al. reach full accuracy at r = 2-4 on CIFAR-10
            ResNet-18 and LSTMs; 4 leaves a margin).
        ratio: top-k's density, k = ceil(ratio x elements) (1 %: Aji & Heafield 2017 and Stich
            et al. 2018 train to full accuracy with error feedback at 1 % and below).
        min_elements: matrix elements under which a layer stays exact (see ``MIN_ELEMENTS``).
        link: plan as if each worker's link were this (``Link.of_bandwidth(12.5e6, 1e-4)``: 100
            Mbit, 100 us per round) instead of the one measured at start-up: to study or test a
            slow network from a fast one.
        compute: plan with these compression compute costs, ``{"fp16" | "powersgd" | "topk":
            (a seconds, b seconds per element)}``, instead of measuring them at start-up. The
            measurement depends on the machine's load, so an ``"auto"`` plan is repeatable bit
            for bit only with ``link`` and ``compute`` both given (the log prints the measured
            ones to copy).

    Raises:
        ConfigError: an unknown method or a value out of range.

    >>> CompressionConfig("powersgd", rank=2).method
    <Compression.POWERSGD: 'powersgd'>
    """

    method: Compression | str = Compression.AUTO
    rank: int = 4
    ratio: float = 0.01
    min_elements: int = MIN_ELEMENTS
    link: Optional[Link] = None
    compute: Optional[Mapping[str, tuple]] = None

    def __post_init__(self) -> None:
        try:
            self.method = Compression(self.method)
        except ValueError:
            raise ConfigError(
                f"compression must be one of {[c.value for c in Compression]} or None, got {self.method!r}"
            ) from None
        if not (isinstance(self.rank, int) and self.rank >= 1):
            raise ConfigError(f"CompressionConfig.rank (PowerSGD's rank) must be an integer >= 1, got {self.rank!r}")
        if not (0.0 < self.ratio <= 1.0):
            raise ConfigError(f"CompressionConfig.ratio (top-k's density) must be in (0, 1], got {self.ratio!r}")
        if self.min_elements < 1:
            raise ConfigError(f"CompressionConfig.min_elements must be >= 1, got {self.min_elements!r}")
        if self.link is not None and not (self.link.beta > 0 and self.link.alpha >= 0):
            raise ConfigError(f"CompressionConfig.link needs beta > 0 and alpha >= 0, got {self.link}")
        if self.compute is not None:
            known = {s.value for s in LOSSY_SCHEMES}
            if not set(self.compute) <= known or not all(len(ab) == 2 and min(ab) >= 0 for ab in self.compute.values()):
                raise ConfigError(
                    f"CompressionConfig.compute maps {sorted(known)} to (a >= 0, b >= 0) seconds, got {self.compute!r}"
                )
            self.compute = {k: (float(a), float(b)) for k, (a, b) in self.compute.items()}

    @classmethod
    def of(cls, value) -> Optional["CompressionConfig"]:
        """``None``, a method name or a config, as ``Trainer(compression=...)`` takes it."""
        if value is None or isinstance(value, CompressionConfig):
            return value
        if isinstance(value, (str, Compression)):
            return cls(value)
        raise ConfigError(f"compression must be None, a method name or a CompressionConfig, got {type(value).__name__}")

    @property
    def schemes(self) -> tuple:
        """The lossy schemes this setting lets the planner use."""
        if self.method is Compression.AUTO:
            return (Scheme.FP16, Scheme.POWERSGD, Scheme.TOPK)
        return (Scheme(self.method.value),)

    def settings(self) -> str:
        """What every rank must agree on, as JSON (its digest is checked at start-up)."""
        link = None if self.link is None else [self.link.alpha, self.link.beta]
        compute = None if self.compute is None else {k: list(v) for k, v in self.compute.items()}
        return json.dumps(
            {
                "method": self.method.value,
                "rank": self.rank,
                "ratio": self.ratio,
                "min_elements": self.min_elements,
                "link": link,
                "compute": compute,
            },
            sort_keys=True,
        )


# -- shapes -----------------------------------------------------------------------------------


def matrix_of(shape: Sequence[int]) -> tuple:
    """A parameter of >= 2 dimensions as a matrix: a Linear's (out, in), a convolution's
    (out_channels, in_channels x kh x kw), an embedding's (rows, dim)."""
    return int(shape[0]), int(math.prod(shape[1:]))


def split_shapes(shapes: Sequence[Sequence[int]]) -> tuple:
    """``(matrices [(m, n)], vector elements)``: what a layer's parameters are to the lossy schemes."""
    mats = [matrix_of(s) for s in shapes if len(s) >= 2]
    vec = sum(int(math.prod(s)) for s in shapes if len(s) < 2)
    return mats, vec


def topk_count(size: int, ratio: float) -> int:
    """k for ``size`` matrix elements: at least one, at most all.

    >>> topk_count(65536, 0.01), topk_count(50, 0.01)
    (656, 1)
    """
    return max(1, min(size, math.ceil(ratio * size)))


@dataclass(frozen=True)
class ComputeCosts:
    """Compression compute per sync and worker: ``a + b x elements`` seconds, per lossy scheme
    (``sync.compress.measure_compute`` measures it).

    ``ComputeCosts()`` is free compute (bytes and messages only).

    >>> ComputeCosts({"topk": (1e-5, 1e-8)}).of(Scheme.TOPK, 1000)
    2e-05
    """

    fits: Mapping[str, tuple] = field(default_factory=dict)

    def of(self, scheme: Scheme, elements: int) -> float:
        a, b = self.fits.get(Scheme(scheme).value, (0.0, 0.0))
        return a + b * elements

    def to_json(self) -> str:
        return json.dumps({k: list(v) for k, v in sorted(self.fits.items())})

    @classmethod
    def from_json(cls, text: str) -> "ComputeCosts":
        return cls({k: (float(a), float(b)) for k, (a, b) in json.loads(text).items()})


def unsuited(layer, scheme: Scheme, config: CompressionConfig, *, forced: bool = False) -> Optional[str]:
    """Why ``layer`` (a ``PlanLayer``) cannot go by lossy ``scheme``, or ``None`` if it can.

    ``forced`` (a per-layer override): only what the scheme needs (float32 matrices), not the
    size threshold or PowerSGD's compression rate.

    >>> from poseidon_aio.plan import LayerShape, PlanLayer
    >>> bn = PlanLayer(LayerShape("bn", "other", 128, 1), False, params=((64,), (64,)))
    >>> unsuited(bn, Scheme.TOPK, CompressionConfig())
    'no matrix parameter (a bias, a norm)'
    """
    mats, _ = split_shapes(layer.params)
    if not layer.params:
        return "its parameter shapes are unknown"
    if not layer.float32:
        return "not float32"
    if not mats:
        return "no matrix parameter (a bias, a norm)"
    if forced:
        return None
    d = sum(m * n for m, n in mats)
    if d < config.min_elements:
        return f"{d} matrix elements, under {config.min_elements}"
    if scheme is Scheme.POWERSGD:
        floats = sum(min(config.rank, m, n) * (m + n) for m, n in mats)
        if floats >= d:
            return f"rank {config.rank} factors are {floats} floats, no fewer than the {d} of its matrices"
    return None


def message_bytes(shapes, scheme: Scheme, config: CompressionConfig) -> int:
    """Bytes of one rank's part of a lossy scheme's sync of parameters of ``shapes``: before the
    all-reduce spreads them (fp16, PowerSGD), or the payload every peer gets (top-k's
    all-gather). The bytes in :func:`lossy_time`, and what MG-WFBP counts as a PowerSGD or top-k
    layer's message (an exact layer's is its parameters' bytes).

    >>> message_bytes([(64, 256), (64,)], Scheme.POWERSGD, CompressionConfig(rank=4))
    5376
    >>> message_bytes([(64, 256), (64,)], Scheme.FP16, CompressionConfig())
    32896
    >>> message_bytes([(64, 256), (64,)], Scheme.TOPK, CompressionConfig(ratio=0.01))  # k = 164
    1568
    """
    mats, vec = split_shapes(shapes)
    if scheme is Scheme.FP16:
        return half.ITEM_BYTES * (sum(m * n for m, n in mats) + vec)
    if scheme is Scheme.POWERSGD:
        return 4 * (sum(min(config.rank, m, n) * (m + n) for m, n in mats) + vec)
    if scheme is Scheme.TOPK:  # all-gathered, not all-reduced: the payload each peer gets
        return sparse.nbytes(vec, topk_count(sum(m * n for m, n in mats), config.ratio))
    raise ConfigError(f"{scheme.value} is not a lossy scheme")


def lossy_time(
    layer, scheme: Scheme, workers: int, link: Link, config: CompressionConfig, costs: ComputeCosts, rows: int = 0
) -> float:
    """Predicted seconds for lossy ``scheme`` to sync ``layer`` (the table above).

    A link that carries the device's seconds per FLOP (``flop``) makes the exact schemes count an
    FC layer's weight gradient, ``2 K M N`` FLOPs in autograd (``cost.predicted_time``); every
    lossy scheme compresses that same gradient, so it counts it alike (``rows`` is K).
    """
    if workers < 2:
        return 0.0
    mats, vec = split_shapes(layer.params)
    d = sum(m * n for m, n in mats)
    spread = 2 * (workers - 1) / workers
    gemm = (
        2.0 * rows * layer.shape.m * layer.shape.n * getattr(link, "flop", 0.0)
        if layer.shape.kind is LayerKind.FC
        else 0.0
    )
    if scheme is Scheme.FP16:
        return (
            2 * link.alpha
            + link.beta * spread * message_bytes(layer.params, scheme, config)
            + costs.of(scheme, d + vec)
            + gemm
        )
    if scheme is Scheme.POWERSGD:
        return (
            4 * link.alpha
            + link.beta * spread * message_bytes(layer.params, scheme, config)
            + costs.of(scheme, d)
            + gemm
        )
    if scheme is Scheme.TOPK:  # all-gathered: (P - 1) payloads each way
        return (
            link.alpha
            + link.beta * (workers - 1) * message_bytes(layer.params, scheme, config)
            + costs.of(scheme, d)
            + gemm
        )
    raise ConfigError(f"{scheme.value} is not a lossy scheme")


@dataclass(frozen=True)
class Weighing:
    """One layer's decision: every candidate's predicted seconds, the exact schemes' choice,
    the choice, and why."""

    times: dict
    exact: Scheme
    choice: Scheme
    why: str


@dataclass(frozen=True)
class LossyPlanner:
    """The compression settings and the measured compute, as the plan uses them.

    >>> planner = LossyPlanner(CompressionConfig("auto"), ComputeCosts())
    """

    config: CompressionConfig
    costs: ComputeCosts = ComputeCosts()

    def weigh(
        self,
        layer,
        rows: int,
        exact: Scheme,
        candidates,
        workers: int,
        shards: int,
        link: Link,
        chunk_bytes: int = 2 << 20,
        hosts=None,
    ) -> Weighing:
        """Decide ``layer`` (a ``PlanLayer``) given the exact schemes' choice ``exact`` among
        ``candidates`` (the rule in this module's docstring). ``hosts``: a
        :class:`~poseidon_aio.plan.cost.Hosts` of several workers each; the lossy schemes stay
        flat, their L workers' flows sharing the host's link."""
        times = {}
        shape = layer.shape.with_rows(rows)
        for c in candidates:
            if Scheme(c).captures_factors and not (layer.factorable and rows):
                continue
            times[Scheme(c).value] = predicted_time(
                shape, Scheme(c), workers, shards, link, chunk_bytes=chunk_bytes, hosts=hosts
            )
        exact_t = times.get(exact.value)
        if exact_t is None:
            exact_t = times[exact.value] = predicted_time(
                shape, exact, workers, shards, link, chunk_bytes=chunk_bytes, hosts=hosts
            )
        by_host = hosts is not None and hosts.local > 1
        flat = hosts.shared(link) if by_host else link
        lossy, reasons = {}, {}
        for scheme in self.config.schemes:
            why = unsuited(layer, scheme, self.config)
            if why is None:
                # By host: top-k's all-gather sends L workers' payloads, bundled, to P_h - 1 hosts;
                # fp16's and PowerSGD's all-reduce a ring's share over P_h hosts, once a host.
                lossy[scheme] = times[scheme.value] = lossy_time(
                    layer,
                    scheme,
                    hosts.hosts if by_host else workers,
                    flat if scheme is Scheme.TOPK else link,
                    self.config,
                    self.costs,
                    rows,
                )
            else:
                reasons[scheme] = why
        if self.config.method is not Compression.AUTO:
            (scheme,) = self.config.schemes
            if scheme in lossy:
                return Weighing(times, exact, scheme, f"{scheme.value} named, and the layer suits it")
            return Weighing(times, exact, exact, f"exact: {reasons[scheme]}")
        if not lossy:
            return Weighing(times, exact, exact, "exact: " + "; ".join(sorted(set(reasons.values()))))
        best = min(lossy, key=lambda s: (lossy[s], LOSSY_SCHEMES.index(s)))
        if lossy[best] < exact_t:
            return Weighing(
                times,
                exact,
                best,
                f"{best.value} predicted {lossy[best] * 1e3:.3g} ms < {exact.value} {exact_t * 1e3:.3g} ms",
            )
        return Weighing(
            times,
            exact,
            exact,
            f"exact: {exact.value} predicted {exact_t * 1e3:.3g} ms <= {best.value} {lossy[best] * 1e3:.3g} ms",
        )
