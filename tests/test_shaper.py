"""Token bucket: exact long-run rate, burst, debt, priorities (fake clock, no sleeping on time)."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from poseidon_aio.errors import ConfigError
from poseidon_aio.net import ShaperConfig, TokenBucket


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@given(
    rate=st.floats(1e3, 1e9),
    burst=st.integers(1, 1 << 20),
    sizes=st.lists(st.integers(1, 1 << 22), min_size=1, max_size=50),
)
def test_never_more_than_burst_plus_rate_times_elapsed(rate, burst, sizes):
    clock = FakeClock()
    bucket = TokenBucket(rate, burst, clock=clock)
    sent = 0
    for size in sizes:
        wait = bucket.reserve(size)
        # Bytes handed out up to now never exceed what the bucket allows, counting the last frame.
        assert sent <= burst + rate * clock.now + 1e-6 * rate
        sent += size
        clock.now += wait


def test_debt_is_repaid_before_the_next_frame():
    clock = FakeClock()
    bucket = TokenBucket(rate=1000.0, burst=100, clock=clock)
    assert bucket.reserve(100) == 0.0
    assert bucket.reserve(400) == pytest.approx(0.4)
    clock.now = 0.4
    assert bucket.reserve(1) == pytest.approx(0.001)


async def test_waiters_are_served_by_priority_then_arrival():
    bucket = TokenBucket(rate=1e6, burst=1000)
    await bucket.acquire(50_000)  # 49 ms of debt: everyone after this waits
    order = []

    async def send(name, priority):
        await bucket.acquire(1000, priority)
        order.append(name)

    tasks = [asyncio.ensure_future(send(n, p)) for n, p in [("bulk-a", 5), ("bulk-b", 5), ("layer0", 0)]]
    async with asyncio.timeout(5):
        await asyncio.gather(*tasks)
    assert order == ["layer0", "bulk-a", "bulk-b"]


async def test_a_cancelled_waiter_does_not_block_the_queue():
    bucket = TokenBucket(rate=1e6, burst=1000)
    await bucket.acquire(20_000)
    stuck = asyncio.ensure_future(bucket.acquire(1000))
    after = asyncio.ensure_future(bucket.acquire(1000))
    await asyncio.sleep(0)
    stuck.cancel()
    async with asyncio.timeout(5):
        await after
    assert stuck.cancelled()


@pytest.mark.parametrize("kwargs", [dict(egress_rate=0), dict(ingress_rate=-1), dict(burst=0)])
def test_invalid_settings_are_config_errors(kwargs):
    with pytest.raises(ConfigError):
        ShaperConfig(**kwargs)


@pytest.mark.parametrize("rate,burst", [(0, 10), (-5, 10), (10, 0)])
def test_invalid_bucket_is_a_config_error(rate, burst):
    with pytest.raises(ConfigError):
        TokenBucket(rate=rate, burst=burst)


def test_message_cost_is_link_time_serialized_with_the_bytes():
    clock = FakeClock()
    bucket = TokenBucket(rate=1e6, burst=1, clock=clock, message_cost=1e-3, costed_kinds={"push"})
    assert bucket.cost_of(500, "push") == 1500 and bucket.cost_of(500, "reply") == 500
    waits = []
    for _ in range(3):
        waits.append(bucket.reserve(bucket.cost_of(1000, "push")))
        clock.now += waits[-1]
    # Each push holds the link 1 ms of start-up plus 1 ms of bytes: 2 ms apart, never overlapping.
    assert clock.now == pytest.approx(3 * 2e-3, rel=1e-3)
