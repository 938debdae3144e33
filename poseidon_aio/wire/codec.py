"""Pure-Python frame codec: the reference implementation and the fallback.

Sans-IO in the h11 / asyncpg sense: bytes in, frames out; no asyncio, socket or torch. The Cython
twin in ``_ext/codec.pyx`` has the same contract, the same error messages and one shared test suite.

Two ways to feed the :class:`FrameDecoder`:

* ``feed(data)`` copies bytes in (an ``asyncio.Protocol`` or a test);
* ``get_buffer()`` / ``buffer_updated(n)`` let the caller's ``recv_into`` write straight into the
  decoder (an ``asyncio.BufferedProtocol``). While a payload with a destination is being read and no
  bytes are buffered ahead of it, ``get_buffer()`` returns the unfilled tail of that destination, so
  the kernel writes payload bytes exactly once: into the receive tensor.

``next_frame()`` then returns complete :class:`Frame` objects, or ``None`` when it needs more bytes.

A frame whose header carries a payload CRC32C is checked as its bytes arrive: each piece is
folded into a running CRC right after it lands in its destination, so a large payload is not read
a second time, and a frame whose payload does not match is never handed out (``FrameError``).

A payload nobody registered a destination for lands in a buffer the decoder allocates, and that
buffer grows with the bytes that actually arrive (doubling, up to the announced length): a peer
that announces 1 GiB and sends 1 MiB costs the receiver about 2 MiB, not 1 GiB.
"""

from __future__ import annotations

import operator
import zlib
from typing import Callable, Optional

from ..errors import FrameError, LocalProtocolError, WireVersionMismatch
from .layout import (
    CHECKED_SIZE,
    DEFAULT_MAX_PAYLOAD,
    FLAG_PAYLOAD_CRC,
    HEADER_SIZE,
    HEADER_STRUCT,
    INITIAL_PAYLOAD_BUFFER,
    ITEMSIZE_BY_CODE,
    KNOWN_KINDS,
    MAGIC,
    U32_MAX,
    U64_MAX,
    USER_FLAGS_MAX,
    VERSION,
    DType,
    Frame,
    Header,
    Kind,
)
from .checksum import extend as _crc32c

__all__ = ["encode_header", "decode_header", "frame_parts", "encode_frame", "byte_view", "FrameDecoder"]

Allocator = Callable[[Header], Optional[object]]

_pack = HEADER_STRUCT.pack
_unpack_from = HEADER_STRUCT.unpack_from
_crc32 = zlib.crc32


def _check_field(name: str, value: int, upper: int) -> int:
    value = int(value)
    if not 0 <= value <= upper:
        raise LocalProtocolError(f"frame field {name}={value} is outside 0..{upper}")
    return value


def encode_header(
    kind: int,
    *,
    rank: int = 0,
    key: int = 0,
    clock: int = 0,
    length: int = 0,
    dtype: int = DType.BYTES,
    flags: int = 0,
    payload_crc: Optional[int] = None,
) -> bytes:
    """Encode one 44-byte frame header.

    Args:
        kind: a :class:`Kind`.
        rank: sender rank (u32). key: key-value pair or layer id (u32). clock: iteration (u64).
        length: payload bytes that follow (u64). dtype: a :class:`DType`. flags: the layer
            above's bits 0-14. payload_crc: the payload's CRC32C (u32), or ``None`` to send none.
    Returns:
        The header bytes, checksum included.
    Raises:
        LocalProtocolError: a field is out of range, the kind or dtype is unknown, or ``length``
            is not a whole number of ``dtype`` items.

    >>> len(encode_header(Kind.PUSH, rank=1, key=7, clock=3, length=8, dtype=DType.FLOAT32))
    44
    """
    kind = int(kind)
    dtype = int(dtype)
    if kind not in KNOWN_KINDS:
        raise LocalProtocolError(f"cannot encode unknown frame kind {kind}")
    itemsize = ITEMSIZE_BY_CODE.get(dtype)
    if itemsize is None:
        raise LocalProtocolError(f"cannot encode unknown payload dtype {dtype}")
    length = _check_field("length", length, U64_MAX)
    if length % itemsize:
        raise LocalProtocolError(f"payload of {length} bytes is not a whole number of {DType(dtype).name} items")
    flags = _check_field("flags", flags, USER_FLAGS_MAX)
    if payload_crc is None:
        payload_crc = 0
    else:
        payload_crc = _check_field("payload_crc", payload_crc, U32_MAX)
        flags |= FLAG_PAYLOAD_CRC
    body = _pack(
        MAGIC,
        VERSION,
        kind,
        flags,
        _check_field("rank", rank, U32_MAX),
        _check_field("key", key, U32_MAX),
        _check_field("clock", clock, U64_MAX),
        length,
        dtype,
        payload_crc,
    )
    return body + (_crc32(body) & 0xFFFFFFFF).to_bytes(4, "little")


