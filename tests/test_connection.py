"""Connection behaviour on an in-memory transport pair: deterministic, no sockets."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from poseidon_aio.errors import ConnectionLost, FrameError, LocalProtocolError, PeerTimeout, RemoteProtocolError
from poseidon_aio.wire import DType, Kind, encode_header

from .support.conditions import until
from .support.memtransport import connected_pair, run_async
from .support.procs import net_config


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
    await asyncio.sleep(0)  # one loop turn: the cancelled future's done-callback frees the slot
    again = server.expect(Kind.PUSH, 3, 4, into=bytearray(2))
    await client.send(Kind.PUSH, b"ok", key=3, clock=4)
    async with asyncio.timeout(10):
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
    async with asyncio.timeout(10):
        await asyncio.gather(*sends)
    await until(lambda: len(order) == 5, what="all five frames reaching the handler")
    assert order == [0, 3, 4, 1, 2]
    await client.close()


async def test_inbox_pauses_reading_until_the_consumer_catches_up():
    client, server = await connected_pair(net_config(), net_config(inbox_high_water=10_000), max_chunk=4096)
    for clock in range(10):
        await client.send(Kind.DATA, bytes(4000), clock=clock)
    await until(lambda: server.max_inbox_bytes > 10_000, what="the inbox passing its high-water mark")
    # Reading pauses once the inbox passes the mark; bytes of the read in hand still decode.
    assert server.max_inbox_bytes <= 10_000 + 4096 + 4000
    for clock in range(10):
        assert (await server.recv(timeout=5)).clock == clock
    await client.close()


async def test_handshake_timeout_is_a_peer_timeout():
    import random

    from poseidon_aio.net.connection import Connection
    from poseidon_aio.net.handshake import Role

    from .support.memtransport import MemTransport

    loop = asyncio.get_running_loop()
    t = MemTransport(loop, random.Random(0), 64)
    t.peer = MemTransport(loop, random.Random(0), 64)
    t.peer._reading = False  # nobody answers
    t.peer.protocol = asyncio.BufferedProtocol()
    conn = Connection(Role.CLIENT, 0, net_config(handshake_timeout=0.05))
    t.protocol = conn
    conn.connection_made(t)
    with pytest.raises(PeerTimeout, match="handshake .* did not complete"):
        async with asyncio.timeout(10):
            await conn.wait_ready()


async def test_send_after_close_raises_connection_lost_naming_the_peer():
    client, server = await connected_pair(net_config(), net_config())
    await client.close()
    with pytest.raises(ConnectionLost, match="rank 1"):
        await client.send(Kind.DATA, b"late")
    with pytest.raises(ConnectionLost, match="GOODBYE"):
        await server.recv(timeout=5)


def _count_writes(conn) -> list:
    """Record each write the connection makes on its transport: how many frames or parts it held."""
    transport = conn._transport
    write, writes = transport.write, []

    def one(data) -> None:
        writes.append(1)
        write(data)

    def lines(parts) -> None:
        parts = list(parts)
        writes.append(len(parts))
        for part in parts:
            write(part)

    transport.write, transport.writelines = one, lines
    return writes


async def test_small_frames_of_one_pass_go_out_in_one_write_in_order():
    client, server = await connected_pair(net_config(), net_config())
    writes = _count_writes(client)
    got = []
    server.set_handler(lambda f: got.append((f.clock, bytes(f.payload))))
    for clock in range(10):
        assert client.try_send(Kind.DATA, bytes([clock]) * 100, clock=clock)
    assert writes == [] and client.stats.frames_sent == 10  # counted as sent, written at the pass's end
    await asyncio.sleep(0)
    assert writes == [10]
    await until(lambda: len(got) == 10, what="the ten frames")
    assert got == [(c, bytes([c]) * 100) for c in range(10)]
    await client.close()


async def test_a_large_frame_or_a_control_frame_goes_after_the_small_frames_before_it():
    from poseidon_aio.net.connection import _GATHER_MAX, _JOIN_BELOW

    client, server = await connected_pair(net_config(), net_config())
    writes = _count_writes(client)
    got = []
    server.set_handler(lambda f: got.append(f.clock))
    client.try_send(Kind.DATA, b"a", clock=1)
    client.try_send(Kind.DATA, b"b", clock=2)
    client.try_send(Kind.DATA, bytes(_JOIN_BELOW), clock=3)  # large: the two small ones first
    assert writes[0] == 2 and sum(writes[1:]) == 2  # (the large frame: its header and payload)
    client.try_send(Kind.DATA, b"c", clock=4)
    client._write_control(Kind.HEARTBEAT)  # goes at once, with the small frame before it
    assert writes[-1] == 2
    before = len(writes)
    for clock in range(5, 5 + _GATHER_MAX // 1000 + 1):  # past the gathering bound: out at once
        client.try_send(Kind.DATA, bytes(1000), clock=clock)
    assert len(writes) == before + 1
    await client.close()  # GOODBYE goes after what is still gathered
    await until(lambda: len(got) == 4 + _GATHER_MAX // 1000 + 1, what="every frame before GOODBYE")
    assert got == list(range(1, 5 + _GATHER_MAX // 1000 + 1))
    with pytest.raises(ConnectionLost, match="GOODBYE"):
        await server.recv(timeout=5)
    with pytest.raises(ConnectionLost):  # a write after the end raises, gathered or not
        client.try_send(Kind.DATA, b"late")


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
    await asyncio.gather(*(client.send(Kind.DATA, bytes(50_000), clock=c) for client, _ in pairs for c in range(2)))
    assert time.monotonic() - started >= (200_000 - burst - 50_000) / rate * 0.95
    for client, _ in pairs:
        await client.close()


async def test_local_link_lands_payloads_and_propagates_close():
    from poseidon_aio.net import LocalLink

    a, b = LocalLink.pair(0, 0)
    into = np.zeros(6, dtype=np.float32)
    fut = b.expect(Kind.AGGREGATE, 2, 5, into=into)
    await a.send(
        Kind.AGGREGATE, [np.ones(2, np.float32), np.full(4, 2, np.float32)], key=2, clock=5, dtype=DType.FLOAT32
    )
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
    from poseidon_aio.ps.slots import ReplyBuffers

    pool = ReplyBuffers()
    dt = np.dtype(np.float32)
    first = pool.take(0, 8, dt)
    first_id = id(first)
    view = memoryview(first)  # a transport still reading it
    second_id = id(pool.take(0, 8, dt))
    del view, first
    # ids, not objects, in the asserts: pytest's assertion rewriting would keep references alive.
    reused = {id(pool.take(0, 8, dt)) for _ in range(3)}
    assert second_id != first_id and reused <= {first_id, second_id}


# -- limits on what a peer can make us hold ----------------------------------------------------


def _announce(conn, kind: Kind, length: int, *, key: int = 3, clock: int = 4) -> None:
    """Write a bare header announcing ``length`` payload bytes, as a misbehaving peer would."""
    conn._transport.write(encode_header(kind, rank=conn.rank, key=key, clock=clock, length=length, payload_crc=0))


async def _ended_by(server, client, error_type, match: str):
    """Wait for both ends to go; check the server's reason and that the client was told it."""
    async with asyncio.timeout(10):
        await server.wait_closed()
        with pytest.raises(ConnectionLost, match=match) as info:
            await client.recv(timeout=10)
    assert isinstance(server.error, error_type), server.error
    assert isinstance(info.value.__cause__, RemoteProtocolError)  # an ERROR frame came first
    return str(server.error)


