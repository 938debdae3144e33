"""The worker's side of the parameter server: push a layer's gradient, get a future of its aggregate.

All I/O runs on the worker's event loop. Pushes send the gradient's own memory (views of the
flattened arrays, gathered into one frame per message); replies of single-key messages are
received straight into the output arrays. Clocks are tracked per message so that :meth:`gate`
can enforce SSP: at clock ``t`` every reply up to clock ``t - s - 1`` is in.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from ..cluster.book import InformationBook, Message
from ..errors import ConnectionLost, LocalProtocolError, RemoteProtocolError, SyncTimeout, WorkerLeft
from ..net.core import Landing
from ..wire import DTYPE_BY_NAME, Frame, Kind, factors
from ..wire.spans import spanning
from .config import PSConfig

log = logging.getLogger("poseidon_aio.ps")


@dataclass
class PushResult:
    """What one push cost and what the shards reported (payload bytes; ``remote_*`` excludes the
    in-process link to a co-located shard)."""

    clock: int
    messages: int
    bytes_sent: int
    bytes_received: int
    dropped: list = field(default_factory=list)
    remote_bytes_sent: int = 0
    remote_bytes_received: int = 0


# Notices are kept for the newest clocks only: a job that drops a straggler at every clock for days
# must not grow a dict by a clock each time. A push reads its clock's notice within sync_timeout.
NOTICES_KEPT = 1024


# Layouts of merged pushes kept (_runs): a trainer pushes a few groups (more while it tries plans).
LAYOUTS_KEPT = 1024


def _keep_newest(notices: dict) -> None:
    while len(notices) > NOTICES_KEPT:
        del notices[next(iter(notices))]


def _scatter(pending: list) -> None:
    """Copy each staging buffer of a multi-key message back into its keys' slices."""
    for into, outs in pending:
        offset = 0
        for o in outs:
            o[:] = into[offset : offset + o.size]
            offset += o.size


def _landing(outs: list) -> tuple:
    """``(into, scattered)``: where a reply for ``outs`` is received. One array, or several back
    to back in memory (the trainer's results of a merge group), are received into directly;
    others through a staging buffer scattered afterwards."""
    if len(outs) == 1:
        return outs[0], False
    span = spanning(outs)
    if span is not None:
        return span, False
    return np.empty(sum(o.size for o in outs), dtype=outs[0].dtype), True


