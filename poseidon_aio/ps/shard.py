"""A key-value shard of the parameter server: coroutines on the hosting process's event loop.

Per message (one or more key-value pairs, see the information book) and clock the shard keeps one
receive slot per worker; pushes are written into their slot by the kernel (the connection's
allocate hook). When every expected worker is in, it finalizes: the mean over the contributors,
summed in rank order — bitwise the same whatever order the pushes arrived in — and sends it to
every worker (AGGREGATE), or applies SGD and sends parameters (PARAMS) when the shard owns the
optimizer. Clocks of one message finalize in order, so SSP's bound holds on every worker.

Straggler dropping, stall reports, dead-worker reports and checkpoints live here too; what a worker
sees of them arrives as CONTROL frames (JSON) before the data they concern.
"""

from __future__ import annotations

import asyncio
import json
import logging
import statistics
import sys
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from ..cluster.book import InformationBook, Message
from ..errors import RemoteProtocolError
from ..net import Endpoint
from ..wire import DType, Frame, Header, Kind
from . import checkpoint
from .config import PSConfig

log = logging.getLogger("poseidon_aio.ps")

WIRE_DTYPE = {"float32": DType.FLOAT32, "float64": DType.FLOAT64, "float16": DType.FLOAT16}
# Reductions over more than this many bytes run on a worker thread (NumPy releases the GIL), so the
# loop keeps receiving other keys' pushes meanwhile; below it a thread hop costs more than the sum.
_OFFLOAD_BYTES = 8 << 20


@dataclass
class ShardStats:
    finalized: int = 0
    late_discarded: int = 0
    dropped: dict = field(default_factory=dict)  # rank -> times dropped
    bytes_in: int = 0
    bytes_out: int = 0
    remote_bytes_in: int = 0  # payload bytes that crossed a network (not the in-process link)
    remote_bytes_out: int = 0
    checkpoints: list = field(default_factory=list)


class _Pending:
    __slots__ = ("slots", "have", "landing", "first_at", "timers", "deadline_passed")

    def __init__(self, slots: np.ndarray) -> None:
        self.slots = slots
        self.have: set = set()
        self.landing: set = set()
        self.first_at = 0.0
        self.timers: list = []
        self.deadline_passed = False


def reduce_mean(slots: np.ndarray, contributors: list, out: Optional[np.ndarray] = None) -> np.ndarray:
    """Mean of ``slots[r]`` over ``contributors``, summed in the given (sorted) order.

    The order is fixed, so the result's bits do not depend on which push arrived first.
    """
    if out is None:
        out = slots[contributors[0]].copy()
    else:
        np.copyto(out, slots[contributors[0]])
    for r in contributors[1:]:
        np.add(out, slots[r], out=out)
    if len(contributors) > 1:
        np.divide(out, out.dtype.type(len(contributors)), out=out)
    return out


class _ReplyBuffers:
    """Reply buffers reused across clocks once no send still reads them.

    A reply is sent to every worker straight from its buffer, and the transport may hold the
    buffer until the kernel has taken the bytes; we cannot be told when. A buffer only the pool
    still references (CPython's reference count) is free. Fresh buffers instead would cost a page fault, and the kernel zeroing a page, per 4 KiB
    of every reply: 16 MiB per shard per step of a 64 MiB model on 4 workers.
    """

    def __init__(self) -> None:
        self._free: dict = {}

    def take(self, mid: int, numel: int, dtype: np.dtype) -> np.ndarray:
        pool = self._free.setdefault(mid, [])
        for i in range(len(pool)):
            if sys.getrefcount(pool[i]) == 2:  # the list and getrefcount's argument
                return pool[i]
        buf = np.empty(numel, dtype=dtype)
        if len(pool) < 4:
            pool.append(buf)
        return buf


