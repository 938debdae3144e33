"""A key-value shard of the parameter server: coroutines on the hosting process's event loop.

Per message (one or more key-value pairs, see the information book) and clock the shard keeps one
receive slot per worker; pushes are written into their slot by the kernel (the connection's
allocate hook). When every expected worker is in, it finalizes: the mean over the contributors,
summed in rank order (bitwise the same whatever order the pushes arrived in), sent to every
worker (AGGREGATE), or SGD applied and parameters sent (PARAMS) when the shard owns the optimizer.
Project Adam's layers arrive as every worker's sufficient factors (FACTORS), rebuilt with one
GEMM, through the same path: late clocks discarded, deadlines, stall reports, stragglers dropped.
Clocks of one message finalize in order, so SSP's bound holds on every worker.

The pieces: :mod:`.tally` (which pushes each clock holds: the per-push path, compiled where the
codec is), :mod:`.slots` (receive slots, reply buffers), :mod:`.outbox` (what each worker is
owed, bounded), :mod:`.pulls` (parameters served to pulling workers), :mod:`.sgd` (server-side
SGD and its checkpoints), :mod:`.rebuild` (Project Adam). Drops, stalls and failures reach the
workers as CONTROL frames (JSON) before the data they concern.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import statistics
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from ..cluster.book import InformationBook, Message
from ..errors import RemoteProtocolError
from ..net import Endpoint
from ..wire import DTYPE_BY_NAME, DType, Frame, Header, Kind
from ..wire import factors as sufficient_factors
from . import checkpoint, tally
from .config import PSConfig
from .outbox import Outbox
from .rebuild import rebuild
from .sgd import ServerOptimizer
from .pulls import Pulls
from .slots import Pending, ReplyBuffers, SlotPool, reduce_mean

log = logging.getLogger("poseidon_aio.ps")

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
    checkpoints: deque = field(default_factory=lambda: deque(maxlen=64))  # the newest clocks written
    ejected: list = field(default_factory=list)  # ranks ejected for falling behind (at most P1)


class KVShard:
    """Shard ``index`` of ``book``: accumulates pushes, finalizes, replies.

    Args:
        index: shard number (0 .. P2-1).
        book: the job's :class:`InformationBook`.
        config: :class:`PSConfig`.
        start_clock: first clock to expect (a restarted job's resume clock).
        state: the server-side optimizer's arrays (a checkpoint), or ``None``.
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
        # Project Adam: the layers this shard rebuilds, by their first message.
        self._factored = {}
        for layer in book.factored:
            found = book.factored_layer(book.messages_of_params(layer)[0].id)
            if found and found[1][0].shard == index:
                self._factored[found[1][0].id] = found
        self._rebuilt = {m.id for _, messages in self._factored.values() for m in messages}
        # Who pushes each message (every host's speaker where hosts run several workers, else
        # every worker), and how many workers' gradients a push sums.
        self._pushers = {mid: frozenset(book.pushers(mid)) for mid in self._messages}
        self._weight = {mid: self.workers // len(self._pushers[mid]) for mid in self._messages}
        self._conns: dict = {}
        self._ever: set = set()
        self._all_joined = asyncio.Event()
        self._all_left = asyncio.Event()
        self._departed: dict = {}
        self._outboxes = {r: Outbox(r, self._outbox_limit(), self._sent) for r in range(self.workers)}
        self._ejected: dict = {}  # rank -> why
        self._pending: dict = {}
        self._slots = SlotPool(self.workers)
        self._replies = ReplyBuffers()
        self._finalized = {mid: start_clock - 1 for mid in self._messages}
        self._busy: set = set()
        self._sgd = (
            ServerOptimizer(config.server_sgd, index, self._dtype, config.checkpoint_every)
            if config.server_sgd
            else None
        )
        self._pulls = Pulls(self._send, {mid: DTYPE_BY_NAME[m.dtype] for mid, m in self._messages.items()})
        self._lags: deque = deque(maxlen=64)
        self._tasks: set = set()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"poseidon-shard{index}")
        self._loop = asyncio.get_running_loop()
        self._closed = False
        self._quorum = config.stragglers.quorum_of(self.workers)
        self._tally = tally.TALLIES[tally.TALLY](self)
        if state is not None and self._sgd is not None:
            self._sgd.load(state, {mid: self._numel[mid] for mid in self._messages if mid not in self._rebuilt})

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
        if rank in self._ejected:
            conn.fail(RemoteProtocolError(self._ejected[rank]))
            return
        if self.book.topology.by_host:  # its loss then names its host and local rank
            conn.peer_host = f" ({self.book.topology.locate(rank)})"
        self._conns[rank] = conn
        self._ever.add(rank)
        if len(self._ever) == self.workers:
            self._all_joined.set()
        # Partials, not lambdas: the link calls these per frame, and a partial adds no Python frame
        # (the compiled tally's methods none at all).
        hooks = self._tally
        conn.set_handler(
            functools.partial(hooks.on_frame, conn),
            allocate=functools.partial(hooks.allocate, conn),
            limit=functools.partial(hooks.limit, conn),
        )
        conn.on_close(self._on_lost)
        self._outboxes[rank].attach(conn)

    def _on_lost(self, conn: Endpoint) -> None:
        rank = conn.peer_rank
        if self._conns.get(rank) is conn:
            del self._conns[rank]
            self._outboxes[rank].detach()
        if len(self._ever) == self.workers and not self._conns:
            self._all_left.set()
        if self._closed or self.config.stragglers.enabled:
            return
        self._departed[rank] = (
            f"rank {rank}{conn.peer_host} left the job: shard {self.index} lost its connection to it ({conn.error}); "
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
        await self._all_joined.wait()

    async def wait_all_left(self) -> None:
        """Return once every worker has connected and every connection has ended."""
        await self._all_left.wait()

    async def close(self) -> None:
        self._closed = True
        for box in self._outboxes.values():
            await box.close()
        for p in self._pending.values():
            for timer in p.timers:
                timer.cancel()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self._pool.shutdown(wait=True)

    # -- receive: pushes go to the tally (tally.py), the rarer kinds come here ----------------

    def _on_frame(self, conn: Endpoint, frame: Frame) -> None:
        kind = frame.header.kind
        if kind is Kind.FACTORS:
            self._on_factors(conn.peer_rank, frame, conn.is_local)
        elif kind is Kind.PULL:
            self._on_pull(conn.peer_rank, frame)
        elif kind is Kind.PARAMS:
            self._on_initial_params(conn.peer_rank, frame)
        else:
            raise RemoteProtocolError(
                f"shard {self.index} got an unexpected {kind.name} frame from rank {conn.peer_rank}"
            )

    def _message(self, rank: int, header: Header) -> Message:
        m = self._messages.get(header.key)
        if m is None:
            raise RemoteProtocolError(
                f"rank {rank} sent {header.kind.name} for message {header.key} at clock {header.clock} to "
                f"shard {self.index}, which does not hold it: the ranks' information books differ"
            )
        if header.length and (header.length != m.nbytes or header.dtype != DTYPE_BY_NAME[m.dtype]):
            raise RemoteProtocolError(
                f"rank {rank} sent {header.length} bytes of {header.dtype.name} for message "
                f"{m.id} ({self._describe(m)}) at clock {header.clock}; shard {self.index} expects "
                f"{m.nbytes} bytes of {m.dtype}: the ranks' parameter shapes differ"
            )
        return m

    def _refuse_push(self, rank: int, frame: Frame) -> None:
        """Raise why rank ``rank`` may not push this message (the tally found it may not)."""
        m = self._messages[frame.header.key]
        if m.id in self._rebuilt:
            raise RemoteProtocolError(
                f"rank {rank} pushed a gradient for message {m.id} ({self._describe(m)}) at clock {frame.clock}, which "
                f"shard {self.index} rebuilds from sufficient factors: the ranks' scheme plans differ"
            )
        raise RemoteProtocolError(
            f"rank {rank} pushed message {m.id} ({self._describe(m)}) at clock {frame.clock}, which its host's "
            f"local rank {self.book.speaker(m.id)} pushes for the host: the ranks' information books differ"
        )

    def _on_factors(self, rank: int, frame: Frame, local: bool) -> None:
        found = self._factored.get(frame.key)
        if found is None:
            raise RemoteProtocolError(
                f"rank {rank} sent factors for message {frame.key} at clock {frame.clock} to shard {self.index}, "
                "which rebuilds no layer there: the ranks' information books differ"
            )
        params = found[0]
        m, n = self.book.manifest[params[0]].shape
        u, v = sufficient_factors.decode(
            frame, m, n, what=f"{self.book.manifest[params[0]].name} at clock {frame.clock}"
        )
        self.stats.bytes_in += frame.header.length
        if not local:
            self.stats.remote_bytes_in += frame.header.length
        self._tally.arrived(rank, frame.header.key, frame, (u, v))  # views: every frame has a buffer of its own

    def _arm_timers(self, mid: int, clock: int, p: Pending) -> None:
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
        missing = sorted(self._pushers[mid] - p.have)
        waited = self._loop.time() - p.first_at
        what = f"message {mid} ({self._describe(self._messages[mid])}) at clock {clock}"
        log.warning("shard %d: %s has waited %.0f s for ranks %s", self.index, what, waited, missing)
        for r in p.have:
            self._send(
                r, [self._notice("stalled", message=mid, clock=clock, waiting_for=missing, waited=round(waited, 1))]
            )

    # -- finalize ---------------------------------------------------------------------------

    def _advance(self, mid: int) -> None:
        if mid in self._busy or self._closed:
            return
        clock = self._finalized[mid] + 1
        p = self._pending.get((mid, clock))
        if p is None:
            return
        # An ejected worker (straggler policy) is no longer waited for.
        pushers = self._pushers[mid]
        waiting = pushers - p.have - (set(self._ejected) if self.config.stragglers.enabled else set())
        quorum = self._quorum if len(pushers) == self.workers else self.config.stragglers.quorum_of(len(pushers))
        if not waiting or (p.deadline_passed and len(p.have) >= quorum):
            contributors = sorted(p.have)
        else:
            return
        self._pulls.started(mid)  # every worker pulled its start-up values before pushing
        self._busy.add(mid)
        del self._pending[(mid, clock)]
        for timer in p.timers:
            timer.cancel()
        if mid in self._factored or self._messages[mid].nbytes > _OFFLOAD_BYTES:
            self._track(self._finalize(mid, clock, p, contributors))
            return
        self._finalize_now(mid, clock, p, contributors)
        # The next clock may be complete already (SSP); a loop here, not recursion, keeps deep
        # queues of finalized-in-a-row clocks off the stack.
        self._loop.call_soon(self._advance, mid)

    async def _finalize(self, mid: int, clock: int, p: Pending, contributors: list) -> None:
        """Finalize on the shard's thread: a Project-Adam rebuild (a GEMM) or a mean over more than
        ``_OFFLOAD_BYTES`` (NumPy releases the GIL: the loop keeps receiving meanwhile)."""
        try:
            if mid in self._factored:
                params, messages = self._factored[mid]
                rebuilt = await self._loop.run_in_executor(
                    self._pool, rebuild, self.book, params, messages, p.slots, contributors
                )
                replies = [(msg, Kind.AGGREGATE, payload, clock) for msg, payload in rebuilt]
            else:
                out = self._replies.take(mid, self._numel[mid], self._dtype[mid])
                mean = await self._loop.run_in_executor(
                    self._pool, reduce_mean, p.slots, contributors, out, self._weight[mid]
                )
                replies = [(self._messages[mid], *self._reply(mid, clock, p, mean))]
            self._deliver(mid, clock, contributors, replies)
        except RemoteProtocolError as exc:
            self._refused(mid, clock, exc)
        finally:
            self._busy.discard(mid)
        self._advance(mid)

    def _finalize_now(self, mid: int, clock: int, p: Pending, contributors: list) -> None:
        """Finalize a mean small enough to take on the loop (a thread hop costs more than the sum;
        and no task: ~30 messages a step on a small model each saved one)."""
        try:
            out = self._replies.take(mid, self._numel[mid], self._dtype[mid])
            mean = reduce_mean(p.slots, contributors, out, self._weight[mid])
            self._deliver(mid, clock, contributors, [(self._messages[mid], *self._reply(mid, clock, p, mean))])
        except RemoteProtocolError as exc:
            self._refused(mid, clock, exc)
        finally:
            self._busy.discard(mid)

    def _reply(self, mid: int, clock: int, p: Pending, mean) -> tuple:
        """``(kind, payload, reply clock)``: the mean, or with server-side SGD the new parameters."""
        if not p.landing:  # no late frame is still being written into these slots
            self._slots.give(mid, p.slots)
        if self._sgd is not None:
            return Kind.PARAMS, self._sgd.apply(mid, mean), clock + 1
        return Kind.AGGREGATE, mean, clock

    def _deliver(self, mid: int, clock: int, contributors: list, replies: list) -> None:
        pushers = self._pushers[mid]
        dropped = sorted(pushers - set(contributors))
        for r in dropped:
            self.stats.dropped[r] = self.stats.dropped.get(r, 0) + 1
        if dropped:
            log.warning("shard %d: message %d at clock %d finalized without ranks %s", self.index, mid, clock, dropped)
        notice = [self._notice("dropped", message=mid, clock=clock, ranks=dropped)] if dropped else []
        for msg, kind, payload, reply_clock in replies:
            self._finalized[msg.id] = clock
            self.stats.finalized += 1
            for r in sorted(pushers):
                self._send(r, [*notice, (kind, payload, msg.id, reply_clock, DTYPE_BY_NAME[msg.dtype])])
        if self._sgd is not None and mid not in self._factored:
            self._after_update(mid, clock + 1)

    def _refused(self, mid: int, clock: int, exc: RemoteProtocolError) -> None:
        """Nothing to reply with (no parameters to apply SGD to): every worker must hear why."""
        log.error("shard %d: %s", self.index, exc)
        for r in sorted(self._pushers[mid]):
            self._send(r, [self._notice("error", message=mid, clock=clock, reason=str(exc))])

    def _after_update(self, mid: int, version: int) -> None:
        owned = sum(1 for m in self._messages if m not in self._rebuilt)
        snap = self._sgd.snapshot(mid, version, owned)
        if snap is not None:
            self._track(self._write_checkpoint(version, snap))
        self._answer_pullers(mid, version)

    # -- parameters: start-up broadcast and pulls -------------------------------------------

    def _on_initial_params(self, rank: int, frame: Frame) -> None:
        m = self._message(rank, frame.header)
        values = np.frombuffer(frame.payload, dtype=self._dtype[m.id]).copy()
        self._pulls.initial(m.id, frame.clock, values)
        if self._sgd is not None:
            self._sgd.init(m.id, values)
            self._finalized[m.id] = frame.clock - 1
        self._answer_pullers(m.id, frame.clock)

    def _on_pull(self, rank: int, frame: Frame) -> None:
        m = self._message(rank, frame.header)
        # A pull is for the start-up values or the next version: bound what a peer can ask for.
        horizon = self._finalized[m.id] + self.config.staleness + 2
        if frame.clock > horizon:
            raise RemoteProtocolError(
                f"rank {rank} pulled message {m.id} for clock {frame.clock}, "
                f"beyond clock {horizon} that shard {self.index} "
                "can be asked for (its newest finalized clock plus the staleness bound)"
            )
        self._pulls.ask(rank, m.id, frame.clock)
        self._answer_pullers(m.id, frame.clock)

    def _answer_pullers(self, mid: int, clock: int) -> None:
        def version():  # the server-side SGD's values, if they are this clock's
            if self._sgd is not None and self._sgd.has(mid) and self._finalized[mid] == clock - 1:
                return self._sgd.values(mid)
            return None

        self._pulls.answer(mid, clock, version)

    # -- checkpoints ------------------------------------------------------------------------

    def state(self) -> dict:
        """A copy of the server-side optimizer's state (``w<message>``, ``v<message>`` arrays), the
        form ``KVShard(state=...)`` takes; empty without server-side SGD."""
        return self._sgd.state() if self._sgd is not None else {}

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
        if rank in self._ejected:
            return
        if not self._outboxes[rank].put(frames):
            self._overflow(rank)

    def _sent(self, kind: Kind, nbytes: int, conn: Endpoint) -> None:
        if kind is not Kind.CONTROL:
            self.stats.bytes_out += nbytes
            if not conn.is_local:
                self.stats.remote_bytes_out += nbytes

    def _outbox_limit(self) -> int:
        """Bytes a worker's outbox may hold: ``PSConfig.outbox_bytes``, or what a healthy worker
        can be owed. Under BSP a worker pushes clock t+1 only once it holds every reply of clock
        t, so it is owed at most two clocks' replies of this shard (one being read, one made);
        SSP adds ``staleness`` clocks. 1 MiB more covers notices and start-up parameters."""
        if self.config.outbox_bytes is not None:
            return self.config.outbox_bytes
        per_clock = sum(m.nbytes for m in self._messages.values())
        return (self.config.staleness + 2) * per_clock + (1 << 20)

    def _overflow(self, rank: int) -> None:
        """Worker ``rank`` fell further behind than its outbox allows: eject it under a straggler
        policy, fail the job naming it otherwise. Either way its queued replies are freed."""
        box = self._outboxes[rank]
        held, limit = box.nbytes, box.limit
        box.clear()
        gone = self._conns.get(rank)
        if self.config.stragglers.enabled:
            reason = (
                f"shard {self.index} ejected rank {rank}: it fell {held} bytes of replies behind, more than the "
                f"outbox bound of {limit} bytes (PSConfig.outbox_bytes); the job goes on without it"
            )
            self._ejected[rank] = reason
            self.stats.ejected.append(rank)
            log.error("shard %d: %s", self.index, reason)
            for mid in self._messages:  # whatever waited for it may finalize now
                self._advance(mid)
        else:
            reason = (
                f"rank {rank} fell {held} bytes of shard {self.index}'s replies behind, more than the outbox bound of "
                f"{limit} bytes (PSConfig.outbox_bytes): it is hung, too slow, or never connected; restart the job, or "
                "enable straggler dropping (PSConfig.stragglers) to go on without it"
            )
            self._ejected[rank] = reason
            self._departed[rank] = reason
            self._report_departed(rank, range(self.workers))
        if gone is not None:
            gone.fail(RemoteProtocolError(reason))

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

    def outbox_bytes(self, rank: int) -> int:
        """Payload bytes of replies queued for worker ``rank`` and not yet handed to its link."""
        return self._outboxes[rank].nbytes

    def pending_ranks(self) -> dict:
        """``{(message, clock): ranks still missing}``: what the shard is waiting for."""
        return {key: sorted(set(range(self.workers)) - p.have) for key, p in self._pending.items()}