class _Sync:
    """One push (or factor push) in flight: its sends, its expected replies, one future.

    Futures and callbacks instead of a coroutine per step: a frame that can go out at once goes
    (``try_send``), a reply's arrival counts down (a :class:`~poseidon_aio.net.receive.Landing`,
    on the receive path), one timer bounds the whole, and a shard's failure notice or a cancelled
    future ends it. On a 30-layer model that is ~5 fewer tasks per layer per step than awaiting
    each part.
    """

    __slots__ = (
        "client",
        "messages",
        "clock",
        "what",
        "future",
        "waits",
        "tasks",
        "scatter",
        "keep",
        "left",
        "timer",
        "sent",
        "received",
        "remote_sent",
        "remote_received",
    )

    def __init__(self, client: "PSClient", messages, clock: int, what: str) -> None:
        self.client = client
        self.messages = messages
        self.clock = clock
        self.what = what
        self.future = client._loop.create_future()
        self.waits: list = []
        self.tasks: list = []
        self.scatter: list = []
        self.keep: list = []
        self.left = 1  # started()'s own: a reply already in the inbox lands inside expect()
        self.timer = None
        self.sent = self.received = self.remote_sent = self.remote_received = 0

    def expect(self, conn, kind: Kind, key: int, clock: int, outs: list) -> None:
        """Expect the reply ``(kind, key, clock)`` into ``outs`` (a staging buffer when several)."""
        if self.future.done():  # a send already failed
            return
        into, scatter = _landing(outs)
        if scatter:
            self.scatter.append((into, outs))
        elif len(outs) > 1:
            self.keep.append(outs)  # the spanning view holds the first array's memory only
        self.left += 1
        self.received += into.nbytes
        if not conn.is_local:
            self.remote_received += into.nbytes
        self.waits.append(landing := Landing(self._landed))
        conn.expect(kind, key, clock, into=into, landing=landing)

    def send(self, conn, kind: Kind, payload, key: int, clock: int, dtype, priority: int, nbytes: int) -> None:
        if self.future.done():
            return
        self.sent += nbytes
        if not conn.is_local:
            self.remote_sent += nbytes
        try:
            if conn.try_send(kind, payload, key=key, clock=clock, dtype=dtype, priority=priority):
                return
        except Exception as exc:  # noqa: BLE001 - a lost link: the future says so, as an awaited send would
            self._finish(exc)
            return
        task = asyncio.ensure_future(conn.send(kind, payload, key=key, clock=clock, dtype=dtype, priority=priority))
        self.tasks.append(task)
        self.left += 1
        task.add_done_callback(self._part_done)

    def started(self) -> asyncio.Future:
        client = self.client
        if self.future.done():  # a send failed at once
            return self.future
        if client._failure.done():
            self._finish(client._failure.exception())
            return self.future
        client._failure.add_done_callback(self._failed)
        self.timer = client._loop.call_later(client.config.sync_timeout, self._timed_out)
        self.future.add_done_callback(self._given_up)
        self._one_in(None)  # its own
        return self.future

    def _landed(self, _, frame, exc) -> None:
        # On the receive path (or in expect): nothing may escape to the link that delivered it.
        try:
            self._one_in(exc)
        except Exception as bug:  # noqa: BLE001 - the push's future says it, not the link
            if not self.future.done():
                self.future.set_exception(bug)

    def _part_done(self, fut: asyncio.Future) -> None:
        if fut.cancelled() and not self.future.done():
            self._finish(ConnectionLost(f"rank {self.client.rank}: {self.what} was given up"))
            return
        self._one_in(None if fut.cancelled() else fut.exception())

    def _one_in(self, exc) -> None:
        """A part is done (a reply landed, a send went), or failed with ``exc``."""
        if self.future.done():
            return
        if exc is not None:
            self._finish(exc)
            return
        self.left -= 1
        if not self.left:
            self._finish(None)

    def _failed(self, failure: asyncio.Future) -> None:
        if not self.future.done():
            self._finish(failure.exception())

    def _timed_out(self) -> None:
        self.timer = None
        if not self.future.done():
            self._finish(self.client.timed_out(self.what, self.messages, self.clock))

    def _given_up(self, fut: asyncio.Future) -> None:
        if fut.cancelled():
            self._cleanup()

    def _finish(self, exc) -> None:
        self._cleanup()
        if self.future.done():
            return
        if exc is not None:
            self.future.set_exception(exc)
            return
        _scatter(self.scatter)
        client, n = self.client, len(self.messages)
        client._count(self.clock, n)
        self.future.set_result(
            PushResult(
                self.clock,
                n,
                self.sent,
                self.received,
                sorted(client.dropped.get(self.clock, ())),
                self.remote_sent,
                self.remote_received,
            )
        )

    def _cleanup(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.client._failure.remove_done_callback(self._failed)
        for fut in (*self.waits, *self.tasks):
            if not fut.done():
                fut.cancel()


class PSClient:
    """Push/pull against every shard of the job.

    Args:
        rank: this worker's rank.
        book: the job's :class:`InformationBook`.
        config: :class:`PSConfig`.
        conns: ``{shard: Connection}``.
        start_clock: the first clock this job runs.
    """

    def __init__(
        self,
        rank: int,
        book: InformationBook,
        config: PSConfig,
        conns: dict,
        *,
        start_clock: int = 0,
    ) -> None:
        self.rank = rank
        self.book = book
        self.config = config
        #: ``{clock: ranks}`` a shard dropped from that clock's aggregation (the newest 1024 clocks).
        self.dropped: dict = {}
        self._conns = conns
        # What every array handed in must be, per parameter: compared as NumPy dtypes (a dtype's
        # name is a Python property, slow to read; this check runs for every parameter every step).
        self._expected = [(spec.shape, np.dtype(spec.dtype)) for spec in book.manifest]
        self._loop = asyncio.get_running_loop()
        self._total = len(book.messages)
        self._done: dict = {}
        self._complete_through = start_clock - 1
        self._gate_waiters: list = []
        self._stalls: dict = {}
        self._failure = self._loop.create_future()
        self._layouts: dict = {}  # params -> _runs(params)
        for conn in conns.values():
            conn.set_handler(self._on_notice, kinds={Kind.CONTROL})

    # -- pushes -----------------------------------------------------------------------------

    def push(
        self,
        params: Sequence[int],
        grads: Sequence[np.ndarray],
        out: Sequence[np.ndarray],
        clock: int,
        priority: int = 0,
    ) -> asyncio.Future:
        """Push the gradients of ``params`` for ``clock``; return a future of the :class:`PushResult`
        (it fails with SyncTimeout, ConnectionLost, WorkerLeft; cancelling it gives the push up).

        Args:
            params: manifest indices of the parameters (a layer, or a whole merge group).
            grads: their gradients, C-contiguous, in the same order.
            out: where the replies go (mean gradients, or parameters with server-side SGD); may
                be ``grads`` themselves only if the caller does not need the local gradient —
                a reply can land while the push is still being sent.
            clock: the iteration clock.
            priority: lower goes first among frames waiting for the link (the bandwidth manager
                gives layers nearest the input the lowest numbers: they gate the next forward).
        Raises:
            LocalProtocolError: a message mixes these parameters with others (push the whole
                merge group), or shapes do not match the manifest.

        >>> # result = await client.push([3, 4], [w_grad, b_grad], [w_out, b_out], clock=t)
        """
        flat_g = self._flat(params, grads)
        flat_o = self._flat(params, out)
        messages = self.book.messages_of_params(params)
        for m in messages:
            for key in m.keys:
                if self.book.pairs[key].param not in flat_g:
                    other = self.book.manifest[self.book.pairs[key].param].name
                    raise LocalProtocolError(
                        f"message {m.id} also carries {other}: push its whole merge group together"
                    )
        reply_kind, reply_clock = self._reply_of(clock)
        op = _Sync(self, messages, clock, f"replies for clock {clock}")
        for m in messages:
            conn = self._conns[m.shard]
            op.expect(conn, reply_kind, m.id, reply_clock, self.book.slices(m, flat_o))
            op.send(
                conn, Kind.PUSH, self.book.slices(m, flat_g), m.id, clock, DTYPE_BY_NAME[m.dtype], priority, m.nbytes
            )
        return op.started()

    def push_flat(
        self, params: Sequence[int], grads: np.ndarray, out: np.ndarray, clock: int, priority: int = 0
    ) -> Optional[asyncio.Future]:
        """:meth:`push` of ``params`` given as one buffer each way (``grads`` and ``out``: 1-D,
        the parameters back to back in this order), each message one slice of them; ``None``
        where some message is not one run of that layout (push the arrays one by one).

        Raises:
            LocalProtocolError: as :meth:`push`, or the buffers do not hold ``params``.
        """
        layout = self._runs(tuple(params))
        if layout is None:
            return None
        runs, size, dtype = layout
        for name, a in (("gradients", grads), ("results", out)):
            if a.shape != (size,) or a.dtype != dtype or not a.flags.c_contiguous:
                first, last = self.book.manifest[params[0]].name, self.book.manifest[params[-1]].name
                raise LocalProtocolError(
                    f"rank {self.rank}: the {name} of {first} to {last} are one buffer of {list(a.shape)} "
                    f"{a.dtype}; the manifest says [{size}] {dtype}, C-contiguous"
                )
        reply_kind, reply_clock = self._reply_of(clock)
        op = _Sync(self, self.book.messages_of_params(params), clock, f"replies for clock {clock}")
        for m, lo, hi in runs:
            conn = self._conns[m.shard]
            op.expect(conn, reply_kind, m.id, reply_clock, [out[lo:hi]])
            op.send(conn, Kind.PUSH, [grads[lo:hi]], m.id, clock, DTYPE_BY_NAME[m.dtype], priority, m.nbytes)
        return op.started()

    def _runs(self, params: tuple) -> Optional[tuple]:
        """``(((message, lo, hi), ...), elements, dtype)``: where each message of ``params`` lies
        in their back-to-back layout, found once per tuple; ``None`` where one is not a single run."""
        found = self._layouts.get(params, False)
        if found is not False:
            return found
        at, size = {}, 0
        for p in params:
            at[p] = size
            size += self.book.manifest[p].numel
        dtypes = {self._expected[p][1] for p in params}
        runs = []
        for m in self.book.messages_of_params(params):
            lo = hi = None
            for k in m.keys:
                pair = self.book.pairs[k]
                if pair.param not in at:
                    other = self.book.manifest[pair.param].name
                    raise LocalProtocolError(
                        f"message {m.id} also carries {other}: push its whole merge group together"
                    )
                begin = at[pair.param] + pair.offset
                if hi is not None and begin != hi:
                    runs = None
                    break
                lo, hi = (begin if lo is None else lo), begin + pair.numel
            if runs is None:
                break
            runs.append((m, lo, hi))
        found = (tuple(runs), size, dtypes.pop()) if runs is not None and len(dtypes) == 1 else None
        if len(self._layouts) < LAYOUTS_KEPT:
            self._layouts[params] = found
        return found

    def push_message(self, message: Message, payload: list, out: list, clock: int, priority: int = 0) -> asyncio.Future:
        """Push ``payload`` (arrays, gathered) as ``message`` for ``clock``, its host's sum where
        hosts push once each (:meth:`InformationBook.pushers`); the reply lands in ``out`` (the
        message's slices). A future of the :class:`PushResult`, as :meth:`push`'s."""
        reply_kind, reply_clock = self._reply_of(clock)
        conn = self._conns[message.shard]
        op = _Sync(self, (message,), clock, f"replies for clock {clock}")
        op.expect(conn, reply_kind, message.id, reply_clock, out)
        op.send(conn, Kind.PUSH, payload, message.id, clock, DTYPE_BY_NAME[message.dtype], priority, message.nbytes)
        return op.started()

    def landed(self, clock: int, messages: int) -> None:
        """``messages`` replies of ``clock`` landed another way (forwarded inside the host): they
        count for :meth:`gate` as the client's own do."""
        self._count(clock, messages)

    def flat(self, params: Sequence[int], arrays: Sequence[np.ndarray]) -> dict:
        """``{manifest index: flattened view}`` of ``arrays``, checked against the manifest.

        Raises:
            LocalProtocolError: a shape, dtype or layout that does not match.
        """
        return self._flat(params, arrays)

    def push_factors(
        self,
        params: Sequence[int],
        u: np.ndarray,
        v: np.ndarray,
        out: Sequence[np.ndarray],
        clock: int,
        priority: int = 0,
    ) -> asyncio.Future:
        """The Project-Adam scheme: send a fully-connected layer's sufficient factors (u: K×M output
        gradient rows, v: K×N input rows) to the shard that holds it; it rebuilds the mean gradient
        and every worker pulls the full matrices (into ``out``: weight, then bias).

        Raises:
            LocalProtocolError: ``params`` is not a layer the information book lists as factored.
        """
        layer = tuple(params)
        if layer not in self.book.factored:
            raise LocalProtocolError(
                f"parameters {list(params)} are not a factored (Project-Adam) layer of the information book"
            )
        flat_o = self._flat(params, out)
        messages = self.book.messages_of_params(layer)
        conn = self._conns[messages[0].shard]
        op = _Sync(self, messages, clock, f"the rebuilt matrices for clock {clock}")
        for m in messages:
            op.expect(conn, Kind.AGGREGATE, m.id, clock, self.book.slices(m, flat_o))
        op.send(
            conn,
            Kind.FACTORS,
            factors.encode(u, v),
            messages[0].id,
            clock,
            factors.DTYPE,
            priority,
            u.nbytes + v.nbytes,
        )
        return op.started()

    def _reply_of(self, clock: int) -> tuple:
        """``(kind, clock)`` of the shards' reply to a push of ``clock``: the mean, or with
        server-side SGD the parameters of the next clock."""
        if self.config.server_sgd is not None:
            return Kind.PARAMS, clock + 1
        return Kind.AGGREGATE, clock

    def _flat(self, params: Sequence[int], arrays: Sequence[np.ndarray]) -> dict:
        """``{manifest index: flattened view}``, each array checked against the manifest."""
        return {p: self._checked(p, a) for p, a in zip(params, arrays)}

    def _checked(self, param: int, array: np.ndarray) -> np.ndarray:
        shape, dtype = self._expected[param]
        if array.shape != shape or array.dtype != dtype:
            spec = self.book.manifest[param]
            raise LocalProtocolError(
                f"rank {self.rank}: {spec.name} is {list(array.shape)} {array.dtype}, the manifest says "
                f"{list(spec.shape)} {spec.dtype}"
            )
        if not array.flags.c_contiguous:
            raise LocalProtocolError(f"rank {self.rank}: {self.book.manifest[param].name} must be C-contiguous")
        return array.reshape(-1)

    async def _bounded(self, aw, what: str, messages: Sequence[Message], clock: int):
        """Await ``aw`` against the sync timeout and a failure notice from any shard."""
        task = asyncio.ensure_future(aw)
        # If we are cancelled (a sibling sync failed), the inner task's fate must not go unread.
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        try:
            done, _ = await asyncio.wait(
                {task, self._failure}, timeout=self.config.sync_timeout, return_when=asyncio.FIRST_COMPLETED
            )
        except asyncio.CancelledError:
            task.cancel()
            raise
        if task in done:
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        if self._failure.done():
            raise self._failure.exception()
        raise self.timed_out(what, messages, clock)

    def timed_out(self, what: str, messages: Sequence[Message], clock: int) -> SyncTimeout:
        """The error of a sync that took longer than ``sync_timeout``: which parameters, which
        shards, and what a shard reported waiting for."""
        names = sorted({self.book.manifest[self.book.pairs[k].param].name for m in messages for k in m.keys})
        shards = sorted({m.shard for m in messages})
        stalls = [self._stalls[(m.id, clock)] for m in messages if (m.id, clock) in self._stalls]
        hint = (
            f"; shard {stalls[0]['shard']} reported waiting for ranks {stalls[0]['waiting_for']}"
            if stalls
            else "; a worker may be dead or stalled (see the shards' logs)"
        )
        return SyncTimeout(
            f"rank {self.rank}: {what} of {', '.join(names)} (shards {shards}) did not complete "
            f"within {self.config.sync_timeout} s{hint}"
        )

    def _count(self, clock: int, n: int) -> None:
        self._done[clock] = self._done.get(clock, 0) + n
        while self._done.get(self._complete_through + 1, 0) >= self._total:
            self._done.pop(self._complete_through + 1)
            self._complete_through += 1
        still = []
        for need, fut in self._gate_waiters:
            if need <= self._complete_through:
                if not fut.done():
                    fut.set_result(None)
            else:
                still.append((need, fut))
        self._gate_waiters = still

    @property
    def complete_through(self) -> int:
        """The newest clock ``c`` such that every reply up to ``c`` is in."""
        return self._complete_through

    async def gate(self, clock: int) -> None:
        """SSP: return once every reply up to ``clock - staleness - 1`` is in.

        Raises:
            SyncTimeout: not within ``config.sync_timeout``.
        """
        need = clock - self.config.staleness - 1
        if need <= self._complete_through:
            return
        fut = self._loop.create_future()
        self._gate_waiters.append((need, fut))
        try:
            await self._bounded(
                fut, f"the SSP gate at clock {clock} (waiting for clock {need})", self.book.messages, need
            )
        finally:
            if not fut.done():
                fut.cancel()

    # -- parameters -------------------------------------------------------------------------

    async def pull(self, params: Sequence[int], out: Sequence[np.ndarray], clock: int) -> None:
        """Fetch the parameters of ``params`` for ``clock`` from the shards into ``out``."""
        flat = self._flat(params, out)
        waits, scatter = [], []
        messages = self.book.messages_of_params(params)
        for m in messages:
            conn = self._conns[m.shard]
            outs = self.book.slices(m, flat)
            into, separate = _landing(outs)  # (``flat`` keeps every array of a spanning view alive)
            if separate:
                scatter.append((into, outs))
            waits.append(conn.expect(Kind.PARAMS, m.id, clock, into=into))
            await conn.send(Kind.PULL, b"", key=m.id, clock=clock, dtype=DTYPE_BY_NAME[m.dtype])
        await self._bounded(asyncio.gather(*waits), f"pulling parameters for clock {clock}", messages, clock)
        _scatter(scatter)

    async def broadcast(self, params: Sequence[int], arrays: Sequence[np.ndarray], clock: int, root: int = 0) -> None:
        """Make every worker's ``arrays`` equal to ``root``'s, through the shards.

        The root sends its values (and, with server-side SGD, the shards adopt them as the model);
        the other workers pull them.
        """
        if self.rank != root:
            await self.pull(params, arrays, clock)
            return
        flat = self._flat(params, arrays)
        for m in self.book.messages_of_params(params):
            parts = self.book.slices(m, flat)
            await self._conns[m.shard].send(Kind.PARAMS, parts, key=m.id, clock=clock, dtype=DTYPE_BY_NAME[m.dtype])

    # -- notices from shards ----------------------------------------------------------------

    def _on_notice(self, frame: Frame) -> None:
        try:
            info = json.loads(bytes(frame.payload).decode("utf-8"))
            kind = info["type"]
        except (UnicodeDecodeError, ValueError, KeyError, TypeError):
            raise RemoteProtocolError(f"rank {self.rank} got a malformed notice from rank {frame.rank}") from None
        if kind == "dropped":
            ranks = [int(r) for r in info["ranks"]]
            self.dropped.setdefault(int(info["clock"]), set()).update(ranks)
            _keep_newest(self.dropped)
            log.warning(
                "rank %d: ranks %s were dropped from clock %s (shard %s)",
                self.rank,
                ranks,
                info["clock"],
                info["shard"],
            )
        elif kind == "stalled":
            self._stalls[(int(info["message"]), int(info["clock"]))] = info
            _keep_newest(self._stalls)
        elif kind == "failed":
            self.fail(WorkerLeft(f"rank {self.rank} was told by shard {info['shard']}: {info['reason']}"))
        elif kind == "error":
            self.fail(
                RemoteProtocolError(
                    f"rank {self.rank}: shard {info['shard']} could not finalize message {info['message']} "
                    f"at clock {info['clock']}: {info['reason']}"
                )
            )
        else:
            log.info("rank %d: ignoring notice of unknown type %r", self.rank, kind)

    def fail(self, exc: BaseException) -> None:
        """Fail every wait of this client with ``exc`` (e.g. when the job is shutting down)."""
        if not self._failure.done():
            self._failure.set_exception(exc)
            self._failure.exception()

    @property
    def connections(self) -> dict:
        return dict(self._conns)


__all__ = ["PSClient", "PushResult", "WorkerLeft", "ConnectionLost"]
