"""All-reduce over the worker mesh: a reduce-scatter then an all-gather, no server.

A bucket's arrays, read as one flat sequence, are cut into P contiguous slices; rank ``r`` owns
slice ``r``. Each slice travels in chunks of at most ``chunk_bytes`` so the first bytes move (and
are summed) while the rest are still on the wire:

1. reduce-scatter: every rank sends chunk ``c`` of slice ``q`` to its owner ``q`` (PUSH frames);
2. the owner sums the P contributions of each chunk in rank order and divides by P — bitwise the
   same whatever order they arrived in — as soon as that chunk's P - 1 peers' parts are in;
3. all-gather: the owner sends each reduced chunk to every peer (AGGREGATE frames), which lands it
   in the bucket's outs; every replica holds the owner's bits, so replicas stay identical.

Per worker and per direction that is 2MN(P-1)/P floats, a ring all-reduce's bytes, in two rounds
of messages (a ring needs 2(P-1)): what a PS with co-located shards moves, but every layer spread
over every rank, so no one link carries a small layer alone.

That is the ``direct`` algorithm: every rank talks to every other at once, P - 1 TCP flows each
way per worker. On a capped link those flows share the bottleneck unevenly and the slowest owner
sets the step (bench/RESULTS.md, "All-reduce: ring or direct": plain sockets in that pattern
take longer than in a ring on a capped link, where one flow each way has the link to itself).
So big buckets go ``ring`` (``auto``, the default: slices of 64 KiB and up,
``cost.goes_round_ring``), the same slices and chunks moved the way gloo moves them: P - 1
reduce-scatter steps, each rank sending one chunk to rank + 1 (its own part first, then what it
received plus its own), so one flow leaves and one arrives per worker; the owner of a slice
(rank q owns slice q + 1) divides the sum by P and it travels P - 1 all-gather steps round the
ring, every rank landing the owner's bits. The sum of a slice runs in ring order from the rank
after its owner: fixed, so replicas stay bitwise identical. Each chunk walks the ring on its own,
so a slice's later chunks are on the wire while its first are being summed. Its 2 (P - 1) steps
in a row cost a small bucket more than the direct flows do, so small buckets (and any too small
to give every rank a chunk) go ``direct``.

Frame keys: ``(first layer of the bucket) << 16 | chunk`` (direct), ``| chunk * (P - 1) + step``
(ring); the clock is the training clock.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..net.endpoint import silence
from ..errors import ConfigError, SyncTimeout
from ..plan.cost import ALLREDUCE_ALGORITHMS, Scheme, goes_round_ring
from ..wire import DTYPE_BY_NAME, Kind, wire_dtype
from ..wire.codec import byte_view
from ..wire.spans import spanning
from .bucket import Bucket
from .syncer import SyncContext, Syncer, SyncResult

CHUNKS_PER_LAYER = 1 << 16


class _Layout:
    """A bucket's arrays as one flat sequence: owners' slices, their chunks, and where each chunk's
    bytes lie in the arrays (``[(array index, start, stop)]``, element offsets)."""

    def __init__(self, sizes: Sequence[int], world: int, chunk_items: int) -> None:
        total = sum(sizes)
        self.starts = np.cumsum([0, *sizes])
        base, extra = divmod(total, world)
        bounds = [0]
        for r in range(world):
            bounds.append(bounds[-1] + base + (1 if r < extra else 0))
        self._bounds = np.array(bounds)
        self.chunks = []  # (owner, start, stop) in flat elements
        for owner in range(world):
            lo, hi = bounds[owner], bounds[owner + 1]
            while lo < hi:
                self.chunks.append((owner, lo, min(hi, lo + chunk_items)))
                lo = min(hi, lo + chunk_items)
        if len(self.chunks) > CHUNKS_PER_LAYER:
            raise ConfigError(f"a bucket of {total} elements makes {len(self.chunks)} chunks; raise the chunk size")
        self._pieces: dict = {}  # (start, stop) -> pieces: the same few ranges, step after step

    def ring_chunks(self, chunk_items: int):
        """``chunks[c][j] = (start, stop)``: slice ``j`` cut into the same number of chunks of at
        most ``chunk_items``, so chunk ``c`` of every slice walks the ring together; None where a
        chunk would be empty (fewer elements than ranks: go direct)."""
        sizes = np.diff(self._bounds)
        count = max(1, int(-(-int(sizes.max()) // chunk_items)))
        if int(sizes.min()) < count:
            return None
        return [
            [
                (int(lo + size * c // count), int(lo + size * (c + 1) // count))
                for lo, size in zip(self._bounds[:-1], sizes)
            ]
            for c in range(count)
        ]

    def pieces(self, start: int, stop: int) -> list:
        """``[(array, lo, hi)]`` covering flat elements ``[start, stop)``."""
        out = self._pieces.get((start, stop))
        if out is None:
            out = self._pieces[(start, stop)] = self._cut(start, stop)
        return out

    def _cut(self, start: int, stop: int) -> list:
        out = []
        i = int(np.searchsorted(self.starts, start, side="right")) - 1
        while start < stop:
            a_lo = self.starts[i]
            a_hi = self.starts[i + 1]
            hi = min(stop, a_hi)
            if hi > start:
                out.append((i, int(start - a_lo), int(hi - a_lo)))
            start = hi
            i += 1
        return out


def _gathered(arrays: list, pieces: list) -> np.ndarray:
    """The flat elements ``pieces`` (``_Layout.pieces``) name: a view where they lie in one array."""
    if len(pieces) == 1:
        i, lo, hi = pieces[0]
        return arrays[i][lo:hi]
    return np.concatenate([arrays[i][lo:hi] for i, lo, hi in pieces])


def _add_into(acc: np.ndarray, arrays: list, pieces: list) -> None:
    """``acc += `` the flat elements ``pieces`` name, piece by piece: the same float32 additions as
    adding their concatenation, without making it."""
    offset = 0
    for i, lo, hi in pieces:
        part = acc[offset : offset + hi - lo]
        np.add(part, arrays[i][lo:hi], out=part)
        offset += hi - lo


def _scatter(flat: np.ndarray, arrays: list, pieces: list) -> None:
    """Copy ``flat`` into the places ``pieces`` name in ``arrays``."""
    offset = 0
    for i, lo, hi in pieces:
        arrays[i][lo:hi] = flat[offset : offset + hi - lo]
        offset += hi - lo


def layout_of(cache: dict, bucket: Bucket, owners: int, chunk_bytes: int, itemsize: int) -> _Layout:
    """The bucket's :class:`_Layout` over ``owners`` slices, made once per bucket shape (``cache``)."""
    sizes = (bucket.flat[0].size,) if bucket.flat is not None else tuple(g.size for g in bucket.grads)
    key = (bucket.layers, sizes)
    layout = cache.get(key)
    if layout is None:
        layout = cache[key] = _Layout(sizes, owners, max(1, chunk_bytes // itemsize))
    return layout


def flat_arrays(bucket: Bucket) -> tuple:
    """``(grads, outs, dtype, wire dtype)``: the bucket's arrays flattened, of one dtype.

    Raises:
        ConfigError: the bucket mixes dtypes, or holds one with no wire type.
    """
    if bucket.flat is not None:  # one buffer each way: no pass per parameter
        grads, outs = [bucket.flat[0]], [bucket.flat[1]]
    else:
        grads = [g.reshape(-1) for g in bucket.grads]
        outs = [o.reshape(-1) for o in bucket.outs]
    dtype = grads[0].dtype
    if any(g.dtype != dtype for g in grads):
        raise ConfigError(
            f"bucket {bucket.label} mixes dtypes {sorted({str(g.dtype) for g in grads})}: "
            "all-reduce one dtype at a time"
        )
    wire = wire_dtype(dtype)
    if wire is None:
        raise ConfigError(
            f"bucket {bucket.label} holds {dtype} arrays, which have no wire type: "
            f"all-reduce {', '.join(DTYPE_BY_NAME)}"
        )
    return grads, outs, dtype, wire


@dataclass
class AllReduceConfig:
    """How the all-reduce scheme's buckets move over the worker mesh.

    Args:
        algorithm: ``"ring"`` (one flow each way per worker, as gloo's: big buckets at gloo's
            speed), ``"direct"`` (every rank to every slice's owner at once: 2 steps instead of
            2 (P - 1), P - 1 flows each way) or ``"auto"``: round the ring from slices of
            ``RING_MIN_SLICE_BYTES`` (64 KiB) up, direct below.
    """

    algorithm: str = "auto"

    def __post_init__(self) -> None:
        if self.algorithm not in ALLREDUCE_ALGORITHMS:
            raise ConfigError(
                f"AllReduceConfig.algorithm must be one of {', '.join(ALLREDUCE_ALGORITHMS)}, got {self.algorithm!r}"
            )


class AllReduceSyncer(Syncer):
    """The all-reduce scheme over every worker as a peer of its own (the scheme's registered
    syncer, :class:`~poseidon_aio.sync.hierarchical.HierarchicalAllReduce`, builds it where every
    host runs one worker).

    Args:
    rank, world: this worker and how many there are.
    peers: ``{rank: link}`` to every other worker.
    timeout: seconds to wait for any one part.
    chunk_bytes: the pipelining granularity (``PSConfig.chunk_bytes``: the same 2 MiB).
    algorithm: ``"auto"``, ``"ring"`` or ``"direct"`` (``AllReduceConfig.algorithm``; see the
        module's text and ``cost.goes_round_ring``).
    ranks: the job's rank of each of ``0 .. world - 1``, where this all-reduce runs over a
        subgroup (the hosts' ring of a hierarchical all-reduce), for messages.
    """

    scheme = Scheme.ALLREDUCE

    def __init__(
        self,
        rank: int,
        world: int,
        peers,
        timeout: float,
        chunk_bytes: int = 2 << 20,
        algorithm: str = "auto",
        ranks: Sequence[int] = (),
    ) -> None:
        if algorithm not in ALLREDUCE_ALGORITHMS:
            raise ConfigError(f"all-reduce algorithm {algorithm!r}: use one of {', '.join(ALLREDUCE_ALGORITHMS)}")
        self.algorithm = algorithm
        self.rank = rank
        self.world = world
        self._ranks = tuple(ranks) or tuple(range(world))
        self._peers = dict(peers)
        self._timeout = timeout
        self._chunk_bytes = chunk_bytes
        self._layouts: dict = {}
        self._free: dict = {}  # (shape, dtype) -> receive buffers made before, reused

    @classmethod
    def build(cls, ctx: SyncContext) -> "AllReduceSyncer":
        return cls(ctx.rank, ctx.world, ctx.peers, ctx.timeout, ctx.chunk_bytes, ctx.allreduce)

    def start(self, bucket: Bucket, clock: int) -> asyncio.Task:
        return asyncio.ensure_future(self._sync(bucket, clock))

    def _layout(self, bucket: Bucket, itemsize: int) -> _Layout:
        return layout_of(self._layouts, bucket, self.world, self._chunk_bytes, itemsize)

    async def _sync(self, bucket: Bucket, clock: int) -> SyncResult:
        grads, outs, dtype, wire = flat_arrays(bucket)
        if self.world == 1:
            for g, o in zip(grads, outs):
                np.copyto(o, g)
            return SyncResult()
        layout = self._layout(bucket, dtype.itemsize)
        if goes_round_ring(sum(g.nbytes for g in grads), self.world, self.algorithm):
            ring = layout.ring_chunks(max(1, self._chunk_bytes // dtype.itemsize))
            if ring is not None:
                return await self._ring(bucket, clock, layout, ring, grads, outs, dtype, wire)
        base = bucket.layers[0] * CHUNKS_PER_LAYER
        mine = [(c, start, stop) for c, (owner, start, stop) in enumerate(layout.chunks) if owner == self.rank]
        # Register every receive before anything is sent: a part that beats its expect would be
        # copied once more out of the inbox.
        parts = {}  # (chunk, peer) -> (future, buffer)
        for c, start, stop in mine:
            for q, conn in self._peers.items():
                buf = self._take((stop - start,), dtype)
                parts[(c, q)] = (conn.expect(Kind.PUSH, base + c, clock, into=buf), buf)
        gathers = {}  # chunk -> future of the owner's reduced chunk
        landings = {}
        for c, (owner, start, stop) in enumerate(layout.chunks):
            if owner == self.rank:
                continue
            into, pieces = self._landing(layout, outs, start, stop, dtype)
            gathers[c] = self._peers[owner].expect(Kind.AGGREGATE, base + c, clock, into=into)
            landings[c] = (into, pieces)
        sent = received = 0
        try:
            sends = []
            for c, (owner, start, stop) in enumerate(layout.chunks):
                if owner != self.rank:
                    payload = [grads[i][lo:hi] for i, lo, hi in layout.pieces(start, stop)]
                    sends.append(
                        self._peers[owner].send(
                            Kind.PUSH, payload, key=base + c, clock=clock, dtype=wire, priority=bucket.priority
                        )
                    )
                    sent += (stop - start) * dtype.itemsize
            reduce_tasks = [
                asyncio.ensure_future(
                    self._reduce_and_gather(bucket, layout, grads, outs, parts, c, start, stop, base, clock, wire)
                )
                for c, start, stop in mine
            ]
            await self._bounded(asyncio.gather(*sends), bucket, clock, "sending its parts")
            from_ranks = {q: fut for (_, q), (fut, _) in parts.items()}
            for n in await self._bounded(
                asyncio.gather(*reduce_tasks), bucket, clock, "the other ranks' parts", [*from_ranks.items()]
            ):
                sent += n
            owners = [(layout.chunks[c][0], fut) for c, fut in gathers.items()]
            frames = await self._bounded(asyncio.gather(*gathers.values()), bucket, clock, "the reduced chunks", owners)
        except BaseException:
            for fut, _ in parts.values():
                fut.cancel()
            for fut in gathers.values():
                fut.cancel()
            raise
        for c, frame in zip(gathers, frames):
            into, pieces = landings[c]
            received += frame.header.length
            if pieces is not None:  # a chunk across arrays: scatter it
                _scatter(into, outs, pieces)
                self._give(into)
        for (c, q), (fut, buf) in parts.items():
            received += buf.nbytes
            self._give(buf)
        return SyncResult(sent, received)

    async def _reduce_and_gather(self, bucket, layout, grads, outs, parts, c, start, stop, base, clock, wire) -> int:
        """Sum chunk ``c`` (this rank owns it) in rank order once every peer's part is in, put the
        mean in the outs, send it to every peer; return the bytes sent."""
        await asyncio.gather(*(parts[(c, q)][0] for q in self._peers))
        pieces = layout.pieces(start, stop)
        mine = _gathered(grads, pieces)
        total = None
        for r in range(self.world):
            x = mine if r == self.rank else parts[(c, r)][1]
            total = x.copy() if total is None else np.add(total, x, out=total)
        np.divide(total, total.dtype.type(self.world), out=total)
        _scatter(total, outs, pieces)
        await asyncio.gather(
            *(
                conn.send(Kind.AGGREGATE, total, key=base + c, clock=clock, dtype=wire, priority=bucket.priority)
                for conn in self._peers.values()
            )
        )
        return total.nbytes * len(self._peers)

    async def _ring(self, bucket, clock, layout, ring, grads, outs, dtype, wire) -> SyncResult:
        P, r, steps = self.world, self.rank, self.world - 1
        if len(ring) * steps > CHUNKS_PER_LAYER:
            raise ConfigError(f"bucket {bucket.label} makes {len(ring)} chunks of {P} slices; raise the chunk size")
        prev = (r - 1) % P
        base = bucket.layers[0] * CHUNKS_PER_LAYER
        # Every receive registered before anything is sent (see _sync). At step s rank r gets
        # slice r - s - 1 (reduce-scatter) and slice r - s (all-gather) from rank r - 1.
        parts, gathers = {}, {}
        for c, slices in enumerate(ring):
            for s in range(steps):
                start, stop = slices[(r - s - 1) % P]
                buf = self._take((stop - start,), dtype)
                parts[(c, s)] = (self._peers[prev].expect(Kind.PUSH, base + c * steps + s, clock, into=buf), buf)
                start, stop = slices[(r - s) % P]
                into, pieces = self._landing(layout, outs, start, stop, dtype)
                gathers[(c, s)] = (
                    self._peers[prev].expect(Kind.AGGREGATE, base + c * steps + s, clock, into=into),
                    into,
                    pieces,
                )
        walks = [
            asyncio.ensure_future(self._walk(bucket, clock, layout, slices, c, grads, outs, parts, gathers, wire))
            for c, slices in enumerate(ring)
        ]
        for walk in walks:  # the first failure is raised; the others' (the same cause) are not news
            walk.add_done_callback(silence)
        try:
            sent = sum(await asyncio.gather(*walks))
        except BaseException:
            for fut in (*walks, *(f for f, *_ in (*parts.values(), *gathers.values()))):
                fut.cancel()
            raise
        # Sent payloads are not copied (Connection.send): a buffer goes back to the pool only
        # once the peer surely has it. A reduce-scatter part has reached rank + 1 when every
        # all-gather step of its chunk is back here (its sum went on round the ring); what this
        # rank sent in the all-gather has no such echo, so those buffers are left to the collector.
        received = 0
        for (c, s), (_, buf) in parts.items():
            received += buf.nbytes
            if s < steps - 1:
                self._give(buf)
        for (c, s), (_, into, pieces) in gathers.items():
            received += into.nbytes
            if pieces is not None and s == steps - 1:
                self._give(into)
        return SyncResult(sent, received)

    async def _walk(self, bucket, clock, layout, slices, c, grads, outs, parts, gathers, wire) -> int:
        """Chunk ``c`` of every slice round the ring: reduce-scatter, then all-gather; returns the
        bytes this rank sent."""
        P, r, steps = self.world, self.rank, self.world - 1
        nxt, prev = self._peers[(r + 1) % P], (r - 1) % P
        base = bucket.layers[0] * CHUNKS_PER_LAYER + c * steps
        start, stop = slices[r]
        await nxt.send(
            Kind.PUSH,
            [grads[i][lo:hi] for i, lo, hi in layout.pieces(start, stop)],
            key=base,
            clock=clock,
            dtype=wire,
            priority=bucket.priority,
        )
        sent = (stop - start) * grads[0].itemsize
        for s in range(steps):
            fut, acc = parts[(c, s)]
            await self._bounded(
                fut, bucket, clock, f"reduce-scatter step {s} of chunk {c} from rank {self._ranks[prev]}"
            )
            _add_into(acc, grads, layout.pieces(*slices[(r - s - 1) % P]))
            if s < steps - 1:
                await nxt.send(Kind.PUSH, acc, key=base + s + 1, clock=clock, dtype=wire, priority=bucket.priority)
                sent += acc.nbytes
        # acc is now the sum of slice r + 1's chunk c over every rank: this rank owns it.
        np.divide(acc, acc.dtype.type(P), out=acc)
        _scatter(acc, outs, layout.pieces(*slices[(r + 1) % P]))
        await nxt.send(Kind.AGGREGATE, acc, key=base, clock=clock, dtype=wire, priority=bucket.priority)
        sent += acc.nbytes
        for s in range(steps):
            fut, into, pieces = gathers[(c, s)]
            await self._bounded(fut, bucket, clock, f"all-gather step {s} of chunk {c} from rank {self._ranks[prev]}")
            if pieces is not None:  # a chunk across arrays: scatter it
                _scatter(into, outs, pieces)
            if s < steps - 1:
                await nxt.send(
                    Kind.AGGREGATE, into, key=base + s + 1, clock=clock, dtype=wire, priority=bucket.priority
                )
                sent += into.nbytes
        return sent

    def _landing(self, layout: _Layout, outs: list, start: int, stop: int, dtype):
        """Where a reduced chunk is received: straight into the out array when it lies in one,
        else a buffer scattered afterwards (returned with its pieces)."""
        pieces = layout.pieces(start, stop)
        if len(pieces) == 1:
            i, lo, hi = pieces[0]
            view = outs[i][lo:hi]
            if view.flags.c_contiguous and not byte_view(view).readonly:
                return view, None
        else:  # the arrays back to back in memory (the trainer's results): one view over them
            span = spanning([outs[i][lo:hi] for i, lo, hi in pieces])
            if span is not None and span.dtype == dtype:
                return span, None
        return self._take((stop - start,), dtype), pieces

    def _take(self, shape: tuple, dtype) -> np.ndarray:
        free = self._free.get((shape, dtype))
        return free.pop() if free else np.empty(shape, dtype=dtype)

    def _give(self, buf: np.ndarray) -> None:
        # Receive buffers are reused step after step: fresh ones cost a page fault per 4 KiB.
        pool = self._free.setdefault((buf.shape, buf.dtype), [])
        if len(pool) < 4 * self.world:
            pool.append(buf)

    async def _bounded(self, aw, bucket: Bucket, clock: int, what: str, waits: Sequence[tuple] = ()):
        """``await aw`` within the sync timeout; ``waits``: ``[(rank, future)]`` it waits on, so the
        error names the ranks that never sent (a wait cancelled by the timeout did not arrive)."""
        try:
            return await asyncio.wait_for(aw, self._timeout)
        except TimeoutError:
            late = sorted({self._ranks[q] for q, fut in waits if fut.cancelled() or not fut.done()})
            who = f" from rank(s) {late}" if late else ""
            raise SyncTimeout(
                f"rank {self._ranks[self.rank]}: all-reduce of {bucket.label} at clock {clock}: {what}{who} "
                f"did not arrive within {self._timeout} s; a worker may be dead or stalled"
            ) from None