async def test_limit_hook_refuses_a_frame_as_soon_as_its_header_arrives():
    client, server = await connected_pair(net_config(), net_config())
    got, sizes = [], {3: 64}
    server.set_handler(got.append, limit=lambda h: sizes.get(h.key))
    await client.send(Kind.PUSH, bytes(64), key=3, clock=1)  # at its limit
    await client.send(Kind.PUSH, bytes(100), key=9, clock=1)  # no opinion: max_payload applies
    await until(lambda: len(got) == 2, what="the frames within their limits arriving")
    _announce(client, Kind.PUSH, 1 << 30)  # 1 GiB for a 64-byte message, and nothing after it
    text = await _ended_by(server, client, FrameError, "accepts at most 64 bytes")
    assert "rank 0" in text and "PUSH key 3 clock 4" in text and "1073741824-byte payload" in text
    assert len(got) == 2 and server.unclaimed_bytes == 0  # refused before any payload buffer


async def test_a_local_link_applies_the_limit_hook_too():
    from poseidon_aio.net import LocalLink

    worker, shard = LocalLink.pair(0, 0)
    got = []
    shard.set_handler(got.append, limit=lambda h: 8)
    await worker.send(Kind.PUSH, bytes(8), key=1, clock=1)
    await worker.send(Kind.PUSH, bytes(9), key=1, clock=2)
    assert [f.clock for f in got] == [1] and isinstance(shard.error, FrameError)
    assert "accepts at most 8 bytes" in str(shard.error)
    with pytest.raises(ConnectionLost, match="accepts at most 8 bytes"):
        await worker.send(Kind.PUSH, bytes(8), key=1, clock=3)


