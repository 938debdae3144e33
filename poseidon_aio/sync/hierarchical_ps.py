"""The parameter-server scheme between hosts of several workers: one push per host and message.

Poseidon keeps one KV store per host (ATC'17 §4), and BytePS sums a host's gradients before its
server sees them. Here every message of a bucket has a speaker on each host, its local rank
``message id mod L`` (``InformationBook.speaker``): the host's other ranks send it their slices
of the message, it sums the L in local-rank order, pushes the sum to the message's shard and
receives the reply (the mean over every worker, or with server-side SGD the new parameters),
which it forwards to its local peers. The shard waits for the P_h speakers and divides their sum
by P (``InformationBook.pushers``). Each host's link carries a message once each way, and the
messages' speakers share it among the host's workers.

Every replica lands the shard's bits: a speaker's own reply, or its forward of it. Local frames'
keys are ``HOST_KEY | message id``: the high bit keeps them apart from the all-reduce's keys on
the same links; what moves inside the host is not counted in the sync's network bytes.
"""

from __future__ import annotations

import asyncio

import numpy as np

from ..net.endpoint import silence
from ..plan.cost import Scheme
from ..wire import DTYPE_BY_NAME, Kind
from .bucket import Bucket
from .ps import PSSyncer
from .syncer import SyncContext, Syncer, SyncResult, register, within

HOST_KEY = 1 << 31


@register
class HierarchicalPS(Syncer):
    """The PS scheme's syncer where the job's hosts run several workers and the parameter
    server's book pushes by host; elsewhere :meth:`build` gives the flat :class:`PSSyncer`.

    Args:
        rank: this worker.
        topology: the job's hosts (:class:`~poseidon_aio.cluster.topology.Topology`).
        peers: ``{rank: link}`` to every other worker.
        client: the node's :class:`~poseidon_aio.ps.PSClient`.
        index: model manifest index -> the parameter server's manifest index.
        timeout: seconds to wait for a local peer's slices or a speaker's forward.
    """

    scheme = Scheme.PS
    on_ps = True

    def __init__(self, rank: int, topology, peers, client, index, timeout: float) -> None:
        self.rank = rank
        self.local = topology.local_peers(rank)
        self.me = topology.local_rank_of(rank)
        self._links = {j: peers[r] for j, r in enumerate(self.local) if r != rank}
        self._client = client
        self._index = dict(index)
        self._timeout = timeout

    @classmethod
    def build(cls, ctx: SyncContext) -> Syncer:
        client = ctx.node.client if ctx.node is not None else None
        if ctx.topology is None or client is None or not client.book.by_host:
            return PSSyncer.build(ctx)
        return cls(ctx.rank, ctx.topology, ctx.peers, client, ctx.ps_index, ctx.timeout)

    def start(self, bucket: Bucket, clock: int) -> asyncio.Task:
        return asyncio.ensure_future(self._sync(bucket, clock))

    async def _sync(self, bucket: Bucket, clock: int) -> SyncResult:
        client = self._client
        book = client.book
        ids = [self._index[i] for i in bucket.params]
        flat_g, flat_o = client.flat(ids, bucket.grads), client.flat(ids, bucket.outs)
        messages = book.messages_of_params(ids)
        server = client.config.server_sgd is not None
        reply = (Kind.PARAMS, clock + 1) if server else (Kind.AGGREGATE, clock)
        parts, forwards, mine, theirs = {}, {}, [], []
        for m in messages:
            dtype = np.dtype(m.dtype)
            numel = m.nbytes // dtype.itemsize
            speaker = book.speaker(m.id)
            if speaker == self.me:
                for j, link in self._links.items():
                    buf = np.empty(numel, dtype)
                    parts[(m.id, j)] = (link.expect(Kind.PUSH, HOST_KEY | m.id, clock, into=buf), buf)
                mine.append(m)
            else:
                into = np.empty(numel, dtype)
                forwards[m.id] = (self._links[speaker].expect(reply[0], HOST_KEY | m.id, reply[1], into=into), into)
                theirs.append(m)
        waits = [*(f for f, _ in parts.values()), *(f for f, _ in forwards.values())]
        speaking = []
        try:
            sends = [
                self._links[book.speaker(m.id)].send(
                    Kind.PUSH,
                    book.slices(m, flat_g),
                    key=HOST_KEY | m.id,
                    clock=clock,
                    dtype=DTYPE_BY_NAME[m.dtype],
                    priority=bucket.priority,
                )
                for m in theirs
            ]
            speaking = [
                asyncio.ensure_future(self._speak(m, parts, flat_g, flat_o, clock, reply, bucket.priority))
                for m in mine
            ]
            for task in speaking:
                task.add_done_callback(silence)
            late = [(self.local[book.speaker(m.id)], forwards[m.id][0]) for m in theirs]
            late += [(self.local[j], fut) for (_, j), (fut, _) in parts.items()]
            results = await self._bounded(
                asyncio.gather(*speaking, *(f for f, _ in forwards.values()), *sends), bucket, clock, late
            )
        except BaseException:
            for fut in (*waits, *speaking):
                fut.cancel()
                fut.add_done_callback(silence)
            raise
        for m in theirs:
            into, offset = forwards[m.id][1], 0
            for view in book.slices(m, flat_o):
                view[:] = into[offset : offset + view.size]
                offset += view.size
        if theirs:
            client.landed(clock, len(theirs))
        pushed = results[: len(mine)]
        return SyncResult(
            sum(r.remote_bytes_sent for r in pushed),
            sum(r.remote_bytes_received for r in pushed),
            tuple(sorted({d for r in pushed for d in r.dropped})),
        )

    async def _speak(self, m, parts, flat_g, flat_o, clock: int, reply: tuple, priority: int):
        """Message ``m`` for this host: its ranks' slices summed in local-rank order, pushed, the
        reply forwarded to them."""
        book = self._client.book
        await asyncio.gather(*(parts[(m.id, j)][0] for j in self._links))
        total = None
        for j in range(len(self.local)):
            if j == self.me:
                views = book.slices(m, flat_g)
                part = views[0] if len(views) == 1 else np.concatenate(views)
            else:
                part = parts[(m.id, j)][1]
            total = np.array(part, copy=True) if total is None else np.add(total, part, out=total)
        outs = book.slices(m, flat_o)
        result = await self._client.push_message(m, [total], outs, clock, priority)
        await asyncio.gather(
            *(
                link.send(
                    reply[0],
                    outs,
                    key=HOST_KEY | m.id,
                    clock=reply[1],
                    dtype=DTYPE_BY_NAME[m.dtype],
                    priority=priority,
                )
                for link in self._links.values()
            )
        )
        return result

    def _bounded(self, aw, bucket: Bucket, clock: int, waits):
        """``await aw`` within the sync timeout; the error names the local ranks never heard from."""

        def message(late: list) -> str:
            who = f": nothing from its host's rank(s) {late}" if late else ""
            return (
                f"rank {self.rank}: the parameter server's sync of {bucket.label} at clock {clock} did not "
                f"complete within {self._timeout} s{who}; a worker on this host may be dead or stalled"
            )

        return within(aw, self._timeout, list(waits), message)