class KVShard:
    """Shard ``index`` of ``book``: accumulates pushes, finalizes, replies.

    Args:
        index: shard number (0 .. P2-1).
        book: the job's :class:`InformationBook`.
        config: :class:`PSConfig`.
        start_clock: first clock to expect (a restarted job's resume clock).
        state: arrays from a checkpoint (server-side SGD), or ``None``.
    """

    def __init__(
        self,
        index: int,
        book: InformationBook,
        config: PSConfig,
        *,
        start_clock: int = 0,
        state: Optional[dict] = None,
    ) -> None:
        self.index = index
        self.book = book
        self.config = config
        self.workers = book.workers
        self.stats = ShardStats()
        self._messages = {m.id: m for m in book.messages_of_shard(index)}
        self._dtype = {m.id: np.dtype(m.dtype) for m in self._messages.values()}
        self._numel = {m.id: m.nbytes // self._dtype[m.id].itemsize for m in self._messages.values()}
        self._conns: dict = {}
        self._ever: set = set()
        self._all_left = asyncio.Event()
        self._departed: dict = {}
        self._outbox: dict = {}
        self._pending: dict = {}
        self._free_slots: dict = {}
        self._replies = _ReplyBuffers()
        self._factors: dict = {}
        self._factored = {}
        for layer in book.factored:
            found = book.factored_layer(book.messages_of_params(layer)[0].id)
            if found and found[1][0].shard == index:
                self._factored[found[1][0].id] = found
        self._finalized = {mid: start_clock - 1 for mid in self._messages}
        self._busy: set = set()
        self._params: dict = {}
        self._momentum: dict = {}
        self._init: dict = {}
        self._pullers: dict = {}
        self._lags: deque = deque(maxlen=64)
        self._snapshots: dict = {}
        self._tasks: set = set()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"poseidon-shard{index}")
        self._loop = asyncio.get_running_loop()
        self._closed = False
        self._quorum = config.stragglers.quorum_of(self.workers)
        if state is not None:
            for mid in self._messages:
                self._params[mid] = state[f"w{mid}"].astype(self._dtype[mid], copy=True)
                self._momentum[mid] = state[f"v{mid}"].astype(self._dtype[mid], copy=True)

    # -- connections ------------------------------------------------------------------------

    def attach(self, conn: Endpoint) -> None:
        """Serve a worker's authenticated connection (the listener's ``on_connection``)."""
        rank = conn.peer_rank
        if not 0 <= rank < self.workers:
            conn.fail(RemoteProtocolError(f"rank {rank} is not a worker of this job (P1={self.workers})"))
            return
        old = self._conns.get(rank)
        if old is not None and old.is_open:
            conn.fail(RemoteProtocolError(f"rank {rank} is already connected to shard {self.index}"))
            return
        self._conns[rank] = conn
        self._ever.add(rank)
        conn.set_handler(
            lambda f: self._on_frame(conn, f),
            allocate=lambda h: self._allocate(conn, h),
            limit=lambda h: self._limit(conn, h),
        )
        conn.on_close(self._on_lost)
        for frames in self._outbox.pop(rank, []):
            self._deliver(rank, frames)

    def _on_lost(self, conn: Endpoint) -> None:
        rank = conn.peer_rank
        if self._conns.get(rank) is conn:
            del self._conns[rank]
        if len(self._ever) == self.workers and not self._conns:
            self._all_left.set()
        if self._closed or self.config.stragglers.enabled:
            return
        self._departed[rank] = (
            f"rank {rank} left the job: shard {self.index} lost its connection to it ({conn.error}); "
            "restart the job from the last checkpoint, or enable straggler dropping to go on without it"
        )
        if any(rank not in p.have for p in self._pending.values()):
            self._report_departed(rank, range(self.workers))

    def _report_departed(self, rank: int, to) -> None:
        reason = self._departed[rank]
        log.error("shard %d: %s", self.index, reason)
        for r in to:
            if r != rank:
                self._send(r, [self._notice("failed", reason=reason, rank=rank)])

    @property
    def joined(self) -> set:
        """Worker ranks that have connected at least once."""
        return set(self._ever)

    async def wait_all_joined(self) -> None:
        while len(self._ever) < self.workers:
            await asyncio.sleep(0.05)

    async def wait_all_left(self) -> None:
        """Return once every worker has connected and every connection has ended."""
        await self._all_left.wait()

    async def close(self) -> None:
        self._closed = True
        for p in self._pending.values():
            for timer in p.timers:
                timer.cancel()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self._pool.shutdown(wait=True)

    # -- receive ----------------------------------------------------------------------------

    def _limit(self, conn: Endpoint, header: Header) -> Optional[int]:
        # A push, pull or parameter frame carries exactly its message: refuse any other size when
        # the header arrives, before a peer with a different model makes us receive the payload.
        if header.kind in (Kind.PUSH, Kind.PARAMS, Kind.PULL):
            return self._message(conn.peer_rank, header).nbytes
        return None  # factors: K rows, judged once received; other kinds: _on_frame refuses them

    def _allocate(self, conn: Endpoint, header: Header):
        if header.kind is not Kind.PUSH:
            return None
        mid, clock = header.key, header.clock
        if mid not in self._messages or header.length != self._messages[mid].nbytes:
            return None
        if clock <= self._finalized[mid]:
            return None
        p = self._pending_for(mid, clock)
        rank = conn.peer_rank
        if rank in p.have or rank in p.landing:
            return None
        p.landing.add(rank)
        return p.slots[rank]

    def _pending_for(self, mid: int, clock: int) -> _Pending:
        p = self._pending.get((mid, clock))
        if p is None:
            # Receive slots are reused clock after clock: fresh ones would cost a page fault (and
            # the kernel zeroing the page) per 4 KiB received, ~80 MiB per process per step.
            free = self._free_slots.get(mid)
            slots = free.pop() if free else np.empty((self.workers, self._numel[mid]), dtype=self._dtype[mid])
            p = self._pending[(mid, clock)] = _Pending(slots)
        return p

    def _on_frame(self, conn: Endpoint, frame: Frame) -> None:
        kind = frame.kind
        if kind is Kind.PUSH:
            self._on_push(conn.peer_rank, frame, conn.is_local)
        elif kind is Kind.PULL:
            self._on_pull(conn.peer_rank, frame)
        elif kind is Kind.PARAMS:
            self._on_initial_params(conn.peer_rank, frame)
        elif kind is Kind.FACTORS:
            self._on_factors(conn.peer_rank, frame, conn.is_local)
        else:
            raise RemoteProtocolError(f"shard {self.index} got an unexpected {kind.name} frame from rank {conn.peer_rank}")

    def _message(self, rank: int, header: Header) -> Message:
        m = self._messages.get(header.key)
        if m is None:
            raise RemoteProtocolError(
                f"rank {rank} sent {header.kind.name} for message {header.key} at clock {header.clock} to "
                f"shard {self.index}, which does not hold it: the ranks' information books differ"
            )
        if header.length and (header.length != m.nbytes or header.dtype != WIRE_DTYPE[m.dtype]):
            raise RemoteProtocolError(
                f"rank {rank} sent {header.length} bytes of {header.dtype.name} for message "
                f"{m.id} ({self._describe(m)}) at clock {header.clock}; shard {self.index} expects "
                f"{m.nbytes} bytes of {m.dtype}: the ranks' parameter shapes differ"
            )
        return m

    def _on_push(self, rank: int, frame: Frame, local: bool = False) -> None:
        m = self._message(rank, frame.header)
        mid, clock = m.id, frame.clock
        self.stats.bytes_in += frame.header.length
        if not local:
            self.stats.remote_bytes_in += frame.header.length
        if clock <= self._finalized[mid]:
            self.stats.late_discarded += 1
            log.info("shard %d: discarded rank %d's late push of message %d at clock %d", self.index, rank, mid, clock)
            return
        p = self._pending_for(mid, clock)
        if rank in p.have:
            raise RemoteProtocolError(f"rank {rank} pushed message {mid} twice at clock {clock}")
        for gone in self._departed:
            if gone not in p.have:  # BSP cannot finalize without it: say so now, not at the timeout
                self._report_departed(gone, [rank])
        if rank not in p.landing:
            p.slots[rank] = np.frombuffer(frame.payload, dtype=self._dtype[mid])
        p.landing.discard(rank)
        p.have.add(rank)
        now = self._loop.time()
        if len(p.have) == 1:
            p.first_at = now
            self._arm_timers(mid, clock, p)
        if len(p.have) == self.workers:
            self._lags.append(now - p.first_at)
        self._advance(mid)

    def _arm_timers(self, mid: int, clock: int, p: _Pending) -> None:
        policy = self.config.stragglers
        if policy.enabled:
            if policy.deadline == "adaptive":
                spread = statistics.quantiles(self._lags, n=10)[-1] if len(self._lags) >= 2 else policy.min_deadline
                deadline = min(policy.max_deadline, max(policy.min_deadline, policy.factor * spread))
            else:
                deadline = float(policy.deadline)
            p.timers.append(self._loop.call_later(deadline, self._deadline_passed, mid, clock))
        p.timers.append(self._loop.call_later(self.config.sync_timeout / 2, self._stalled, mid, clock))

    def _deadline_passed(self, mid: int, clock: int) -> None:
        p = self._pending.get((mid, clock))
        if p is not None:
            p.deadline_passed = True
            self._advance(mid)

    def _stalled(self, mid: int, clock: int) -> None:
        p = self._pending.get((mid, clock))
        if p is None:
            return
        missing = sorted(set(range(self.workers)) - p.have)
        waited = self._loop.time() - p.first_at
        log.warning(
            "shard %d: message %d (%s) at clock %d has waited %.0f s for ranks %s",
            self.index, mid, self._describe(self._messages[mid]), clock, waited, missing,
        )
        for r in p.have:
            self._send(r, [self._notice("stalled", message=mid, clock=clock, waiting_for=missing, waited=round(waited, 1))])

    # -- the Project-Adam scheme: factors in, full matrices out -----------------------------

    def _on_factors(self, rank: int, frame: Frame, local: bool) -> None:
        layer = self._factored.get(frame.key)
        if layer is None:
            raise RemoteProtocolError(
                f"rank {rank} sent factors for message {frame.key} at clock {frame.clock} to shard {self.index}, "
                "which rebuilds no layer there: the ranks' information books differ"
            )
        params, messages = layer
        m, n = self.book.manifest[params[0]].shape
        floats = frame.header.length // 4
        if frame.header.dtype is not DType.FLOAT32 or floats % (m + n):
            raise RemoteProtocolError(
                f"rank {rank} sent {frame.header.length} bytes of factors for {self.book.manifest[params[0]].name} "
                f"({m}x{n}) at clock {frame.clock}: not K rows of {m}+{n} float32"
            )
        if not local:
            self.stats.remote_bytes_in += frame.header.length
        self.stats.bytes_in += frame.header.length
        k = floats // (m + n)
        arr = np.frombuffer(frame.payload, dtype=np.float32)
        got = self._factors.setdefault((frame.key, frame.clock), {})
        if rank in got:
            raise RemoteProtocolError(f"rank {rank} sent factors for message {frame.key} twice at clock {frame.clock}")
        got[rank] = (arr[: k * m].reshape(k, m).copy(), arr[k * m :].reshape(k, n).copy())
        if len(got) == self.workers:
            del self._factors[(frame.key, frame.clock)]
            self._track(self._rebuild(params, messages, frame.clock, got))

    async def _rebuild(self, params: tuple, messages: tuple, clock: int, got: dict) -> None:
        """Sum u_p^T v_p in rank order with one GEMM, then reply every message of the layer."""
        us = np.concatenate([got[r][0] for r in range(self.workers)])
        vs = np.concatenate([got[r][1] for r in range(self.workers)])

        def gemm():
            scale = np.float32(1.0 / self.workers)
            weight = (us.T @ vs) * scale
            bias = us.sum(axis=0) * scale
            return [weight.reshape(-1), bias]

        flat = await self._loop.run_in_executor(self._pool, gemm)
        values = {params[i]: flat[i] for i in range(len(params))}
        for msg in messages:
            parts = self.book.slices(msg, values)
            payload = np.concatenate(parts) if len(parts) > 1 else parts[0]
            self._finalized[msg.id] = clock
            self.stats.finalized += 1
            for r in range(self.workers):
                self._send(r, [(Kind.AGGREGATE, payload, msg.id, clock, WIRE_DTYPE[msg.dtype])])

    # -- finalize ---------------------------------------------------------------------------

    def _advance(self, mid: int) -> None:
        if mid in self._busy or self._closed:
            return
        clock = self._finalized[mid] + 1
        p = self._pending.get((mid, clock))
        if p is None:
            return
        if len(p.have) == self.workers:
            contributors = list(range(self.workers))
        elif p.deadline_passed and len(p.have) >= self._quorum:
            contributors = sorted(p.have)
        else:
            return
        self._init.pop((mid, clock), None)  # every worker pulled its start-up values before pushing
        self._busy.add(mid)
        del self._pending[(mid, clock)]
        for timer in p.timers:
            timer.cancel()
        self._track(self._finalize(mid, clock, p, contributors))

    async def _finalize(self, mid: int, clock: int, p: _Pending, contributors: list) -> None:
        m = self._messages[mid]
        try:
            if m.nbytes > _OFFLOAD_BYTES:
                out = self._replies.take(mid, self._numel[mid], self._dtype[mid])
                mean = await self._loop.run_in_executor(self._pool, reduce_mean, p.slots, contributors, out)
            else:
                mean = reduce_mean(p.slots, contributors, self._replies.take(mid, self._numel[mid], self._dtype[mid]))
            if not p.landing:  # no late frame is still being written into these slots
                self._free_slots.setdefault(mid, []).append(p.slots)
            dropped = sorted(set(range(self.workers)) - set(contributors))
            for r in dropped:
                self.stats.dropped[r] = self.stats.dropped.get(r, 0) + 1
            if dropped:
                log.warning("shard %d: message %d at clock %d finalized without ranks %s", self.index, mid, clock, dropped)
            sgd = self.config.server_sgd
            if sgd is not None:
                payload, kind, reply_clock = self._apply_sgd(mid, mean, sgd), Kind.PARAMS, clock + 1
            else:
                payload, kind, reply_clock = mean, Kind.AGGREGATE, clock
            self._finalized[mid] = clock
            self.stats.finalized += 1
            notice = [self._notice("dropped", message=mid, clock=clock, ranks=dropped)] if dropped else []
            data = (kind, payload, mid, reply_clock, WIRE_DTYPE[m.dtype])
            for r in range(self.workers):
                self._send(r, [*notice, data])
            if sgd is not None:
                self._maybe_checkpoint(mid, clock + 1)
                self._answer_pullers(mid, clock + 1)
        finally:
            self._busy.discard(mid)
        self._advance(mid)

    def _apply_sgd(self, mid: int, grad: np.ndarray, sgd) -> np.ndarray:
        w = self._params.get(mid)
        if w is None:
            raise RemoteProtocolError(
                f"shard {self.index} has no parameters for message {mid}: with server-side SGD, "
                "rank 0 must broadcast the initial parameters (PSClient.broadcast) before the first push"
            )
        v = self._momentum[mid]
        if sgd.weight_decay:
            grad = grad + w.dtype.type(sgd.weight_decay) * w
        if sgd.momentum:
            np.multiply(v, v.dtype.type(sgd.momentum), out=v)
            np.add(v, grad, out=v)
            step = v
        else:
            step = grad
        np.subtract(w, w.dtype.type(sgd.lr) * step, out=w)
        return w.copy()  # the send keeps reading it; the next clock updates w in place

    # -- parameters: start-up broadcast and pulls -------------------------------------------

    def _on_initial_params(self, rank: int, frame: Frame) -> None:
        m = self._message(rank, frame.header)
        values = np.frombuffer(frame.payload, dtype=self._dtype[m.id]).copy()
        self._init[(m.id, frame.clock)] = values
        if self.config.server_sgd is not None:
            self._params[m.id] = values.copy()
            self._momentum[m.id] = np.zeros_like(values)
            self._finalized[m.id] = frame.clock - 1
        self._answer_pullers(m.id, frame.clock)

    def _on_pull(self, rank: int, frame: Frame) -> None:
        m = self._message(rank, frame.header)
        self._pullers.setdefault((m.id, frame.clock), set()).add(rank)
        self._answer_pullers(m.id, frame.clock)

    def _answer_pullers(self, mid: int, clock: int) -> None:
        ranks = self._pullers.get((mid, clock))
        if not ranks:
            return
        values = self._init.get((mid, clock))
        if values is None and mid in self._params and self._finalized[mid] == clock - 1:
            values = self._params[mid].copy()
        if values is None:
            return
        m = self._messages[mid]
        for r in sorted(ranks):
            self._send(r, [(Kind.PARAMS, values, mid, clock, WIRE_DTYPE[m.dtype])])
        del self._pullers[(mid, clock)]

    # -- checkpoints ------------------------------------------------------------------------

    def _maybe_checkpoint(self, mid: int, version: int) -> None:
        every = self.config.checkpoint_every
        if not every or version % every:
            return
        snap = self._snapshots.setdefault(version, {})
        snap[f"w{mid}"] = self._params[mid].copy()
        snap[f"v{mid}"] = self._momentum[mid].copy()
        if len(snap) == 2 * len(self._messages):
            del self._snapshots[version]
            self._track(self._write_checkpoint(version, snap))

    async def _write_checkpoint(self, version: int, arrays: dict) -> None:
        root, digest = self.config.checkpoint_dir, self.book.digest()
        await self._loop.run_in_executor(self._pool, checkpoint.write, root, self.index, version, digest, arrays)
        self.stats.checkpoints.append(version)
        log.info("shard %d: checkpoint at clock %d written", self.index, version)

    # -- send -------------------------------------------------------------------------------

    def _notice(self, kind: str, **fields) -> tuple:
        body = json.dumps({"type": kind, "shard": self.index, **fields}).encode()
        return (Kind.CONTROL, body, 0, 0, DType.JSON)

    def _send(self, rank: int, frames: list) -> None:
        if rank in self._conns:
            self._deliver(rank, frames)
        else:
            self._outbox.setdefault(rank, []).append(frames)

    def _deliver(self, rank: int, frames: list) -> None:
        conn = self._conns[rank]

        async def deliver():
            for kind, payload, key, clock, dtype in frames:
                await conn.send(kind, payload, key=key, clock=clock, dtype=dtype)
                if kind is not Kind.CONTROL:
                    nbytes = len(payload) if isinstance(payload, bytes) else payload.nbytes
                    self.stats.bytes_out += nbytes
                    if not conn.is_local:
                        self.stats.remote_bytes_out += nbytes

        self._track(deliver())

    def _track(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None and not self._closed:
            # A send to a lost connection is already reported by that connection.
            level = logging.DEBUG if isinstance(exc, ConnectionError) else logging.ERROR
            log.log(level, "shard %d: %s", self.index, exc, exc_info=level == logging.ERROR)

    def _describe(self, m: Message) -> str:
        names = sorted({self.book.manifest[self.book.pairs[k].param].name for k in m.keys})
        return f"keys {list(m.keys)} of {', '.join(names)}"

    def pending_ranks(self) -> dict:
        """``{(message, clock): ranks still missing}``: what the shard is waiting for."""
        return {key: sorted(set(range(self.workers)) - p.have) for key, p in self._pending.items()}
