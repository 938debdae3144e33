"""The trainer's side of gradient compression: layers as the lossy planner sees them, the compute
measurement every rank agrees on, and the error-feedback state in checkpoints.

The schemes, their arithmetic and the planner's rule are ``sync``'s (``sync/compress.py``,
``sync/lossyplan.py``); this module only turns torch objects into what those take.
"""

from __future__ import annotations

import logging
from typing import Awaitable, Callable, Optional

import torch

from ..errors import CheckpointError
from ..plan import LOSSY_SCHEMES, CompressionConfig, ComputeCosts, LossyPlanner, PlanLayer, Scheme
from ..plan.lossy import message_bytes as lossy_bytes
from ..sync import Feedback, measure_compute
from .layers import Layer

log = logging.getLogger("poseidon_aio.train")


def plan_layer(layer: Layer) -> PlanLayer:
    """``layer`` for the plan: its cost-model shape, whether it has sufficient factors, its
    parameters' shapes and whether all are float32."""
    shapes = tuple(tuple(p.shape) for _, p in layer.params)
    float32 = all(p.dtype is torch.float32 for _, p in layer.params)
    return PlanLayer(layer.shape(), layer.factorable, params=shapes, float32=float32)


def message_bytes(layer: Layer, scheme: Scheme, config: Optional[CompressionConfig]) -> int:
    """What MG-WFBP counts as ``layer``'s message when ``scheme`` syncs it: its parameters' bytes,
    or, for the lossy schemes it merges, one rank's factor bytes (PowerSGD) or payload (top-k)."""
    if scheme in LOSSY_SCHEMES:
        return lossy_bytes([tuple(p.shape) for _, p in layer.params], scheme, config or CompressionConfig())
    return sum(p.numel() * p.element_size() for _, p in layer.params)


async def agreed_planner(
    config: Optional[CompressionConfig], rdzv, rank: int, world: int, run: Callable[..., Awaitable]
) -> Optional[LossyPlanner]:
    """The lossy planner every rank uses: ``None`` without compression or with one worker.

    Every rank checks that all hold the same settings (a rank asking for another PowerSGD rank
    would send payloads of another length); rank 0 measures the compression compute (``run``
    puts it on the compute thread) and publishes it, as the link's alpha and beta are: one plan
    needs one measurement.

    Raises:
        ManifestMismatch: the ranks' compression settings differ.
        PeerTimeout: rank 0 did not publish its measurement.
    """
    if config is None or world < 2:
        return None
    await rdzv.check_digest("compression settings", config.settings())
    if config.compute is not None:  # given: the same on every rank (its digest was checked)
        return LossyPlanner(config, ComputeCosts(dict(config.compute)))
    if rank == 0:
        costs = await run(measure_compute, config)
        await rdzv.publish("compression-compute", costs.to_json())
    costs = ComputeCosts.from_json(await rdzv.read("compression-compute", who="rank 0"))
    log.info("rank %d: compression compute (a s, b s/element) %s", rank, costs.to_json())
    return LossyPlanner(config, costs)


def checkpoint_state(feedback: Feedback, config: Optional[CompressionConfig]) -> dict:
    """What ``Trainer.save`` keeps of compression: the settings (JSON) and every layer's error
    and warm-started Q, as tensors (``torch.load(weights_only=True)`` reads them back)."""
    return {
        "settings": config.settings() if config is not None else "",
        "state": {k: torch.from_numpy(v) for k, v in feedback.state().items()},
    }


def restore_state(
    feedback: Feedback, config: Optional[CompressionConfig], saved: Optional[dict], schemes: dict
) -> None:
    """Put a checkpoint's error-feedback state back.

    Args:
        saved: the checkpoint's ``compression`` entry (absent in checkpoints from before it).
        schemes: the checkpoint's scheme plan, ``{layer name: scheme value}``.
    Raises:
        CheckpointError: the checkpoint's plan has lossy layers but it was taken with other
            compression settings than this trainer's (its state would not fit them).
    """
    lossy = sorted(name for name, scheme in schemes.items() if scheme in {s.value for s in LOSSY_SCHEMES})
    saved = saved or {}
    mine = config.settings() if config is not None else ""
    if lossy and saved.get("settings", "") != mine:
        raise CheckpointError(
            f"the checkpoint syncs layers {lossy[:4]}{' ...' if len(lossy) > 4 else ''} by lossy schemes under the "
            f"compression settings {saved.get('settings') or 'none'}; this trainer has {mine or 'none'}: "
            "resume with the same compression"
        )
    feedback.load({k: v.numpy() for k, v in (saved.get("state") or {}).items()})


def describe(report: dict) -> str:
    """One line per layer of the lossy plan: its choice, why, and every candidate's predicted time."""
    lines = []
    for name, w in report.items():
        times = ", ".join(f"{s} {t * 1e3:.3g} ms" for s, t in sorted(w.times.items(), key=lambda kv: kv[1]))
        lines.append(f"{name}: {w.choice.value} ({w.why}; {times})")
    return "\n".join(lines)
