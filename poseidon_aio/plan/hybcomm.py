"""HybComm's plan: the scheme of every layer (ATC'17 Algorithm 1), the same on every rank.

Pure decisions on numbers every rank agrees on (layer shapes, the rows K each layer sees per
worker, the cluster shape): no torch, no I/O. The trainer measures K, agrees on it with the other
ranks (max over ranks) and checks the resulting plan's hash.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from ..errors import ConfigError
from .cost import (
    HYBCOMM_SCHEMES,
    LOSSY_SCHEMES,
    Hosts,
    PAPER_SCHEMES,
    LayerKind,
    LayerShape,
    Link,
    Scheme,
    best_scheme,
    hybcomm_choice,
)
from .lossy import CompressionConfig, unsuited


class Mode(str, enum.Enum):
    """How the trainer synchronizes (see ``train.trainer``)."""

    NAIVE = "naive"  # every layer by PS, all started after the whole backward
    WFBP = "wfbp"  # every layer by PS, each the moment its gradient exists
    MGWFBP = "mgwfbp"  # WFBP by PS, small consecutive layers merged into one message
    POSEIDON = "poseidon"  # WFBP + HybComm (the cheapest of PS, SFB, all-reduce per layer) + merging


@dataclass(frozen=True)
class PlanLayer:
    """A layer as the plan sees it: its shape for the cost model, and whether it has sufficient
    factors at all (an unshared float32 fully-connected layer); for the lossy schemes, its
    parameters' shapes (a convolution's kernel is a matrix to PowerSGD) and whether all are
    float32."""

    shape: LayerShape
    factorable: bool
    params: tuple = ()
    float32: bool = True

    @property
    def name(self) -> str:
        return self.shape.name


def choose_schemes(
    layers: Sequence[PlanLayer],
    rows: Mapping[str, int],
    *,
    mode: Mode,
    workers: int,
    shards: int,
    overrides: Optional[Mapping[str, str]] = None,
    link: Link = Link(),
    candidates=HYBCOMM_SCHEMES,
    chunk_bytes: int = 2 << 20,
    compression=None,
    report: Optional[dict] = None,
    hosts: Optional[Hosts] = None,
    merged: bool = False,
) -> dict:
    """``{layer name: Scheme}``.

    Args:
        rows: K per layer per worker (max over ranks); a layer never called has no K and SFB
            cannot judge it.
        overrides: ``{layer name: scheme}`` the user fixed.
        link: the measured alpha and beta (default: bytes only, as the paper counts).
        candidates: the schemes HybComm weighs in mode ``poseidon`` by their predicted time on
            ``link``; exactly the paper's (PS and SFB) is Algorithm 1 on bytes, as ATC'17 writes it.
        compression: a :class:`~poseidon_aio.plan.lossy.LossyPlanner`: in mode ``poseidon``
            each layer's exact choice is then weighed against the lossy schemes (its rule).
        report: filled with ``{layer name: Weighing}`` (candidates, predicted times, choice).
        hosts: the job's :class:`~poseidon_aio.plan.cost.Hosts` where they run several workers
            each: the candidates' times are then the host's link's (``predicted_time``).
        merged: MG-WFBP merges small layers (``hybcomm_choice``): a mergeable candidate's
            start-ups are its merge group's.
    Raises:
        ConfigError: an override names a scheme the layer cannot use, a layer the model does not
            have, or a scheme the mode does not use.
    """
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - {layer.name for layer in layers})
    if unknown:
        raise ConfigError(f"scheme overrides name layers the model does not have: {unknown}")
    out = {}
    for layer in layers:
        want = overrides.get(layer.name)
        if want is not None:
            scheme = Scheme(want)
            if scheme.captures_factors and not layer.factorable:
                raise ConfigError(
                    f"layer {layer.name} ({layer.shape.kind.value}) cannot go by {scheme.value}: only an unshared "
                    "float32 nn.Linear has sufficient factors"
                )
            if scheme is Scheme.ROWS and layer.shape.kind is not LayerKind.EMBEDDING:
                raise ConfigError(
                    f"layer {layer.name} ({layer.shape.kind.value}) cannot go by rows: "
                    "only an unshared float32 nn.Embedding or "
                    "nn.EmbeddingBag has a gradient that is zero but for its batch's tokens"
                )
            if scheme in LOSSY_SCHEMES:
                why = unsuited(layer, scheme, compression.config if compression else CompressionConfig(), forced=True)
                if why:
                    raise ConfigError(f"layer {layer.name} cannot go by {scheme.value}: {why}")
        elif mode is Mode.POSEIDON and set(candidates) == set(PAPER_SCHEMES):
            # The paper's HybComm: Algorithm 1, on bytes (a layer never called has no K: PS).
            factored = layer.factorable and rows.get(layer.name)
            scheme = best_scheme(layer.shape.with_rows(rows[layer.name]), workers, shards) if factored else Scheme.PS
        elif mode is Mode.POSEIDON and workers > 1:
            # SFB needs factors (a factorable layer) and K (a layer the planning forward called).
            usable = [
                c for c in candidates if not Scheme(c).captures_factors or (layer.factorable and rows.get(layer.name))
            ]
            usable = usable or [Scheme.PS]
            scheme = hybcomm_choice(
                layer.shape.with_rows(rows.get(layer.name, 0)),
                workers,
                shards,
                link=link,
                candidates=usable,
                chunk_bytes=chunk_bytes,
                hosts=hosts,
                merged=merged,
            )
        else:
            scheme = Scheme.PS
        if want is None and compression is not None and mode is Mode.POSEIDON and workers > 1:
            weighing = compression.weigh(
                layer, rows.get(layer.name, 0), scheme, candidates, workers, shards, link, chunk_bytes, hosts
            )
            scheme = weighing.choice
            if report is not None:
                report[layer.name] = weighing
        if mode is not Mode.POSEIDON and scheme is not Scheme.PS:
            raise ConfigError(
                f"mode {mode.value!r} syncs every layer by PS; use mode='poseidon' for {scheme.value} overrides"
            )
        out[layer.name] = scheme
    return out
