"""All-reduce over hosts of several workers: reduce inside the host, the hosts' ring on 1/L of the
bytes, gather inside the host (the hierarchical all-reduce of NCCL and Horovod).

A bucket's arrays, read as one flat sequence, are cut into L slices; local rank ``j`` owns
slice ``j`` (:class:`~poseidon_aio.sync.slices.Layout` over the host's L ranks):

1. reduce-scatter inside the host: every local rank sends each chunk of slice ``j`` to local
   rank ``j`` (PUSH frames), which sums the L parts in local-rank order;
2. across hosts: local rank ``j`` all-reduces its summed slice with local rank ``j`` of every
   other host (:class:`AllReduceSyncer` over the H hosts: the ring or direct by size, its mean
   over H), so every local rank's share of the host's link carries 1/L of the bucket and the
   host's link carries a ring all-reduce's bytes once, not L times;
3. all-gather inside the host: the owner divides by L, lands its slice and sends it to every
   local peer (AGGREGATE frames).

Every element is summed by one rank in one fixed order (local ranks 0..L-1, then the hosts' ring
order) and every replica lands that rank's bits: replicas stay bitwise identical. The mean is
``(sum over hosts of (sum over local ranks) / H) / L``.

Inside the host the parts travel over the worker mesh's own connections (loopback TCP between
processes of one machine); their bytes do not cross the host's link and are not counted in the
sync's network bytes. Frame keys are the flat all-reduce's, ``(first layer) << 16 | chunk``: a
local frame and a cross-host frame never share a connection.
"""

from __future__ import annotations

import asyncio
from typing import Sequence

import numpy as np

from ..net.endpoint import silence
from ..plan.cost import Scheme
from ..wire import Kind
from .allreduce import AllReduceSyncer
from .slices import CHUNKS_PER_LAYER, flat_arrays, gathered, layout_of, scatter
from .bucket import Bucket
from .syncer import SyncContext, Syncer, SyncResult, register, within