def decode_header(data, max_payload: int = DEFAULT_MAX_PAYLOAD) -> Header:
    """Decode and validate the first 44 bytes of ``data``.

    Raises:
        FrameError: bad magic, unknown version, checksum mismatch, unknown kind or dtype, length
            over ``max_payload`` or not a whole number of items.
        LocalProtocolError: ``data`` is shorter than a header (a caller bug, not a peer's).
    """
    if len(data) < HEADER_SIZE:
        raise LocalProtocolError(f"a frame header needs {HEADER_SIZE} bytes, got {len(data)}")
    if len(data) >= 5 and bytes(data[:4]) == MAGIC and data[4] != VERSION:
        # Checked before the layout of this version is read: another version's header may differ.
        raise version_mismatch(data[4])
    magic, version, kind, flags, rank, key, clock, length, dtype, crc = _unpack_from(data, 0)
    if magic != MAGIC:
        raise FrameError(f"bad magic {bytes(magic)!r} (expected {MAGIC!r}): not a poseidon_aio stream")
    checksum = int.from_bytes(data[CHECKED_SIZE:HEADER_SIZE], "little")
    expected = _crc32(data[:CHECKED_SIZE]) & 0xFFFFFFFF
    if checksum != expected:
        raise FrameError(f"header checksum mismatch (got {checksum:#010x}, computed {expected:#010x})")
    if kind not in KNOWN_KINDS:
        raise FrameError(f"unknown frame kind {kind} from rank {rank}")
    itemsize = ITEMSIZE_BY_CODE.get(dtype)
    if itemsize is None:
        raise FrameError(f"unknown payload dtype {dtype} in frame kind {kind} from rank {rank}")
    if length > max_payload:
        raise FrameError(
            f"payload of {length} bytes exceeds the maximum of {max_payload} "
            f"(kind {kind}, rank {rank}, key {key}, clock {clock})"
        )
    if length % itemsize:
        raise FrameError(
            f"payload of {length} bytes is not a whole number of {itemsize}-byte items "
            f"(kind {kind}, rank {rank}, key {key}, clock {clock})"
        )
    return Header(
        Kind(kind),
        rank,
        key,
        clock,
        length,
        DType(dtype),
        flags & USER_FLAGS_MAX,
        version,
        crc if flags & FLAG_PAYLOAD_CRC else None,
    )


def byte_view(payload) -> memoryview:
    """A flat unsigned-byte view of any C-contiguous buffer, without copying."""
    view = payload if isinstance(payload, memoryview) else memoryview(payload)
    if view.ndim != 1 or view.format != "B":
        if not view.c_contiguous:
            raise LocalProtocolError("payload buffers must be C-contiguous")
        if view.nbytes == 0:
            # memoryview refuses to cast a view with a zero in its shape (a (0, N) array: an
            # SFB layer this rank did not use contributes K = 0 rows).
            return memoryview(bytearray(0))
        view = view.cast("B")
    return view


_NBYTES = operator.attrgetter("nbytes")


def payload_views(payload) -> tuple:
    """``(views, bytes)``: flat byte views of a payload given as one buffer or a list (or tuple)
    of them, sent back to back (gathered, not copied), and their total size."""
    if isinstance(payload, (list, tuple)):
        views = [byte_view(p) for p in payload]
        return views, sum(map(_NBYTES, views))
    view = byte_view(payload)
    return [view], view.nbytes


def frame_parts(
    kind: int,
    payload=b"",
    *,
    rank: int = 0,
    key: int = 0,
    clock: int = 0,
    dtype: int = DType.BYTES,
    flags: int = 0,
    checksum: bool = False,
) -> list:
    """Return ``[header, payload_view]`` for ``transport.writelines``: the payload is not copied.

    ``checksum=True`` puts the payload's CRC32C in the header.

    >>> parts = frame_parts(Kind.DATA, b"abc", rank=0, key=1, clock=2)
    >>> len(parts[0]), bytes(parts[1])
    (40, b'abc')
    """
    view = byte_view(payload)
    crc = _crc32c(view) if checksum else None
    header = encode_header(
        kind, rank=rank, key=key, clock=clock, length=view.nbytes, dtype=dtype, flags=flags, payload_crc=crc
    )
    return [header, view]


def encode_frame(kind: int, payload=b"", **fields) -> bytes:
    """One frame as a single bytes object (tests and small control frames)."""
    header, view = frame_parts(kind, payload, **fields)
    return header + view.tobytes()


