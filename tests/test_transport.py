"""Connections between separate processes on 127.0.0.1: data, refusal, loss, backpressure, TLS.

Every test runs on both asyncio's loop and uvloop (conftest); every wait on the other process is
bounded by ``asyncio.timeout``, and every wait for the listener to record something waits on that
state (``Listener.wait_refused``, :func:`~tests.support.conditions.until`), never for a fixed time.
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import socket
import time
import tracemalloc

import numpy as np
import pytest

from poseidon_aio.errors import (
    AuthenticationError,
    ConnectionLost,
    FrameError,
    HandshakeError,
    PeerTimeout,
    RemoteProtocolError,
    VersionMismatch,
)
from poseidon_aio.net import Connection, connect, listen
from poseidon_aio.net.handshake import Handshake, Role
from poseidon_aio.wire import DType, FrameDecoder, Kind, encode_frame, encode_header

from .support.conditions import until
from .support.echo import round_trips
from .support.rawpeer import raw_handshake
from .support.procs import TOKEN, child, connector, echo_server, net_config, report, slow_reader

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("tls", [False, True], ids=["tcp", "tls"])
async def test_frames_cross_processes_into_registered_buffers(tls):
    with child(echo_server, TOKEN, tls, {}) as (proc, pipe, port):
        async with asyncio.timeout(30):
            conn = await connect("127.0.0.1", port, rank=0, config=net_config(tls=tls))
            assert conn.peer_rank == 1
            await round_trips(conn, [0, 1, 4, 1000, 65536, 1 << 20, 3 << 20])
            await conn.close()
        assert report(pipe)["refused"] == []


async def test_wrong_token_is_refused_on_both_ends():
    with child(echo_server, TOKEN, False, {}) as (proc, pipe, port):
        async with asyncio.timeout(30):
            with pytest.raises(AuthenticationError, match="failed to prove the cluster token"):
                await connect("127.0.0.1", port, rank=0, config=net_config(token=b"not-the-token-0123456789"))
        refused = report(pipe)["refused"]
    assert refused and refused[0][0] == "AuthenticationError", refused
    assert "refused the connection" in refused[0][1]


async def test_wrong_protocol_version_is_refused_on_both_ends():
    with child(echo_server, TOKEN, False, {}) as (proc, pipe, port):
        async with asyncio.timeout(30):
            with pytest.raises(VersionMismatch, match="speaks protocol version 3"):
                await connect("127.0.0.1", port, rank=0, config=net_config(), protocol=3)
        refused = report(pipe)["refused"]
    assert refused and refused[0][0] == "VersionMismatch" and "version 3" in refused[0][1]


async def test_listener_refuses_a_client_of_another_version():
    received = []
    listener = await listen("127.0.0.1", 0, rank=1, config=net_config(), on_connection=received.append, protocol=3)
    try:
        with child(connector, listener.address[1], TOKEN, 1) as (proc, pipe, _):
            async with asyncio.timeout(30):
                outcome = await asyncio.to_thread(pipe.recv)
        assert outcome[0] == "VersionMismatch" and "refused" in outcome[1]
        # The client hears the refusal first; the listener records it a few loop turns later.
        await listener.wait_refused(1, timeout=30)
        assert received == [] and type(listener.refused[0]) is VersionMismatch
    finally:
        await listener.close()


async def _listener_with_log():
    conns = []

    async def serve(conn):
        conns.append(conn)
        while True:
            frame = await conn.recv()
            await conn.send(Kind.AGGREGATE, frame.payload, key=frame.key, clock=frame.clock)

    listener = await listen("127.0.0.1", 0, rank=1, config=net_config(), on_connection=serve)
    return listener, conns


async def test_data_before_handshake_is_refused_and_never_processed():
    listener, conns = await _listener_with_log()
    try:

        def attack():
            with socket.create_connection(listener.address, timeout=10) as sock:
                sock.sendall(encode_frame(Kind.PUSH, b"\x00" * 64, rank=0, key=1, clock=0))
                return sock.recv(4096)

        async with asyncio.timeout(20):
            reply = await asyncio.to_thread(attack)
        await listener.wait_refused(1, timeout=30)
        dec = FrameDecoder()
        dec.feed(reply)
        frame = dec.next_frame()
        assert frame.kind is Kind.ERROR and b"unexpected PUSH frame" in bytes(frame.payload)
        assert isinstance(listener.refused[0], HandshakeError) and conns == []

        # An unauthenticated peer cannot make us buffer more than a handshake message.
        def oversized():
            with socket.create_connection(listener.address, timeout=10) as sock:
                sock.sendall(encode_frame(Kind.HELLO, b"x" * 100_000, rank=0)[:4096])
                return sock.recv(4096)

        async with asyncio.timeout(20):
            await asyncio.to_thread(oversized)
        await listener.wait_refused(2, timeout=30)
        assert isinstance(listener.refused[1], FrameError) and "exceeds the maximum of 4096" in str(listener.refused[1])
    finally:
        await listener.close()


async def test_recorded_handshake_cannot_be_replayed():
    listener, conns = await _listener_with_log()
    try:

        def record_then_replay():
            hs = Handshake(Role.CLIENT, 0, TOKEN)
            sent = []
            with socket.create_connection(listener.address, timeout=10) as sock:
                real_sendall = sock.sendall
                dec = FrameDecoder()
                for kind, payload in hs.start():
                    data = encode_frame(kind, payload, rank=0, dtype=DType.JSON)
                    sent.append(data)
                    real_sendall(data)
                while not hs.ready:
                    dec.feed(sock.recv(4096))
                    while (frame := dec.next_frame()) is not None:
                        for kind, payload in hs.receive(frame):
                            data = encode_frame(kind, payload, rank=0, dtype=DType.JSON)
                            sent.append(data)
                            real_sendall(data)
            # An eavesdropper replays the client's recorded bytes on a new connection.
            with socket.create_connection(listener.address, timeout=10) as sock:
                for data in sent:
                    sock.sendall(data)
                replies = b""
                while chunk := sock.recv(4096):
                    replies += chunk
            return replies

        async with asyncio.timeout(20):
            replies = await asyncio.to_thread(record_then_replay)
        await listener.wait_refused(1, timeout=30)
        # The genuine connection reaches on_connection in its own task, which may run after the
        # replay's refusal: wait for it rather than assume an order.
        await until(lambda: len(conns) >= 1, what="the genuine connection reaching on_connection")
        assert isinstance(listener.refused[0], AuthenticationError)
        assert b"WELCOME" not in replies and len(conns) == 1 and listener.refused_total == 1
    finally:
        await listener.close()


async def test_malformed_frame_ends_one_connection_and_the_listener_keeps_serving():
    listener, conns = await _listener_with_log()
    try:

        def misbehave():
            with socket.create_connection(listener.address, timeout=10) as sock:
                raw_handshake(sock.sendall, sock.recv, Handshake(Role.CLIENT, 5, TOKEN))
                sock.sendall(b"GET / HTTP/1.1\r\n" + b"x" * 64)
                replies = b""
                while chunk := sock.recv(4096):
                    replies += chunk
                return replies

        async with asyncio.timeout(20):
            replies = await asyncio.to_thread(misbehave)
        # The connection may fail before its on_connection task runs: wait for both.
        await until(lambda: conns and conns[0].error is not None, what="the malformed connection ending")
        assert isinstance(conns[0].error, FrameError)
        assert "bad magic" in str(conns[0].error) and "rank 5" in str(conns[0].error)
        assert b"bad magic" in replies  # the peer is told why
        async with asyncio.timeout(20):
            good = await connect(*listener.address, rank=0, config=net_config())
            fut = good.expect(Kind.AGGREGATE, 1, 1)
            await good.send(Kind.PUSH, b"still serving", key=1, clock=1)
            assert bytes((await fut).payload) == b"still serving"
            await good.close()
    finally:
        await listener.close()


async def test_a_corrupted_payload_ends_its_connection_unused_naming_peer_key_and_clock():
    """The listener has registered where the payload lands; the frame still never reaches it."""
    received = []

    async def serve(conn):
        received.append(conn)
        conn.expect(Kind.PUSH, 3, 7, into=bytearray(256))

    listener = await listen("127.0.0.1", 0, rank=1, config=net_config(), on_connection=serve)
    try:

        def corrupt():
            with socket.create_connection(listener.address, timeout=10) as sock:
                raw_handshake(sock.sendall, sock.recv, Handshake(Role.CLIENT, 5, TOKEN))
                frame = bytearray(encode_frame(Kind.PUSH, bytes(range(256)), rank=5, key=3, clock=7, checksum=True))
                frame[-100] ^= 0x10  # one bit, as a bad NIC flips it
                sock.sendall(frame)
                replies = b""
                while chunk := sock.recv(4096):
                    replies += chunk
                return replies

        async with asyncio.timeout(20):
            replies = await asyncio.to_thread(corrupt)
        await until(lambda: received and received[0].error is not None, what="the corrupted connection ending")
        error = received[0].error
        assert isinstance(error, FrameError)
        assert str(error).startswith("payload checksum mismatch in PUSH key 3 clock 7 from rank 5 (256 bytes")
        assert "from rank 5 at 127.0.0.1:" in str(error) and b"payload checksum mismatch" in replies
    finally:
        await listener.close()


async def test_a_peer_of_wire_version_1_is_refused_with_a_version_error():
    import struct
    import zlib

    listener = await listen("127.0.0.1", 0, rank=1, config=net_config(), on_connection=lambda conn: None)
    try:

        def old_release():
            hello = b'{"protocol":1,"rank":0,"nonce":"00"}'
            body = struct.pack("<4sBBHIIQQB3x", b"PSDN", 1, Kind.HELLO, 0, 0, 0, 0, len(hello), DType.JSON)
            with socket.create_connection(listener.address, timeout=10) as sock:
                sock.sendall(body + zlib.crc32(body).to_bytes(4, "little") + hello)
                return sock.recv(4096)

        async with asyncio.timeout(20):
            reply = await asyncio.to_thread(old_release)
            await listener.wait_refused(1, timeout=20)
        refused = listener.refused[0]
        assert isinstance(refused, VersionMismatch)
        assert "speaks wire version 1, this build speaks 2: run the same poseidon_aio release" in str(refused)
        assert reply[:5] == b"PSDN\x02"  # told why, in frames the old release refuses by their version
    finally:
        await listener.close()


@pytest.mark.parametrize(
    "dialler,listener_side,expected",
    [
        (dict(), dict(), True),
        (dict(payload_checksum=False), dict(), True),
        (dict(), dict(payload_checksum=False), True),
        (dict(payload_checksum=False), dict(payload_checksum=False), False),
        (dict(tls=True), dict(tls=True), False),
    ],
    ids=["both", "listener-asks", "dialler-asks", "neither", "tls"],
)
async def test_payloads_are_checksummed_unless_neither_end_asks_or_tls_is_on(dialler, listener_side, expected):
    conns = []

    async def serve(conn):
        conns.append(conn)
        frame = await conn.recv()
        await conn.send(Kind.AGGREGATE, frame.payload, key=frame.key, clock=frame.clock)

    listener = await listen("127.0.0.1", 0, rank=1, config=net_config(**listener_side), on_connection=serve)
    try:
        async with asyncio.timeout(20):
            conn = await connect(*listener.address, rank=0, config=net_config(**dialler))
            fut = conn.expect(Kind.AGGREGATE, 1, 1)
            await conn.send(Kind.PUSH, b"x" * 1000, key=1, clock=1)
            assert bytes((await fut).payload) == b"x" * 1000
        assert conn.payload_checksum == conns[0].payload_checksum == expected
        await conn.close()
    finally:
        await listener.close()


async def test_killed_peer_fails_every_pending_waiter():
    with child(echo_server, TOKEN, False, {}) as (proc, pipe, port):
        async with asyncio.timeout(30):
            conn = await connect("127.0.0.1", port, rank=0, config=net_config())
            pending = [conn.expect(Kind.AGGREGATE, key=k, clock=99) for k in range(5)]
            recv = asyncio.ensure_future(conn.recv())
            os.kill(proc.pid, signal.SIGKILL)
            results = await asyncio.gather(*pending, recv, return_exceptions=True)
        assert all(isinstance(r, ConnectionLost) for r in results), results
        assert "rank 1" in str(results[0])
        with pytest.raises(ConnectionLost):
            await conn.send(Kind.PUSH, b"x")


async def test_silent_peer_times_out_and_heartbeats_keep_a_quiet_one_alive():
    # The idle timeout is 10 heartbeats: a process descheduled for up to ~1.8 s on a loaded machine
    # still counts as alive, while a link without heartbeats would die in 2 s of quiet.
    idle = 2.0
    quick = dict(heartbeat_interval=idle / 10, idle_timeout=idle)
    with child(echo_server, TOKEN, False, quick) as (proc, pipe, port):
        async with asyncio.timeout(60):
            conn = await connect("127.0.0.1", port, rank=0, config=net_config(**quick))
            # This sleep is what the test is about (a quiet link), not a barrier: 2 idle timeouts.
            await asyncio.sleep(2 * idle)
            assert conn.is_open, conn.error
            fut = conn.expect(Kind.AGGREGATE, 1, 1)
            os.kill(proc.pid, signal.SIGSTOP)
            try:
                started = time.monotonic()
                with pytest.raises(ConnectionLost) as info:
                    await fut
                waited = time.monotonic() - started
            finally:
                os.kill(proc.pid, signal.SIGCONT)
        assert isinstance(info.value.__cause__, PeerTimeout) and "idle timeout" in str(info.value)
        assert waited < idle + 20  # a bound, not a race: the timeout fires within a tick of `idle`


async def test_slow_reader_bounds_the_senders_memory():
    frame, high, inbox = 256 * 1024, 512 * 1024, 1 << 20
    overrides = dict(inbox_high_water=inbox)
    with child(slow_reader, 0.01, overrides) as (proc, pipe, port):
        async with asyncio.timeout(60):
            config = net_config(write_high_water=high, write_low_water=high // 4)
            conn = await connect("127.0.0.1", port, rank=0, config=config)
            payload = np.zeros(frame, dtype=np.uint8)
            for clock in range(150):  # 37.5 MiB against a reader that takes ~25 MiB/s
                await conn.send(Kind.DATA, payload, clock=clock)
            done = conn.expect(Kind.CONTROL, 0, 0)
            await conn.send(Kind.CONTROL, b"end")
            await done
            await conn.close()
        seen = report(pipe)
    assert seen["frames"] == 151
    assert conn.stats.write_pauses > 0
    # Sender: buffered bytes never exceed the high-water mark plus the frame in hand.
    assert conn.stats.max_write_buffer <= high + frame + 64
    # Receiver: the inbox stops growing once reading pauses (one socket read past the mark).
    assert seen["max_inbox"] <= inbox + 4 * frame


async def test_shaper_caps_the_send_rate():
    from poseidon_aio.net import ShaperConfig

    rate, burst, total = 4e6, 64 * 1024, 2 << 20
    with child(echo_server, TOKEN, False, {}) as (proc, pipe, port):
        async with asyncio.timeout(30):
            config = net_config(shaper=ShaperConfig(egress_rate=rate, burst=burst))
            conn = await connect("127.0.0.1", port, rank=0, config=config)
            chunk = bytes(128 * 1024)
            started = time.monotonic()
            for clock in range(total // len(chunk)):
                await conn.send(Kind.DATA, chunk, clock=clock)
            elapsed = time.monotonic() - started
            await conn.close()
    # A lower bound only: the shaper may never let more than burst + rate * t bytes out.
    assert elapsed >= (total - burst - len(chunk)) / rate * 0.95


async def test_clean_close_tells_the_peer():
    arrived = asyncio.Event()
    server_side = []

    async def serve(conn):
        server_side.append(conn)
        arrived.set()
        with pytest.raises(ConnectionLost, match="GOODBYE"):
            await conn.recv(timeout=20)

    listener = await listen("127.0.0.1", 0, rank=1, config=net_config(), on_connection=serve)
    try:
        async with asyncio.timeout(20):
            conn = await connect(*listener.address, rank=0, config=net_config())
            await arrived.wait()
            await conn.close()
            await server_side[0].wait_closed()
        assert isinstance(server_side[0].error, ConnectionLost)
    finally:
        await listener.close()


async def test_remote_error_frame_is_reported():
    async def serve(conn):
        conn._fail(RemoteProtocolError("shape mismatch on key 4 at clock 2"), "error")

    listener = await listen("127.0.0.1", 0, rank=1, config=net_config(), on_connection=serve)
    try:
        async with asyncio.timeout(20):
            conn = await connect(*listener.address, rank=0, config=net_config())
            with pytest.raises(ConnectionLost, match="shape mismatch on key 4") as info:
                await conn.recv(timeout=10)
        assert isinstance(info.value.__cause__, RemoteProtocolError)
    finally:
        await listener.close()


# -- what a peer can make a listener hold -------------------------------------------------------


def _open_silent(address, count: int) -> list:
    """Open ``count`` TCP connections that never send a byte (blocking; run it in a thread)."""
    socks = []
    try:
        for _ in range(count):
            socks.append(socket.create_connection(address, timeout=30))
    except BaseException:
        for sock in socks:
            sock.close()
        raise
    return socks


def _server_connections_from(addresses: set) -> list:
    """Every server-side Connection still alive for a peer at one of ``addresses`` ("host:port")."""
    gc.collect()
    # type(), not isinstance(): the latter reads __class__, which some of torch's objects warn about.
    live = [obj for obj in gc.get_objects() if type(obj) is Connection and obj.role is Role.SERVER]
    return [conn for conn in live if conn.peer_address in addresses]


async def _good_tls_client_connects(listener) -> None:
    async with asyncio.timeout(30):
        conn = await connect(*listener.address, rank=0, config=net_config(tls=True))
        fut = conn.expect(Kind.AGGREGATE, 1, 1)
        await conn.send(Kind.PUSH, b"served", key=1, clock=1)
        assert bytes((await fut).payload) == b"served"
        await conn.close()


async def _echo(conn):
    while True:
        frame = await conn.recv()
        await conn.send(Kind.AGGREGATE, frame.payload, key=frame.key, clock=frame.clock)


async def test_tls_connections_that_never_handshake_are_dropped_at_the_deadline():
    count, deadline = 200, 0.5
    config = net_config(tls=True, handshake_timeout=deadline)
    listener = await listen("127.0.0.1", 0, rank=1, config=config, on_connection=_echo)
    socks = []
    try:
        socks = await asyncio.to_thread(_open_silent, listener.address, count)
        addresses = {"{}:{}".format(*s.getsockname()[:2]) for s in socks}
        # Each is either turned away at accept (beyond max_pending_handshakes) or dropped at
        # its deadline: wait for all 200 to be accounted for, however long the machine takes.
        await until(
            lambda: listener.refused_total + listener.turned_away == count and listener.pending_handshakes == 0,
            timeout=60,
            what=f"all {count} silent connections being dropped",
        )
        assert all(isinstance(e, (PeerTimeout, HandshakeError)) for e in listener.refused)
        await until(lambda: not listener._tasks, what="the listener's handshake tasks ending")
        assert _server_connections_from(addresses) == [], "the listener still holds connections of silent peers"
        assert listener.connections == set()
        await _good_tls_client_connects(listener)
    finally:
        for sock in socks:
            sock.close()
        await listener.close()


async def test_a_listener_turns_away_connections_beyond_max_pending_handshakes():
    # A deadline far beyond the test: the first 4 connections hold their slots until they close.
    config = net_config(tls=True, handshake_timeout=60, max_pending_handshakes=4)
    listener = await listen("127.0.0.1", 0, rank=1, config=config, on_connection=_echo)
    socks = []
    try:
        socks = await asyncio.to_thread(_open_silent, listener.address, 10)
        await until(lambda: listener.turned_away == 6, what="6 connections being turned away")
        assert listener.pending_handshakes == 4

        def closed_by_the_listener(sock) -> bool:
            sock.settimeout(30)
            try:
                return sock.recv(1) == b""
            except ConnectionResetError:
                return True

        # Accepted in the order they connected: the last 6 were closed at once, before any TLS.
        assert all(await asyncio.to_thread(lambda: [closed_by_the_listener(s) for s in socks[4:]]))
        for sock in socks:
            sock.close()
        await until(lambda: listener.pending_handshakes == 0, what="the 4 pending handshakes ending")
        await listener.wait_refused(4, timeout=30)
        await _good_tls_client_connects(listener)
    finally:
        for sock in socks:
            sock.close()
        await listener.close()


@pytest.mark.parametrize("within_budget", [True, False], ids=["grows-with-bytes", "over-budget"])
async def test_an_authenticated_peer_announcing_1_gib_does_not_make_us_allocate_it(within_budget):
    announced, sent = 1 << 30, 1 << 20
    budget = 2 * announced if within_budget else 256 << 20
    conns = []

    async def keep(conn):
        conns.append(conn)
        await conn.wait_closed()

    config = net_config(max_payload=announced, memory_budget=budget)
    listener = await listen("127.0.0.1", 0, rank=1, config=config, on_connection=keep)
    sock = socket.create_connection(listener.address, timeout=30)
    tracemalloc.start()
    try:
        await asyncio.to_thread(raw_handshake, sock.sendall, sock.recv, Handshake(Role.CLIENT, 5, TOKEN))
        await until(lambda: conns, what="the peer being admitted")
        # Its payload never completes, so the checksum the connection agreed to is never tested.
        header = encode_header(Kind.PUSH, rank=5, key=3, clock=7, length=announced, dtype=DType.FLOAT32, payload_crc=0)
        # 256 KiB more than awaited: that much of a payload may wait in the kernel until more
        # comes (SO_RCVLOWAT, Connection._tune_lowat), and the whole 1 MiB must be read.
        beyond = 256 << 10
        await asyncio.to_thread(sock.sendall, header + bytes(sent + beyond) if within_budget else header)
        conn = conns[0]
        if within_budget:
            await until(lambda: conn.stats.bytes_received >= len(header) + sent, what="1 MiB of payload arriving")
            # A buffer grown for the bytes that came (doubling), not for the 1 GiB announced.
            assert conn.is_open and conn.unclaimed_bytes <= 2 * sent + (1 << 20)
        else:
            async with asyncio.timeout(30):
                await conn.wait_closed()
            assert isinstance(conn.error, FrameError) and "memory_budget" in str(conn.error)
            assert "rank 5 at 127.0.0.1:" in str(conn.error) and "PUSH key 3 clock 7" in str(conn.error)
            reply = await asyncio.to_thread(_read_until_closed, sock)
            assert b"NetConfig.memory_budget" in reply  # the peer is told why
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        sock.close()
        await listener.close()
    assert peak < 32 << 20, f"receiving {sent} bytes of a 1 GiB announcement allocated {peak} bytes at peak"


def _read_until_closed(sock) -> bytes:
    replies = b""
    while chunk := sock.recv(4096):
        replies += chunk
    return replies


async def test_the_receive_mark_is_set_on_the_transports_socket_and_our_duplicate_closes_with_it():
    # Connection._tune_lowat sets SO_RCVLOWAT through a socket of its own on uvloop (a duplicate
    # descriptor: uvloop's stand-in builds a socket.socket per call); the mark must reach the
    # transport's socket, and the duplicate must not outlive the connection.
    conns = []

    async def keep(conn):
        conns.append(conn)
        await conn.wait_closed()

    listener = await listen("127.0.0.1", 0, rank=1, config=net_config(), on_connection=keep)
    try:
        async with asyncio.timeout(30):
            client = await connect(*listener.address, rank=0, config=net_config())
            await until(lambda: conns, what="the peer being admitted")
        server = conns[0]
        if server._lowat_sock is None:
            pytest.skip("SO_RCVLOWAT is not used on this platform")
        mark = socket.SOL_SOCKET, socket.SO_RCVLOWAT
        transports = server._transport.get_extra_info("socket")
        ours, owned = server._lowat_sock, server._lowat_owned
        assert owned == (asyncio.get_running_loop().__class__.__module__.startswith("uvloop"))
        ours.setsockopt(*mark, 12345)
        assert transports.getsockopt(*mark) == 12345
        await client.close()
        async with asyncio.timeout(30):
            await server.wait_closed()
        assert server._lowat_sock is None
        if owned:
            assert ours.fileno() == -1  # our duplicate closed with the link
    finally:
        await listener.close()
