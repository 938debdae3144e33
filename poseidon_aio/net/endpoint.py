"""Receive-side bookkeeping shared by every kind of link: expectations, handler, inbox, failure.

A frame that reaches an endpoint goes, in this order, to the future (or
:class:`~poseidon_aio.net.receive.Landing`) registered with :meth:`Endpoint.expect` for its
``(kind, key, clock)``, to the handler set with :meth:`Endpoint.set_handler` (if it takes that
kind), or to an inbox read by :meth:`Endpoint.recv` and searched by later :meth:`Endpoint.expect`
calls (a reply that beat its request).

The handler's ``limit`` and ``allocate`` hooks judge a frame by its header, before its payload
arrives: a frame over its limit, or one the hooks refuse by raising, ends the link at once.

:class:`~poseidon_aio.net.connection.Connection` (TCP) and :class:`~poseidon_aio.net.local.LocalLink`
(in-process) differ only in how frames arrive and leave.
"""

from __future__ import annotations

import asyncio
import functools
from collections import deque
from typing import Callable, Iterable, Optional

from ..errors import ConnectionLost, FrameError, LocalProtocolError, PeerTimeout, RemoteProtocolError
from ..wire import Frame, Header, Kind, byte_view


def silence(fut: asyncio.Future) -> None:
    # Whoever holds the future sees the exception when awaiting it; nobody holding it is not a
    # bug worth the loop's "exception was never retrieved" report.
    if fut.done() and not fut.cancelled():
        fut.exception()


def moved_into(frame: Frame, into) -> Frame:
    """``frame`` with its payload copied into ``into`` (which must have exactly its size)."""
    view = byte_view(into)
    if view.nbytes != frame.header.length or view.readonly:
        raise LocalProtocolError(
            f"destination for {frame.kind.name} key {frame.key} clock {frame.clock} must be a "
            f"writable buffer of {frame.header.length} bytes, got {view.nbytes}"
        )
    view[:] = frame.payload
    return Frame(frame.header, view)


