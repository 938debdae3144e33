# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Compiled twin of ``poseidon_aio/wire/codec.py``: same contract, same errors, same messages.

Header encode/decode and the stream decoder's bookkeeping run in C; the header's CRC-32 uses a
table built at import (the IEEE polynomial zlib uses, so both codecs agree bit for bit). Payload
bytes are moved with one ``memcpy`` from the scratch buffer, or not at all when the kernel wrote
them straight into the destination; a payload buffer the decoder owns grows as bytes arrive, like
the twin's. The payload's CRC32C is the ``crc32c`` package's (CPU instructions), extended with
each piece as it lands, as in the twin. Imports nothing from asyncio, socket or torch.
"""

from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_FromStringAndSize
from cpython.bytes cimport PyBytes_FromStringAndSize, PyBytes_AS_STRING
from cpython.object cimport PyObject_GenericSetAttr
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t
from libc.string cimport memcpy, memmove

from poseidon_aio.errors import FrameError, LocalProtocolError
from poseidon_aio.wire.checksum import extend as _crc32c_extend
from poseidon_aio.wire.codec import missing_checksum, payload_mismatch, version_mismatch
from poseidon_aio.wire.layout import (
    DEFAULT_MAX_PAYLOAD, INITIAL_PAYLOAD_BUFFER, ITEMSIZE_BY_CODE, KNOWN_KINDS, MAGIC, DType, Frame, Header,
    Kind,
)

DEF HEADER_SIZE = 44
DEF CHECKED_SIZE = 40
DEF VERSION = 2
DEF FLAG_PAYLOAD_CRC = 0x8000
DEF USER_FLAGS_MAX = 0x7FFF

cdef uint32_t _CRC_TABLE[256]
cdef uint32_t _MAGIC = <uint32_t>0x4E445350u  # b"PSDN" read little-endian

cdef void _init_crc_table() noexcept:
    cdef uint32_t c
    cdef int n, k
    for n in range(256):
        c = <uint32_t>n
        for k in range(8):
            if c & 1:
                c = (<uint32_t>0xEDB88320u) ^ (c >> 1)
            else:
                c = c >> 1
        _CRC_TABLE[n] = c

_init_crc_table()

# Header and Frame are frozen slotted dataclasses whose __init__ runs as Python code, once per
# frame: a frame decoded here gets its slots filled from C instead, as that __init__ fills them.
cdef object _new_instance = object.__new__


cdef inline object _header(kind, rank, key, clock, length, dtype, flags, version, payload_crc):
    header = _new_instance(Header)
    PyObject_GenericSetAttr(header, "kind", kind)
    PyObject_GenericSetAttr(header, "rank", rank)
    PyObject_GenericSetAttr(header, "key", key)
    PyObject_GenericSetAttr(header, "clock", clock)
    PyObject_GenericSetAttr(header, "length", length)
    PyObject_GenericSetAttr(header, "dtype", dtype)
    PyObject_GenericSetAttr(header, "flags", flags)
    PyObject_GenericSetAttr(header, "version", version)
    PyObject_GenericSetAttr(header, "payload_crc", payload_crc)
    return header


cdef inline object _frame(header, payload):
    frame = _new_instance(Frame)
    PyObject_GenericSetAttr(frame, "header", header)
    PyObject_GenericSetAttr(frame, "payload", payload)
    return frame


cdef dict _KINDS = {int(k): k for k in Kind}
cdef dict _DTYPES = {int(d): d for d in DType}
cdef dict _ITEMSIZE = dict(ITEMSIZE_BY_CODE)


cdef inline uint32_t _crc32(const uint8_t* p, Py_ssize_t n) noexcept nogil:
    cdef uint32_t ones = <uint32_t>0xFFFFFFFFu
    cdef uint32_t c = ones
    cdef Py_ssize_t i
    for i in range(n):
        c = _CRC_TABLE[(c ^ p[i]) & 0xFFu] ^ (c >> 8)
    return c ^ ones


cdef inline uint64_t _rd(const uint8_t* p, int n) noexcept nogil:
    cdef uint64_t v = 0
    cdef int i
    for i in range(n - 1, -1, -1):
        v = (v << 8) | p[i]
    return v


cdef inline void _wr(uint8_t* p, uint64_t v, int n) noexcept nogil:
    cdef int i
    for i in range(n):
        p[i] = <uint8_t>(v & 0xFF)
        v >>= 8


cdef object _check_field(str name, object value, object upper):
    value = int(value)
    if not 0 <= value <= upper:
        raise LocalProtocolError(f"frame field {name}={value} is outside 0..{upper}")
    return value


def encode_header(kind, *, rank=0, key=0, clock=0, length=0, dtype=DType.BYTES, flags=0, payload_crc=None):
    """Encode one 44-byte frame header (see the pure-Python twin for the contract)."""
    kind = int(kind)
    dtype = int(dtype)
    if kind not in KNOWN_KINDS:
        raise LocalProtocolError(f"cannot encode unknown frame kind {kind}")
    itemsize = _ITEMSIZE.get(dtype)
    if itemsize is None:
        raise LocalProtocolError(f"cannot encode unknown payload dtype {dtype}")
    length = _check_field("length", length, 0xFFFFFFFFFFFFFFFF)
    if length % itemsize:
        raise LocalProtocolError(
            f"payload of {length} bytes is not a whole number of {DType(dtype).name} items"
        )
    cdef uint64_t f = _check_field("flags", flags, USER_FLAGS_MAX)
    cdef uint64_t crc = 0
    if payload_crc is not None:
        crc = _check_field("payload_crc", payload_crc, 0xFFFFFFFF)
        f |= FLAG_PAYLOAD_CRC
    cdef uint64_t r = _check_field("rank", rank, 0xFFFFFFFF)
    cdef uint64_t k = _check_field("key", key, 0xFFFFFFFF)
    cdef uint64_t c = _check_field("clock", clock, 0xFFFFFFFFFFFFFFFF)
    cdef uint64_t n = length
    out = PyBytes_FromStringAndSize(NULL, HEADER_SIZE)
    cdef uint8_t* p = <uint8_t*>PyBytes_AS_STRING(out)
    _wr(p, _MAGIC, 4)
    p[4] = VERSION
    p[5] = <uint8_t>kind
    _wr(p + 6, f, 2)
    _wr(p + 8, r, 4)
    _wr(p + 12, k, 4)
    _wr(p + 16, c, 8)
    _wr(p + 24, n, 8)
    p[32] = <uint8_t>dtype
    p[33] = 0
    p[34] = 0
    p[35] = 0
    _wr(p + 36, crc, 4)
    _wr(p + CHECKED_SIZE, _crc32(p, CHECKED_SIZE), 4)
    return out


cdef object _decode(const uint8_t* p, uint64_t max_payload):
    cdef uint32_t magic = <uint32_t>_rd(p, 4)
    cdef unsigned int version = p[4]
    cdef unsigned int kind = p[5]
    cdef unsigned int dtype = p[32]
    cdef uint64_t rank = _rd(p + 8, 4)
    cdef uint64_t length = _rd(p + 24, 8)
    cdef uint32_t checksum, expected
    cdef unsigned int flags
    if magic != _MAGIC:
        raise FrameError(
            f"bad magic {PyBytes_FromStringAndSize(<char*>p, 4)!r} "
            f"(expected {MAGIC!r}): not a poseidon_aio stream"
        )
    if version != VERSION:
        raise version_mismatch(version)
    checksum = <uint32_t>_rd(p + CHECKED_SIZE, 4)
    expected = _crc32(p, CHECKED_SIZE)
    if checksum != expected:
        raise FrameError(f"header checksum mismatch (got {checksum:#010x}, computed {expected:#010x})")
    kind_obj = _KINDS.get(kind)
    if kind_obj is None:
        raise FrameError(f"unknown frame kind {kind} from rank {rank}")
    itemsize_obj = _ITEMSIZE.get(dtype)
    if itemsize_obj is None:
        raise FrameError(f"unknown payload dtype {dtype} in frame kind {kind} from rank {rank}")
    cdef uint64_t itemsize = itemsize_obj
    cdef uint64_t key = _rd(p + 12, 4)
    cdef uint64_t clock = _rd(p + 16, 8)
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
    flags = <unsigned int>_rd(p + 6, 2)
    crc_obj = <uint32_t>_rd(p + 36, 4) if flags & FLAG_PAYLOAD_CRC else None
    return _header(kind_obj, rank, key, clock, length, _DTYPES[dtype], flags & USER_FLAGS_MAX, version, crc_obj)


def decode_header(data, max_payload=DEFAULT_MAX_PAYLOAD):
    """Decode and validate the first 40 bytes of ``data`` (see the pure-Python twin)."""
    cdef const uint8_t[::1] view
    if len(data) < HEADER_SIZE:
        raise LocalProtocolError(f"a frame header needs {HEADER_SIZE} bytes, got {len(data)}")
    view = _byte_view(data)
    return _decode(&view[0], max_payload)


cdef memoryview _byte_view(payload):
    cdef memoryview view = payload if isinstance(payload, memoryview) else memoryview(payload)
    if view.ndim != 1 or view.format != "B":
        if not view.c_contiguous:
            raise LocalProtocolError("payload buffers must be C-contiguous")
        if view.nbytes == 0:
            # A (0, N) array cannot be cast (the twin says why).
            return memoryview(bytearray(0))
        view = view.cast("B")
    return view


def byte_view(payload):
    """A flat unsigned-byte view of any C-contiguous buffer, without copying."""
    return _byte_view(payload)


def payload_views(payload):
    """``(views, bytes)``: flat byte views of a payload given as one buffer or a list (or tuple)
    of them, sent back to back (gathered, not copied), and their total size."""
    cdef list views
    cdef memoryview view
    cdef Py_ssize_t total = 0
    if isinstance(payload, (list, tuple)):
        views = []
        for part in payload:
            view = _byte_view(part)
            views.append(view)
            total += view.nbytes
        return views, total
    view = _byte_view(payload)
    return [view], view.nbytes


def frame_parts(kind, payload=b"", *, rank=0, key=0, clock=0, dtype=DType.BYTES, flags=0, checksum=False):
    """Return ``[header, payload_view]`` for ``transport.writelines``: the payload is not copied."""
    view = _byte_view(payload)
    header = encode_header(
        kind, rank=rank, key=key, clock=clock, length=view.nbytes, dtype=dtype, flags=flags,
        payload_crc=_crc32c_extend(view) if checksum else None,
    )
    return [header, view]


def encode_frame(kind, payload=b"", **fields):
    """One frame as a single bytes object (tests and small control frames)."""
    header, view = frame_parts(kind, payload, **fields)
    return header + view.tobytes()


cdef class FrameDecoder:
    """Incremental frame decoder (see the pure-Python twin for the contract).

    Its fields are declared in ``poseidon_aio/wire/_ccodec.pxd``, so that the compiled receive
    core (``_ext/receive.pyx``) drives it and overrides ``_destination_for`` with C calls.
    """

    def __init__(
        self, *, max_payload=DEFAULT_MAX_PAYLOAD, allocate=None, scratch_size=1 << 16,
        initial_payload_buffer=INITIAL_PAYLOAD_BUFFER, require_checksum=False,
    ):
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
        self._header = None
        self._dest = None
        self._destmv = None
        self._destcap = 0
        self._length = 0
        self._owned = False
        self._filled = 0
        self._lent_dest = False
        self._checking = False
        self._crc = 0
        self._error = None

    @property
    def buffered(self):
        return self._end - self._start + self._filled

    @property
    def own_payload_bytes(self):
        return self._destcap if self._owned else 0

    @property
    def payload_remaining(self):
        if self._dest is not None and self._start == self._end:
            return self._length - self._filled
        return 0

    @property
    def partial(self):
        if self._header is None:
            return None
        return (self._header, self._filled)

    def feed(self, data):
        if self._error is not None:
            raise self._error
        view = _byte_view(data)
        cdef const uint8_t[::1] src = view
        cdef Py_ssize_t total = src.shape[0]
        cdef Py_ssize_t offset = 0
        cdef Py_ssize_t n
        if self._dest is not None and self._start == self._end:
            n = min(total, self._length - self._filled)
            if n:
                self._room(n)
                memcpy(&self._destmv[self._filled], &src[0], n)
                if self._checking:
                    self._crc = _crc32c_extend(view[:n], self._crc)
            self._filled += n
            offset = n
        cdef Py_ssize_t rest = total - offset
        if rest:
            self._reserve(rest)
            memcpy(<uint8_t*>PyByteArray_AS_STRING(self._buf) + self._end, &src[offset], rest)
            self._end += rest

    cpdef get_buffer(self, Py_ssize_t sizehint=-1):
        if self._error is not None:
            raise self._error
        if self._dest is not None and self._start == self._end and self._filled < self._length:
            self._room(1)
            self._lent_dest = True
            return self._dest[self._filled:]
        self._lent_dest = False
        self._reserve(sizehint if sizehint > 1 else 1)
        return self._view[self._end:]

    cpdef buffer_updated(self, Py_ssize_t nbytes):
        if self._lent_dest:
            if self._checking and nbytes:
                self._crc = _crc32c_extend(self._dest[self._filled:self._filled + nbytes], self._crc)
            self._filled += nbytes
        else:
            self._end += nbytes

    cdef _reserve(self, Py_ssize_t n):
        cdef Py_ssize_t size = len(self._buf)
        if size - self._end >= n:
            return
        cdef Py_ssize_t used = self._end - self._start
        cdef bytearray grown
        if self._start and size - used >= n:
            memmove(PyByteArray_AS_STRING(self._buf),
                    PyByteArray_AS_STRING(self._buf) + self._start, used)
        else:
            while size - used < n:
                size *= 2
            grown = bytearray(size)
            memcpy(PyByteArray_AS_STRING(grown), PyByteArray_AS_STRING(self._buf) + self._start, used)
            self._view.release()
            self._buf = grown
            self._view = memoryview(grown)
        self._start = 0
        self._end = used

    cdef _own(self, Py_ssize_t size):
        # Not zero-filled: every byte is written before the frame is handed out, and untouched
        # pages of a large buffer then cost no memory until bytes arrive.
        grown = PyByteArray_FromStringAndSize(NULL, size)
        cdef uint8_t[::1] mv = grown
        if self._filled:
            memcpy(&mv[0], &self._destmv[0], self._filled)
        self._dest = memoryview(grown)
        self._destmv = mv
        self._destcap = size

    cdef _room(self, Py_ssize_t n):
        cdef Py_ssize_t need = self._filled + n
        cdef Py_ssize_t size = self._destcap
        if need <= size:
            return
        size = 2 * size
        if size < need:
            size = need
        if size > self._length:
            size = self._length
        self._own(size)

    cpdef next_frame(self):
        if self._error is not None:
            raise self._error
        cdef uint8_t* base
        cdef Py_ssize_t need, have, n
        if self._header is None:
            if self._end - self._start < HEADER_SIZE:
                return None
            base = <uint8_t*>PyByteArray_AS_STRING(self._buf)
            try:
                header = _decode(base + self._start, self.max_payload)
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
            base = <uint8_t*>PyByteArray_AS_STRING(self._buf)
            memcpy(&self._destmv[self._filled], base + self._start, n)
            if self._checking:
                self._crc = _crc32c_extend(self._view[self._start:self._start + n], self._crc)
            self._filled += n
            self._start += n
        if self._start == self._end:
            self._start = 0
            self._end = 0
        if self._filled < self._length:
            return None
        if self._checking and self._crc != self._header.payload_crc:
            self._error = payload_mismatch(self._header, self._crc)
            raise self._error
        frame = _frame(self._header, self._dest)
        self._header = None
        self._dest = None
        self._destmv = None
        self._destcap = 0
        self._length = 0
        self._owned = False
        self._filled = 0
        return frame

    cdef _set_destination(self, header):
        cdef Py_ssize_t length = header.length
        self._length = length
        self._owned = False
        self._filled = 0
        dest = None
        if length == 0:
            self._dest = memoryview(bytearray(0))
            self._destmv = None
            self._destcap = 0
            return
        dest = self._destination_for(header)
        if dest is None:
            self._destmv = None
            self._own(length if length < self._initial_payload else self._initial_payload)
            self._owned = True
            return
        view = _byte_view(dest)
        if view.readonly or view.nbytes != length:
            raise LocalProtocolError(
                f"destination for kind {header.kind.name} key {header.key} clock {header.clock} "
                f"must be a writable buffer of {length} bytes, got "
                f"{view.nbytes} bytes{' (read-only)' if view.readonly else ''}"
            )
        self._dest = view
        self._destmv = view
        self._destcap = length

    cdef object _destination_for(self, header):
        # The compiled receive core overrides this: a C call instead of a Python one per header.
        if self.allocate is None:
            return None
        return self.allocate(header)
