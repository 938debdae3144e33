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

from ..errors import ConfigError, ConnectionLost, SyncTimeout
from ..net.core import Landing
from ..plan.cost import ALLREDUCE_ALGORITHMS, Scheme, goes_round_ring
from ..wire import Kind, byte_view
from ..wire.spans import spanning
from .bucket import Bucket
from .slices import CHUNKS_PER_LAYER, Layout, add_into, flat_arrays, gathered, layout_of, scatter
from .syncer import SyncContext, Syncer, SyncResult


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

    def start(self, bucket: Bucket, clock: int) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        try:
            grads, outs, dtype, wire = flat_arrays(bucket)
            if self.world == 1:
                for g, o in zip(grads, outs):
                    np.copyto(o, g)
                done = loop.create_future()
                done.set_result(SyncResult())
                return done
            layout = self._layout(bucket, dtype.itemsize)
            if goes_round_ring(sum(g.nbytes for g in grads), self.world, self.algorithm):
                ring = layout.ring_chunks(max(1, self._chunk_bytes // dtype.itemsize))
                if ring is not None:
                    return _Ring(self, bucket, clock, layout, ring, grads, outs, dtype, wire).start()
            return _Direct(self, bucket, clock, layout, grads, outs, dtype, wire).start()
        except Exception as exc:  # noqa: BLE001 - the sync's future says it, as a task's would
            failed = loop.create_future()
            failed.set_exception(exc)
            return failed

    def _layout(self, bucket: Bucket, itemsize: int) -> Layout:
        return layout_of(self._layouts, bucket, self.world, self._chunk_bytes, itemsize)

    def _timeout_error(self, bucket: Bucket, clock: int, what: str, late: Sequence[int]) -> SyncTimeout:
        who = f" from rank(s) {sorted({self._ranks[q] for q in late})}" if late else ""
        return SyncTimeout(
            f"rank {self._ranks[self.rank]}: all-reduce of {bucket.label} at clock {clock}: {what}{who} "
            f"did not arrive within {self._timeout} s; a worker may be dead or stalled"
        )

    def _landing(self, layout: Layout, outs: list, start: int, stop: int, dtype):
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


class _InFlight:
    """One all-reduce in flight, driven by callbacks as the PS client's pushes are: a frame goes
    out at once where it can (``try_send``; else a send task), each receive is a
    :class:`~poseidon_aio.net.receive.Landing` whose arrival runs the next piece of work on the
    receive path (a chunk summed and sent on, or landed), the sync's future is settled when
    nothing is left, and one timer bounds the whole. A task and a ``wait_for`` per chunk and step
    cost the loop more than a small bucket's bytes take to move, and a future's callbacks a pass of
    the loop each."""

    __slots__ = (
        "syncer",
        "bucket",
        "clock",
        "layout",
        "grads",
        "outs",
        "dtype",
        "wire",
        "base",
        "future",
        "parts",
        "gathers",
        "left",
        "tasks",
        "timer",
        "sent",
    )

    def __init__(self, syncer: AllReduceSyncer, bucket: Bucket, clock: int, layout, grads, outs, dtype, wire) -> None:
        self.syncer, self.bucket, self.clock, self.layout = syncer, bucket, clock, layout
        self.grads, self.outs, self.dtype, self.wire = grads, outs, dtype, wire
        self.base = bucket.layers[0] * CHUNKS_PER_LAYER
        self.future = asyncio.get_running_loop().create_future()
        self.parts: dict = {}  # -> (Landing, buffer): the parts this rank sums
        self.gathers: dict = {}  # -> (Landing, into, pieces): the means this rank lands
        # Pieces of work not yet done (each subclass's), plus sends under way, plus one while
        # start() registers them: a frame already in the inbox lands inside expect().
        self.left = 1
        self.tasks: list = []
        self.timer = None
        self.sent = 0

    def _armed(self) -> asyncio.Future:
        self.future.add_done_callback(self._ended)
        self._count_down()  # start()'s own: settled here where nothing was left to move
        if not self.future.done():
            self.timer = self.future.get_loop().call_later(self.syncer._timeout, self._timed_out)
        return self.future

    def _send(self, conn, kind: Kind, payload, key: int, nbytes: int) -> None:
        if self.future.done():
            return
        self.sent += nbytes
        priority = self.bucket.priority
        try:
            if conn.try_send(kind, payload, key=key, clock=self.clock, dtype=self.wire, priority=priority):
                return
        except Exception as exc:  # noqa: BLE001 - a lost link: the sync's future says so
            self._fail(exc)
            return
        task = asyncio.ensure_future(
            conn.send(kind, payload, key=key, clock=self.clock, dtype=self.wire, priority=priority)
        )
        self.tasks.append(task)
        self.left += 1
        task.add_done_callback(self._sent)

    def _sent(self, task: asyncio.Future) -> None:
        if not self._failed(task):
            self._count_down()

    def _count_down(self) -> None:
        self.left -= 1
        if not self.left and not self.future.done():
            self.future.set_result(SyncResult(self.sent, self._received()))

    def _landed(self, todo: tuple, frame, exc) -> None:
        """A receive's callback (``Landing(self._landed, (work, tag))``): ``work(tag)`` runs as
        it lands. Each landing is stored before ``expect`` registers it, as a frame already in the
        inbox lands inside ``expect``."""
        # On the receive path (or in expect): nothing may escape to the link that delivered it.
        if self.future.done():
            return
        if exc is not None:
            self._fail(exc)
            return
        work, tag = todo
        try:
            work(tag)
        except Exception as exc:  # noqa: BLE001 - a bug here must end the sync, not leave it to time out
            self._fail(exc)

    def _failed(self, fut: asyncio.Future) -> bool:
        """Whether the sync is over (settled before, or ended now by send task ``fut``'s failure)."""
        exc = None if fut.cancelled() else fut.exception()  # retrieved, even where it is no news
        if self.future.done():
            return True
        if fut.cancelled():
            me = self.syncer._ranks[self.syncer.rank]
            self._fail(
                ConnectionLost(f"rank {me}: all-reduce of {self.bucket.label} at clock {self.clock} was given up")
            )
            return True
        if exc is not None:
            self._fail(exc)
            return True
        return False

    def _fail(self, exc: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(exc)

    def _ended(self, fut: asyncio.Future) -> None:
        # Settled, failed or given up: nothing of this sync is waited for any more.
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        for wait in self._waits():
            if not wait.done():
                wait.cancel()
        for task in self.tasks:
            if not task.done():
                task.cancel()

    def _waits(self) -> list:
        return [w for w, _ in self.parts.values()] + [w for w, _, _ in self.gathers.values()]

    def _timed_out(self) -> None:
        self.timer = None
        if not self.future.done():
            self._fail(self._late())

    def _received(self) -> int:
        """Bytes received; the receive buffers no peer can still be writing go back to the pool."""
        raise NotImplementedError

    def _late(self) -> SyncTimeout:
        """The timeout's error: what this rank still waits for, and from whom."""
        raise NotImplementedError


class _Direct(_InFlight):
    """The direct algorithm: every part to its owner at once; an owned chunk summed, and its mean
    sent to every peer, as its last part lands; settled as the last mean from the others lands."""

    __slots__ = ("missing",)

    def start(self) -> asyncio.Future:
        syncer, layout, rank = self.syncer, self.layout, self.syncer.rank
        # parts: (chunk, peer) -> the owned chunks' parts; gathers: chunk -> the others' means
        self.missing: dict = {}  # owned chunk -> its parts not yet in
        # Every receive is registered before anything is sent: a part that beats its expect would
        # be copied once more out of the inbox.
        for c, (owner, start, stop) in enumerate(layout.chunks):
            self.left += 1
            if owner == rank:
                self.missing[c] = len(syncer._peers)
                for q, conn in syncer._peers.items():
                    buf = syncer._take((stop - start,), self.dtype)
                    self.parts[(c, q)] = (landing := Landing(self._landed, (self._part_in, c)), buf)
                    conn.expect(Kind.PUSH, self.base + c, self.clock, into=buf, landing=landing)
            else:
                into, pieces = syncer._landing(layout, self.outs, start, stop, self.dtype)
                self.gathers[c] = (landing := Landing(self._landed, (self._mean_in, c)), into, pieces)
                syncer._peers[owner].expect(Kind.AGGREGATE, self.base + c, self.clock, into=into, landing=landing)
        for c, (owner, start, stop) in enumerate(layout.chunks):
            if owner != rank:
                payload = [self.grads[i][lo:hi] for i, lo, hi in layout.pieces(start, stop)]
                self._send(
                    syncer._peers[owner], Kind.PUSH, payload, self.base + c, (stop - start) * self.dtype.itemsize
                )
        return self._armed()

    def _part_in(self, c: int) -> None:
        self.missing[c] -= 1
        if not self.missing[c]:
            self._reduce(c)

    def _reduce(self, c: int) -> None:
        """Every peer's part of owned chunk ``c`` is in: sum in rank order (the same bits whatever
        order they came in), the mean into the outs and to every peer."""
        syncer = self.syncer
        _, start, stop = self.layout.chunks[c]
        pieces = self.layout.pieces(start, stop)
        mine = gathered(self.grads, pieces)
        total = None
        for r in range(syncer.world):
            x = mine if r == syncer.rank else self.parts[(c, r)][1]
            total = x.copy() if total is None else np.add(total, x, out=total)
        np.divide(total, total.dtype.type(syncer.world), out=total)
        scatter(total, self.outs, pieces)
        for conn in syncer._peers.values():
            self._send(conn, Kind.AGGREGATE, total, self.base + c, total.nbytes)
        self._count_down()

    def _mean_in(self, c: int) -> None:
        _, into, pieces = self.gathers[c]
        if pieces is not None:  # a chunk across arrays: scatter it
            scatter(into, self.outs, pieces)
        self._count_down()

    def _received(self) -> int:
        syncer, received = self.syncer, 0
        for _, into, pieces in self.gathers.values():
            received += into.nbytes
            if pieces is not None:
                syncer._give(into)
        for _, buf in self.parts.values():
            received += buf.nbytes
            syncer._give(buf)
        return received

    def _late(self) -> SyncTimeout:
        late = [q for (_, q), (fut, _) in self.parts.items() if not fut.done()]
        what = "the other ranks' parts"
        if not late:
            late = [self.layout.chunks[c][0] for c, (fut, _, _) in self.gathers.items() if not fut.done()]
            what = "the reduced chunks" if late else "sending its parts"
        return self.syncer._timeout_error(self.bucket, self.clock, what, late)


class _Ring(_InFlight):
    """The ring algorithm: each chunk walks the ring on its own, a step as its part lands: P - 1
    reduce-scatter steps (add this rank's slice, send the sum on), the owner's mean, P - 1
    all-gather steps (land it, send it on); settled as every step of every chunk is done."""

    __slots__ = ("ring",)

    def __init__(self, syncer, bucket, clock, layout, ring, grads, outs, dtype, wire) -> None:
        super().__init__(syncer, bucket, clock, layout, grads, outs, dtype, wire)
        self.ring = ring

    def start(self) -> asyncio.Future:
        syncer, ring = self.syncer, self.ring
        P, r, steps = syncer.world, syncer.rank, syncer.world - 1
        if len(ring) * steps > CHUNKS_PER_LAYER:
            raise ConfigError(
                f"bucket {self.bucket.label} makes {len(ring)} chunks of {P} slices; raise the chunk size"
            )
        prev = syncer._peers[(r - 1) % P]
        # Every receive registered before anything is sent (see _Direct.start). At step s rank r
        # gets slice r - s - 1 (reduce-scatter) and slice r - s (all-gather) from rank r - 1.
        # parts and gathers: (chunk, step) -> that step's reduce-scatter part and all-gather mean.
        # Each is work of its own, whatever the order they land in (a rank that started late sends
        # its sums before its own parts): the walk is done when all of them are.
        for c, slices in enumerate(ring):
            key = self.base + c * steps
            self.left += 2 * steps
            for s in range(steps):
                start, stop = slices[(r - s - 1) % P]
                buf = syncer._take((stop - start,), self.dtype)
                self.parts[(c, s)] = (landing := Landing(self._landed, (self._reduce_step, (c, s))), buf)
                prev.expect(Kind.PUSH, key + s, self.clock, into=buf, landing=landing)
                start, stop = slices[(r - s) % P]
                into, pieces = syncer._landing(self.layout, self.outs, start, stop, self.dtype)
                self.gathers[(c, s)] = (landing := Landing(self._landed, (self._gather_step, (c, s))), into, pieces)
                prev.expect(Kind.AGGREGATE, key + s, self.clock, into=into, landing=landing)
        nxt = syncer._peers[(r + 1) % P]
        for c, slices in enumerate(ring):
            start, stop = slices[r]
            payload = [self.grads[i][lo:hi] for i, lo, hi in self.layout.pieces(start, stop)]
            self._send(nxt, Kind.PUSH, payload, self.base + c * steps, (stop - start) * self.dtype.itemsize)
        return self._armed()

    def _reduce_step(self, at: tuple) -> None:
        c, s = at
        syncer, slices = self.syncer, self.ring[c]
        P, r, steps = syncer.world, syncer.rank, syncer.world - 1
        nxt, key = syncer._peers[(r + 1) % P], self.base + c * steps
        acc = self.parts[at][1]
        add_into(acc, self.grads, self.layout.pieces(*slices[(r - s - 1) % P]))
        if s < steps - 1:
            self._send(nxt, Kind.PUSH, acc, key + s + 1, acc.nbytes)
        else:  # acc is now the sum of slice r + 1's chunk c over every rank: this rank owns it
            np.divide(acc, acc.dtype.type(P), out=acc)
            scatter(acc, self.outs, self.layout.pieces(*slices[(r + 1) % P]))
            self._send(nxt, Kind.AGGREGATE, acc, key, acc.nbytes)
        self._count_down()

    def _gather_step(self, at: tuple) -> None:
        c, s = at
        syncer = self.syncer
        r, steps = syncer.rank, syncer.world - 1
        _, into, pieces = self.gathers[at]
        if pieces is not None:  # a chunk across arrays: scatter it
            scatter(into, self.outs, pieces)
        if s < steps - 1:
            nxt = syncer._peers[(r + 1) % syncer.world]
            self._send(nxt, Kind.AGGREGATE, into, self.base + c * steps + s + 1, into.nbytes)
        self._count_down()

    def _received(self) -> int:
        # Sent payloads are not copied (Connection.send): a buffer goes back to the pool only
        # once the peer surely has it. A reduce-scatter part has reached rank + 1 when every
        # all-gather step of its chunk is back here (its slice's sum, which it went into, came
        # round the ring as that slice's mean, whatever order the steps landed in); what this
        # rank sent in the all-gather has no such echo, so those buffers are left to the collector.
        syncer, steps, received = self.syncer, self.syncer.world - 1, 0
        for (c, s), (_, buf) in self.parts.items():
            received += buf.nbytes
            if s < steps - 1:
                syncer._give(buf)
        for (c, s), (_, into, pieces) in self.gathers.items():
            received += into.nbytes
            if pieces is not None and s == steps - 1:
                syncer._give(into)
        return received

    def _late(self) -> SyncTimeout:
        syncer = self.syncer
        prev = syncer._ranks[(syncer.rank - 1) % syncer.world]
        for phase, waits in (("reduce-scatter", self.parts), ("all-gather", self.gathers)):
            for (c, s), entry in waits.items():
                if not entry[0].done():
                    return syncer._timeout_error(
                        self.bucket, self.clock, f"{phase} step {s} of chunk {c} from rank {prev}", []
                    )
        return syncer._timeout_error(self.bucket, self.clock, "sending its parts", [])
