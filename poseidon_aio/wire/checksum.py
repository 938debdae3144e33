"""CRC32C (Castagnoli) of payloads: the ``crc32c`` package, on the CPU's CRC instructions.

Its ``crc32c(data, value)`` takes any buffer (a writable NumPy array or a memoryview slice of a
receive tensor among them) and extends ``value`` with ``data``, so a receiver checksums each
piece of a payload as it lands, while those bytes are still in cache. ``HARDWARE`` says whether
the SSE4.2 / ARMv8 implementation is in use (about ten times the software one).
"""

from __future__ import annotations

from crc32c import crc32c as extend
from crc32c import hardware_based as HARDWARE

__all__ = ["HARDWARE", "extend", "payload_crc"]


def payload_crc(views) -> int:
    """CRC32C of the byte views of one payload, back to back.

    >>> hex(payload_crc([b"1234", b"56789"]))
    '0xe3069283'
    """
    crc = 0
    for view in views:
        crc = extend(view, crc)
    return crc
