"""Wire format v2: frame layout and the codec (compiled when available, pure Python otherwise).

``CODEC`` says which one is active: ``"cython"`` or ``"python"``. ``POSEIDON_NO_EXTENSIONS=1``
forces the pure-Python twin. ``CODECS`` maps both names to their modules where both exist, so the
tests and the benchmark can run each.
"""

from __future__ import annotations

import os
from contextlib import suppress

from . import codec as _pycodec
from .checksum import HARDWARE as CRC32C_HARDWARE
from .checksum import payload_crc
from .layout import (
    DEFAULT_MAX_PAYLOAD,
    DTYPE_BY_NAME,
    FLAG_PAYLOAD_CRC,
    HEADER_SIZE,
    INITIAL_PAYLOAD_BUFFER,
    ITEMSIZE,
    MAGIC,
    VERSION,
    DType,
    Frame,
    Header,
    Kind,
    wire_dtype,
)

CODECS = {"python": _pycodec}
with suppress(ImportError):
    from . import _ccodec  # type: ignore[attr-defined]

    CODECS["cython"] = _ccodec

if os.environ.get("POSEIDON_NO_EXTENSIONS") == "1" or "cython" not in CODECS:
    CODEC = "python"
else:
    CODEC = "cython"

_active = CODECS[CODEC]
encode_header = _active.encode_header
decode_header = _active.decode_header
frame_parts = _active.frame_parts
encode_frame = _active.encode_frame
FrameDecoder = _active.FrameDecoder
byte_view = _active.byte_view
payload_views = _active.payload_views

__all__ = [
    "CODEC",
    "CODECS",
    "CRC32C_HARDWARE",
    "DEFAULT_MAX_PAYLOAD",
    "DTYPE_BY_NAME",
    "FLAG_PAYLOAD_CRC",
    "HEADER_SIZE",
    "INITIAL_PAYLOAD_BUFFER",
    "ITEMSIZE",
    "MAGIC",
    "VERSION",
    "DType",
    "Frame",
    "Header",
    "Kind",
    "wire_dtype",
    "encode_header",
    "decode_header",
    "frame_parts",
    "encode_frame",
    "FrameDecoder",
    "byte_view",
    "payload_views",
    "payload_crc",
]