def _no_slot(header):
    raise RemoteProtocolError(f"no slot for key {header.key}")


@pytest.mark.parametrize(
    "hook,error_type,match",
    [
        (_no_slot, RemoteProtocolError, "no slot for key 3"),
        (lambda h: {}[h.key], KeyError, "3"),
        (lambda h: bytearray(3), LocalProtocolError, "allocate hook on rank 1 returned 3 bytes"),
    ],
    ids=["refusal", "bug", "wrong-size"],
)
async def test_an_allocate_hook_failure_ends_that_connection_with_an_error_frame(hook, error_type, match):
    client, server = await connected_pair(net_config(), net_config())
    server.set_handler(lambda f: None, allocate=hook)
    await client.send(Kind.PUSH, bytes(16), key=3, clock=4)
    await _ended_by(server, client, error_type, match)


async def test_a_frame_that_cannot_fit_the_memory_budget_ends_the_connection_at_its_header():
    budget = 1 << 20
    client, server = await connected_pair(net_config(), net_config(memory_budget=budget, inbox_high_water=budget // 2))
    # Bytes landing in a buffer the caller registered are the caller's: they do not count.
    into = bytearray(2 * budget)
    claimed = server.expect(Kind.DATA, 1, 1, into=into)
    await client.send(Kind.DATA, b"\x01" * len(into), key=1, clock=1)
    async with asyncio.timeout(10):
        await claimed
    assert into == b"\x01" * len(into)
    _announce(client, Kind.DATA, budget + 1, key=5, clock=6)
    text = await _ended_by(server, client, FrameError, "memory_budget")
    assert "rank 0 at memory:" in text and "DATA key 5 clock 6" in text and f"at most {budget} bytes" in text
    assert server.unclaimed_bytes == 0


async def test_a_peer_pushing_past_the_memory_budget_is_cut_off():
    config = net_config(memory_budget=100_000, inbox_high_water=90_000)
    client, server = await connected_pair(net_config(), config, max_chunk=4096)
    for clock in range(8):  # 80 000 bytes nobody takes: under the high-water mark, reading goes on
        await client.send(Kind.DATA, bytes(10_000), clock=clock)
    await client.send(Kind.DATA, bytes(50_000), key=2, clock=8)
    text = await _ended_by(server, client, FrameError, "NetConfig.memory_budget")
    assert "80000 bytes of frames nobody has taken yet" in text and "DATA key 2 clock 8" in text
    assert "100000 bytes" in text and server.max_inbox_bytes == 80_000


async def test_set_handler_drains_the_inbox_and_resumes_reading():
    client, server = await connected_pair(net_config(), net_config(inbox_high_water=10_000), max_chunk=4096)
    for clock in range(10):
        await client.send(Kind.DATA, bytes(4000), clock=clock)
    await until(lambda: server.max_inbox_bytes > 10_000, what="reading pausing on a full inbox")
    got = []
    server.set_handler(lambda f: got.append(f.clock))  # takes what waited, and reading resumes
    await until(lambda: len(got) == 10, what="every frame reaching the handler")
    assert got == list(range(10)) and server.unclaimed_bytes == 0
    await client.close()


async def test_frames_replayed_by_set_handler_fail_like_any_other(caplog):
    """A handler refusing a frame that waited in the inbox ends the link; set_handler raises nothing."""
    client, server = await connected_pair(net_config(), net_config())
    await client.send(Kind.PUSH, b"early", key=1, clock=1)
    await client.send(Kind.PUSH, b"later", key=1, clock=2)
    await until(lambda: server.max_inbox_bytes == 10, what="both frames waiting in the inbox")
    seen = []

    def refuse(frame):
        seen.append(frame.clock)
        raise RemoteProtocolError(f"rank 1 does not take {frame.kind.name} key {frame.key} clock {frame.clock}")

    with caplog.at_level("WARNING", logger="poseidon_aio"):
        server.set_handler(refuse)
        text = await _ended_by(server, client, RemoteProtocolError, "does not take PUSH key 1 clock 1")
    assert seen == [1]  # the frame after the refused one is not handed over
    server_lines = [r for r in caplog.records if r.getMessage().startswith("rank 1:")]
    assert len(server_lines) == 1 and server_lines[0].levelname == "WARNING" and text in server_lines[0].getMessage()
    assert all(r.exc_info is None for r in caplog.records), "a traceback was logged"


# -- where recurring work runs (net.loop.Offload) ---------------------------------------------


def _spin(cpu_s: float) -> int:
    """Burn ``cpu_s`` of this thread's CPU (not wall time: a preempted spin takes no less)."""
    import threading
    import time

    started = time.thread_time()
    while time.thread_time() - started < cpu_s:
        pass
    return threading.get_ident()


async def test_offload_keeps_cheap_work_on_the_loop_once_measured_and_sends_costly_work_off():
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from poseidon_aio.net.loop import Offload

    here = threading.get_ident()
    with ThreadPoolExecutor(max_workers=1) as pool:
        offload = Offload(pool, budget_s=0.02)
        # First run of a key: on the executor, measured there. Then cheap work stays here.
        assert await offload.run("cheap", _spin, 0.0) != here
        assert [await offload.run("cheap", _spin, 0.0) for _ in range(3)] == [here] * 3
        # Work over the budget never leaves the executor.
        assert {await offload.run("costly", _spin, 0.05) for _ in range(3)} == {
            pool.submit(threading.get_ident).result()
        }
        # A failure is the caller's.
        with pytest.raises(ZeroDivisionError):
            await offload.run("fails", lambda: 1 / 0)
        # A budget of 0 (a GPU's work) keeps everything off the loop.
        never = Offload(pool, budget_s=0.0)
        assert here not in {await never.run("cheap", _spin, 0.0) for _ in range(3)}


async def test_offload_sends_work_that_grows_past_the_budget_back_off_the_loop_within_the_sampling_period():
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from poseidon_aio.net.loop import INLINE_SAMPLE_EVERY, Offload

    here = threading.get_ident()
    with ThreadPoolExecutor(max_workers=1) as pool:
        offload = Offload(pool, budget_s=0.005)
        assert await offload.run("grows", _spin, 0.0) != here  # measured on the executor: cheap
        # Runs on the loop are timed every INLINE_SAMPLE_EVERY-th: the one that is sends the next off.
        on_loop = 0
        while await offload.run("grows", _spin, 0.01) == here:
            on_loop += 1
            assert on_loop <= INLINE_SAMPLE_EVERY, "work over the budget stayed on the loop"
        assert on_loop == INLINE_SAMPLE_EVERY
        # Timed on the executor at every run: once cheap again, it is back on the loop at once.
        assert await offload.run("grows", _spin, 0.0) != here
        assert await offload.run("grows", _spin, 0.0) == here


async def test_offload_remembers_a_bounded_number_of_keys(monkeypatch):
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from poseidon_aio.net import loop

    monkeypatch.setattr(loop, "OFFLOAD_KEYS", 2)
    here = threading.get_ident()
    with ThreadPoolExecutor(max_workers=1) as pool:
        offload = loop.Offload(pool, budget_s=0.02)
        for key in "abc":
            await offload.run(key, _spin, 0.0)
        assert (offload.inline("a"), offload.inline("b"), offload.inline("c")) == (True, True, False)
        assert await offload.run("c", _spin, 0.0) != here  # not remembered: still off the loop
    assert await loop.Offload(None).run("any", _spin, 0.0) == here  # no executor: in place (tests)
