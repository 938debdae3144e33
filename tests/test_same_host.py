"""The link between workers on one host: a Connection on shared-memory rings, reached through an
abstract Unix socket (``net.shm``, ``net.unix``, ``cluster.links``).

The same contract as over TCP (tests/test_transport.py), checked on the new link: the token
handshake before any frame, a malformed frame ends that link alone, a killed peer fails every
waiter, memory stays bounded on both sides, GOODBYE is not an abort; a peer may offer only a
sealed ring and announce only what fits it; the socket's name is abstract, so it never becomes a
file and goes with its process. Every wait on another process is bounded, and every wait for a
state waits on that state, never for a fixed time.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from poseidon_aio.errors import AuthenticationError, ConnectionLost, FrameError, HandshakeError
from poseidon_aio.net import connect_unix, listen
from poseidon_aio.net.handshake import Handshake, Role
from poseidon_aio.net.shm import MIN_RING_BYTES, RING_BYTES
from poseidon_aio.net.unix import AVAILABLE, PREFIX
from poseidon_aio.wire import DType, FrameDecoder, Kind, encode_frame

from .support.conditions import until
from .support.memtransport import run_async
from .support.rawshm import RawRingPeer
from .support.echo import round_trips
from .support.rawpeer import raw_handshake
from .support.procs import TOKEN, child, net_config, report, slow_reader, unix_echo_server

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not AVAILABLE, reason="abstract Unix sockets are Linux's")]


def unix_table() -> str:
    """The host's Unix sockets as the kernel lists them (abstract names begin with "@")."""
    with open("/proc/net/unix") as f:
        return f.read()


async def echo_listener(**overrides):
    """A listener in this process that also takes same-host peers; echoes PUSH as AGGREGATE."""
    conns = []

    async def serve(conn):
        conns.append(conn)
        while True:
            frame = await conn.recv()
            await conn.send(Kind.AGGREGATE, frame.payload, key=frame.key, clock=frame.clock, dtype=frame.header.dtype)

    listener = await listen("127.0.0.1", 0, rank=1, config=net_config(**overrides), on_connection=serve, same_host=True)
    return listener, conns


def read_to_end(sock: socket.socket) -> bytes:
    out = b""
    while chunk := sock.recv(4096):
        out += chunk
    return out


async def test_frames_cross_processes_over_the_rings_into_registered_buffers():
    with child(unix_echo_server, TOKEN, {}) as (proc, pipe, name):
        assert name.startswith(PREFIX)
        async with asyncio.timeout(30):
            conn = await connect_unix(name, rank=0, config=net_config())
            assert conn.via == "shm" and conn.peer_rank == 1 and f"@{name}" in conn.where
            assert not conn.payload_checksum  # one host: no NIC between the two, no CRC asked
            await round_trips(conn, [0, 1, 4, 1000, 65536, 1 << 20, 3 << 20])
            await conn.close()
        seen = report(pipe)
    assert seen["refused"] == [] and seen["vias"] == ["shm"]


async def test_the_socket_s_name_is_abstract_and_goes_with_its_process():
    # Listed by the kernel as "@name" (no file in /tmp or anywhere) while its process lives;
    # gone once that process is killed with SIGKILL, with nothing to clean up.
    with child(unix_echo_server, TOKEN, {}) as (proc, pipe, name):
        assert f"@{name}" in unix_table()
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)
        assert proc.exitcode == -signal.SIGKILL
    assert f"@{name}" not in unix_table() and not os.path.exists(name)


async def test_a_process_without_the_token_is_refused_on_the_same_host_link():
    with child(unix_echo_server, TOKEN, {}) as (proc, pipe, name):
        async with asyncio.timeout(30):
            with pytest.raises(AuthenticationError, match="failed to prove the cluster token"):
                await connect_unix(name, rank=0, config=net_config(token=b"not-the-token-0123456789"))
        refused = report(pipe)["refused"]
    assert refused and refused[0][0] == "AuthenticationError", refused
    assert f"on unix socket @{name}" in refused[0][1]  # the listener names the dialler's pid and socket