class Endpoint:
    """One end of a link to a peer, as the layers above see it.

    Subclasses provide ``send``, ``close``, ``where`` and ``is_open``, call :meth:`_dispatch` for
    each data frame that arrives, and :meth:`_fail` once when the link ends.
    """

    #: True for an in-process link: its bytes never cross a network.
    is_local = False

    def _init_endpoint(self, loop: asyncio.AbstractEventLoop, rank: int, inbox_high_water: int) -> None:
        self.rank = rank
        self.peer_rank: Optional[int] = None
        #: Where the peer runs, for messages (``" (host 1 'node-b', local rank 1)"``), once the
        #: job knows its hosts; empty where every worker is a host of its own.
        self.peer_host = ""
        self._loop = loop
        self._exc: Optional[BaseException] = None
        self._closed = loop.create_future()
        self._expected: dict = {}
        self._handler: Optional[Callable[[Frame], None]] = None
        self._handler_kinds: Optional[frozenset] = None
        self._allocate_unclaimed: Optional[Callable[[Header], object]] = None
        self._limit_unclaimed: Optional[Callable[[Header], Optional[int]]] = None
        self._landing: Optional[tuple] = None  # (kind, key, clock) whose payload lands in its `into`
        self._inbox: deque = deque()
        self._inbox_bytes = 0
        self._inbox_high_water = inbox_high_water
        self.max_inbox_bytes = 0
        self._recv_waiter: Optional[asyncio.Future] = None

    # -- what subclasses provide ------------------------------------------------------------

    @property
    def where(self) -> str:
        raise NotImplementedError

    def _on_inbox_full(self) -> None:
        """The inbox passed its high-water mark (a TCP link pauses reading)."""

    def _on_inbox_drained(self) -> None:
        """The inbox fell to half its high-water mark."""

    # -- public API -------------------------------------------------------------------------

    @property
    def error(self) -> Optional[BaseException]:
        """Why the link ended, or ``None`` while it is open."""
        return self._exc

    async def wait_closed(self) -> None:
        await asyncio.shield(self._closed)

    def on_close(self, callback: Callable[["Endpoint"], None]) -> None:
        """Call ``callback(link)`` on the loop once the link is gone (``error`` says why)."""
        self._closed.add_done_callback(lambda _: callback(self))

    def expect(self, kind: Kind, key: int, clock: int, into=None, landing=None):
        """Claim the next frame ``(kind, key, clock)``; return a future of it.

        Args:
            into: optional writable buffer of exactly the payload's size: the payload is received
                straight into it (zero copy), and the frame's ``payload`` is a view of it.
            landing: a fresh :class:`~poseidon_aio.net.receive.Landing` to complete instead of a
                future (returned): its callback runs on the receive path as the frame lands.
        Raises:
            LocalProtocolError: that frame is already expected.

        Register before the peer can send the frame where you can (e.g. before pushing the
        gradient whose aggregate it is): a frame that arrives first waits in the inbox and is
        copied into ``into`` when claimed.
        """
        ident = (kind if type(kind) is Kind else Kind(kind), int(key), int(clock))  # (the enum's call is dear)
        if ident in self._expected:
            raise LocalProtocolError(
                f"frame {ident[0].name} key {key} clock {clock} from {self.where} is already expected"
            )
        fut = self._loop.create_future() if landing is None else landing
        # A frame that arrived before the link ended is still delivered (a peer may send its last
        # frame and say GOODBYE before we ask for it).
        early = self._claim_from_inbox(ident)
        if early is not None:
            fut.set_result(early if into is None else moved_into(early, into))
            return fut
        if self._exc is not None:
            fut.set_exception(self._lost())
            silence(fut)
            return fut
        self._expected[ident] = (fut, into)
        if landing is None:
            fut.add_done_callback(functools.partial(self._forget, ident))
        else:
            landing._link, landing._ident = self, ident
        return fut

    def set_handler(
        self,
        handler: Optional[Callable[[Frame], None]],
        allocate: Optional[Callable[[Header], object]] = None,
        kinds: Optional[Iterable[Kind]] = None,
        limit: Optional[Callable[[Header], Optional[int]]] = None,
    ) -> None:
        """Deliver unclaimed frames to ``handler(frame)`` on the loop instead of the inbox.

        Args:
            handler: called with each frame no :meth:`expect` claimed. It must not block; an
                exception from it ends the link with that error (a :class:`RemoteProtocolError`
                is also sent to the peer). Matching frames already in the inbox are handed over
                first, with the same error handling.
            allocate: called with the header of each unclaimed frame as soon as it is decoded;
                returns the buffer its payload is received into (zero copy), or ``None``. A
                parameter-server shard uses it to land pushes in per-key receive slots.
            kinds: only frames of these kinds go to the handler; the others stay in the inbox,
                where a later :meth:`expect` claims them.
            limit: called with the header of each unclaimed frame the handler takes, before
                ``allocate``; returns the largest payload it accepts for that header in bytes
                (``None``: no opinion, ``NetConfig.max_payload`` applies). A longer frame ends the
                link as soon as its header arrives, with a :class:`FrameError` the peer is told.

        An exception from ``allocate`` or ``limit`` (raise :class:`RemoteProtocolError` to refuse
        a frame with your own words) ends the link the same way, before any payload byte is
        buffered.

        >>> # conn.set_handler(on_push, allocate=slot_for, limit=lambda h: sizes.get(h.key, 0))
        """
        self._handler = handler
        self._handler_kinds = frozenset(kinds) if kinds is not None else None
        self._allocate_unclaimed = allocate
        self._limit_unclaimed = limit
        if handler is None:
            return
        taken = [f for f in self._inbox if self._handles(f)]
        if not taken:
            return
        self._inbox = deque(f for f in self._inbox if not self._handles(f))
        self._inbox_bytes -= sum(f.header.length for f in taken)
        if self._inbox_bytes <= self._inbox_high_water // 2:
            self._on_inbox_drained()
        for frame in taken:
            if self._exc is not None:
                break  # the handler ended the link; the frames after it go with it
            self._to_handler(frame)

    async def recv(self, timeout: Optional[float] = None) -> Frame:
        """Next unclaimed frame.

        Raises:
            PeerTimeout: nothing arrived within ``timeout`` seconds.
            ConnectionLost: the link ended (the cause is chained).
        """
        if self._inbox:
            return self._pop_inbox()
        if self._exc is not None:
            raise self._lost()
        if self._recv_waiter is not None:
            raise LocalProtocolError(f"another coroutine is already waiting in recv() on the link to {self.where}")
        self._recv_waiter = self._loop.create_future()
        try:
            async with asyncio.timeout(timeout):
                await self._recv_waiter
        except TimeoutError:
            raise PeerTimeout(f"no frame from {self.where} within {timeout} s") from None
        finally:
            self._recv_waiter = None
        return self._pop_inbox()

    # -- receive side -----------------------------------------------------------------------

    def _allocate(self, header: Header):
        """Where the payload of a frame whose header just arrived should land (or ``None``).

        Raises:
            FrameError: the frame is over the limit the handler's ``limit`` hook sets.
            LocalProtocolError: the ``allocate`` hook returned a buffer of the wrong size.
            Exception: whatever the hooks raised.
        """
        ident = (header.kind, header.key, header.clock)
        entry = self._expected.get(ident)
        self._landing = None
        if entry is not None:
            into = entry[1]
            if into is None or memoryview(into).nbytes != header.length:
                return None  # a wrong-sized `into` fails that future alone, in _dispatch
            self._landing = ident
            return into
        if not self._handles_kind(header.kind):
            return None
        if self._limit_unclaimed is not None:
            limit = self._limit_unclaimed(header)
            if limit is not None and header.length > limit:
                raise FrameError(
                    f"{self.where} sent {header.kind.name} key {header.key} clock {header.clock} with a "
                    f"{header.length}-byte payload; rank {self.rank} accepts at most {limit} bytes for "
                    "that frame (its handler's limit): the two ranks disagree about this message, "
                    "check that they run the same model and build"
                )
        if self._allocate_unclaimed is None:
            return None
        dest = self._allocate_unclaimed(header)
        if dest is None:
            return None
        view = byte_view(dest)
        if view.readonly or view.nbytes != header.length:
            raise LocalProtocolError(
                f"the allocate hook on rank {self.rank} returned {view.nbytes} bytes"
                f"{' (read-only)' if view.readonly else ''} for {header.kind.name} key {header.key} "
                f"clock {header.clock} from {self.where}, whose payload is {header.length} bytes: "
                "it must return a writable buffer of exactly that size, or None"
            )
        return view

    def _dispatch(self, frame: Frame) -> None:
        header = frame.header
        ident = (header.kind, header.key, header.clock)
        entry = self._expected.pop(ident, None)
        if entry is not None:
            fut, into = entry
            landed, self._landing = self._landing == ident, None
            if fut.done():
                return
            if into is not None and not landed:
                self._claimed_late(frame, fut, into)
                return
            fut.set_result(frame)
            return
        if self._handles_kind(header.kind):
            self._to_handler(frame)
            return
        self._to_inbox(frame)

    def _claimed_late(self, frame: Frame, fut: asyncio.Future, into) -> None:
        # expect() came after this frame's header, or `into` has the wrong size.
        try:
            fut.set_result(moved_into(frame, into))
        except LocalProtocolError as exc:
            fut.set_exception(exc)

    def _to_inbox(self, frame: Frame) -> None:
        self._inbox.append(frame)
        self._inbox_bytes += frame.header.length
        self.max_inbox_bytes = max(self.max_inbox_bytes, self._inbox_bytes)
        if self._inbox_bytes > self._inbox_high_water:
            self._on_inbox_full()
        waiter = self._recv_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _to_handler(self, frame: Frame) -> None:
        try:
            self._handler(frame)
        except RemoteProtocolError as exc:  # the peer broke the protocol: tell it why
            self._fail(exc, "error")
        except Exception as exc:  # noqa: BLE001 - a handler bug ends this link, visibly
            self._fail(exc, "abort")

    def _handles(self, frame: Frame) -> bool:
        return self._handles_kind(frame.kind)

    def _handles_kind(self, kind: Kind) -> bool:
        return self._handler is not None and (self._handler_kinds is None or kind in self._handler_kinds)

    def _claim_from_inbox(self, ident: tuple) -> Optional[Frame]:
        for i, frame in enumerate(self._inbox):
            if (frame.kind, frame.key, frame.clock) == ident:
                if i == 0:
                    return self._pop_inbox()
                del self._inbox[i]
                self._inbox_bytes -= frame.header.length
                if self._inbox_bytes <= self._inbox_high_water // 2:
                    self._on_inbox_drained()
                return frame
        return None

    def _forget(self, ident: tuple, fut) -> None:
        # A cancelled expectation must not swallow the frame (or write into a buffer) later.
        entry = self._expected.get(ident)
        if entry is not None and entry[0] is fut:
            del self._expected[ident]

    def _pop_inbox(self) -> Frame:
        frame = self._inbox.popleft()
        self._inbox_bytes -= frame.header.length
        if self._inbox_bytes <= self._inbox_high_water // 2:
            self._on_inbox_drained()
        return frame

    # -- failure ----------------------------------------------------------------------------

    def _fail(self, exc: BaseException, how: str, cause: Optional[BaseException] = None) -> None:
        raise NotImplementedError

    def fail(self, exc: BaseException) -> None:
        """End the link because of ``exc``, telling the peer why where the link can."""
        self._fail(exc, "error")

    def _lost(self) -> ConnectionLost:
        exc = self._exc
        if isinstance(exc, ConnectionLost):
            err = ConnectionLost(str(exc))
        else:
            err = ConnectionLost(f"connection to {self.where} ended: {exc}")
        err.__cause__ = exc
        return err

    def _fail_waiters(self) -> None:
        lost = self._lost()
        for fut, _ in list(self._expected.values()):
            if not fut.done():
                fut.set_exception(lost)
                silence(fut)
        self._expected.clear()
        if self._recv_waiter is not None and not self._recv_waiter.done():
            self._recv_waiter.set_exception(lost)
            silence(self._recv_waiter)
