"""The rows scheme: an embedding's gradient as the rows its batch touched, all-gathered.

An ``nn.Embedding``'s (or ``nn.EmbeddingBag``'s) weight gradient is zero in every row whose
token the batch does not hold: a batch of 256 tokens over a vocabulary of 1000 touches at most
256 rows, a quarter of what a dense scheme moves. Each rank sends the rows of its gradient that
are not all zero, with their indices (``wire/rows.py``), to every peer; every rank adds all
ranks' rows in rank order into zeros and divides by P. That is the rank-order sum the dense
all-reduce computes, a row left out being a row of zeros, so the result is exact and every
replica holds the same bits. It costs ``K (N + 1) (P - 1)`` floats each way against
``2 M N (P - 1) / P`` for a dense all-reduce: the cost model
(:func:`~poseidon_aio.plan.cost.predicted_time`) picks it where K is well below the vocabulary, as
a sparse variable's path is chosen apart from the dense ones in Parallax (Kim et al., EuroSys'19).
The rows are found in the gradient itself, not in the batch's tokens: a row of a token whose
gradient is exactly zero is not sent, and any use of the weight is covered.
"""

from __future__ import annotations

import asyncio

import numpy as np

from ..errors import ConfigError
from ..plan.cost import Scheme
from ..wire import rows as wire_rows
from .bucket import Bucket
from .exchange import MeshExchange
from .syncer import SyncContext, Syncer, SyncResult, register

PHASE = 0


@register
class RowsSyncer(Syncer):
    """Args:
    mesh: the worker's :class:`~poseidon_aio.sync.exchange.MeshExchange`.
    """

    scheme = Scheme.ROWS

    def __init__(self, mesh: MeshExchange) -> None:
        self._mesh = mesh

    @classmethod
    def build(cls, ctx: SyncContext) -> "RowsSyncer":
        return cls(MeshExchange.of(ctx))

    def start(self, bucket: Bucket, clock: int) -> asyncio.Task:
        return asyncio.ensure_future(self._sync(bucket, clock))

    async def _sync(self, bucket: Bucket, clock: int) -> SyncResult:
        if len(bucket.grads) != 1 or bucket.grads[0].ndim != 2 or bucket.grads[0].dtype != np.float32:
            shapes = [(g.dtype.name, g.shape) for g in bucket.grads]
            raise ConfigError(
                f"layer {bucket.label}: the rows scheme takes one float32 vocabulary x width matrix, "
                f"got {shapes}; sync it by a dense scheme"
            )
        grad, out = bucket.grads[0], bucket.outs[0]
        vocab, width = grad.shape
        layer = bucket.layers[0]
        what = f"the rows of layer {bucket.label}"
        mine = await self._mesh.run((layer, "rows"), wire_rows.touched, grad)
        frames, sent, received = await self._mesh.allgather(
            wire_rows.encode(*mine),
            wire_rows.DTYPE,
            layer=layer,
            phase=PHASE,
            clock=clock,
            what=what,
            priority=bucket.priority,
        )

        def finish() -> None:
            where = f"{what} at clock {clock}"
            parts = [
                mine if r == self._mesh.rank else wire_rows.decode(frames[r], vocab, width, what=where)
                for r in range(self._mesh.world)
            ]
            total = out.reshape(vocab, width)  # a view of a landing buffer, which is contiguous
            in_place = np.shares_memory(total, out)
            if not in_place:
                total = np.empty((vocab, width), np.float32)
            total.fill(0.0)
            for indices, rows in parts:  # rank order: the dense sum's order, so every replica's bits
                total[indices] += rows
            np.divide(total, np.float32(self._mesh.world), out=total)
            if not in_place:
                np.copyto(out, total.reshape(out.shape))

        await self._mesh.run((layer, "finish"), finish)
        return SyncResult(sent, received)
