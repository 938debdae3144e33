"""MG-WFBP: which consecutive layers to merge into one message (Shi & Chu, Theorem 1, Algorithm 1).

Pure functions on numbers every rank agrees on. Layers are indexed as the paper does, 1..L from
the input to the output; backward runs L -> 1 and layer l's gradient is ready at
``tau_b[l] + t_b[l]``. A message of ``p`` bytes costs ``T(p) = a + b * p`` (``a``: start-up,
the alpha that merging saves; ``b``: seconds per byte).

Timeline (Eqs. 19-21): ``tau_b[L] = t_f``; ``tau_b[l] = tau_b[l+1] + t_b[l+1]``;
``tau_c[L] = tau_b[L] + t_b[L]``; ``tau_c[l] = max(tau_c[l+1] + t_c[l+1], tau_b[l] + t_b[l])``;
the iteration ends when layer 1's communication does: ``tau_c[1] + t_c[1]``.

Theorem 1: layer l (2 <= l <= L) is a merged-gradient layer — its gradient travels with layer
l-1's — when ``tau_b[l-2] - tau_c[l] < a``, where ``tau_b[0]`` is the end of the backward pass.
Algorithm 1 walks l = L .. 2, merging where the condition holds and recomputing the timeline after
each merge (O(L^2)).

Beyond the paper, a message may also cost the *backward* some time: ``serial``, the host CPU
its sending takes from the compute where the cores are oversubscribed (several workers on one
host: every message's Python and kernel work is taken from some rank's backward). The paper's
model is ``serial = 0``, and then every function here is the paper's. With ``serial > 0`` each
message sent while the backward runs pushes the rest of the backward back by ``serial``; merging
l into l-1 then also gives that back, and never ends the two layers' messages later when
``tau_b[l-2] - tau_c[l] < a + serial`` or ``b * p_l <= serial`` (l-1's gradient is ready
``serial`` sooner; the merged message carries ``p_l`` more bytes).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Sequence

from ..errors import ConfigError


@dataclass(frozen=True)
class CommModel:
    """``T(p) = a + b * p`` seconds for a message of ``p`` bytes; each message sent during the
    backward delays the rest of it by ``serial`` seconds (0: the paper's model)."""

    a: float
    b: float
    serial: float = 0.0

    def time(self, nbytes: float) -> float:
        return self.a + self.b * nbytes if nbytes > 0 else 0.0


def fit(sizes: Sequence[float], times: Sequence[float]) -> CommModel:
    """``T(p) = a + b p`` from timed messages (a and b clamped at 0): ``b`` the least-squares
    slope, ``a`` what the smallest messages take beyond ``b p`` (their median).

    Sizes span three decades (4 KiB to 4 MiB): a least-squares intercept is what is left of the
    largest messages' noise, which can exceed a small message's whole time, while the slope is
    theirs to set; the start-up is the small messages' to set (bench/RESULTS.md, "Training step
    time vs DDP: a message's cost to the backward, and the 2-worker rows").

    >>> m = fit([1e3, 1e6, 4e6], [1e-4 + 1e-9 * x for x in (1e3, 1e6, 4e6)])
    >>> round(m.a * 1e6), round(m.b * 1e12)
    (100, 1000)
    """
    n = len(sizes)
    if n < 2:
        raise ConfigError("fitting alpha and beta needs at least two (size, time) pairs")
    mx, my = sum(sizes) / n, sum(times) / n
    sxx = sum((x - mx) ** 2 for x in sizes)
    b = sum((x - mx) * (y - my) for x, y in zip(sizes, times)) / sxx if sxx else 0.0
    b = max(b, 0.0)
    if sxx:
        smallest = min(sizes)
        rest = sorted(y - b * x for x, y in zip(sizes, times) if x == smallest)
        a = rest[len(rest) // 2]
    else:
        a = my - b * mx
    return CommModel(max(a, 0.0), b)


def timeline(t_f: float, t_b: Sequence[float], t_c: Sequence[float]) -> tuple:
    """``(tau_b, tau_c, t_iter)`` for layers 1..L (lists indexed 1..L; index 0 is the end of backward)."""
    L = len(t_b)
    tb = [0.0] + list(t_b)
    tc = [0.0] + list(t_c)
    tau_b = [0.0] * (L + 1)
    tau_b[L] = t_f
    for layer in range(L - 1, 0, -1):
        tau_b[layer] = tau_b[layer + 1] + tb[layer + 1]
    tau_b[0] = tau_b[1] + tb[1]  # the end of the backward pass
    tau_c = [0.0] * (L + 1)
    tau_c[L] = tau_b[L] + tb[L]
    for layer in range(L - 1, 0, -1):
        tau_c[layer] = max(tau_c[layer + 1] + tc[layer + 1], tau_b[layer] + tb[layer])
    # A layer merged away (t_c = 0) still "starts" its zero-length message; the end is layer 1's.
    t_iter = max(tau_c[1] + tc[1], tau_b[0])
    return tau_b, tau_c, t_iter


@dataclass(frozen=True)
class MergePlan:
    """Merged-gradient layers and the resulting groups (1-based layer numbers, input side first)."""

    merged: tuple
    groups: tuple  # each a tuple of consecutive layer numbers, travelling as one message
    t_iter: float
    t_iter_wfbp: float
    t_iter_single: float

    def digest(self) -> str:
        return hashlib.sha256(json.dumps([list(g) for g in self.groups]).encode()).hexdigest()


def groups_of(L: int, merged) -> tuple:
    """Groups from a set of merged-gradient layers: ``layer`` in ``merged`` joins ``layer - 1``'s group."""
    out, current = [], [1]
    for layer in range(2, L + 1):
        if layer in merged:
            current.append(layer)
        else:
            out.append(tuple(current))
            current = [layer]
    out.append(tuple(current))
    return tuple(out)


def with_launches(t_b: Sequence[float], groups, serial: float) -> list:
    """``t_b`` with ``serial`` added to the backward of the layer below each message sent while
    the backward still runs (a group whose lowest layer is ``k >= 2`` is sent as layer ``k - 1``
    starts its backward)."""
    out = list(t_b)
    if serial:
        for group in groups:
            k = min(group)
            if k >= 2:
                out[k - 2] += serial
    return out


def iteration_time(t_f: float, t_b: Sequence[float], sizes: Sequence[float], model: CommModel, groups) -> float:
    """Iteration time when each group travels as one message sent once its lowest layer is ready."""
    L = len(t_b)
    t_c = [0.0] * L
    for group in groups:
        t_c[min(group) - 1] = model.time(sum(sizes[layer - 1] for layer in group))
    return timeline(t_f, with_launches(t_b, groups, model.serial), t_c)[2]


def merge_plan(t_f: float, t_b: Sequence[float], sizes: Sequence[float], model: CommModel) -> MergePlan:
    """Algorithm 1: the merged-gradient layers for backward times ``t_b`` and message ``sizes``.

    Args:
        t_f: forward time, seconds.
        t_b: backward time of layers 1..L (index 0 = layer 1, nearest the input), seconds.
        sizes: bytes each layer communicates, same order.
        model: the fitted ``T(p) = a + b p``.

    >>> plan = merge_plan(0.0, [1e-4] * 4, [1e3] * 4, CommModel(a=1e-3, b=1e-9))
    >>> plan.groups, plan.t_iter < plan.t_iter_wfbp
    (((1, 2, 3, 4),), True)
    """
    L = len(t_b)
    if L != len(sizes):
        raise ConfigError(f"t_b ({len(t_b)} layers) and sizes ({len(sizes)}) must describe the same layers")
    p = [0.0] + [float(s) for s in sizes]
    t_c = [0.0] + [model.time(s) for s in p[1:]]
    serial = model.serial
    t_b_sent = with_launches(t_b, [(layer,) for layer in range(1, L + 1)], serial)  # every layer its own message
    merged = []
    tau_b, tau_c, _ = timeline(t_f, t_b_sent, t_c[1:])
    for layer in range(L, 1, -1):
        if tau_b[layer - 2] - tau_c[layer] < model.a + serial or (serial > 0 and model.b * p[layer] <= serial):
            t_c[layer] = 0.0
            p[layer - 1] += p[layer]
            p[layer] = 0.0
            t_c[layer - 1] = model.time(p[layer - 1])
            t_b_sent[layer - 2] -= serial  # this layer's message is no longer sent before layer - 1's backward
            merged.append(layer)
            tau_b, tau_c, _ = timeline(t_f, t_b_sent, t_c[1:])
    groups = groups_of(L, set(merged))
    return MergePlan(
        merged=tuple(sorted(merged)),
        groups=groups,
        t_iter=iteration_time(t_f, t_b, sizes, model, groups),
        t_iter_wfbp=iteration_time(t_f, t_b, sizes, model, tuple((layer,) for layer in range(1, L + 1))),
        t_iter_single=iteration_time(t_f, t_b, sizes, model, (tuple(range(1, L + 1)),)),
    )


def optimal_plan(t_f: float, t_b: Sequence[float], sizes: Sequence[float], model: CommModel) -> MergePlan:
    """The exact minimum of the same timeline over all merges of consecutive layers, in O(L^2).

    Algorithm 1 is greedy and can miss the optimum. Here: ``E[k]``, the earliest time the link is free after
    sending layers k..L, is ``min over h >= k of max(E[h+1], ready[k]) + T(p[k] + ... + p[h])``
    with ``ready[k] = tau_b[k] + t_b[k]``; a group [k..h] goes once its lowest layer k is ready.
    An earlier free link never delays anything after it, so minimizing ``E`` layer by layer is
    exact (a max-plus recursion).

    >>> plan = optimal_plan(0.0, [1e-4] * 4, [1e3] * 4, CommModel(a=1e-3, b=1e-9))
    >>> plan.groups
    ((1, 2, 3, 4),)
    """
    L = len(t_b)
    tau_b, _, _ = timeline(t_f, t_b, [0.0] * L)
    ready = [0.0] + [tau_b[k] + t_b[k - 1] for k in range(1, L + 1)]
    prefix = [0.0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    if model.serial > 0:
        groups = _optimal_groups_serial(ready, prefix, model)
        return _plan_of(t_f, t_b, sizes, model, groups)
    free = [0.0] * (L + 2)
    cut = [0] * (L + 2)
    for k in range(L, 0, -1):
        best, best_h = float("inf"), k
        for h in range(k, L + 1):
            end = max(free[h + 1], ready[k]) + model.time(prefix[h] - prefix[k - 1])
            if end < best:
                best, best_h = end, h
        free[k], cut[k] = best, best_h
    groups, k = [], 1
    while k <= L:
        groups.append(tuple(range(k, cut[k] + 1)))
        k = cut[k] + 1
    return _plan_of(t_f, t_b, sizes, model, tuple(groups))


def _optimal_groups_serial(ready: list, prefix: list, model: CommModel) -> tuple:
    """The exact plan when each message sent during the backward costs it ``model.serial``: the
    recursion of :func:`optimal_plan` with the number of messages already sent as a second state
    (layer k's gradient is ready ``serial`` later for each), O(L^3)."""
    L = len(ready) - 1
    inf = float("inf")
    # free[k][n]: the earliest the link is free after sending layers k..L as n messages.
    free = [[inf] * (L + 2) for _ in range(L + 2)]
    cut = [[0] * (L + 2) for _ in range(L + 2)]
    free[L + 1][0] = 0.0
    for k in range(L, 0, -1):
        for n in range(1, L - k + 2):
            at = ready[k] + model.serial * (n - 1)
            best, best_h = inf, k
            for h in range(k, L - n + 2):
                above = free[h + 1][n - 1]
                if above == inf:
                    continue
                end = max(above, at) + model.time(prefix[h] - prefix[k - 1])
                if end < best:
                    best, best_h = end, h
            free[k][n], cut[k][n] = best, best_h
    n = min(range(1, L + 1), key=lambda m: free[1][m])
    groups, k = [], 1
    while k <= L:
        h = cut[k][n]
        groups.append(tuple(range(k, h + 1)))
        k, n = h + 1, n - 1
    return tuple(groups)


def single_plan(t_f: float, t_b: Sequence[float], sizes: Sequence[float], model: CommModel) -> MergePlan:
    """One message of every layer after the backward (SyncEASGD), as a plan beside the planners'."""
    return _plan_of(t_f, t_b, sizes, model, (tuple(range(1, len(t_b) + 1)),))


def ddp_buckets(sizes: Sequence[float], first_bytes: float = 1 << 20, bucket_bytes: float = 25 << 20) -> list:
    """DistributedDataParallel's buckets: layers in backward order (from the output) fill a bucket
    until its bytes reach ``first_bytes`` for the first bucket, ``bucket_bytes`` after; the layer
    that reaches the cap closes its bucket. Returns the buckets in that order (the output's
    first), each the ascending 1-based numbers of its layers.

    >>> ddp_buckets([600e3] * 4)
    [(3, 4), (1, 2)]
    """
    if first_bytes <= 0 or bucket_bytes <= 0:
        raise ConfigError(f"bucket sizes must be positive, got first {first_bytes} and then {bucket_bytes} bytes")
    groups, current, filled, cap = [], [], 0.0, first_bytes
    for layer in range(len(sizes), 0, -1):
        current.append(layer)
        filled += sizes[layer - 1]
        if filled >= cap:
            groups.append(tuple(sorted(current)))
            current, filled, cap = [], 0.0, bucket_bytes
    if current:
        groups.append(tuple(sorted(current)))
    return groups


def bucket_plan(
    t_f: float,
    t_b: Sequence[float],
    sizes: Sequence[float],
    model: CommModel,
    first_bytes: float = 1 << 20,
    bucket_bytes: float = 25 << 20,
) -> MergePlan:
    """DistributedDataParallel's buckets as a plan beside the planners': layers in backward order
    (from the output) fill a bucket until its bytes reach ``first_bytes`` for the first bucket,
    ``bucket_bytes`` after (DDP's 1 MiB and ``bucket_cap_mb=25``); the layer that reaches the cap
    closes its bucket. It needs no timeline: where the planners' model is off (a ring's steps in a
    row on a host whose cores the workers share), it is a plan known to overlap the backward.

    >>> bucket_plan(0.0, [1e-4] * 4, [600e3] * 4, CommModel(a=1e-3, b=1e-9)).groups
    ((1, 2), (3, 4))
    """
    return _plan_of(t_f, t_b, sizes, model, tuple(sorted(ddp_buckets(sizes[: len(t_b)], first_bytes, bucket_bytes))))


def tapered_plan(
    t_f: float,
    t_b: Sequence[float],
    sizes: Sequence[float],
    model: CommModel,
    first_bytes: float = 1 << 20,
    bucket_bytes: float = 25 << 20,
) -> MergePlan:
    """DDP's buckets (:func:`bucket_plan`) with the bucket nearest the input cut in two: its
    layers nearest the input, up to ``first_bytes`` (at least one layer), become the last message,
    and the rest of the bucket goes as soon as its own lowest layer is ready.

    The bucket nearest the input is ready only when the backward ends, so all of it is exposed
    while the link may have idled before it. DDP keeps its first bucket small so the link starts
    early; this keeps the last one small so it finishes early. Like :func:`bucket_plan` it needs
    no timeline, so it holds where the planners' model is off: near a saturated link their plans
    lose to DDP's buckets once the per-byte cost is misjudged (bench/RESULTS.md, "Tapered buckets:
    ResNet-152 ahead of DDP at 8 and 16 workers; why the planners' plans lose there").

    >>> tapered_plan(0.0, [1e-4] * 4, [600e3] * 4, CommModel(a=1e-3, b=1e-9)).groups
    ((1,), (2,), (3, 4))
    """
    groups = sorted(ddp_buckets(sizes[: len(t_b)], first_bytes, bucket_bytes))
    last, filled, cut = groups[0], 0.0, 0
    for layer in last:
        filled += sizes[layer - 1]
        if cut and filled > first_bytes:
            break
        cut += 1
    if cut < len(last):
        groups[0:1] = [last[:cut], last[cut:]]
    return _plan_of(t_f, t_b, sizes, model, tuple(groups))


def _plan_of(t_f: float, t_b: Sequence[float], sizes: Sequence[float], model: CommModel, groups: tuple) -> MergePlan:
    L = len(t_b)
    merged = tuple(sorted(layer for g in groups for layer in g[1:]))
    return MergePlan(
        merged=merged,
        groups=tuple(groups),
        t_iter=iteration_time(t_f, t_b, sizes, model, groups),
        t_iter_wfbp=iteration_time(t_f, t_b, sizes, model, tuple((layer,) for layer in range(1, L + 1))),
        t_iter_single=iteration_time(t_f, t_b, sizes, model, (tuple(range(1, L + 1)),)),
    )