@register
class HierarchicalAllReduce(Syncer):
    """The all-reduce scheme's syncer where the job's hosts run several workers each; where each
    runs one, :meth:`build` gives the flat :class:`AllReduceSyncer`.

    Args:
        rank: this worker.
        topology: the job's hosts (:class:`~poseidon_aio.cluster.topology.Topology`).
        peers: ``{rank: link}`` to every other worker.
        timeout: seconds to wait for any one part.
        chunk_bytes, algorithm: as :class:`AllReduceSyncer`'s (the hosts' ring takes them).
    """

    scheme = Scheme.ALLREDUCE

    def __init__(
        self, rank: int, topology, peers, timeout: float, chunk_bytes: int = 2 << 20, algorithm: str = "auto"
    ) -> None:
        self.rank = rank
        self.local: Sequence[int] = topology.local_peers(rank)
        self.me = topology.local_rank_of(rank)
        host = topology.host_of(rank)
        across = [members[self.me] for members in topology.hosts]  # local rank `me` of each host
        self._links = {j: peers[r] for j, r in enumerate(self.local) if r != rank}
        self._across = AllReduceSyncer(
            host,
            len(across),
            {h: peers[r] for h, r in enumerate(across) if r != rank},
            timeout,
            chunk_bytes,
            algorithm,
            ranks=across,
        )
        self._timeout = timeout
        self._chunk_bytes = chunk_bytes
        self._layouts: dict = {}

    @classmethod
    def build(cls, ctx: SyncContext) -> Syncer:
        topology = ctx.by_host
        if topology is None:
            return AllReduceSyncer.build(ctx)
        return cls(ctx.rank, topology, ctx.peers, ctx.timeout, ctx.chunk_bytes, ctx.allreduce)

    def start(self, bucket: Bucket, clock: int) -> asyncio.Task:
        return asyncio.ensure_future(self._sync(bucket, clock))

    async def _sync(self, bucket: Bucket, clock: int) -> SyncResult:
        grads, outs, dtype, wire = flat_arrays(bucket)
        layout = layout_of(self._layouts, bucket, len(self.local), self._chunk_bytes, dtype.itemsize)
        base = bucket.layers[0] * CHUNKS_PER_LAYER
        mine = [(c, start, stop) for c, (owner, start, stop) in enumerate(layout.chunks) if owner == self.me]
        # Every receive registered before anything is sent (as the flat all-reduce does).
        parts = {}  # (chunk, local rank) -> (future, buffer)
        for c, start, stop in mine:
            for j, link in self._links.items():
                buf = np.empty(stop - start, dtype)
                parts[(c, j)] = (link.expect(Kind.PUSH, base + c, clock, into=buf), buf)
        gathers = {}
        for c, (owner, start, stop) in enumerate(layout.chunks):
            if owner != self.me:
                into = np.empty(stop - start, dtype)
                gathers[c] = (self._links[owner].expect(Kind.AGGREGATE, base + c, clock, into=into), into)
        waits = [*(fut for fut, _ in parts.values()), *(fut for fut, _ in gathers.values())]
        try:
            sends = [
                self._links[owner].send(
                    Kind.PUSH,
                    [grads[i][lo:hi] for i, lo, hi in layout.pieces(start, stop)],
                    key=base + c,
                    clock=clock,
                    dtype=wire,
                    priority=bucket.priority,
                )
                for c, (owner, start, stop) in enumerate(layout.chunks)
                if owner != self.me
            ]
            await self._bounded(asyncio.gather(*sends), bucket, clock, "sending its parts to its host's ranks")
            await self._bounded(
                asyncio.gather(*(fut for fut, _ in parts.values())),
                bucket,
                clock,
                "the parts of its host's ranks",
                [(self.local[j], fut) for (_, j), (fut, _) in parts.items()],
            )
            # 1. This rank's slice summed over the host in local-rank order.
            lo = mine[0][1] if mine else 0
            summed = np.empty((mine[-1][2] - lo) if mine else 0, dtype)
            for c, start, stop in mine:
                seg = summed[start - lo : stop - lo]
                for j in range(len(self.local)):
                    part = gathered(grads, layout.pieces(start, stop)) if j == self.me else parts[(c, j)][1]
                    if j == 0:
                        np.copyto(seg, part)
                    else:
                        np.add(seg, part, out=seg)
            # 2. Across hosts, the mean over H; 3. divided by L, landed and sent to the host.
            reduced = np.empty_like(summed)
            across = Bucket(
                bucket.label, bucket.layers, bucket.params, [reduced], grads=[summed], priority=bucket.priority
            )
            result = await self._across.start(across, clock)
            np.divide(reduced, reduced.dtype.type(len(self.local)), out=reduced)
            gathered_sends = []
            for c, start, stop in mine:
                seg = reduced[start - lo : stop - lo]
                scatter(seg, outs, layout.pieces(start, stop))
                gathered_sends += [
                    link.send(Kind.AGGREGATE, seg, key=base + c, clock=clock, dtype=wire, priority=bucket.priority)
                    for link in self._links.values()
                ]
            await self._bounded(asyncio.gather(*gathered_sends), bucket, clock, "sending its slice to its host's ranks")
            owners = [(self.local[layout.chunks[c][0]], fut) for c, (fut, _) in gathers.items()]
            await self._bounded(
                asyncio.gather(*(fut for fut, _ in gathers.values())), bucket, clock, "its host's slices", owners
            )
        except BaseException:
            for fut in waits:
                fut.cancel()
                fut.add_done_callback(silence)
            raise
        for c, (_, into) in gathers.items():
            scatter(into, outs, layout.pieces(*layout.chunks[c][1:]))
        return SyncResult(result.bytes_sent, result.bytes_received)

    def _bounded(self, aw, bucket: Bucket, clock: int, what: str, waits: Sequence[tuple] = ()):
        """``await aw`` within the sync timeout; the error names the local ranks never heard from."""

        def message(late: list) -> str:
            who = f" from rank(s) {late}" if late else ""
            return (
                f"rank {self.rank}: all-reduce of {bucket.label} at clock {clock}: {what}{who} did not arrive "
                f"within {self._timeout} s; a worker on this host may be dead or stalled"
            )

        return within(aw, self._timeout, list(waits), message)
