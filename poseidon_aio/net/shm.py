"""Shared-memory rings as an asyncio transport: what carries a :class:`Connection` between two
workers on one host.

Each direction has a ring in an anonymous memory file (``memfd_create``), of the size its writer
chose (``NetConfig.same_host_ring_bytes``): the
sender copies its bytes in, the receiver copies them out straight into the protocol's buffer
(the decoder's, or a registered destination), and a connected Unix socket carries only the
doorbells: ``W n`` (n more bytes are in the ring) and ``R n`` (n bytes were taken, their space
is free). The ring file is handed over on that socket with ``SCM_RIGHTS`` before anything else,
so it has no name: nothing appears in ``/dev/shm``, and the kernel frees it with its last
mapping, however the processes end. The Unix socket is also how either side learns that the
other is gone (EOF or reset, at once, even after SIGKILL).

Rings rather than the Unix socket's own byte stream: a stream socket moves a large frame in
pieces of its buffer's size, each a wake-up of the receiving loop; a ring hands it over in steps
of ``_READ_STEP`` with one doorbell a pass of the loop (``python -m bench inside`` compares them).

The stream in the rings is the one a socket would carry, so the Connection on top runs the same
handshake, codec, heartbeats, GOODBYE and bounds. Backpressure is the socket's: a receiver that
pauses reading stops giving space back; the sender then queues in this transport and, above the
write high-water mark, pauses its protocol. A peer cannot make us fault or read out of bounds:
its ring file must be sealed against shrinking and growing, of the announced size, and a
doorbell that claims more than the ring holds ends the link.
"""

from __future__ import annotations

import asyncio
import fcntl
import mmap
import os
import socket
import struct
from collections import deque
from typing import Optional

from ..errors import HandshakeError, RemoteProtocolError

#: Bytes of the ring a process writes into, by default (``NetConfig.same_host_ring_bytes``), and
#: the bounds of what either side may choose: a whole number of pages (it is mapped).
RING_BYTES = 4 << 20
MIN_RING_BYTES, MAX_RING_BYTES = 64 << 10, 1 << 30
#: Whether this platform has what the rings need (memfd with seals, fd passing): Linux.
AVAILABLE = all(hasattr(os, n) for n in ("memfd_create", "MFD_ALLOW_SEALING")) and hasattr(fcntl, "F_ADD_SEALS")

# The ring offer each side sends first, with its ring's descriptor: magic, version, ring bytes.
_OFFER = struct.Struct("<4sII")
_MAGIC, _VERSION = b"PSHM", 1
_SEALS = (fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL) if AVAILABLE else 0
# Bytes handed to the protocol at a time: a protocol that pauses reading (its inbox full) stops
# within one step, as it would within one socket read, not a whole ring later.
_READ_STEP = 512 << 10
# A doorbell: b"W" (bytes written) or b"R" (bytes read back), and how many.
_BELL = struct.Struct("<cI")


