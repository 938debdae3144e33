"""The parameter-server scheme (ATC'17 §3): push the gradient's key-value pairs to their shards,
receive the mean (or, with server-side SGD, the new parameters) back into the bucket's outs."""

from __future__ import annotations

import asyncio

from .bucket import Bucket
from .cost import Scheme
from .syncer import SyncContext, Syncer, SyncResult, register


@register
class PSSyncer(Syncer):
    """Args:
        client: the node's :class:`~poseidon_aio.ps.PSClient`.
        index: model manifest index -> the parameter server's manifest index.
    """

    scheme = Scheme.PS
    on_ps = True
    mergeable = True

    def __init__(self, client, index) -> None:
        self._client = client
        self._index = dict(index)

    @classmethod
    def build(cls, ctx: SyncContext) -> "PSSyncer":
        return cls(ctx.node.client, ctx.ps_index)

    def start(self, bucket: Bucket, clock: int) -> asyncio.Task:
        ids = [self._index[i] for i in bucket.params]
        push = self._client.push(ids, bucket.grads, bucket.outs, clock, bucket.priority)
        return asyncio.ensure_future(_result_of(push))


async def _result_of(push) -> SyncResult:
    result = await push
    return SyncResult(result.remote_bytes_sent, result.remote_bytes_received, tuple(result.dropped))
