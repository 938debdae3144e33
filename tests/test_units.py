"""The one parser of link rates (poseidon_aio.units)."""

from __future__ import annotations

import pytest

from poseidon_aio.errors import ConfigError
from poseidon_aio.units import parse_rate, parse_rate_bytes


@pytest.mark.parametrize(
    "text,bits",
    [("100mbit", 1e8), ("1gbit", 1e9), ("10GBIT", 1e10), ("64kbit", 64e3), ("2.5gbit", 2.5e9), ("1500", 1500.0)],
)
def test_rates_read_in_bits_per_second(text, bits):
    assert parse_rate(text) == bits


@pytest.mark.parametrize("text,nbytes", [("1gbit", 125e6), ("100mbit", 12.5e6), ("4096", 4096.0)])
def test_the_bytes_companion_takes_a_plain_number_as_bytes(text, nbytes):
    assert parse_rate_bytes(text) == nbytes


@pytest.mark.parametrize("text", ["fast", "mbit", "1 gigabit", ""])
def test_a_bad_rate_names_the_text_and_shows_a_valid_one(text):
    with pytest.raises(ConfigError, match=rf"{text!r}.*e\.g\. 100mbit"):
        parse_rate(text)
