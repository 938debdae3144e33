"""The planner's side of compression: what a lossy scheme costs a layer, and when it wins.

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
``c(x) = a + b x`` is measured once at start-up on this machine (:func:`measure_compute`: a
small encode and decode per scheme at two sizes), rank 0's measurement shared with every rank so
every rank makes the same plan.

The rule (:meth:`LossyPlanner.weigh`): a layer is *suited* to a lossy scheme when its
parameters are float32, it has matrix parameters with at least ``min_elements`` (16384) elements
in all, and, for PowerSGD, its rank-r factors are fewer floats than its matrices
(sum r_i (m_i + n_i) < d, the "no cheaper than exact" test of DDP's PowerSGD hook at a minimum
compression rate of 1). With ``compression="auto"`` the layer takes the least predicted time of
the exact schemes' choice and every suited lossy scheme; a tie stays exact. With one named
method, the layer takes it where suited, the exact choice elsewhere.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Mapping, Optional

import numpy as np

from ..errors import ConfigError
from ..wire import half, sparse
from .compress import Compression, CompressionConfig, Feedback, PowerSGDStep, TopKStep, rank_order_mean, split_shapes, topk_count
from .cost import LOSSY_SCHEMES, LayerKind, Link, Scheme, predicted_time
from .syncer import syncer_class

# Elements of the start-up measurement: a 64 x 64 and a 256 x 256 matrix. Large enough that the
# per-element slope is not lost in call overhead, small enough that all three schemes at both
# sizes, best of 3, take tens of milliseconds.
CALIBRATION_ELEMENTS = (4096, 65536)


@dataclass(frozen=True)
class ComputeCosts:
    """Compression compute per sync and worker: ``a + b x elements`` seconds, per lossy scheme.

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


def measure_compute(config: CompressionConfig, sizes=CALIBRATION_ELEMENTS, repeats: int = 3) -> ComputeCosts:
    """Time each lossy scheme's arithmetic on this machine at ``sizes`` elements (square
    matrices), best of ``repeats``, and fit ``a + b x elements`` through the two smallest.

    What is timed is the code the syncers run for one layer: fp16's encode and decode twice (its
    contribution and the mean), PowerSGD's three stages with a rank-order mean standing in for
    each all-reduce, top-k's selection and its rank-order sum of two ranks' parts.

    Returns:
        :class:`ComputeCosts` with a fit per lossy scheme (times vary run to run: the trainer
        uses rank 0's on every rank).

    >>> sorted(measure_compute(CompressionConfig(), sizes=(64, 256), repeats=1).fits)
    ['fp16', 'powersgd', 'topk']
    """
    rng = np.random.default_rng(0)
    samples: dict = {s.value: [] for s in LOSSY_SCHEMES}
    for size in sorted(sizes)[:2]:
        side = max(1, int(round(size**0.5)))
        grads = [rng.standard_normal((side, side), dtype=np.float32), rng.standard_normal(side, dtype=np.float32)]
        flat = np.concatenate([g.reshape(-1) for g in grads])
        elements = side * side

        def fp16() -> None:
            for _ in range(2):
                half.expand(half.encode(flat))

        def powersgd() -> None:
            step = PowerSGDStep("calibration", grads, config.rank, Feedback())
            q = step.middle(rank_order_mean([step.begin()]))
            step.finish(rank_order_mean([q]))

        def topk() -> None:
            step = TopKStep("calibration", grads, config.ratio, Feedback())
            mine = step.begin()
            step.finish([mine, mine])

        for scheme, fn in ((Scheme.FP16, fp16), (Scheme.POWERSGD, powersgd), (Scheme.TOPK, topk)):
            best = float("inf")
            for _ in range(repeats):
                started = time.perf_counter()
                fn()
                best = min(best, time.perf_counter() - started)
            samples[scheme.value].append((elements, best))
    fits = {}
    for scheme, points in samples.items():
        (x1, t1), (x2, t2) = points[0], points[-1]
        b = max(0.0, (t2 - t1) / (x2 - x1)) if x2 > x1 else 0.0
        fits[scheme] = (max(0.0, t1 - b * x1), b)
    return ComputeCosts(fits)


def unsuited(layer, scheme: Scheme, config: CompressionConfig, *, forced: bool = False) -> Optional[str]:
    """Why ``layer`` (a ``PlanLayer``) cannot go by lossy ``scheme``, or ``None`` if it can.

    ``forced`` (a per-layer override): only what the scheme needs (float32 matrices), not the
    size threshold or PowerSGD's compression rate.

    >>> from poseidon_aio.sync import LayerShape, PlanLayer
    >>> unsuited(PlanLayer(LayerShape("bn", "other", 128, 1), False, params=((64,), (64,))), Scheme.TOPK, CompressionConfig())
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


def lossy_time(layer, scheme: Scheme, workers: int, link: Link, config: CompressionConfig, costs: ComputeCosts, rows: int = 0) -> float:
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
    gemm = 2.0 * rows * layer.shape.m * layer.shape.n * getattr(link, "flop", 0.0) if layer.shape.kind is LayerKind.FC else 0.0
    if scheme is Scheme.FP16:
        return 2 * link.alpha + link.beta * spread * message_bytes(layer.params, scheme, config) + costs.of(scheme, d + vec) + gemm
    if scheme is Scheme.POWERSGD:
        return 4 * link.alpha + link.beta * spread * message_bytes(layer.params, scheme, config) + costs.of(scheme, d) + gemm
    if scheme is Scheme.TOPK:  # all-gathered: (P - 1) payloads each way
        return link.alpha + link.beta * (workers - 1) * message_bytes(layer.params, scheme, config) + costs.of(scheme, d) + gemm
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

    def weigh(self, layer, rows: int, exact: Scheme, candidates, workers: int, shards: int, link: Link, chunk_bytes: int = 2 << 20) -> Weighing:
        """Decide ``layer`` (a ``PlanLayer``) given the exact schemes' choice ``exact`` among
        ``candidates`` (the rule in this module's docstring)."""
        times = {}
        shape = layer.shape.with_rows(rows)
        for c in candidates:
            if syncer_class(c).captures_factors and not (layer.factorable and rows):
                continue
            times[Scheme(c).value] = predicted_time(shape, Scheme(c), workers, shards, link, chunk_bytes=chunk_bytes)
        exact_t = times.get(exact.value)
        if exact_t is None:
            exact_t = times[exact.value] = predicted_time(shape, exact, workers, shards, link, chunk_bytes=chunk_bytes)
        lossy, reasons = {}, {}
        for scheme in self.config.schemes:
            why = unsuited(layer, scheme, self.config)
            if why is None:
                lossy[scheme] = times[scheme.value] = lossy_time(layer, scheme, workers, link, self.config, self.costs, rows)
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
            return Weighing(times, exact, best, f"{best.value} predicted {lossy[best] * 1e3:.3g} ms < {exact.value} {exact_t * 1e3:.3g} ms")
        return Weighing(times, exact, exact, f"exact: {exact.value} predicted {exact_t * 1e3:.3g} ms <= {best.value} {lossy[best] * 1e3:.3g} ms")
