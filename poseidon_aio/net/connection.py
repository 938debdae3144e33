"""Framed, authenticated connections on asyncio: the only place that touches sockets.

Layering follows asyncpg: the sans-IO codec (``wire``) and the sans-IO handshake
(``net.handshake``) do all parsing; :class:`Connection` is the ``asyncio.BufferedProtocol``
adapter that moves bytes between them and the transport.

Receive path: the connection's receive core (:mod:`poseidon_aio.net.core`: compiled in
``_ext/receive.pyx``, or its pure-Python twin :mod:`poseidon_aio.net.receive`) implements
``get_buffer`` and ``buffer_updated``. ``get_buffer`` hands the kernel the decoder's buffer,
which, while a payload with a registered destination is being read, is the unfilled tail of that
destination (a slice of a receive tensor): payload bytes are written once. Frames then go, in
this order, to the future registered with :meth:`Connection.expect` for their
``(kind, key, clock)``, to the handler set with
:meth:`Connection.set_handler`, or to an inbox read with :meth:`Connection.recv`.

Payload integrity: unless TLS is on (its MAC covers every byte), both ends put a CRC32C of each
payload in its header and the decoder checks it as the bytes land (``NetConfig.payload_checksum``;
on when either end asks). A mismatch ends the connection with a ``FrameError`` naming the frame.

Send path: ``transport.writelines([header, memoryview(payload)])`` over the payload's own memory;
small frames are copied whole and those of one pass of the loop go out together, in one write.
Above the write high-water mark senders queue, lowest ``priority`` value first, and wait for
``resume_writing``; with a shaper they also wait for tokens.

Every wait has a bound: connect, handshake and close timeouts, and an idle timeout fed by
heartbeats. A lost connection fails every pending waiter with :class:`ConnectionLost`.

Memory has a bound too: a frame nobody registered a buffer for is received into a buffer that
grows with the bytes that arrive, and what a connection holds for unclaimed frames (inbox plus
that buffer) stays under ``NetConfig.memory_budget``. The handshake deadline runs from
construction, which on a listener (``net.listener``) is accept, TLS included.

Connections are made by :func:`~poseidon_aio.net.dial.connect` and
:func:`~poseidon_aio.net.listener.listen`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import socket
import sys
import time
from typing import Optional

from ..errors import (
    ConnectionLost,
    HandshakeError,
    LocalProtocolError,
    PeerTimeout,
    RemoteProtocolError,
)
from ..wire import DType, Frame, Kind, encode_frame, encode_header, payload_crc, payload_views
from .backpressure import WriteTurns
from .config import NetConfig
from .core import ReceiveCore
from .endpoint import Endpoint, silence
from .handshake import HANDSHAKE_MAX_PAYLOAD, PROTOCOL_VERSION, Handshake, Role
from .loop import is_uvloop
from .shaper import Shaper
from .sockopts import LOWAT_OPT, option_socket

log = logging.getLogger("poseidon_aio.net")

# Below this a payload is joined to its header: one 44-byte write per frame costs more than a copy.
_JOIN_BELOW = 16 * 1024
# Small frames written in one pass of the loop wait for its next pass and go out in one write: a
# system call each cost the loop more than their bytes. Past this many bytes waiting they go at
# once (or past the write high-water mark, if lower), so backpressure never lags far behind.
_GATHER_MAX = 64 * 1024
# asyncio's own transports before 3.12 implement writelines as write(b"".join(...)): a full copy.
_WRITELINES_COPIES = sys.version_info < (3, 12)


class ConnectionStats:
    """What a connection has moved. The receive counters are its receive core's (C integers
    in the compiled one), read here when asked."""

    __slots__ = ("_core", "bytes_sent", "frames_sent", "write_pauses", "max_write_buffer")

    def __init__(self, core: ReceiveCore) -> None:
        self._core = core
        self.bytes_sent = 0
        self.frames_sent = 0
        self.write_pauses = 0
        self.max_write_buffer = 0

    @property
    def bytes_received(self) -> int:
        return self._core._bytes_received

    @property
    def frames_received(self) -> int:
        return self._core._frames_received

    def __repr__(self) -> str:
        return (
            f"ConnectionStats(bytes_sent={self.bytes_sent}, bytes_received={self.bytes_received}, "
            f"frames_sent={self.frames_sent}, frames_received={self.frames_received}, "
            f"write_pauses={self.write_pauses}, max_write_buffer={self.max_write_buffer})"
        )


class Connection(ReceiveCore, asyncio.BufferedProtocol, Endpoint):
    """One framed, authenticated connection to a peer process.

    Made by :func:`~poseidon_aio.net.dial.connect` and :func:`~poseidon_aio.net.listener.listen`,
    which return it once the handshake is complete.

    Args:
        role: ``Role.CLIENT`` if this side dialled.
        rank: this process's rank (sent as the sender of every frame).
        config: :class:`NetConfig`.
        process_shaper: a :class:`Shaper` shared by all connections of the process, or ``None``.
        protocol: protocol version to announce (tests use another to check refusal).
        same_host: the peer is a process of this host (the shared-memory link): ask for no
            payload CRC32C, since its bytes cross no NIC, switch or cable.

    The handshake deadline (``config.handshake_timeout``) runs from construction, that is from
    accept on a listener, whether or not a transport ever comes up (with TLS the loop calls
    ``connection_made`` only once TLS is up).
    """

    def __init__(
        self,
        role: Role,
        rank: int,
        config: NetConfig,
        *,
        process_shaper: Optional[Shaper] = None,
        protocol: int = PROTOCOL_VERSION,
        same_host: bool = False,
    ) -> None:
        self._init_endpoint(asyncio.get_running_loop(), rank, config.inbox_high_water)
        self._init_receive(max_payload=HANDSHAKE_MAX_PAYLOAD, memory_budget=config.memory_budget)
        self.role = role
        self.config = config
        self.peer_address = "unknown address"
        self.stats = ConnectionStats(self)
        #: What carries the frames, once connected: ``"tcp"``, ``"tls"``, or ``"shm"`` (shared
        #: memory with a peer on this host, :mod:`poseidon_aio.net.shm`).
        self.via = ""
        # Bytes between two processes of one host cross no NIC or switch: the rings ask for no CRC.
        asks = config.payload_checksum and config.tls is None and not same_host
        self._handshake = Handshake(role, rank, config.token, protocol=protocol, checksum=asks)
        # Handshake frames always carry a payload CRC32C (they are tiny); from WELCOME on, frames
        # do when the two ends agreed to (Handshake.checksum).
        self._checksum = True
        self._transport: Optional[asyncio.Transport] = None
        self._ready = self._loop.create_future()
        self._turns = WriteTurns(self._loop)
        self._gathered: list = []  # small frames not yet handed to the transport (_flush)
        self._gathered_bytes = 0
        self._gather_max = min(_GATHER_MAX, config.write_high_water)
        self._flush_soon = False  # a _flush is scheduled for the loop's next pass
        self._read_pauses: set = set()
        self._last_send = self._loop.time()
        self._timer: Optional[asyncio.TimerHandle] = None
        self._closing = False
        self._lowat_sock = None  # a plain TCP socket whose SO_RCVLOWAT follows the payload
        self._lowat_owned = False  # whether _lowat_sock is our own duplicate, closed with the link
        # From accept, not from connection_made: with TLS the loop calls connection_made only once
        # TLS is up, and a peer that never finishes it must not hold this connection forever.
        self._handshake_timer: Optional[asyncio.TimerHandle] = self._loop.call_later(
            config.handshake_timeout, self._handshake_expired
        )
        own = Shaper.from_config(config.shaper)
        self._egress = [b for b in (own.egress, process_shaper and process_shaper.egress) if b]
        self._ingress = [b for b in (own.ingress, process_shaper and process_shaper.ingress) if b]
        self._writelines_copies = _WRITELINES_COPIES and not is_uvloop(self._loop)

    # -- public API -------------------------------------------------------------------------

    def __repr__(self) -> str:
        return f"<Connection rank {self.rank} <-> rank {self.peer_rank} at {self.peer_address} via {self.via or '?'}>"

    @property
    def where(self) -> str:
        """Names the peer for error messages."""
        rank = self.peer_rank if self.peer_rank is not None else "?"
        return f"rank {rank}{self.peer_host} at {self.peer_address}"

    @property
    def claimed_rank(self) -> Optional[int]:
        """The rank the peer named in its handshake, authenticated or not (``None`` before)."""
        return self._handshake.peer_rank

    @property
    def is_open(self) -> bool:
        return self._exc is None and self._transport is not None

    @property
    def payload_checksum(self) -> bool:
        """Whether frames on this connection carry and are checked against a payload CRC32C
        (settled by the handshake: either end asked, and there is no TLS)."""
        return self._checksum

    @property
    def unclaimed_bytes(self) -> int:
        """Bytes held for frames nobody has claimed: what ``config.memory_budget`` bounds.

        The inbox plus the buffer the decoder allocated for the payload being received (0 while
        that payload lands in a registered destination).
        """
        return self._inbox_bytes + self._decoder.own_payload_bytes

    async def wait_ready(self) -> "Connection":
        """Wait for the handshake (bounded by ``config.handshake_timeout``)."""
        return await asyncio.shield(self._ready)

    async def send(
        self,
        kind: Kind,
        payload=b"",
        *,
        key: int = 0,
        clock: int = 0,
        dtype: DType = DType.BYTES,
        flags: int = 0,
        priority: int = 0,
    ) -> None:
        """Send one frame; return once it is handed to the transport.

        The payload is not copied: it must stay unchanged until the peer has it (in practice,
        until the reply that depends on it arrives).

        Args:
            kind, key, clock, dtype, flags: header fields (see ``docs/wire.md``).
            payload: any C-contiguous buffer (bytes, bytearray, memoryview, NumPy array), or a
                list of them sent back to back as one payload (gathered, not copied).
            priority: lower values go first among frames waiting on backpressure or the shaper.
        Raises:
            ConnectionLost: the connection is closed or broke (the cause is chained).
            LocalProtocolError: a header field is out of range.

        >>> # await conn.send(Kind.PUSH, grad.numpy(), key=3, clock=t, dtype=DType.FLOAT32)
        """
        self._raise_if_closed()
        parts, nbytes = self._build_frame(kind, payload, key, clock, dtype, flags)
        for bucket in self._egress:
            await bucket.acquire(bucket.cost_of(nbytes, kind), priority)
        if self._turns.busy:
            await self._turns.wait(priority)
        self._raise_if_closed()  # (again: the link may have ended while this frame waited)
        self._write(parts, nbytes)

    def try_send(
        self,
        kind: Kind,
        payload=b"",
        *,
        key: int = 0,
        clock: int = 0,
        dtype: DType = DType.BYTES,
        flags: int = 0,
        priority: int = 0,
    ) -> bool:
        """Send one frame now if nothing stands before it: no shaper, no backpressure, no sender
        waiting its turn. Returns ``False`` (nothing sent) otherwise; then ``await send(...)``.

        A coroutine per frame costs its creation and a task to run it; on the hot path of a
        step most frames go straight out, so they skip both.

        Raises:
            ConnectionLost, LocalProtocolError: as :meth:`send`.
        """
        if self._egress or self._turns.busy:
            return False
        self._raise_if_closed()
        self._write(*self._build_frame(kind, payload, key, clock, dtype, flags))
        return True

    async def close(self) -> None:
        """Say GOODBYE, flush what is queued and close (bounded by ``config.close_timeout``).

        Pending waiters on this side fail with :class:`ConnectionLost`.
        """
        if self._transport is not None and self._exc is None and self._handshake.ready:
            self._write_control(Kind.GOODBYE)
        self._closing = True
        self._fail(ConnectionLost(f"connection to {self.where} was closed by rank {self.rank}"), "close")
        try:
            async with asyncio.timeout(self.config.close_timeout):
                await asyncio.shield(self._closed)
        except TimeoutError:
            if self._transport is not None:
                self._transport.abort()

    def abort(self) -> None:
        """Drop the connection at once (no GOODBYE, no flush)."""
        self._fail(ConnectionLost(f"connection to {self.where} was aborted by rank {self.rank}"), "abort")

    def _discard(self) -> None:
        # Its TCP or TLS set-up failed, or its listener closed: stop the handshake timer, no warning.
        self._closing = True
        self.abort()

    # -- asyncio protocol callbacks ---------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if self._exc is not None:
            # The handshake deadline passed, or the listener closed, while the loop was still
            # bringing the transport up (negotiating TLS).
            transport.abort()
            return
        self._transport = transport  # type: ignore[assignment]
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple):  # a same-host peer's name is set by whoever made the link
            self.peer_address = f"{peer[0]}:{peer[1]}"
        sock = transport.get_extra_info("socket")
        if transport.get_extra_info("shm") is not None:
            self.via = "shm"
        else:
            self.via = "tls" if transport.get_extra_info("sslcontext") is not None else "tcp"
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if transport.get_extra_info("sslcontext") is None and LOWAT_OPT is not None:
                self._lowat_sock, self._lowat_owned = option_socket(sock)
        transport.set_write_buffer_limits(self.config.write_high_water, self.config.write_low_water)
        self._handshake.peer = self.peer_address
        self._handshake.tls = self._channel_binding(transport)
        for kind, payload in self._handshake.start():
            self._write_control(kind, payload, DType.JSON)
        self._arm_tick()

    def _channel_binding(self, transport: asyncio.BaseTransport) -> str:
        """The listener's certificate as this end sees it (SHA-256 hex), or "" without TLS."""
        ssl_object = transport.get_extra_info("ssl_object")
        if ssl_object is None:
            return ""
        if self.role is Role.SERVER:
            return self.config.tls.fingerprint
        der = ssl_object.getpeercert(binary_form=True)
        return hashlib.sha256(der).hexdigest() if der else "no certificate"

    def _transport_failed(self, exc: BaseException, tls: bool) -> None:
        """The loop could not bring the transport up: TLS failed or timed out, or the peer left."""
        what = "TLS handshake" if tls else "connection set-up"
        if isinstance(exc, HandshakeError):  # refused in words of its own (a same-host link's rings)
            self._fail(exc, "none")
        else:
            self._fail(HandshakeError(f"{what} with {self.peer_address} failed: {exc!r}"), "none", exc)
        if not self._closed.done():
            self._closed.set_result(None)  # connection_lost will not come: there was no connection

    def _shape_ingress(self, nbytes: int) -> None:
        for bucket in self._ingress:
            delay = bucket.reserve(nbytes)
            if delay > 0:
                self._pause_reading("ingress")
                self._loop.call_later(delay, self._resume_reading, "ingress")

    def _set_lowat(self, lowat: int) -> None:
        """Set the socket's receive mark (the receive core's ``_tune_lowat`` says when)."""
        try:
            self._lowat_sock.setsockopt(socket.SOL_SOCKET, LOWAT_OPT, lowat)
        except OSError:
            if self._lowat_owned:
                self._lowat_sock.close()
            self._lowat_sock = None  # not supported here: segment by segment, as before
            return
        self._lowat = lowat

    def eof_received(self) -> bool:
        return False  # close our side too; connection_lost reports it

    def pause_writing(self) -> None:
        self._turns.pause()
        self.stats.write_pauses += 1

    def resume_writing(self) -> None:
        self._turns.resume()

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._transport = None
        if self._lowat_sock is not None and self._lowat_owned:
            self._lowat_sock.close()  # our duplicate of the descriptor (sockopts.option_socket)
        self._lowat_sock = None
        if self._exc is None:
            partial = self._decoder.partial
            detail = f": {exc}" if exc else " (the peer closed it without GOODBYE)"
            if partial is not None:
                header, got = partial
                detail += (
                    f"; {got} of {header.length} payload bytes of {header.kind.name} key {header.key} "
                    f"clock {header.clock} had arrived"
                )
            self._fail(ConnectionLost(f"connection to {self.where} was lost{detail}"), "none")
        if not self._closed.done():
            self._closed.set_result(None)

    # -- receive side -----------------------------------------------------------------------

    def _on_control_frame(self, frame: Frame) -> None:
        kind = frame.kind
        if kind is Kind.GOODBYE:
            self._closing = True
            self._fail(ConnectionLost(f"{self.where} closed the connection (GOODBYE)"), "close")
        elif kind is Kind.ERROR:
            self._fail(RemoteProtocolError(f"{self.where} reported an error: {_error_text(frame)}"), "abort")
        else:
            self._fail(RemoteProtocolError(f"{self.where} sent {kind.name} after the handshake"), "error")

    def _on_handshake_frame(self, frame: Frame) -> None:
        try:
            replies = self._handshake.receive(frame)
        except HandshakeError as exc:  # the peer refused us: it already knows why
            self._fail(exc, "abort")
            return
        for kind, payload in replies:
            self._write_control(kind, payload, DType.JSON)
        if self._handshake.error is not None:
            self._fail(self._handshake.error, "close")
        elif self._handshake.ready:
            self.peer_rank = self._handshake.peer_rank
            self._decoder.max_payload = self.config.max_payload
            self._checksum = self._handshake.checksum
            self._decoder.require_checksum = self._checksum
            self._handshaken = True
            self._handshake_timer.cancel()
            self._ready.set_result(self)

    def _handshake_expired(self) -> None:
        if not self._handshake.ready:
            if self._transport is not None:
                stage = f"handshake state {self._handshake.state.value}"
            elif self.config.tls is not None:
                stage = "TLS still negotiating"
            else:
                stage = "no transport yet"
            self._fail(
                PeerTimeout(
                    f"handshake with {self.peer_address} did not complete within "
                    f"{self.config.handshake_timeout} s ({stage}); rank {self.rank} dropped it"
                ),
                "abort",
            )

    def _on_inbox_full(self) -> None:
        self._pause_reading("inbox")

    def _on_inbox_drained(self) -> None:
        if "inbox" in self._read_pauses:
            self._resume_reading("inbox")

    def _pause_reading(self, why: str) -> None:
        if not self._read_pauses and self._transport is not None:
            self._transport.pause_reading()
        self._read_pauses.add(why)

    def _resume_reading(self, why: str) -> None:
        self._read_pauses.discard(why)
        if not self._read_pauses and self._transport is not None:
            self._transport.resume_reading()

    # -- send side --------------------------------------------------------------------------

    def _build_frame(self, kind: Kind, payload, key: int, clock: int, dtype: DType, flags: int) -> tuple:
        """``([header, *payload views], total bytes)``: what :meth:`_write` takes."""
        views, length = payload_views(payload)
        crc = payload_crc(views) if self._checksum else None
        header = encode_header(
            kind, rank=self.rank, key=key, clock=clock, length=length, dtype=dtype, flags=flags, payload_crc=crc
        )
        return [header, *views], len(header) + length

    def _write(self, parts: list, nbytes: int) -> None:
        """Hand a frame to the transport (the caller has checked the link is open)."""
        if nbytes < _JOIN_BELOW:
            self._gather(b"".join(parts), nbytes)
        else:
            if self._gathered:
                self._flush()  # what was written before goes before
            transport = self._transport
            if self._writelines_copies:
                for part in parts:
                    transport.write(part)
            else:
                transport.writelines(parts)
            self._note_buffered(transport)
        self.stats.bytes_sent += nbytes
        self.stats.frames_sent += 1
        self._last_send = self._loop.time()
        self._turns.wake()

    def _gather(self, frame: bytes, nbytes: int) -> None:
        self._gathered.append(frame)
        self._gathered_bytes += nbytes
        if self._gathered_bytes >= self._gather_max:
            self._flush()
        elif not self._flush_soon:
            self._flush_soon = True
            self._loop.call_soon(self._flush_scheduled)

    def _flush_scheduled(self) -> None:
        self._flush_soon = False
        self._flush()

    def _flush(self) -> None:
        """Hand the gathered small frames to the transport, in one write."""
        gathered = self._gathered
        if not gathered:
            return
        self._gathered = []
        self._gathered_bytes = 0
        transport = self._transport
        if transport is None:  # the link is gone, and with it these frames (as the transport's own)
            return
        if len(gathered) == 1:
            transport.write(gathered[0])
        else:
            transport.writelines(gathered)
        self._note_buffered(transport)

    def _note_buffered(self, transport: asyncio.Transport) -> None:
        buffered = transport.get_write_buffer_size()
        if buffered > self.stats.max_write_buffer:
            self.stats.max_write_buffer = buffered

    def _write_control(self, kind: Kind, payload: bytes = b"", dtype: DType = DType.BYTES) -> None:
        # Control frames are tiny and must not queue behind data (a heartbeat stuck behind 100 MB
        # of gradients would time the peer out), so they skip backpressure and the shaper; they go
        # at once, after the small frames gathered before them and in the same write.
        if self._transport is None:
            return
        self._gathered.append(encode_frame(kind, payload, rank=self.rank, dtype=dtype, checksum=self._checksum))
        self._flush()
        self._last_send = self._loop.time()

    # -- liveness ---------------------------------------------------------------------------

    def _arm_tick(self) -> None:
        self._timer = self._loop.call_later(self.config.heartbeat_interval / 2, self._tick)

    def _tick(self) -> None:
        self._timer = None
        if self._exc is not None:
            return
        now = self._loop.time()
        # _last_recv is on time.monotonic()'s clock: the receive core stamps it without the loop.
        if self._read_pauses:
            self._last_recv = time.monotonic()  # we chose not to read; silence is ours, not the peer's
        if time.monotonic() - self._last_recv > self.config.idle_timeout:
            self._fail(
                PeerTimeout(
                    f"no bytes from {self.where} for {self.config.idle_timeout} s (idle timeout): "
                    "the peer process is hung or the network is down"
                ),
                "abort",
            )
            return
        if (
            self._handshake.ready
            and not self._turns.paused
            and now - self._last_send >= self.config.heartbeat_interval / 2
        ):
            self._write_control(Kind.HEARTBEAT)
        self._arm_tick()

    # -- failure ----------------------------------------------------------------------------

    def _raise_if_closed(self) -> None:
        if self._exc is not None:
            raise self._lost()
        if self._transport is None:
            raise LocalProtocolError(f"connection to {self.where} is not established")

    def _fail(self, exc: BaseException, how: str, cause: Optional[BaseException] = None) -> None:
        """End the connection because of ``exc``; fail every waiter.

        ``how``: "close" flushes queued bytes first; "error" also tells the peer why with an
        ERROR frame; "abort" drops the connection at once; "none" means it is already gone.
        """
        if self._exc is not None:
            return
        self._exc = exc
        if cause is not None:
            exc.__cause__ = cause
        quiet = isinstance(exc, ConnectionLost) and self._closing
        # A listener logs the refusal of an accepted connection that never got through its
        # handshake; a second line here would double what a flood of such peers writes.
        quiet = quiet or (self.role is Role.SERVER and not self._handshake.ready)
        level = logging.DEBUG if quiet else logging.WARNING
        log.log(level, "rank %s: connection to %s ended: %s", self.rank, self.where, exc)
        for timer in (self._timer, self._handshake_timer):
            if timer is not None:
                timer.cancel()
        if not self._ready.done():
            self._ready.set_exception(exc)
            silence(self._ready)
        self._fail_waiters()
        self._turns.fail(self._lost())
        transport = self._transport
        if transport is None or how in ("none", "abort"):
            self._gathered, self._gathered_bytes = [], 0  # dropped, as an abort drops the transport's
            if transport is not None and how == "abort":
                transport.abort()
            return
        if how == "error":
            payload = json.dumps({"reason": "protocol", "message": str(exc)}).encode()
            self._write_control(Kind.ERROR, payload, DType.JSON)
        self._flush()
        transport.close()


def _error_text(frame: Frame) -> str:
    try:
        info = json.loads(bytes(frame.payload).decode("utf-8"))
        return str(info.get("message", info))
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return repr(bytes(frame.payload[:200]))