class FrameDecoder:
    """Incremental frame decoder.

    Args:
        max_payload: frames announcing more payload bytes raise :class:`FrameError`.
        allocate: called with each :class:`Header` whose length is > 0; returns a writable
            C-contiguous buffer of exactly ``header.length`` bytes to receive the payload (zero
            copy), or ``None`` to let the decoder allocate one.
        scratch_size: initial size of the buffer that holds headers and small frames.
        initial_payload_buffer: first size of a payload buffer the decoder allocates itself; it
            doubles as bytes arrive, up to the frame's length.
        require_checksum: refuse frames whose header carries no payload CRC32C (a connection
            sets it once both ends agreed to checksum). Frames that carry one are checked
            whatever this says.

    After a :class:`FrameError` the decoder is dead: every later call raises the same error. So
    it is after an exception from ``allocate``, or a destination of the wrong size: the header
    was consumed and its payload has nowhere to go.

    >>> dec = FrameDecoder()
    >>> dec.feed(encode_frame(Kind.DATA, b"hi", rank=3))
    >>> frame = dec.next_frame(); frame.rank, bytes(frame.payload)
    (3, b'hi')
    >>> dec.next_frame() is None
    True
    """

    def __init__(
        self,
        *,
        max_payload: int = DEFAULT_MAX_PAYLOAD,
        allocate: Optional[Allocator] = None,
        scratch_size: int = 1 << 16,
        initial_payload_buffer: int = INITIAL_PAYLOAD_BUFFER,
        require_checksum: bool = False,
    ) -> None:
        if scratch_size < HEADER_SIZE:
            raise LocalProtocolError(f"scratch_size must be at least {HEADER_SIZE}")
        if initial_payload_buffer < 1:
            raise LocalProtocolError("initial_payload_buffer must be at least 1 byte")
        self.max_payload = max_payload
        self.allocate = allocate
        self.require_checksum = require_checksum
        self._initial_payload = initial_payload_buffer
        self._buf = bytearray(scratch_size)
        self._view = memoryview(self._buf)
        self._start = 0
        self._end = 0
        self._header: Optional[Header] = None
        self._dest: Optional[memoryview] = None  # the payload's buffer; while owned, maybe short
        self._length = 0  # the payload's announced length
        self._owned = False  # the decoder allocated _dest (it grows) rather than `allocate`
        self._filled = 0
        self._lent_dest = False
        self._checking = False  # the frame in progress carries a payload CRC32C
        self._crc = 0  # CRC32C of its payload bytes received so far
        self._error: Optional[BaseException] = None

    # -- state ------------------------------------------------------------------------------

    @property
    def payload_remaining(self) -> int:
        """Bytes the frame being received still needs, once its header is in and nothing else is
        buffered (0 otherwise): until they are in there is no frame to act on."""
        if self._dest is not None and self._start == self._end:
            return self._length - self._filled
        return 0

    @property
    def buffered(self) -> int:
        """Bytes received but not yet part of a returned frame (scratch and partial payload)."""
        return self._end - self._start + self._filled

    @property
    def own_payload_bytes(self) -> int:
        """Size of the buffer the decoder allocated itself for the payload in progress.

        0 between frames and while the payload lands in a destination from ``allocate``.
        """
        return len(self._dest) if self._owned and self._dest is not None else 0

    @property
    def partial(self) -> Optional[tuple]:
        """``(header, bytes_received)`` of a frame whose payload is incomplete, else ``None``."""
        if self._header is None:
            return None
        return (self._header, self._filled)

    # -- input ------------------------------------------------------------------------------

    def feed(self, data) -> None:
        """Copy ``data`` in. Call :meth:`next_frame` until it returns ``None`` afterwards."""
        if self._error is not None:
            raise self._error
        view = byte_view(data)
        offset = 0
        if self._dest is not None and self._start == self._end:
            n = min(len(view), self._length - self._filled)
            if n:
                self._room(n)
                self._dest[self._filled : self._filled + n] = view[:n]
                if self._checking:
                    self._crc = _crc32c(view[:n], self._crc)
                self._filled += n
            offset = n
        rest = len(view) - offset
        if rest:
            self._reserve(rest)
            self._view[self._end : self._end + rest] = view[offset:]
            self._end += rest

    def get_buffer(self, sizehint: int = -1) -> memoryview:
        """A writable buffer for the next received bytes (``BufferedProtocol.get_buffer``)."""
        if self._error is not None:
            raise self._error
        if self._dest is not None and self._start == self._end and self._filled < self._length:
            self._room(1)
            self._lent_dest = True
            return self._dest[self._filled :]
        self._lent_dest = False
        self._reserve(max(sizehint, 1))
        return self._view[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        """Record that ``nbytes`` were written into the buffer :meth:`get_buffer` returned."""
        if self._lent_dest:
            if self._checking and nbytes:
                self._crc = _crc32c(self._dest[self._filled : self._filled + nbytes], self._crc)
            self._filled += nbytes
        else:
            self._end += nbytes

    def _reserve(self, n: int) -> None:
        if len(self._buf) - self._end >= n:
            return
        used = self._end - self._start
        if self._start and len(self._buf) - used >= n:
            self._view[:used] = self._view[self._start : self._end]
        else:
            size = len(self._buf)
            while size - used < n:
                size *= 2
            grown = bytearray(size)
            grown[:used] = self._view[self._start : self._end]
            self._view.release()
            self._buf = grown
            self._view = memoryview(grown)
        self._start, self._end = 0, used

    def _room(self, n: int) -> None:
        """Make the payload buffer hold ``n`` more bytes (``n <= length - filled``)."""
        need = self._filled + n
        size = len(self._dest)
        if need <= size:
            return
        size = min(self._length, max(need, 2 * size))
        grown = memoryview(bytearray(size))
        grown[: self._filled] = self._dest[: self._filled]  # view to view: one memcpy, no temporary
        self._dest = grown

    # -- output -----------------------------------------------------------------------------

    def next_frame(self) -> Optional[Frame]:
        """Return the next complete frame, or ``None`` if more bytes are needed.

        Raises:
            FrameError: the stream is malformed (the decoder stays failed).
            LocalProtocolError: ``allocate`` returned a buffer of the wrong size (ditto).
            Exception: whatever ``allocate`` raised (ditto).
        """
        if self._error is not None:
            raise self._error
        if self._header is None:
            if self._end - self._start < HEADER_SIZE:
                return None
            try:
                header = decode_header(self._view[self._start : self._start + HEADER_SIZE], self.max_payload)
                if header.payload_crc is None and self.require_checksum:
                    raise missing_checksum(header)
                self._start += HEADER_SIZE
                self._header = header
                self._checking = header.payload_crc is not None
                self._crc = 0
                self._set_destination(header)
            except Exception as exc:
                self._error = exc
                raise
            self._filled = 0
        need = self._length - self._filled
        have = self._end - self._start
        if need and have:
            n = need if need < have else have
            self._room(n)
            self._dest[self._filled : self._filled + n] = self._view[self._start : self._start + n]
            if self._checking:
                self._crc = _crc32c(self._view[self._start : self._start + n], self._crc)
            self._filled += n
            self._start += n
        if self._start == self._end:
            self._start = self._end = 0
        if self._filled < self._length:
            return None
        if self._checking and self._crc != self._header.payload_crc:
            self._error = payload_mismatch(self._header, self._crc)
            raise self._error
        frame = Frame(self._header, self._dest)
        self._header = None
        self._dest = None
        self._owned = False
        self._filled = 0
        return frame

    def _set_destination(self, header: Header) -> None:
        length = header.length
        self._length = length
        self._owned = False
        if length == 0:
            self._dest = memoryview(bytearray(0))
            return
        dest = self.allocate(header) if self.allocate is not None else None
        if dest is None:
            self._dest = memoryview(bytearray(min(length, self._initial_payload)))
            self._owned = True
            return
        view = byte_view(dest)
        if view.readonly or view.nbytes != length:
            raise LocalProtocolError(
                f"destination for kind {header.kind.name} key {header.key} clock {header.clock} "
                f"must be a writable buffer of {length} bytes, got "
                f"{view.nbytes} bytes{' (read-only)' if view.readonly else ''}"
            )
        self._dest = view


def version_mismatch(version: int) -> WireVersionMismatch:
    """The error for a header of another wire version (both codecs)."""
    return WireVersionMismatch(
        f"the peer speaks wire version {version}, this build speaks {VERSION}: "
        "run the same poseidon_aio release on every process"
    )


def payload_mismatch(header: Header, computed: int) -> FrameError:
    """The error for a payload whose CRC32C is not the one its header carries (both codecs)."""
    return FrameError(
        f"payload checksum mismatch in {header.kind.name} key {header.key} clock {header.clock} "
        f"from rank {header.rank} ({header.length} bytes; CRC32C sent {header.payload_crc:#010x}, "
        f"received {computed:#010x}): the bytes were corrupted on the way (NIC, switch, cable or "
        "memory), the frame was dropped unused; check that path's hardware and restart from the "
        "last checkpoint"
    )


def missing_checksum(header: Header) -> FrameError:
    """The error for a frame without a payload CRC32C where one is required (both codecs)."""
    return FrameError(
        f"{header.kind.name} key {header.key} clock {header.clock} from rank {header.rank} carries no "
        "payload checksum, and this connection agreed to checksum every payload: the peer's "
        "build does not follow the wire protocol"
    )
