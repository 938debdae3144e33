"""Frame layout of wire format v2: constants, kinds, dtypes and the frame event types.

A frame is a fixed 44-byte little-endian header followed by ``length`` raw payload bytes::

    offset size field       meaning
         0    4 magic       b"PSDN"
         4    1 version     wire version, 2
         5    1 kind        what the frame is (:class:`Kind`)
         6    2 flags       bit 15: payload_crc holds the payload's CRC32C; bits 0-14 for the
                            layer above (none defined yet, senders write 0)
         8    4 rank        sender rank
        12    4 key         key-value pair id or layer id
        16    8 clock       iteration clock
        24    8 length      payload length in bytes
        32    1 dtype       payload element type (:class:`DType`)
        33    3 -           reserved, zero
        36    4 payload_crc CRC32C (Castagnoli) of the payload when flag bit 15 is set, else zero
        40    4 checksum    CRC-32 (IEEE, as zlib.crc32) of bytes 0..39

This module is shared by both codecs; it imports nothing from asyncio, socket or torch.
"""

from __future__ import annotations

import enum
import functools
import struct
from dataclasses import dataclass
from typing import Optional

MAGIC = b"PSDN"
VERSION = 2
HEADER_SIZE = 44
# Everything the header checksum covers: the header without its last 4 bytes.
CHECKED_SIZE = 40
HEADER_STRUCT = struct.Struct("<4sBBHIIQQB3xI")
assert HEADER_STRUCT.size == CHECKED_SIZE
# Flag bit 15 belongs to the wire: the payload_crc field is set. The layer above has bits 0-14.
FLAG_PAYLOAD_CRC = 1 << 15
USER_FLAGS_MAX = FLAG_PAYLOAD_CRC - 1

# 1 GiB: larger than any 2 MiB key-value chunk or sufficient-factor block by far, small enough that
# a corrupted length cannot make a receiver allocate the machine's memory.
DEFAULT_MAX_PAYLOAD = 1 << 30

# Where a payload buffer the decoder allocates itself starts (when nobody registered a destination).
# Frames up to 1 MiB (control messages, most merged layers) get their exact size at once; a 2 MiB
# key-value chunk grows once. Doubling from there keeps the copying amortized O(bytes received):
# the bytes moved by all the growths of one payload add up to less than its length.
INITIAL_PAYLOAD_BUFFER = 1 << 20

U16_MAX = (1 << 16) - 1
U32_MAX = (1 << 32) - 1
U64_MAX = (1 << 64) - 1


class Kind(enum.IntEnum):
    """What a frame is. Codes 1-15 are the connection's own protocol; 16 and up carry training data."""

    # Handshake (net.handshake); no data frame is accepted before WELCOME.
    HELLO = 1
    CHALLENGE = 2
    AUTH = 3
    WELCOME = 4
    # Connection life.
    HEARTBEAT = 8
    GOODBYE = 9
    ERROR = 10
    CONTROL = 11
    # Data.
    DATA = 16
    PUSH = 17
    AGGREGATE = 18
    PARAMS = 19
    FACTORS = 20
    PULL = 21
    COLLECTIVE = 22  # the user's all-reduce and barrier (sync.collective)


KNOWN_KINDS = frozenset(int(k) for k in Kind)


class DType(enum.IntEnum):
    """Element type of a payload; the length must be a whole number of items."""

    BYTES = 0
    FLOAT32 = 1
    FLOAT64 = 2
    FLOAT16 = 3
    BFLOAT16 = 4
    INT32 = 5
    INT64 = 6
    UINT8 = 7
    INT8 = 8
    JSON = 9


# The one table of payload types: each one's item size, and NumPy's name for it (an array's
# ``dtype.name``, a manifest's "float32"), None where NumPy has no such type or it is no array.
_DTYPES = {
    DType.BYTES: (1, None),
    DType.FLOAT32: (4, "float32"),
    DType.FLOAT64: (8, "float64"),
    DType.FLOAT16: (2, "float16"),
    DType.BFLOAT16: (2, None),  # NumPy has no bfloat16
    DType.INT32: (4, "int32"),
    DType.INT64: (8, "int64"),
    DType.UINT8: (1, "uint8"),
    DType.INT8: (1, "int8"),
    DType.JSON: (1, None),
}
ITEMSIZE = {code: size for code, (size, _) in _DTYPES.items()}
ITEMSIZE_BY_CODE = {int(k): v for k, v in ITEMSIZE.items()}
DTYPE_BY_NAME = {name: code for code, (_, name) in _DTYPES.items() if name is not None}


def wire_dtype(dtype, default: Optional[DType] = None) -> Optional[DType]:
    """The wire type of an array's payload, from its NumPy dtype or a dtype's name.

    Args:
        dtype: ``array.dtype``, or a name such as ``"float32"``.
        default: what to return where no wire type fits (another type, a non-native byte order).
    Returns:
        The :class:`DType`, or ``default``.

    >>> wire_dtype("float16"), wire_dtype("bool", DType.BYTES)
    (<DType.FLOAT16: 3>, <DType.BYTES: 0>)
    """
    found = _wire_dtype(dtype)
    return default if found is None else found


# Cached: a NumPy dtype's ``name`` is a Python property, slow for a lookup made per frame.
@functools.lru_cache(maxsize=64)
def _wire_dtype(dtype) -> Optional[DType]:
    if not getattr(dtype, "isnative", True):
        return None
    return DTYPE_BY_NAME.get(getattr(dtype, "name", dtype))


@dataclass(frozen=True, slots=True)
class Header:
    """A decoded (or to-be-encoded) frame header."""

    kind: Kind
    rank: int
    key: int
    clock: int
    length: int
    dtype: DType = DType.BYTES
    flags: int = 0
    version: int = VERSION
    #: CRC32C of the payload as the sender computed it, or ``None`` where it sent none. A decoder
    #: hands out no frame whose payload does not match it.
    payload_crc: Optional[int] = None


@dataclass(frozen=True, slots=True)
class Frame:
    """One complete frame: its header and its payload.

    ``payload`` is a writable memoryview of exactly ``header.length`` bytes: either the destination
    buffer the caller registered for this frame (zero copy) or a buffer the decoder allocated.
    """

    header: Header
    payload: memoryview

    @property
    def kind(self) -> Kind:
        return self.header.kind

    @property
    def key(self) -> int:
        return self.header.key

    @property
    def clock(self) -> int:
        return self.header.clock

    @property
    def rank(self) -> int:
        return self.header.rank
