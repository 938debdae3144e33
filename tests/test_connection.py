"""Connection behaviour on an in-memory transport pair: deterministic, no sockets."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from poseidon_aio.errors import ConnectionLost, LocalProtocolError, PeerTimeout
from poseidon_aio.wire import DType, Kind

from .memtransport import connected_pair, run_async
from .procs import net_config


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sizes=st.lists(st.integers(0, 3000), min_size=1, max_size=8),
    delays=st.lists(st.integers(0, 12), min_size=8, max_size=8),
    seed=st.integers(0, 2**16),
    max_chunk=st.sampled_from([1, 7, 64, 4096]),
)
def test_expected_payload_lands_in_into_whatever_the_timing(sizes, delays, seed, max_chunk):
    """expect() before the frame, during its payload, or after it: ``into`` ends up holding it."""

    async def scenario():
        client, server = await connected_pair(net_config(), net_config(), seed=seed, max_chunk=max_chunk)
        payloads = [np.random.default_rng(i).integers(0, 255, s, dtype=np.uint8) for i, s in enumerate(sizes)]
        for clock, payload in enumerate(payloads):
            await client.send(Kind.PUSH, payload, key=1, clock=clock)
        futures, targets = [], []
        for clock, payload in enumerate(payloads):
            for _ in range(delays[clock]):
                await asyncio.sleep(0)
            into = np.full(payload.size, 7, dtype=np.uint8)
            targets.append(into)
            futures.append(server.expect(Kind.PUSH, key=1, clock=clock, into=into))
        frames = await asyncio.gather(*futures)
        for frame, into, payload in zip(frames, targets, payloads):
            np.testing.assert_array_equal(into, payload)
            np.testing.assert_array_equal(np.frombuffer(frame.payload, dtype=np.uint8), payload)
        await client.close()

    run_async(scenario())


async def test_wrong_sized_into_fails_that_future_only():
    client, server = await connected_pair(net_config(), net_config())
    bad = server.expect(Kind.PUSH, key=0, clock=0, into=bytearray(3))
    good = server.expect(Kind.PUSH, key=0, clock=1, into=bytearray(4))
    await client.send(Kind.PUSH, b"abcd", key=0, clock=0)
    await client.send(Kind.PUSH, b"efgh", key=0, clock=1)
    with pytest.raises(LocalProtocolError, match="writable buffer of 4 bytes"):
        await bad
    assert bytes((await good).payload) == b"efgh" and server.is_open
    await client.close()


async def test_duplicate_expectation_is_refused_and_cancelled_one_frees_the_slot():
    client, server = await connected_pair(net_config(), net_config())
    fut = server.expect(Kind.PUSH, 3, 4)
    with pytest.raises(LocalProtocolError, match="already expected"):
        server.expect(Kind.PUSH, 3, 4)
    fut.cancel()
    await asyncio.sleep(0)
    again = server.expect(Kind.PUSH, 3, 4, into=bytearray(2))
    await client.send(Kind.PUSH, b"ok", key=3, clock=4)
    assert bytes((await again).payload) == b"ok"
    await client.close()


async def test_priorities_order_frames_queued_behind_backpressure():
    config = net_config(write_high_water=1000, write_low_water=0)
    client, server = await connected_pair(config, net_config(), max_chunk=256)
    await client.send(Kind.DATA, bytes(20_000), clock=0)  # over the high mark: writing pauses
    order = []
    server.set_handler(lambda f: order.append(f.clock))
    sends = [
        asyncio.ensure_future(client.send(Kind.DATA, bytes(100), clock=c, priority=p))
        for c, p in [(1, 9), (2, 9), (3, 0), (4, 5)]
    ]
    await asyncio.gather(*sends)
    while len(order) < 5:
        await asyncio.sleep(0)
    assert order == [0, 3, 4, 1, 2]
    await client.close()


async def test_inbox_pauses_reading_until_the_consumer_catches_up():
    client, server = await connected_pair(net_config(), net_config(inbox_high_water=10_000), max_chunk=4096)
    for clock in range(10):
        await client.send(Kind.DATA, bytes(4000), clock=clock)
    for _ in range(200):
        await asyncio.sleep(0)
    # Reading pauses once the inbox passes the mark; bytes of the read in hand still decode.
    assert server.max_inbox_bytes <= 10_000 + 4096 + 4000
    for clock in range(10):
        assert (await server.recv(timeout=5)).clock == clock
    await client.close()


async def test_handshake_timeout_is_a_peer_timeout():
    import random

    from poseidon_aio.net.connection import Connection
    from poseidon_aio.net.handshake import Role

    from .memtransport import MemTransport

    loop = asyncio.get_running_loop()
    t = MemTransport(loop, random.Random(0), 64)
    t.peer = MemTransport(loop, random.Random(0), 64)
    t.peer._reading = False  # nobody answers
    t.peer.protocol = asyncio.BufferedProtocol()
    conn = Connection(Role.CLIENT, 0, net_config(handshake_timeout=0.05))
    t.protocol = conn
    conn.connection_made(t)
    with pytest.raises(PeerTimeout, match="handshake .* did not complete"):
        await conn.wait_ready()


async def test_send_after_close_raises_connection_lost_naming_the_peer():
    client, server = await connected_pair(net_config(), net_config())
    await client.close()
    with pytest.raises(ConnectionLost, match="rank 1"):
        await client.send(Kind.DATA, b"late")
    with pytest.raises(ConnectionLost, match="GOODBYE"):
        await server.recv(timeout=5)


async def test_ingress_shaping_paces_reads():
    import time

    from poseidon_aio.net import ShaperConfig

    rate, burst, total = 1e6, 16 * 1024, 200_000
    server_config = net_config(shaper=ShaperConfig(ingress_rate=rate, burst=burst))
    client, server = await connected_pair(net_config(), server_config, max_chunk=8192)
    got = []
    server.set_handler(lambda f: got.append(f.header.length))
    started = time.monotonic()
    for clock in range(total // 10_000):
        await client.send(Kind.DATA, bytes(10_000), clock=clock)
    async with asyncio.timeout(10):
        while sum(got) < total:
            await asyncio.sleep(0.005)
    assert time.monotonic() - started >= (total - burst - 8192) / rate * 0.95
    await client.close()


async def test_a_process_shaper_caps_all_its_connections_together():
    import time

    from poseidon_aio.net import Shaper, TokenBucket

    rate, burst = 2e6, 16 * 1024
    shared = Shaper(egress=TokenBucket(rate, burst))
    pairs = [await connected_pair(net_config(), net_config(), process_shaper=shared) for _ in range(2)]
    started = time.monotonic()
    await asyncio.gather(
        *(client.send(Kind.DATA, bytes(50_000), clock=c) for client, _ in pairs for c in range(2))
    )
    assert time.monotonic() - started >= (200_000 - burst - 50_000) / rate * 0.95
    for client, _ in pairs:
        await client.close()


async def test_local_link_lands_payloads_and_propagates_close():
    from poseidon_aio.net import LocalLink

    a, b = LocalLink.pair(0, 0)
    into = np.zeros(6, dtype=np.float32)
    fut = b.expect(Kind.AGGREGATE, 2, 5, into=into)
    await a.send(Kind.AGGREGATE, [np.ones(2, np.float32), np.full(4, 2, np.float32)], key=2, clock=5, dtype=DType.FLOAT32)
    frame = await fut
    assert into.tolist() == [1, 1, 2, 2, 2, 2] and frame.payload.obj is not None
    await a.send(Kind.DATA, b"early", key=1, clock=1)  # nobody expects it yet: the inbox keeps it
    assert bytes((await b.expect(Kind.DATA, 1, 1)).payload) == b"early"
    pending = b.expect(Kind.DATA, 9, 9)
    await a.close()
    with pytest.raises(ConnectionLost, match="ended the link"):
        await pending
    with pytest.raises(ConnectionLost):
        await b.send(Kind.DATA, b"x")


def test_reply_buffers_are_reused_only_once_nobody_holds_them():
    from poseidon_aio.ps.shard import _ReplyBuffers

    pool = _ReplyBuffers()
    dt = np.dtype(np.float32)
    first = pool.take(0, 8, dt)
    first_id = id(first)
    view = memoryview(first)  # a transport still reading it
    second_id = id(pool.take(0, 8, dt))
    del view, first
    # ids, not objects, in the asserts: pytest's assertion rewriting would keep references alive.
    reused = {id(pool.take(0, 8, dt)) for _ in range(3)}
    assert second_id != first_id and reused <= {first_id, second_id}
