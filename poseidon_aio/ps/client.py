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
from typing import Sequence

import numpy as np

from ..cluster.book import InformationBook, Message
from ..errors import ConnectionLost, LocalProtocolError, RemoteProtocolError, SyncTimeout, WorkerLeft
from ..wire import Frame, Kind, factors
from .config import PSConfig
from .shard import WIRE_DTYPE

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
        self._loop = asyncio.get_running_loop()
        self._total = len(book.messages)
        self._done: dict = {}
        self._complete_through = start_clock - 1
        self._gate_waiters: list = []
        self._stalls: dict = {}
        self._failure = self._loop.create_future()
        for conn in conns.values():
            conn.set_handler(self._on_notice, kinds={Kind.CONTROL})

    # -- pushes -----------------------------------------------------------------------------

    def push(
        self, params: Sequence[int], grads: Sequence[np.ndarray], out: Sequence[np.ndarray], clock: int, priority: int = 0
    ) -> asyncio.Task:
        """Push the gradients of ``params`` for ``clock``; return a task of the :class:`PushResult`.

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
        return asyncio.ensure_future(self._push(messages, flat_g, flat_o, clock, priority))

    def push_factors(self, params: Sequence[int], u: np.ndarray, v: np.ndarray, out: Sequence[np.ndarray], clock: int, priority: int = 0) -> asyncio.Task:
        """The Project-Adam scheme: send a fully-connected layer's sufficient factors (u: K×M output
        gradient rows, v: K×N input rows) to the shard that holds it; it rebuilds the mean gradient
        and every worker pulls the full matrices (into ``out``: weight, then bias).

        Raises:
            LocalProtocolError: ``params`` is not a layer the information book lists as factored.
        """
        layer = tuple(params)
        if layer not in self.book.factored:
            raise LocalProtocolError(f"parameters {list(params)} are not a factored (Project-Adam) layer of the information book")
        return asyncio.ensure_future(self._push_factors(layer, u, v, self._flat(params, out), clock, priority))

    async def _push_factors(self, layer: tuple, u: np.ndarray, v: np.ndarray, flat_o: dict, clock: int, priority: int) -> PushResult:
        messages = self.book.messages_of_params(layer)
        conn = self._conns[messages[0].shard]
        waits, scatter = [], []
        for m in messages:
            outs = self.book.slices(m, flat_o)
            into = outs[0] if len(outs) == 1 else np.empty(sum(o.size for o in outs), dtype=outs[0].dtype)
            if len(outs) > 1:
                scatter.append((into, outs))
            waits.append(conn.expect(Kind.AGGREGATE, m.id, clock, into=into))
        sent = u.nbytes + v.nbytes
        try:
            send = conn.send(Kind.FACTORS, factors.encode(u, v), key=messages[0].id, clock=clock, dtype=factors.DTYPE, priority=priority)
            await self._bounded(send, f"sending factors at clock {clock}", messages, clock)
            await self._bounded(asyncio.gather(*waits), f"the rebuilt matrices for clock {clock}", messages, clock)
        except BaseException:
            for fut in waits:
                fut.cancel()
            raise
        _scatter(scatter)
        self._count(clock, len(messages))
        received = sum(m.nbytes for m in messages)
        remote = not conn.is_local
        return PushResult(clock, len(messages), sent, received, [], sent if remote else 0, received if remote else 0)

    def _flat(self, params: Sequence[int], arrays: Sequence[np.ndarray]) -> dict:
        """``{manifest index: flattened view}``, each array checked against the manifest."""
        return {p: self._checked(p, a) for p, a in zip(params, arrays)}

    def _checked(self, param: int, array: np.ndarray) -> np.ndarray:
        spec = self.book.manifest[param]
        if tuple(array.shape) != spec.shape or str(array.dtype) != spec.dtype:
            raise LocalProtocolError(
                f"rank {self.rank}: {spec.name} is {list(array.shape)} {array.dtype}, the manifest says "
                f"{list(spec.shape)} {spec.dtype}"
            )
        if not array.flags.c_contiguous:
            raise LocalProtocolError(f"rank {self.rank}: {spec.name} must be C-contiguous")
        return array.reshape(-1)

    async def _push(self, messages, flat_g: dict, flat_o: dict, clock: int, priority: int) -> PushResult:
        server = self.config.server_sgd is not None
        reply_kind, reply_clock = (Kind.PARAMS, clock + 1) if server else (Kind.AGGREGATE, clock)
        waits, sends, scatter, sent, received, remote = [], [], [], 0, 0, 0
        for m in messages:
            conn = self._conns[m.shard]
            parts, outs = self.book.slices(m, flat_g), self.book.slices(m, flat_o)
            if len(outs) == 1:
                into = outs[0]
            else:
                into = np.empty(sum(o.size for o in outs), dtype=outs[0].dtype)
                scatter.append((into, outs))
            waits.append((m, conn.expect(reply_kind, m.id, reply_clock, into=into)))
            sends.append(conn.send(Kind.PUSH, parts, key=m.id, clock=clock, dtype=WIRE_DTYPE[m.dtype], priority=priority))
            sent += m.nbytes
            received += m.nbytes
            if not conn.is_local:
                remote += m.nbytes
        try:
            await self._bounded(asyncio.gather(*sends), f"sending clock {clock}", messages, clock)
            await self._bounded(asyncio.gather(*(f for _, f in waits)), f"replies for clock {clock}", messages, clock)
        except BaseException:
            for _, fut in waits:
                fut.cancel()
            raise
        _scatter(scatter)
        self._count(clock, len(messages))
        return PushResult(clock, len(messages), sent, received, sorted(self.dropped.get(clock, ())), remote, remote)

    async def _bounded(self, aw, what: str, messages: Sequence[Message], clock: int):
        """Await ``aw`` against the sync timeout and a failure notice from any shard."""
        task = asyncio.ensure_future(aw)
        # If we are cancelled (a sibling sync failed), the inner task's fate must not go unread.
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        try:
            done, _ = await asyncio.wait({task, self._failure}, timeout=self.config.sync_timeout, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            raise
        if task in done:
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        if self._failure.done():
            raise self._failure.exception()
        names = sorted({self.book.manifest[self.book.pairs[k].param].name for m in messages for k in m.keys})
        shards = sorted({m.shard for m in messages})
        stalls = [self._stalls[(m.id, clock)] for m in messages if (m.id, clock) in self._stalls]
        hint = (
            f"; shard {stalls[0]['shard']} reported waiting for ranks {stalls[0]['waiting_for']}"
            if stalls
            else "; a worker may be dead or stalled (see the shards' logs)"
        )
        raise SyncTimeout(
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
            await self._bounded(fut, f"the SSP gate at clock {clock} (waiting for clock {need})", self.book.messages, need)
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
            into = outs[0] if len(outs) == 1 else np.empty(sum(o.size for o in outs), dtype=outs[0].dtype)
            if len(outs) > 1:
                scatter.append((into, outs))
            waits.append(conn.expect(Kind.PARAMS, m.id, clock, into=into))
            await conn.send(Kind.PULL, b"", key=m.id, clock=clock, dtype=WIRE_DTYPE[m.dtype])
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
            await self._conns[m.shard].send(Kind.PARAMS, parts, key=m.id, clock=clock, dtype=WIRE_DTYPE[m.dtype])

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
            log.warning("rank %d: ranks %s were dropped from clock %s (shard %s)", self.rank, ranks, info["clock"], info["shard"])
        elif kind == "stalled":
            self._stalls[(int(info["message"]), int(info["clock"]))] = info
            _keep_newest(self._stalls)
        elif kind == "failed":
            self.fail(WorkerLeft(f"rank {self.rank} was told by shard {info['shard']}: {info['reason']}"))
        elif kind == "error":
            self.fail(RemoteProtocolError(f"rank {self.rank}: shard {info['shard']} could not finalize message {info['message']} at clock {info['clock']}: {info['reason']}"))
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