def _new_ring(size: int) -> int:
    # Sealed: the peer that maps it can neither shrink it (its reads would fault: SIGBUS) nor
    # grow it, and nobody can take the seals off.
    fd = os.memfd_create("poseidon-aio-ring", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_ring(fd: int, size: int, peer: str) -> None:
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        raise HandshakeError(f"{peer} offered a ring that is not a sealed memory file: refused") from None
    if seals & _SEALS != _SEALS or os.fstat(fd).st_size != size:
        raise HandshakeError(f"{peer} offered a ring that is not sealed at {size} bytes: refused")


async def _readable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    ready = loop.create_future()
    loop.add_reader(sock.fileno(), lambda: ready.done() or ready.set_result(None))
    try:
        await ready
    finally:
        loop.remove_reader(sock.fileno())


def ring_size_problem(size: int) -> str:
    """Why ``size`` cannot be a ring's (``""``: it can)."""
    if not MIN_RING_BYTES <= size <= MAX_RING_BYTES:
        return f"{size} bytes, outside {MIN_RING_BYTES}..{MAX_RING_BYTES}"
    if size % mmap.PAGESIZE:
        return f"{size} bytes, not a whole number of {mmap.PAGESIZE}-byte pages"
    return ""


async def _exchange(sock: socket.socket, first: bool, peer: str, ring_bytes: int) -> tuple:
    """Send our ring's offer and take the peer's (the dialler goes first). Returns ``(our fd, its
    fd, its size)``."""
    loop = asyncio.get_running_loop()
    ours = _new_ring(ring_bytes)
    try:
        offer = _OFFER.pack(_MAGIC, _VERSION, ring_bytes)
        if first:
            socket.send_fds(sock, [offer], [ours])
        while True:
            await _readable(loop, sock)
            try:
                data, fds, _, _ = socket.recv_fds(sock, _OFFER.size, 1)
                break
            except BlockingIOError:
                continue
        try:
            if len(data) != _OFFER.size or len(fds) != 1:
                raise HandshakeError(f"{peer} did not offer a shared-memory ring (got {len(data)} bytes): refused")
            magic, version, size = _OFFER.unpack(data)
            if magic != _MAGIC or version != _VERSION:
                raise HandshakeError(
                    f"{peer} offered ring version {version} where this release uses version {_VERSION}: "
                    "run the same poseidon_aio release everywhere"
                )
            if problem := ring_size_problem(size):
                raise HandshakeError(f"{peer} offered a ring of {problem}: refused")
            _check_ring(fds[0], size, peer)
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        if not first:
            socket.send_fds(sock, [offer], [ours])
        return ours, fds[0], size
    except BaseException:
        os.close(ours)
        raise


async def open_link(
    sock: socket.socket, protocol: asyncio.BufferedProtocol, *, first: bool, peer: str, ring_bytes: int = RING_BYTES
):
    """Put ``protocol`` on shared-memory rings with the process at the other end of ``sock``.

    Args:
        sock: a connected, non-blocking AF_UNIX stream socket; the transport owns it after this.
        first: whether this side sends its ring first (the dialler does).
        peer: names the other side in errors.
        ring_bytes: the size of the ring this side writes into (the peer's is its own choice).
    Returns:
        The :class:`ShmTransport`; ``protocol.connection_made`` has been called.
    Raises:
        HandshakeError: the peer offered no ring, or one we may not map.
        OSError: the socket failed.
    """
    ours, theirs, their_bytes = await _exchange(sock, first, peer, ring_bytes)
    try:
        out_ring = mmap.mmap(ours, ring_bytes)
        in_ring = mmap.mmap(theirs, their_bytes, prot=mmap.PROT_READ)
    finally:
        os.close(ours)
        os.close(theirs)
    transport = ShmTransport(asyncio.get_running_loop(), protocol, out_ring, in_ring, sock)
    await asyncio.get_running_loop().connect_accepted_socket(lambda: _Bell(transport), sock)
    return transport


class _Bell(asyncio.Protocol):
    """The doorbell socket's protocol: hands each doorbell to its transport."""

    def __init__(self, transport: "ShmTransport") -> None:
        self._shm = transport
        self._partial = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._shm._bell_made(transport)

    def data_received(self, data: bytes) -> None:
        data = self._partial + data
        whole = len(data) - len(data) % _BELL.size
        self._partial = data[whole:]
        for what, n in _BELL.iter_unpack(data[:whole]):
            if self._shm._on_bell(what, n):
                return

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._shm._bell_lost(exc)


class ShmTransport(asyncio.Transport):
    """A byte stream through two shared-memory rings, as an asyncio transport for a
    ``BufferedProtocol``. Made by :func:`open_link`."""

    def __init__(self, loop, protocol, out_ring: mmap.mmap, in_ring: mmap.mmap, sock: socket.socket) -> None:
        super().__init__({"shm": (len(out_ring), len(in_ring)), "socket": sock, "peername": None})
        self._loop = loop
        self._protocol = protocol
        self._out_map, self._in_map = out_ring, in_ring
        self._out, self._in = memoryview(out_ring), memoryview(in_ring)
        self._out_size, self._in_size = len(out_ring), len(in_ring)
        self._written = self._taken_back = 0  # our ring: bytes put in, bytes the peer gave back
        self._read = self._unread = 0  # the peer's ring: bytes taken out, bytes announced not yet taken
        self._queue: deque = deque()  # what did not fit in our ring yet (views, not copies)
        self._queued = 0
        self._high, self._low = 4 << 20, 1 << 20
        self._writing_paused = False
        self._reading = True
        self._closing = False
        self._lost = False
        self._bell: Optional[asyncio.Transport] = None
        self._eof: Optional[tuple] = None  # (exc,) once the doorbell socket ended
        self._consume_scheduled = False
        self._announce = 0  # bytes put in our ring since the last doorbell
        self._announce_scheduled = False
        self._returning = 0  # bytes taken from the peer's ring since the last doorbell
        self._return_scheduled = False

    # -- asyncio.Transport ------------------------------------------------------------------

    def write(self, data) -> None:
        self._send([data])

    def writelines(self, list_of_data) -> None:
        self._send(list_of_data)

    def get_write_buffer_size(self) -> int:
        return self._queued

    def get_write_buffer_limits(self) -> tuple:
        return self._low, self._high

    def set_write_buffer_limits(self, high=None, low=None) -> None:
        self._high = 4 << 20 if high is None else high
        self._low = self._high // 4 if low is None else low

    def can_write_eof(self) -> bool:
        return False

    def is_closing(self) -> bool:
        return self._closing or self._lost

    def is_reading(self) -> bool:
        return self._reading and not self._lost

    def pause_reading(self) -> None:
        self._reading = False

    def resume_reading(self) -> None:
        if not self._reading:
            self._reading = True
            self._schedule_consume()

    def close(self) -> None:
        """Flush what is queued into the ring, then close the doorbell socket (the peer's EOF
        comes after every doorbell of ours)."""
        if self._closing or self._lost:
            return
        self._closing = True
        if not self._queue and self._bell is not None:
            self._ring_bell()
            self._bell.close()

    def abort(self) -> None:
        self._closing = True
        self._queue.clear()
        self._queued = 0
        if self._bell is not None:
            self._bell.abort()

    def get_protocol(self):
        return self._protocol

    def set_protocol(self, protocol) -> None:
        self._protocol = protocol

    # -- send side --------------------------------------------------------------------------

    def _send(self, parts) -> None:
        if self._closing or self._lost:
            return
        for part in parts:
            view = memoryview(part).cast("B")
            if view.nbytes:
                self._queue.append(view)
                self._queued += view.nbytes
        self._flush()

    def _flush(self) -> None:
        """Move queued bytes into our ring while it has room; ring the doorbell once."""
        put = 0
        while self._queue:
            room = self._out_size - (self._written - self._taken_back)
            if room == 0:
                break
            view = self._queue[0]
            pos = self._written % self._out_size
            k = min(room, view.nbytes, self._out_size - pos)
            self._out[pos : pos + k] = view[:k]
            self._written += k
            put += k
            if k == view.nbytes:
                self._queue.popleft()
            else:
                self._queue[0] = view[k:]
        self._queued -= put
        if put:
            # One doorbell for every write of this pass of the loop: a step's small frames
            # wake the peer once, not once each.
            self._announce += put
            if not self._announce_scheduled:
                self._announce_scheduled = True
                self._loop.call_soon(self._ring_bell)
        if not self._writing_paused and self._queued > self._high:
            self._writing_paused = True
            self._protocol.pause_writing()
        elif self._writing_paused and self._queued <= self._low:
            self._writing_paused = False
            self._protocol.resume_writing()
        if self._closing and not self._queue and self._bell is not None:
            self._ring_bell()
            self._bell.close()

    def _ring_bell(self) -> None:
        self._announce_scheduled = False
        if self._announce and not self._lost and not self._bell.is_closing():
            self._bell.write(_BELL.pack(b"W", self._announce))
        self._announce = 0

    # -- receive side -----------------------------------------------------------------------

    def _bell_made(self, bell: asyncio.Transport) -> None:
        self._bell = bell
        self._protocol.connection_made(self)

    def _on_bell(self, what: bytes, n: int) -> bool:
        """One doorbell from the peer; ``True`` when it ended the link."""
        if self._lost or self._eof is not None:
            return True
        if what == b"W" and self._unread + n <= self._in_size:
            self._unread += n
            self._schedule_consume()
            return False
        if what == b"R" and self._taken_back + n <= self._written:
            self._taken_back += n
            self._flush()
            return False
        self._bell.abort()
        self._eof = (
            RemoteProtocolError(
                f"doorbell {what!r} {n} does not fit the shared-memory ring ({self._unread} bytes unread of "
                f"{self._in_size}, {self._written - self._taken_back} of ours in flight): the peer is not a "
                "poseidon_aio process of this release"
            ),
        )
        return True

    def _schedule_consume(self) -> None:
        if not self._consume_scheduled:
            self._consume_scheduled = True
            self._loop.call_soon(self._consume)

    def _consume(self) -> None:
        """Copy announced bytes from the peer's ring into the protocol while it reads."""
        self._consume_scheduled = False
        if self._lost:
            return
        broken = self._eof is not None and (self._eof[0] is not None or self._closing)
        if not broken:
            while self._unread and self._reading and not self._lost:
                pos = self._read % self._in_size
                buf = memoryview(self._protocol.get_buffer(min(self._unread, _READ_STEP))).cast("B")
                k = min(buf.nbytes, self._unread, self._in_size - pos, _READ_STEP)
                buf[:k] = self._in[pos : pos + k]
                buf.release()
                self._read += k
                self._unread -= k
                self._give_back(k)
                self._protocol.buffer_updated(k)
        if self._eof is not None and (broken or not self._unread):
            self._finish(self._eof[0])

    def _give_back(self, n: int) -> None:
        """Return ``n`` bytes of the peer's ring with one doorbell a pass of the loop. It is
        scheduled before the protocol sees the bytes, so it goes out before the doorbell of
        anything the protocol writes in reply (a CHALLENGE, an ERROR): a peer that closes on
        reading that reply never makes this one fail, and with it the bytes it sent last."""
        self._returning += n
        if not self._return_scheduled:
            self._return_scheduled = True
            self._loop.call_soon(self._return_space)

    def _return_space(self) -> None:
        self._return_scheduled = False
        if self._returning and self._eof is None and not self._closing and not self._lost:
            self._bell.write(_BELL.pack(b"R", self._returning))
        self._returning = 0

    def _bell_lost(self, exc: Optional[Exception]) -> None:
        if self._eof is None:
            self._eof = (exc,)
        # The peer's clean EOF still delivers what it put in the ring before (its GOODBYE), once
        # the protocol reads again; a broken link, or one we closed, ends now.
        self._schedule_consume()

    def _finish(self, exc: Optional[BaseException]) -> None:
        if self._lost:
            return
        self._lost = True
        self._queue.clear()
        self._queued = 0
        self._out.release()
        self._in.release()
        self._out_map.close()
        self._in_map.close()
        self._protocol.connection_lost(exc)
