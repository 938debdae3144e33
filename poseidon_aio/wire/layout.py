"""Frame layout of wire format v1: constants, kinds, dtypes and the frame event types.

A frame is a fixed 40-byte little-endian header followed by ``length`` raw payload bytes::

    offset size field     meaning
         0    4 magic     b"PSDN"
         4    1 version   wire version, 1
         5    1 kind      what the frame is (:class:`Kind`)
         6    2 flags     bits for the layer above; none is defined yet, senders write 0
         8    4 rank      sender rank
        12    4 key       key-value pair id or layer id
        16    8 clock     iteration clock
        24    8 length    payload length in bytes
        32    1 dtype     payload element type (:class:`DType`)
        33    3 -         reserved, zero
        36    4 checksum  CRC-32 (IEEE, as zlib.crc32) of bytes 0..35

This module is shared by both codecs; it imports nothing from asyncio, socket or torch.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

MAGIC = b"PSDN"
VERSION = 1
HEADER_SIZE = 40
# Everything the checksum covers: the header without its last 4 bytes.
CHECKED_SIZE = 36
HEADER_STRUCT = struct.Struct("<4sBBHIIQQB3x")
assert HEADER_STRUCT.size == CHECKED_SIZE

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


ITEMSIZE = {
    DType.BYTES: 1,
    DType.FLOAT32: 4,
    DType.FLOAT64: 8,
    DType.FLOAT16: 2,
    DType.BFLOAT16: 2,
    DType.INT32: 4,
    DType.INT64: 8,
    DType.UINT8: 1,
    DType.INT8: 1,
    DType.JSON: 1,
}
ITEMSIZE_BY_CODE = {int(k): v for k, v in ITEMSIZE.items()}



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
