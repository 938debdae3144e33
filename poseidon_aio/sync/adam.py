"""Project Adam's scheme (Chilimbi et al., OSDI'14), kept for comparison: a worker pushes its
sufficient factors to the shard that holds the layer; the shard rebuilds the mean gradient and
every worker receives the full matrices. It moves K(M+N) + MN floats per worker per layer."""

from __future__ import annotations

import asyncio

from ..plan.cost import Scheme
from .bucket import Bucket
from .syncer import SyncContext, Syncer, register
from .ps import _result_of


@register
class AdamSyncer(Syncer):
    scheme = Scheme.ADAM
    on_ps = True
    factored = True

    def __init__(self, client, index) -> None:
        self._client = client
        self._index = dict(index)

    @classmethod
    def build(cls, ctx: SyncContext) -> "AdamSyncer":
        return cls(ctx.node.client, ctx.ps_index)

    def start(self, bucket: Bucket, clock: int) -> asyncio.Future:
        ids = [self._index[i] for i in bucket.params]
        u, v = bucket.factors
        push = self._client.push_factors(ids, u, v, bucket.outs, clock, bucket.priority)
        return _result_of(push)