async def test_a_peer_that_offers_no_ring_an_unsealed_one_or_one_out_of_bounds_is_refused():
    listener, conns = await echo_listener()
    try:

        def no_ring():
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(10)
                sock.connect("\0" + listener.unix_name)
                sock.sendall(encode_frame(Kind.PUSH, b"\x00" * 64, rank=0, key=1, clock=0))
                try:
                    return sock.recv(4096)
                except ConnectionResetError:
                    return b""

        def unsealed():
            with RawRingPeer(listener.unix_name, sealed=False) as peer:
                return peer.offered

        def tiny():
            with RawRingPeer(listener.unix_name, size=MIN_RING_BYTES // 2) as peer:
                return peer.offered

        async with asyncio.timeout(20):
            assert await asyncio.to_thread(no_ring) == b""
            await listener.wait_refused(1, timeout=30)
            assert await asyncio.to_thread(unsealed) is False
            await listener.wait_refused(2, timeout=30)
            assert await asyncio.to_thread(tiny) is False
            await listener.wait_refused(3, timeout=30)
        assert "did not offer a shared-memory ring" in str(listener.refused[0])
        assert "not sealed" in str(listener.refused[1]) and conns == []
        assert f"offered a ring of {MIN_RING_BYTES // 2} bytes, outside" in str(listener.refused[2])
        assert all(isinstance(e, HandshakeError) and "\n" not in str(e) for e in listener.refused)
    finally:
        await listener.close()


async def test_bytes_before_the_handshake_are_refused_on_the_rings():
    listener, conns = await echo_listener()
    try:

        def attack():
            with RawRingPeer(listener.unix_name) as peer:
                peer.send(encode_frame(Kind.PUSH, b"\x00" * 64, rank=0, key=1, clock=0))
                return peer.read_to_end()

        async with asyncio.timeout(20):
            reply = await asyncio.to_thread(attack)
        await listener.wait_refused(1, timeout=30)
        dec = FrameDecoder()
        dec.feed(reply)
        frame = dec.next_frame()
        assert frame.kind is Kind.ERROR and b"unexpected PUSH frame" in bytes(frame.payload)
        assert isinstance(listener.refused[0], HandshakeError) and conns == []
    finally:
        await listener.close()


async def test_a_malformed_frame_on_the_rings_ends_that_link_only():
    listener, conns = await echo_listener()
    try:

        def misbehave():
            with RawRingPeer(listener.unix_name) as peer:
                raw_handshake(peer.send, peer.recv, Handshake(Role.CLIENT, 5, TOKEN))
                peer.send(b"GET / HTTP/1.1\r\n" + b"x" * 64)
                return peer.read_to_end()

        async with asyncio.timeout(20):
            replies = await asyncio.to_thread(misbehave)
        await until(lambda: conns and conns[0].error is not None, what="the malformed link ending")
        error = conns[0].error
        assert isinstance(error, FrameError) and conns[0].via == "shm"
        assert "bad magic" in str(error) and "from rank 5 at pid " in str(error) and "\n" not in str(error)
        assert "closing that connection" in str(error)
        assert b"bad magic" in replies  # the peer is told why
        async with asyncio.timeout(20):
            good = await connect_unix(listener.unix_name, rank=0, config=net_config())
            fut = good.expect(Kind.AGGREGATE, 1, 1)
            await good.send(Kind.PUSH, b"still serving", key=1, clock=1)
            assert bytes((await fut).payload) == b"still serving"
            await good.close()
    finally:
        await listener.close()


async def test_a_doorbell_beyond_the_ring_ends_the_link_naming_the_peer():
    listener, conns = await echo_listener()
    try:

        def lie():
            with RawRingPeer(listener.unix_name) as peer:
                raw_handshake(peer.send, peer.recv, Handshake(Role.CLIENT, 6, TOKEN))
                peer.ring(b"W", RING_BYTES + 1)
                return peer.read_to_end()

        async with asyncio.timeout(20):
            await asyncio.to_thread(lie)
        await until(lambda: conns and conns[0].error is not None, what="the lying link ending")
        error = str(conns[0].error)
        assert "does not fit the shared-memory ring" in error and "rank 6 at pid " in error and "\n" not in error
    finally:
        await listener.close()


async def test_a_peer_killed_with_sigkill_fails_every_waiter_on_the_same_host_link():
    with child(unix_echo_server, TOKEN, {}) as (proc, pipe, name):
        async with asyncio.timeout(30):
            conn = await connect_unix(name, rank=0, config=net_config())
            pending = [conn.expect(Kind.AGGREGATE, key=k, clock=99) for k in range(5)]
            recv = asyncio.ensure_future(conn.recv())
            os.kill(proc.pid, signal.SIGKILL)
            results = await asyncio.gather(*pending, recv, return_exceptions=True)
        assert all(isinstance(r, ConnectionLost) for r in results), results
        assert f"rank 1 at unix socket @{name} was lost" in str(results[0])
        with pytest.raises(ConnectionLost):
            await conn.send(Kind.PUSH, b"x")


async def test_a_slow_reader_on_the_rings_bounds_both_sides_memory():
    frame, high, inbox = 256 * 1024, 512 * 1024, 1 << 20
    with child(slow_reader, 0.01, dict(inbox_high_water=inbox), True) as (proc, pipe, name):
        async with asyncio.timeout(60):
            conn = await connect_unix(name, rank=0, config=net_config(write_high_water=high, write_low_water=high // 4))
            payload = np.zeros(frame, dtype=np.uint8)
            for clock in range(150):  # 37.5 MiB against a reader that takes ~25 MiB/s
                await conn.send(Kind.DATA, payload, clock=clock)
            done = conn.expect(Kind.CONTROL, 0, 0)
            await conn.send(Kind.CONTROL, b"end")
            await done
            await conn.close()
        seen = report(pipe)
    assert seen["frames"] == 151 and conn.stats.write_pauses > 0
    assert conn.stats.max_write_buffer <= high + frame + 64
    assert seen["max_inbox"] <= inbox + 4 * frame


async def test_goodbye_is_an_orderly_close_and_abort_is_not():
    listener, conns = await echo_listener()
    try:
        async with asyncio.timeout(20):
            polite = await connect_unix(listener.unix_name, rank=0, config=net_config())
            await until(lambda: len(conns) == 1, what="the first link reaching the listener")
            await polite.close()
            await conns[0].wait_closed()
            assert "closed the connection (GOODBYE)" in str(conns[0].error)
            rude = await connect_unix(listener.unix_name, rank=2, config=net_config())
            await until(lambda: len(conns) == 2, what="the second link reaching the listener")
            rude.abort()
            await conns[1].wait_closed()
            assert "without GOODBYE" in str(conns[1].error) and "rank 2 at pid " in str(conns[1].error)
    finally:
        await listener.close()


async def test_nobody_on_the_name_is_a_connection_lost_that_names_it():
    with pytest.raises(ConnectionLost, match=f"could not connect to unix socket @{PREFIX}nobody") as info:
        async with asyncio.timeout(20):
            await connect_unix(f"{PREFIX}nobody", rank=0, config=net_config())
    assert isinstance(info.value.__cause__, ConnectionRefusedError)


_KINDS = [Kind.PUSH, Kind.DATA, Kind.CONTROL]
_DTYPES = [DType.BYTES, DType.UINT8, DType.FLOAT32]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    frames=st.lists(
        st.tuples(
            st.sampled_from(_KINDS),
            st.integers(0, 2**32 - 1),
            st.integers(0, 2**31 - 1),
            st.binary(max_size=70_000).map(lambda b: b[: len(b) - len(b) % 4]),
            st.sampled_from(_DTYPES),
            st.booleans(),
        ),
        min_size=1,
        max_size=6,
        unique_by=lambda f: (f[1], f[2]),
    )
)
def test_any_frame_crosses_the_rings_and_back_unchanged(frames):
    # There and back through the codec on both ends: header fields and payload bytes arrive as
    # sent, into a registered buffer or not.
    async def scenario():
        listener, _ = await echo_listener()
        try:
            conn = await connect_unix(listener.unix_name, rank=3, config=net_config())
            waits = []
            for kind, key, clock, payload, dtype, into in frames:
                buf = bytearray(len(payload)) if into else None
                waits.append((conn.expect(Kind.AGGREGATE, key, clock, into=buf), buf))
                await conn.send(kind, payload, key=key, clock=clock, dtype=dtype)
            for (fut, buf), (_, key, clock, payload, dtype, _) in zip(waits, frames):
                frame = await fut
                assert (frame.key, frame.clock, frame.header.rank, frame.header.dtype) == (key, clock, 1, dtype)
                assert bytes(frame.payload) == payload and (buf is None or bytes(buf) == payload)
            await conn.close()
        finally:
            await listener.close()

    run_async(scenario())


class StoreStub:
    """The two calls of a rendezvous that ``cluster.links`` makes, on a dict."""

    def __init__(self) -> None:
        self.kv: dict = {}

    async def publish(self, key: str, value: str) -> None:
        self.kv[key] = value

    async def read(self, key: str, *, who: str, deadline=None) -> str:
        return self.kv[key]


@pytest.mark.parametrize(
    "listener_link, dialler_link, same_host, want",
    [
        ("auto", "auto", True, "shm"),
        ("auto", "auto", False, "tcp"),  # another host: the name is never read
        ("tcp", "auto", True, "tcp"),  # the listener offers no ring
        ("auto", "tcp", True, "tcp"),  # the dialler asks for none
    ],
)
async def test_same_host_link_is_per_process_and_either_side_can_keep_tcp(listener_link, dialler_link, same_host, want):
    from poseidon_aio.cluster.links import dial, publish_listener

    store = StoreStub()
    listener = await listen(
        "127.0.0.1",
        0,
        rank=1,
        config=net_config(same_host_link=listener_link),
        on_connection=lambda c: None,
        same_host=True,
    )
    try:
        assert (listener.unix_name is None) == (listener_link == "tcp")
        await publish_listener(store, "addr/mesh/1", "127.0.0.1", listener)
        async with asyncio.timeout(20):
            conn = await dial(
                store,
                "addr/mesh/1",
                who="rank 1",
                same_host=same_host,
                rank=0,
                config=net_config(same_host_link=dialler_link),
            )
        assert conn.via == want
        await conn.close()
    finally:
        await listener.close()


async def test_a_same_host_peer_in_another_network_namespace_is_reached_over_tcp(caplog):
    # The launcher says "same host" but nobody listens on the published name here (another
    # machine, another container): that pair's link is TCP, and a warning says why.
    from poseidon_aio.cluster.links import dial, publish_listener

    store = StoreStub()
    listener = await listen("127.0.0.1", 0, rank=1, config=net_config(), on_connection=lambda c: None)
    try:
        await publish_listener(store, "addr/mesh/1", "127.0.0.1", listener)
        store.kv["addr/mesh/1/unix"] = f"{PREFIX}elsewhere"
        async with asyncio.timeout(20):
            conn = await dial(store, "addr/mesh/1", who="rank 1", same_host=True, rank=0, config=net_config())
        assert conn.via == "tcp"
        assert any("listens on no unix socket" in r.getMessage() for r in caplog.records)
        await conn.close()
    finally:
        await listener.close()


def test_same_host_link_is_validated():
    from poseidon_aio.errors import ConfigError

    with pytest.raises(ConfigError, match="same_host_link must be one of auto, tcp"):
        net_config(same_host_link="udp")
    with pytest.raises(ConfigError, match="same_host_ring_bytes: 65636 bytes, not a whole number of"):
        net_config(same_host_ring_bytes=65636)
    with pytest.raises(ConfigError, match="same_host_ring_bytes: 2147483648 bytes, outside"):
        net_config(same_host_ring_bytes=2 << 30)


async def test_each_side_writes_into_a_ring_of_its_own_size_and_larger_frames_go_in_pieces():
    listener, conns = await echo_listener(same_host_ring_bytes=MIN_RING_BYTES)
    try:
        async with asyncio.timeout(30):
            conn = await connect_unix(listener.unix_name, rank=0, config=net_config(same_host_ring_bytes=1 << 20))
            assert conn.via == "shm" and conn._transport.get_extra_info("shm") == (1 << 20, MIN_RING_BYTES)
            await round_trips(conn, [4, MIN_RING_BYTES - 44, MIN_RING_BYTES + 4, 3 << 20], key=2)
            await conn.close()
    finally:
        await listener.close()
