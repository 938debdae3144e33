"""Link rates as people write them ("100mbit", "1gbit"), for the CLI, the benchmarks and the examples.

Imports nothing but the error hierarchy, so any layer (and a script that must not load torch or
asyncio) can use it.
"""

from __future__ import annotations

from .errors import ConfigError

__all__ = ["RATE_UNITS", "parse_rate", "parse_rate_bytes"]

# tc's decimal units, in bits per second.
RATE_UNITS = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3}


def parse_rate(text: str) -> float:
    """Bits per second from ``"1gbit"``, ``"100mbit"``, ``"64kbit"`` (tc's units) or a plain number
    of bits per second.

    Args:
        text: a number followed by ``gbit``, ``mbit`` or ``kbit`` (any case), or a plain number.
    Returns:
        The rate in bits per second.
    Raises:
        ConfigError: ``text`` is neither (the message names it and shows a valid rate).

    >>> parse_rate("100mbit"), parse_rate("1GBIT")
    (100000000.0, 1000000000.0)
    """
    return _parse(text, 1.0)


def parse_rate_bytes(text: str) -> float:
    """Bytes per second from the same units as :func:`parse_rate`; a plain number is taken as
    bytes per second (what a shaper or ``Link.of_bandwidth`` wants).

    Raises:
        ConfigError: as :func:`parse_rate`.

    >>> parse_rate_bytes("1gbit"), parse_rate_bytes("4096")
    (125000000.0, 4096.0)
    """
    return _parse(text, 8.0) / 8


def _parse(text: str, plain: float) -> float:
    """``text`` in bits per second; a plain number is multiplied by ``plain``."""
    number, scale = text, plain
    for unit, bits in RATE_UNITS.items():
        if text.lower().endswith(unit):
            number, scale = text[: -len(unit)], bits
            break
    try:
        return float(number) * scale
    except ValueError:
        raise ConfigError(
            f"cannot read {text!r} as a rate: write a number with gbit, mbit or kbit, e.g. 100mbit or 1gbit"
        ) from None
