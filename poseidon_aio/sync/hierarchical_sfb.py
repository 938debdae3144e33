"""Sufficient factor broadcasting between hosts of several workers: each host's factors cross the
network once per peer host, stacked (K·L rows), not once per worker pair.

1. Inside the host every rank sends its ``(u, v)`` to every local peer: each then holds its
   host's stack, the L ranks' rows in local-rank order.
2. Across hosts host ``h`` sends its stack to host ``g`` from its local rank ``g mod L`` to
   ``g``'s local rank ``h mod L`` (so the host's links to its peers are shared among its local
   ranks), which forwards it to its local peers.
3. Every rank rebuilds the mean gradient with one GEMM over the hosts' stacks in host order: the
   same rows in the same order on every rank, so every replica gets the same bits.

Frame keys: ``(layer) << 16 | slot``, slot 0 a rank's own factors (inside the host), slot
``1 + h`` host ``h``'s stack (across hosts, and forwarded inside the receiving host). A stack
that crosses the network is counted in the sync's bytes; what moves inside the host is not.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np

from ..errors import ConfigError
from ..net.endpoint import silence
from ..plan.cost import Scheme
from ..wire import Kind, factors
from .bucket import Bucket
from .sfb import SFBSyncer
from .syncer import SyncContext, Syncer, SyncResult, register, within

_SLOTS = 1 << 16


@register
class HierarchicalSFB(Syncer):
    """The SFB scheme's syncer where the job's hosts run several workers each; where each runs
    one, :meth:`build` gives the flat :class:`SFBSyncer`.

    Args:
        rank: this worker.
        topology: the job's hosts (:class:`~poseidon_aio.cluster.topology.Topology`).
        peers: ``{rank: link}`` to every other worker.
        reconstruct, executor, timeout: as :class:`SFBSyncer`'s.
    """

    scheme = Scheme.SFB
    host_outs = False  # the reconstruction kernel writes the (device) tensors

    def __init__(self, rank: int, topology, peers, reconstruct, executor, timeout: float) -> None:
        self.rank = rank
        self.topology = topology
        self.host = topology.host_of(rank)
        self.local = topology.local_peers(rank)
        hosts = len(topology.hosts)
        if hosts >= _SLOTS:
            raise ConfigError(f"{hosts} hosts: hierarchical SFB's frame keys name at most {_SLOTS - 2}")
        self._locals = {r: peers[r] for r in self.local if r != rank}
        sends_to, comes_from, self._crossing = topology.routes(rank)
        self._sends_to = {g: peers[q] for g, q in sends_to.items()}
        self._stack_from = {h: peers[q] for h, q in comes_from.items()}
        self._stack_sender = comes_from
        self._reconstruct = reconstruct
        self._executor = executor
        self._timeout = timeout

    @classmethod
    def build(cls, ctx: SyncContext) -> Syncer:
        topology = ctx.by_host
        if topology is None:
            return SFBSyncer.build(ctx)
        return cls(ctx.rank, topology, ctx.peers, ctx.reconstruct, ctx.executor, ctx.timeout)

    def start(self, bucket: Bucket, clock: int) -> asyncio.Task:
        return asyncio.ensure_future(self._sync(bucket, clock))

    async def _sync(self, bucket: Bucket, clock: int) -> SyncResult:
        base = bucket.layers[0] * _SLOTS
        m, n = bucket.shape
        u, v = bucket.factors
        what = f"layer {bucket.label} at clock {clock}"
        own = {r: conn.expect(Kind.FACTORS, base, clock) for r, conn in self._locals.items()}
        stacks = {h: conn.expect(Kind.FACTORS, base + 1 + h, clock) for h, conn in self._stack_from.items()}
        waits = [*own.values(), *stacks.values()]
        sent = received = 0
        try:
            send = self._sender(bucket, clock)
            await self._bounded(
                asyncio.gather(*(send(conn, base, factors.encode(u, v)) for conn in self._locals.values())),
                bucket,
                clock,
                "sending its factors to its host's ranks",
            )
            frames = await self._bounded(
                asyncio.gather(*own.values()), bucket, clock, "the factors of its host's ranks", own.items()
            )
            us, vs = {self.rank: u}, {self.rank: v}
            for r, frame in zip(own, frames):
                us[r], vs[r] = factors.decode(frame, m, n, what=what)
            mine_u = np.concatenate([us[r] for r in self.local])
            mine_v = np.concatenate([vs[r] for r in self.local])
            parts = factors.encode(mine_u, mine_v)
            out = [send(conn, base + 1 + self.host, parts) for conn in self._sends_to.values()]
            sent += factors.nbytes(mine_u.shape[0], m, n) * len(self._sends_to)
            forwards = [asyncio.ensure_future(self._forward(stacks[h], base + 1 + h, send)) for h in self._crossing]
            arrived = await self._bounded(
                asyncio.gather(*stacks.values(), *out, *forwards),
                bucket,
                clock,
                "the other hosts' factors",
                [(self._stack_sender[h], fut) for h, fut in stacks.items()],
            )
        except BaseException:
            for fut in waits:
                fut.cancel()
                fut.add_done_callback(silence)
            raise
        by_host = dict(zip(stacks, arrived[: len(stacks)]))
        host_u, host_v = [], []
        for h in range(len(self.topology.hosts)):
            if h == self.host:
                host_u.append(mine_u)
                host_v.append(mine_v)
                continue
            hu, hv = factors.decode(by_host[h], m, n, what=what)
            host_u.append(hu)
            host_v.append(hv)
            if h in self._crossing:
                received += by_host[h].header.length
        out_w = bucket.outs[0]
        out_b = bucket.outs[1] if len(bucket.outs) > 1 else None
        started = time.perf_counter()
        await asyncio.get_running_loop().run_in_executor(
            self._executor, self._reconstruct, host_u, host_v, 1.0 / self.topology.world, out_w, out_b
        )
        return SyncResult(sent, received, work=((f"rebuild {bucket.label}", started, time.perf_counter()),))

    def _sender(self, bucket: Bucket, clock: int):
        def send(conn, key: int, parts):
            return conn.send(Kind.FACTORS, parts, key=key, clock=clock, dtype=factors.DTYPE, priority=bucket.priority)

        return send

    async def _forward(self, arrival: asyncio.Future, key: int, send) -> None:
        """Another host's stack, once it is here, to every local peer (its bytes as they came)."""
        frame = await arrival
        payload = np.frombuffer(frame.payload, dtype=np.float32)
        await asyncio.gather(*(send(conn, key, [payload]) for conn in self._locals.values()))

    def _bounded(self, aw, bucket: Bucket, clock: int, what: str, waits=()):
        """``await aw`` within the sync timeout; the error names the ranks never heard from."""

        def message(late: list) -> str:
            who = f" from rank(s) {late}" if late else ""
            return (
                f"rank {self.rank}: sufficient factors of layer {bucket.label} at clock {clock}: {what}{who} "
                f"did not arrive within {self._timeout} s"
            )

        return within(aw, self._timeout, list(waits), message)
