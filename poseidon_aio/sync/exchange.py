"""The worker-mesh collectives of the lossy schemes: an all-reduce through a payload codec, and an
all-gather.

**All-reduce** (fp16, PowerSGD's P and Q): a float32 vector is cut into P contiguous slices, rank
``r`` owning slice ``r``, each sent in chunks of at most ``chunk_bytes`` on the wire. Every rank
encodes its chunks of the others' slices and sends them to their owner (PUSH); an owner decodes
the P - 1 contributions of a chunk, adds them and its own (exact) values in rank order in float32,
divides by P, encodes the mean and sends it to every peer (AGGREGATE), keeping for itself exactly
what they will decode. Every replica thus holds the owner's bits, whatever the arrival order.
Per worker and direction: ``2 (P - 1) / P`` of the encoded vector, in two rounds of messages.

**All-gather** (top-k, rows): every rank sends one payload to every peer (PUSH) and gets theirs;
the caller decodes and adds them in rank order. ``(P - 1)`` payloads each way, one round: a sparse
payload cannot be summed by an owner without densifying it. Where hosts run L workers each, the
payloads cross the network once a host pair: every rank sends its payload to its local peers,
host ``h``'s bundle (its L payloads behind a table of their lengths) goes to host ``g`` from local
rank ``g mod L`` to local rank ``h mod L``, which forwards it inside ``g`` (chunk ``1 + h`` of the
key); the caller gets every rank's payload as before.

Where hosts run L workers each, the all-reduce goes by host as the exact one does
(``sync.hierarchical``): local rank ``j`` sums slice ``j`` over its host in float32, all-reduces
that through the codec with local rank ``j`` of every other host (P_h ranks, on 1/L of the
vector), divides by L and hands the slice to its host.

Frame keys: ``layer << 16 | phase << 14 | chunk`` (``phase`` tells a scheme's collectives of one
layer and clock apart: PowerSGD's P and Q); clocks are training clocks. The lossy schemes own
their layers, so no other scheme uses those keys. Decoding validates every payload (the codecs in
``wire/``) and raises :class:`~poseidon_aio.errors.RemoteProtocolError` naming the layer, the
clock and the sending rank. One deadline bounds each collective.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor
from typing import Callable, Hashable, Mapping, Optional

import numpy as np

from ..net.endpoint import silence
from ..errors import ConfigError, RemoteProtocolError, SyncTimeout
from ..net.loop import Offload
from ..plan.lossy import CompressionConfig
from ..wire import DType, Frame, Header, Kind
from ..wire.layout import ITEMSIZE
from .compress import Feedback

LAYER_SHIFT = 16
PHASE_SHIFT = 14
MAX_CHUNKS = 1 << PHASE_SHIFT  # 16384 chunks of 2 MiB: 32 GiB of encoded layer
MAX_PHASES = 1 << (LAYER_SHIFT - PHASE_SHIFT)
MAX_LAYERS = 1 << (32 - LAYER_SHIFT)


def frame_key(layer: int, phase: int, chunk: int) -> int:
    """The frame key of ``chunk`` of collective ``phase`` of ``layer``.

    >>> frame_key(3, 1, 2)
    212994

    Raises:
        ConfigError: past 65536 layers, 4 phases or 16384 chunks.
    """
    if not (0 <= layer < MAX_LAYERS and 0 <= phase < MAX_PHASES and 0 <= chunk < MAX_CHUNKS):
        raise ConfigError(
            f"a lossy scheme's frame key holds layers < {MAX_LAYERS}, phases < {MAX_PHASES} and chunks < {MAX_CHUNKS}: "
            f"got layer {layer}, phase {phase}, chunk {chunk} (raise PSConfig.chunk_bytes for so large a layer)"
        )
    return layer << LAYER_SHIFT | phase << PHASE_SHIFT | chunk


class MeshExchange:
    """Collectives over the worker mesh for one worker.

    Args:
        rank, world: this worker and how many there are.
        peers: ``{rank: link}`` to every other worker.
        timeout: seconds any one collective may take.
        chunk_bytes: the largest payload sent at once (``PSConfig.chunk_bytes``: 2 MiB).
        executor: where encoding, decoding and sums run (the loop keeps moving bytes meanwhile)
            once they cost more than a thread hop (``net.loop.Offload``); ``None`` runs them on
            the loop (tests).
        topology: the job's hosts; where they run several workers each, the all-gather goes by
            host (the all-reduce stays flat).

    >>> # mean, sent, received = await mesh.allreduce(x, half, layer=3, phase=0, clock=t, what="layer fc1")
    """

    def __init__(
        self,
        rank: int,
        world: int,
        peers: Mapping[int, object],
        timeout: float,
        chunk_bytes: int = 2 << 20,
        executor: Optional[Executor] = None,
        topology=None,
    ) -> None:
        self.rank = rank
        self.world = world
        self._peers = dict(peers)
        self._topology = topology if topology is not None and topology.by_host else None
        self._across: Optional["MeshExchange"] = None  # the hosts' exchange, local rank j of each
        self._timeout = timeout
        self._chunk_bytes = chunk_bytes
        self._executor = executor
        self._offload = Offload(executor)
        self._layouts: dict = {}

    @classmethod
    def of(cls, ctx) -> "MeshExchange":
        """The exchange of a :class:`~poseidon_aio.sync.syncer.SyncContext`."""
        return cls(ctx.rank, ctx.world, ctx.peers, ctx.timeout, ctx.chunk_bytes, ctx.executor, ctx.by_host)

    async def run(self, key: Hashable, fn: Callable, *args):
        """``fn(*args)``, a recurring piece of work known by ``key``: on the executor (NumPy
        releases the GIL in its kernels), or on the loop where it costs less than the hop."""
        return await self._offload.run(key, fn, *args)

    def chunks(self, n: int, item_bytes: int) -> list:
        """``[(owner, start, stop)]``: ``n`` values cut into P balanced slices, each in chunks of
        at most ``chunk_bytes // item_bytes`` values."""
        key = (n, item_bytes)
        layout = self._layouts.get(key)
        if layout is None:
            per_chunk = max(1, self._chunk_bytes // item_bytes)
            base, extra = divmod(n, self.world)
            layout, lo = [], 0
            for owner in range(self.world):
                hi = lo + base + (1 if owner < extra else 0)
                while lo < hi:
                    layout.append((owner, lo, min(hi, lo + per_chunk)))
                    lo = min(hi, lo + per_chunk)
            if len(layout) > MAX_CHUNKS:
                raise ConfigError(
                    f"{n} values make {len(layout)} chunks of {self._chunk_bytes} bytes, past {MAX_CHUNKS}: "
                    "raise PSConfig.chunk_bytes"
                )
            self._layouts[key] = layout
        return layout

    # -- all-reduce -------------------------------------------------------------------------

    async def allreduce(
        self, x: np.ndarray, codec, *, layer: int, phase: int, clock: int, what: str, priority: int = 0
    ) -> tuple:
        """The rank-order mean of every rank's ``x`` (1-D float32, the same length everywhere),
        through ``codec`` (a ``wire`` payload module: ``encode``, ``expand``, ``decode``, ``DTYPE``,
        ``ITEM_BYTES``).

        Returns:
            ``(mean, bytes sent, bytes received)``; ``mean`` is a new array, the same bits on
            every rank.
        Raises:
            SyncTimeout: the collective did not complete within ``timeout`` (names the ranks
                still awaited).
            RemoteProtocolError: a peer's payload is malformed (names the layer and the rank).
            ConnectionLost: a link broke.
        """
        out = np.empty(x.size, dtype=np.float32)
        if self.world == 1:
            out[:] = codec.expand(codec.encode(x))
            return out, 0, 0
        if self._topology is not None:
            return await self._allreduce_by_host(x, out, codec, layer, phase, clock, what, priority)
        layout = self.chunks(x.size, codec.ITEM_BYTES)
        pending: dict = {}  # (description, rank) -> future: what the deadline's message names
        try:
            return await asyncio.wait_for(
                self._allreduce(x, out, codec, layout, layer, phase, clock, what, priority, pending), self._timeout
            )
        except TimeoutError:
            raise self._timed_out(what, clock, pending) from None
        finally:
            for fut in pending.values():
                fut.cancel()

    async def _allreduce(self, x, out, codec, layout, layer, phase, clock, what, priority, pending) -> tuple:
        mine = [(c, lo, hi) for c, (owner, lo, hi) in enumerate(layout) if owner == self.rank]
        # Every receive is registered before anything is sent.
        for c, _, _ in mine:
            for q, conn in self._peers.items():
                pending[(f"its part of chunk {c}", q)] = conn.expect(Kind.PUSH, frame_key(layer, phase, c), clock)
        theirs = [(c, owner, lo, hi) for c, (owner, lo, hi) in enumerate(layout) if owner != self.rank]
        for c, owner, _, _ in theirs:
            pending[(f"the reduced chunk {c}", owner)] = self._peers[owner].expect(
                Kind.AGGREGATE, frame_key(layer, phase, c), clock
            )
        encoded = await self.run((layer, phase, "encode"), lambda: [codec.encode(x[lo:hi]) for _, _, lo, hi in theirs])
        sent = received = 0
        sends = []
        for (c, owner, _, _), parts in zip(theirs, encoded):
            sends.append(
                self._peers[owner].send(
                    Kind.PUSH, parts, key=frame_key(layer, phase, c), clock=clock, dtype=codec.DTYPE, priority=priority
                )
            )
            sent += sum(p.nbytes for p in parts)
        reduces = [
            asyncio.ensure_future(self._reduce(x, out, codec, c, lo, hi, layer, phase, clock, what, priority, pending))
            for c, lo, hi in mine
        ]
        for task in reduces:
            task.add_done_callback(silence)
        try:
            await asyncio.gather(*sends)
            for s, r in await asyncio.gather(*reduces):
                sent, received = sent + s, received + r
        finally:
            for task in reduces:
                task.cancel()
        frames = await asyncio.gather(*(pending[(f"the reduced chunk {c}", owner)] for c, owner, _, _ in theirs))

        def land() -> int:
            n = 0
            for (c, _, lo, hi), frame in zip(theirs, frames):
                out[lo:hi] = codec.decode(frame, hi - lo, what=f"{what} at clock {clock} (chunk {c})")
                n += frame.header.length
            return n

        received += await self.run((layer, phase, "land"), land)
        return out, sent, received

    async def _reduce(self, x, out, codec, c, lo, hi, layer, phase, clock, what, priority, pending) -> tuple:
        """Chunk ``c``, which this rank owns: every peer's part in, the mean out to every peer."""
        frames = {q: await pending[(f"its part of chunk {c}", q)] for q in self._peers}

        def reduce() -> list:
            total = None
            for r in range(self.world):  # rank order: the same float32 additions whatever arrived first
                part = (
                    x[lo:hi]
                    if r == self.rank
                    else codec.decode(frames[r], hi - lo, what=f"{what} at clock {clock} (chunk {c})")
                )
                total = np.array(part, dtype=np.float32, copy=True) if total is None else np.add(total, part, out=total)
            np.divide(total, np.float32(self.world), out=total)
            parts = codec.encode(total)
            out[lo:hi] = codec.expand(parts)  # what every peer will read
            return parts

        parts = await self.run((layer, phase, "reduce", c), reduce)
        key = frame_key(layer, phase, c)
        await asyncio.gather(
            *(
                conn.send(Kind.AGGREGATE, parts, key=key, clock=clock, dtype=codec.DTYPE, priority=priority)
                for conn in self._peers.values()
            )
        )
        nbytes = sum(p.nbytes for p in parts)
        return nbytes * len(self._peers), sum(f.header.length for f in frames.values())

    async def _allreduce_by_host(self, x, out, codec, layer, phase, clock, what, priority) -> tuple:
        """:meth:`allreduce` where hosts run several workers: local rank ``j`` sums slice ``j``
        over its host in float32 (local-rank order), all-reduces that sum through ``codec`` with
        local rank ``j`` of every other host, divides by L and hands its slice to its host."""
        topo, rank = self._topology, self.rank
        me, L = topo.local_rank_of(rank), topo.local_size
        local = topo.local_peers(rank)
        links = {j: self._peers[q] for j, q in enumerate(local) if q != rank}
        if self._across is None:
            across = [h[me] for h in topo.hosts]
            self._across = MeshExchange(
                topo.host_of(rank),
                len(across),
                {h: self._peers[q] for h, q in enumerate(across) if q != rank},
                self._timeout,
                self._chunk_bytes,
                self._executor,
            )
        base, extra = divmod(x.size, L)
        bounds = [j * base + min(j, extra) for j in range(L + 1)]
        lo, hi = bounds[me], bounds[me + 1]
        key = frame_key(layer, phase, 0)
        pending = {}
        for j, conn in links.items():
            pending[(f"its part of slice {me}", local[j])] = conn.expect(Kind.PUSH, key, clock)
            pending[(f"the mean of slice {j}", local[j])] = conn.expect(Kind.AGGREGATE, key, clock)

        async def body() -> tuple:
            await asyncio.gather(
                *(
                    conn.send(
                        Kind.PUSH,
                        x[bounds[j] : bounds[j + 1]],
                        key=key,
                        clock=clock,
                        dtype=DType.FLOAT32,
                        priority=priority,
                    )
                    for j, conn in links.items()
                )
            )
            parts = {j: await pending[(f"its part of slice {me}", local[j])] for j in links}
            total = np.zeros(hi - lo, np.float32)
            for j in range(L):  # local-rank order: the same float32 additions on every host
                np.add(total, x[lo:hi] if j == me else np.frombuffer(parts[j].payload, np.float32), out=total)
            mean, sent, received = await self._across.allreduce(
                total, codec, layer=layer, phase=phase, clock=clock, what=what, priority=priority
            )
            np.divide(mean, np.float32(L), out=mean)
            out[lo:hi] = mean
            await asyncio.gather(
                *(
                    conn.send(Kind.AGGREGATE, mean, key=key, clock=clock, dtype=DType.FLOAT32, priority=priority)
                    for conn in links.values()
                )
            )
            for j in links:
                frame = await pending[(f"the mean of slice {j}", local[j])]
                out[bounds[j] : bounds[j + 1]] = np.frombuffer(frame.payload, np.float32)
            return out, sent, received

        try:
            return await asyncio.wait_for(body(), self._timeout)
        except TimeoutError:
            raise self._timed_out(what, clock, pending) from None
        finally:
            for fut in pending.values():
                fut.cancel()

    # -- all-gather -------------------------------------------------------------------------

    async def allgather(
        self, parts: list, dtype, *, layer: int, phase: int, clock: int, what: str, priority: int = 0
    ) -> tuple:
        """Send ``parts`` (one payload, gathered) to every peer; receive every peer's.

        Returns:
            ``({rank: frame}, bytes sent, bytes received)`` (the caller decodes and validates).
        Raises:
            SyncTimeout, ConnectionLost: as :meth:`allreduce`.
        """
        if self.world == 1:
            return {}, 0, 0
        if self._topology is not None:
            return await self._by_host(parts, dtype, layer, phase, clock, what, priority)
        key = frame_key(layer, phase, 0)
        pending = {("its payload", q): conn.expect(Kind.PUSH, key, clock) for q, conn in self._peers.items()}

        async def body():
            await asyncio.gather(
                *(
                    conn.send(Kind.PUSH, parts, key=key, clock=clock, dtype=dtype, priority=priority)
                    for conn in self._peers.values()
                )
            )
            return await asyncio.gather(*pending.values())

        try:
            frames = await asyncio.wait_for(body(), self._timeout)
        except TimeoutError:
            raise self._timed_out(what, clock, pending) from None
        finally:
            for fut in pending.values():
                fut.cancel()
        nbytes = sum(p.nbytes for p in parts)
        by_rank = {q: f for (_, q), f in zip(pending, frames)}
        return by_rank, nbytes * len(self._peers), sum(f.header.length for f in frames)

    async def _by_host(self, parts, dtype, layer, phase, clock, what, priority) -> tuple:
        """:meth:`allgather` where hosts run several workers: a host's payloads cross once."""
        topo, rank = self._topology, self.rank
        host, local = topo.host_of(rank), topo.local_peers(rank)
        links = {q: self._peers[q] for q in local if q != rank}
        routes, bundle_from, crossing = topo.routes(rank)
        sends_to = {g: self._peers[q] for g, q in routes.items()}
        own_key = frame_key(layer, phase, 0)
        pending = {("its payload", q): conn.expect(Kind.PUSH, own_key, clock) for q, conn in links.items()}
        for h, q in bundle_from.items():
            pending[(f"host {h}'s bundle", q)] = self._peers[q].expect(Kind.PUSH, frame_key(layer, phase, 1 + h), clock)

        def send(conn, key, payload, kind_dtype):
            return conn.send(Kind.PUSH, payload, key=key, clock=clock, dtype=kind_dtype, priority=priority)

        async def forward(h: int, fut) -> None:
            frame = await fut
            payload = np.frombuffer(frame.payload, np.uint8)
            await asyncio.gather(
                *(send(c, frame_key(layer, phase, 1 + h), [payload], DType.UINT8) for c in links.values())
            )

        async def body() -> tuple:
            await asyncio.gather(*(send(conn, own_key, parts, dtype) for conn in links.values()))
            own = {q: await pending[("its payload", q)] for q in links}
            mine = [
                np.frombuffer(p if isinstance(p, (bytes, memoryview)) else np.ascontiguousarray(p), np.uint8)
                for p in parts
            ]
            payloads = []
            for r in local:
                if r == rank:
                    payloads.append(mine[0] if len(mine) == 1 else np.concatenate(mine))
                else:
                    payloads.append(np.frombuffer(own[r].payload, np.uint8))
            table = np.array([p.size for p in payloads], dtype="<u8").view(np.uint8)
            bundle = [table, *payloads]
            waits = [pending[(f"host {h}'s bundle", bundle_from[h])] for h in bundle_from]
            await asyncio.gather(
                *(send(conn, frame_key(layer, phase, 1 + host), bundle, DType.UINT8) for conn in sends_to.values()),
                *(forward(h, pending[(f"host {h}'s bundle", bundle_from[h])]) for h in crossing),
                *waits,
            )
            sent = sum(b.nbytes for b in bundle) * len(sends_to)
            received = sum(pending[(f"host {h}'s bundle", bundle_from[h])].result().header.length for h in crossing)
            return own, sent, received

        try:
            own, sent, received = await asyncio.wait_for(body(), self._timeout)
        except TimeoutError:
            raise self._timed_out(what, clock, pending) from None
        finally:
            for fut in pending.values():
                fut.cancel()
        by_rank = dict(own)
        for h, q in bundle_from.items():
            frame = pending[(f"host {h}'s bundle", q)].result()
            by_rank.update(self._unbundle(frame, topo.hosts[h], dtype, what, clock, h))
        return by_rank, sent, received

    @staticmethod
    def _unbundle(frame, ranks, dtype, what: str, clock: int, host: int) -> dict:
        """Host ``host``'s bundle cut back into one frame per rank (the payloads' views).

        Raises:
            RemoteProtocolError: its table does not add up to its length.
        """
        data = np.frombuffer(frame.payload, np.uint8)
        n = len(ranks)
        sizes = data[: 8 * n].view("<u8").astype(np.int64) if data.size >= 8 * n else None
        if sizes is None or int(sizes.sum()) != data.size - 8 * n or any(s % ITEMSIZE[dtype] for s in sizes):
            raise RemoteProtocolError(
                f"{what} at clock {clock}: rank {frame.header.rank} sent host {host}'s payloads as a bundle of "
                f"{data.size} bytes whose table does not add up; do the ranks run the same release?"
            )
        out, at = {}, 8 * n
        for r, size in zip(ranks, sizes):
            header = Header(Kind.PUSH, r, frame.header.key, clock, int(size), dtype)
            out[r] = Frame(header, memoryview(data[at : at + int(size)]).cast("B"))
            at += int(size)
        return out

    def _timed_out(self, what: str, clock: int, pending: dict) -> SyncTimeout:
        late = sorted({q for (_, q), fut in pending.items() if not fut.done() or fut.cancelled()})
        waits = sorted({d for (d, _), fut in pending.items() if not fut.done() or fut.cancelled()})[:3]
        return SyncTimeout(
            f"rank {self.rank}: {what} at clock {clock}: nothing from ranks {late} within {self._timeout} s "
            f"(waiting for {', '.join(waits)}{', ...' if len(waits) == 3 else ''}); a worker may be dead or stalled"
        )


class LossySyncer:
    """What the lossy schemes' syncers share (mixed into each ``Syncer`` subclass): built from the
    context's mesh, compression settings and error-feedback state; one layer's syncs run one
    after another in clock order (under SSP a layer's next clock may start while its last is
    still in flight, and error feedback needs the last one's residual first); the results land
    in the bucket's host outs.
    """

    host_outs = True

    def __init__(self, mesh: MeshExchange, config, feedback) -> None:
        self._mesh = mesh
        self.config = config
        self.feedback = feedback
        self._last: dict = {}  # layer label -> its latest sync

    @classmethod
    def build(cls, ctx):
        return cls(
            MeshExchange.of(ctx),
            ctx.compression or CompressionConfig(),
            ctx.feedback if ctx.feedback is not None else Feedback(),
        )

    def start(self, bucket, clock: int) -> asyncio.Task:
        before = self._last.get(bucket.label)
        task = asyncio.ensure_future(self._in_order(before, bucket, clock))
        self._last[bucket.label] = task
        return task

    async def _in_order(self, before, bucket, clock: int):
        if before is not None and not before.done():
            await asyncio.wait([before])  # bounded: that sync has its own deadline; its error is its own
        for g in bucket.grads:
            if g.dtype != np.float32:
                raise ConfigError(
                    f"layer {bucket.label}: the lossy schemes take float32 gradients, got {g.dtype}; "
                    "sync it by an exact scheme"
                )
        return await self._sync(bucket, clock)

    async def _sync(self, bucket, clock: int):  # pragma: no cover - each scheme's own
        raise NotImplementedError

    @staticmethod
    def _land(bucket, arrays: list) -> None:
        for out, value in zip(bucket.outs, arrays):
            np.copyto(out, value.reshape(out.shape))
