"""The fp16 scheme: an all-reduce over the worker mesh whose payloads are scaled float16.

The layer's arrays, read as one float32 vector, are all-reduced by :class:`MeshExchange` through
the half codec (``wire/half.py``): a chunk is a float32 scale and one float16 per value, and an
owner adds its chunk's contributions in float32 in rank order. Half the bytes of an exact
all-reduce (2 instead of 4 per value, plus 4 per 2 MiB chunk); the error is at most half an ulp
of float16, 2^-11 relative, at each of the two roundings (the contribution and the mean). No
error feedback: that error is a rounding, not a discarded part of the gradient.
"""

from __future__ import annotations

import numpy as np

from ..plan.cost import Scheme
from ..wire import half
from .exchange import LossySyncer
from .syncer import Syncer, SyncResult, register

PHASE = 0


@register
class HalfSyncer(LossySyncer, Syncer):
    """Args:
    mesh: the worker's :class:`~poseidon_aio.sync.exchange.MeshExchange`.
    config: the job's :class:`~poseidon_aio.plan.lossy.CompressionConfig` (unused: fp16
        has no setting).
    feedback: the worker's error-feedback state (unused: fp16 keeps none).
    """

    scheme = Scheme.FP16

    async def _sync(self, bucket, clock: int) -> SyncResult:
        flat = [g.reshape(-1) for g in bucket.grads]
        x = np.concatenate(flat) if len(flat) > 1 else flat[0]
        mean, sent, received = await self._mesh.allreduce(
            x,
            half,
            layer=bucket.layers[0],
            phase=PHASE,
            clock=clock,
            what=f"the fp16 all-reduce of layer {bucket.label}",
            priority=bucket.priority,
        )
        offset, arrays = 0, []
        for g in bucket.grads:
            arrays.append(mean[offset : offset + g.size])
            offset += g.size
        self._land(bucket, arrays)
        return SyncResult(sent, received)
