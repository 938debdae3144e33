"""The parameter-server scheme (ATC'17 §3): push the gradient's key-value pairs to their shards,
receive the mean (or, with server-side SGD, the new parameters) back into the bucket's outs."""

from __future__ import annotations

import asyncio

from ..plan.cost import Scheme
from .bucket import Bucket
from .syncer import SyncContext, Syncer, SyncResult


class PSSyncer(Syncer):
    """The PS scheme, every worker pushing for itself (the scheme's registered syncer,
    :class:`~poseidon_aio.sync.hierarchical_ps.HierarchicalPS`, builds it where the book pushes
    per worker).

    Args:
    client: the node's :class:`~poseidon_aio.ps.PSClient`.
    index: model manifest index -> the parameter server's manifest index.
    """

    scheme = Scheme.PS
    on_ps = True

    def __init__(self, client, index) -> None:
        self._client = client
        self._index = dict(index)

    @classmethod
    def build(cls, ctx: SyncContext) -> "PSSyncer":
        return cls(ctx.node.client, ctx.ps_index)

    def start(self, bucket: Bucket, clock: int) -> asyncio.Future:
        ids = [self._index[i] for i in bucket.params]
        push = None
        if bucket.flat is not None:
            push = self._client.push_flat(ids, *bucket.flat, clock, bucket.priority)
        if push is None:
            push = self._client.push(ids, bucket.grads, bucket.outs, clock, bucket.priority)
        return _result_of(push)


def _result_of(push: asyncio.Future) -> asyncio.Future:
    """The push's :class:`SyncResult`, as a future settled by a callback on ``push``: a task per
    layer a step (created, scheduled, stepped twice) was the loop's dearest item after the frames
    themselves. Cancelling the result cancels the push, as cancelling a task awaiting it did."""
    out = push.get_loop().create_future()

    def settle(done: asyncio.Future) -> None:
        if out.done():
            return
        if done.cancelled():
            out.cancel()
        elif done.exception() is not None:
            out.set_exception(done.exception())
        else:
            r = done.result()
            out.set_result(SyncResult(r.remote_bytes_sent, r.remote_bytes_received, tuple(r.dropped)))

    def given_up(result: asyncio.Future) -> None:
        if result.cancelled():
            push.cancel()

    push.add_done_callback(settle)
    out.add_done_callback(given_up)
    return out
