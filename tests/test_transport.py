"""Connections between separate processes on 127.0.0.1: data, refusal, loss, backpressure, TLS.

Every test runs on both asyncio's loop and uvloop (conftest); every wait on the other process is
bounded by ``asyncio.timeout``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time

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
from poseidon_aio.net import connect, listen
from poseidon_aio.net.handshake import Handshake, Role
from poseidon_aio.wire import DType, FrameDecoder, Kind, encode_frame

from .procs import TOKEN, child, connector, echo_server, net_config, report, slow_reader

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("tls", [False, True], ids=["tcp", "tls"])
async def test_frames_cross_processes_into_registered_buffers(tls):
    with child(echo_server, TOKEN, tls, {}) as (proc, pipe, port):
        async with asyncio.timeout(30):
            conn = await connect("127.0.0.1", port, rank=0, config=net_config(tls=tls))
            assert conn.peer_rank == 1
            rng = np.random.default_rng(0)
            for clock, size in enumerate([0, 1, 4, 1000, 65536, 1 << 20, 3 << 20]):
                grad = rng.standard_normal(size // 4, dtype=np.float32)
                into = np.empty_like(grad)
                fut = conn.expect(Kind.AGGREGATE, key=9, clock=clock, into=into)
                await conn.send(Kind.PUSH, grad, key=9, clock=clock, dtype=DType.FLOAT32)
                frame = await fut
                np.testing.assert_array_equal(into, grad)
                assert frame.header.dtype is DType.FLOAT32 and frame.header.length == grad.nbytes
                if grad.nbytes:
                    assert frame.payload.obj is into or np.shares_memory(np.asarray(frame.payload), into)
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
            with pytest.raises(VersionMismatch, match="speaks protocol version 2"):
                await connect("127.0.0.1", port, rank=0, config=net_config(), protocol=2)
        refused = report(pipe)["refused"]
    assert refused and refused[0][0] == "VersionMismatch" and "version 2" in refused[0][1]


async def test_listener_refuses_a_client_of_another_version():
    received = []
    listener = await listen(
        "127.0.0.1", 0, rank=1, config=net_config(), on_connection=received.append, protocol=3
    )
    try:
        with child(connector, listener.address[1], TOKEN, 1) as (proc, pipe, _):
            async with asyncio.timeout(30):
                outcome = await asyncio.to_thread(pipe.recv)
        assert outcome[0] == "VersionMismatch" and "refused" in outcome[1]
        assert received == [] and type(listener.refused[0]) is VersionMismatch
    finally:
        await listener.close()


def _raw_handshake(sock: socket.socket, hs: Handshake) -> None:
    """Drive a client handshake over a blocking socket (used to then misbehave)."""
    dec = FrameDecoder()
    for kind, payload in hs.start():
        sock.sendall(encode_frame(kind, payload, rank=hs.rank, dtype=DType.JSON))
    while not hs.ready:
        data = sock.recv(4096)
        assert data, "listener closed during the handshake"
        dec.feed(data)
        while (frame := dec.next_frame()) is not None:
            for kind, payload in hs.receive(frame):
                sock.sendall(encode_frame(kind, payload, rank=hs.rank, dtype=DType.JSON))


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
            while not listener.refused:
                await asyncio.sleep(0.01)
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
            while len(listener.refused) < 2:
                await asyncio.sleep(0.01)
        assert isinstance(listener.refused[1], FrameError) and "exceeds the maximum of 4096" in str(
            listener.refused[1]
        )
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
            while not listener.refused:
                await asyncio.sleep(0.01)
        assert isinstance(listener.refused[0], AuthenticationError)
        assert b"WELCOME" not in replies and len(conns) == 1
    finally:
        await listener.close()


async def test_malformed_frame_ends_one_connection_and_the_listener_keeps_serving():
    listener, conns = await _listener_with_log()
    try:
        def misbehave():
            with socket.create_connection(listener.address, timeout=10) as sock:
                _raw_handshake(sock, Handshake(Role.CLIENT, 5, TOKEN))
                sock.sendall(b"GET / HTTP/1.1\r\n" + b"x" * 64)
                replies = b""
                while chunk := sock.recv(4096):
                    replies += chunk
                return replies

        async with asyncio.timeout(20):
            replies = await asyncio.to_thread(misbehave)
            while not conns or conns[0].error is None:
                await asyncio.sleep(0.01)
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
    quick = dict(heartbeat_interval=0.1, idle_timeout=0.6)
    with child(echo_server, TOKEN, False, quick) as (proc, pipe, port):
        async with asyncio.timeout(30):
            conn = await connect("127.0.0.1", port, rank=0, config=net_config(**quick))
            await asyncio.sleep(2.0)  # > 3 idle timeouts of silence above the heartbeats
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
        assert waited < 5


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
