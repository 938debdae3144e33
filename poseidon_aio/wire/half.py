"""The scaled half-precision payload: one codec for the fp16 scheme's sender and receiver.

A chunk of ``n`` float32 values travels as a float32 scale ``s`` followed by ``n`` IEEE float16
values ``h``, little-endian, back to back (``4 + 2n`` bytes, payload dtype ``BYTES``); the
receiver reads ``h * s`` in float32.

Why a scale: plain float16 has 10 fraction bits but a narrow range, normal only in
[6.1e-5, 65504]. Gradients of 1e-6..1e-3, common after a few epochs, would be subnormal there
and keep 0-7 significant bits; a loss spike past 65504 would turn into inf. The sender picks
``s = 2^(e - 15)`` where ``2^e`` is the least power of two >= the chunk's largest finite
magnitude, so ``|x| / s <= 2^15`` (no overflow, 65504 > 32768) and every value within 2^-29 of
the largest stays normal: relative error <= 2^-11 (half an ulp) whatever the gradients' scale.
Dividing by a power of two is exact in float32, so the only rounding is the cast to float16.

Non-finite inputs (a diverged step) travel as float16 inf/nan and reach every replica, as an
exact scheme would carry them. The scale itself is always a power of two from 2^-126 to 2^112
(normal in float32; 65504 x 2^112 < 2^128 cannot overflow), and a receiver refuses any other.
"""

from __future__ import annotations

import math

import numpy as np

from ..errors import LocalProtocolError, RemoteProtocolError
from .layout import DType, Frame

DTYPE = DType.BYTES
ITEM_BYTES = 2  # wire bytes per value (the scale aside): what the sender's chunking divides by
SCALE_BYTES = 4
_HEADROOM_BITS = 15  # |x| / s <= 2^15 = 32768 < 65504, float16's largest finite value
# The scale stays a normal float32, 2^-126 .. 2^112, so no decoded value overflows float32: a
# chunk whose largest value is in [2^127, 2^128) keeps the scale 2^112 and its values are clipped
# to float16's largest, 65504 x 2^112 (at most 2^-11 off: |x| / s < 65536).
_MIN_EXP, _MAX_EXP = -126, 112
_HALF_MAX = 65504.0


def nbytes(n: int) -> int:
    """Payload bytes of a chunk of ``n`` values."""
    return SCALE_BYTES + ITEM_BYTES * n


def encode(x: np.ndarray) -> list:
    """The payload parts of float32 values ``x`` (1-D): ``[scale (1,), halves (n,)]``.

    >>> parts = encode(np.array([1e-6, -3e-7], dtype=np.float32))
    >>> float(np.abs(expand(parts) - [1e-6, -3e-7]).max()) < 1e-9
    True

    Raises:
        LocalProtocolError: ``x`` is not 1-D float32 (a bug on this side).
    """
    if x.dtype != np.float32 or x.ndim != 1:
        raise LocalProtocolError(f"the half codec takes 1-D float32 values, got {x.dtype} {x.shape}")
    magnitude = np.abs(x)
    finite = magnitude[np.isfinite(magnitude)]
    top = float(finite.max()) if finite.size else 0.0
    if top > 0.0:
        _, exp = np.frexp(np.float32(top))  # top = mantissa * 2^exp, mantissa in [0.5, 1)
        exp = int(np.clip(int(exp) - _HEADROOM_BITS, _MIN_EXP, _MAX_EXP))
    else:
        exp = 0
    scale = np.float32(np.ldexp(np.float32(1.0), exp))
    scaled = x / scale
    if exp == _MAX_EXP:
        finite = np.isfinite(scaled)
        scaled[finite] = np.clip(scaled[finite], -_HALF_MAX, _HALF_MAX)
    halves = scaled.astype(np.float16)
    return [np.array([scale], dtype=np.float32), halves]


def expand(parts: list) -> np.ndarray:
    """Float32 values of an encoded chunk, as a receiver reads them (the owner of a reduced chunk
    keeps exactly what its peers will read)."""
    scale, halves = parts
    return halves.astype(np.float32) * scale[0]


def decode(frame: Frame, n: int, *, what: str) -> np.ndarray:
    """Float32 values of a received chunk of ``n`` values (a new array).

    Args:
        what: names the layer, clock and chunk in the error message.
    Raises:
        RemoteProtocolError: the payload is not a chunk of ``n`` values, or its scale is not a
            finite positive power of two (the ranks build different models, or a peer is broken).
    """
    length = frame.header.length
    if frame.header.dtype is not DTYPE or length != nbytes(n):
        raise RemoteProtocolError(
            f"rank {frame.rank} sent {length} bytes of {frame.header.dtype.name} for {what}: expected a half-precision "
            f"chunk of {n} values ({nbytes(n)} bytes of BYTES) — do the ranks build the same model?"
        )
    raw = np.frombuffer(frame.payload, dtype=np.uint8)
    scale = raw[:SCALE_BYTES].view(np.float32)
    s = float(scale[0])
    mantissa, exp = np.frexp(s) if math.isfinite(s) else (0.0, 0)
    if s <= 0.0 or mantissa != 0.5 or not (_MIN_EXP <= exp - 1 <= _MAX_EXP):
        raise RemoteProtocolError(
            f"rank {frame.rank} sent the scale {s!r} for {what}: a half-precision chunk's scale is a power of two from "
            f"2^{_MIN_EXP} to 2^{_MAX_EXP}"
        )
    with np.errstate(invalid="ignore"):  # a signalling NaN among the halves stays a NaN, quietly
        return expand([scale, raw[SCALE_BYTES:].view(np.float16)])
