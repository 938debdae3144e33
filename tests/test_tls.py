"""TLS bound to the token handshake: no CA only by explicit opt-in, and a relay that terminates
TLS on both sides (a man in the middle) is refused on both ends."""

from __future__ import annotations

import asyncio
import ssl

import numpy as np
import pytest

from poseidon_aio.errors import ChannelBindingError, ConfigError
from poseidon_aio.net import NetConfig, TLSConfig, connect, listen
from poseidon_aio.net.credentials import tls_env, tls_from_env
from poseidon_aio.wire import DType, Kind

from .support.procs import DATA, TOKEN

CERT, KEY = str(DATA / "test-cert.pem"), str(DATA / "test-key.pem")
RELAY_CERT, RELAY_KEY = str(DATA / "relay-cert.pem"), str(DATA / "relay-key.pem")


def _config(tls: TLSConfig, **overrides) -> NetConfig:
    return NetConfig(token=TOKEN, tls=tls, handshake_timeout=10, **overrides)


def test_tls_without_a_ca_is_refused_unless_asked_for_by_name():
    with pytest.raises(ConfigError, match=r"TLS without a CA .* TLSConfig\(unauthenticated=True\)"):
        TLSConfig(CERT, KEY)
    with pytest.raises(ConfigError, match="POSEIDON_TLS_UNAUTHENTICATED=1"):
        tls_from_env({"POSEIDON_TLS_CERT": CERT, "POSEIDON_TLS_KEY": KEY})
    with pytest.raises(ConfigError, match="not both"):
        TLSConfig(CERT, KEY, cafile=CERT, unauthenticated=True)
    opted = tls_from_env({"POSEIDON_TLS_CERT": CERT, "POSEIDON_TLS_KEY": KEY, "POSEIDON_TLS_UNAUTHENTICATED": "1"})
    assert opted.unauthenticated and tls_from_env(tls_env(opted)) == opted


def test_the_binding_is_the_listener_certificate_as_tls_presents_it():
    with open(CERT) as f:
        der = ssl.PEM_cert_to_DER_cert(f.read())
    import hashlib

    assert TLSConfig(CERT, KEY, cafile=CERT).fingerprint == hashlib.sha256(der).hexdigest()


async def _echo_listener(tls: TLSConfig):
    accepted = []

    async def serve(conn):
        accepted.append(conn)
        while True:
            frame = await conn.recv()
            await conn.send(Kind.AGGREGATE, frame.payload, key=frame.key, clock=frame.clock, dtype=frame.header.dtype)

    return await listen("127.0.0.1", 0, rank=1, config=_config(tls), on_connection=serve), accepted


@pytest.mark.timeout(60)
@pytest.mark.parametrize("unauthenticated", [False, True], ids=["ca", "no-ca"])
async def test_direct_tls_connections_bind_and_leave_payloads_to_the_tls_mac(unauthenticated):
    tls = TLSConfig(CERT, KEY, unauthenticated=True) if unauthenticated else TLSConfig(CERT, KEY, cafile=CERT)
    listener, accepted = await _echo_listener(tls)
    try:
        async with asyncio.timeout(30):
            conn = await connect(*listener.address, rank=0, config=_config(tls))
            await conn.send(Kind.PUSH, np.arange(64, dtype=np.float32), key=2, clock=1, dtype=DType.FLOAT32)
            frame = await conn.expect(Kind.AGGREGATE, 2, 1)
        assert np.array_equal(np.frombuffer(frame.payload, np.float32), np.arange(64, dtype=np.float32))
        assert conn._handshake.tls == tls.fingerprint  # the client saw the listener's own certificate
        assert not conn.payload_checksum and not accepted[0].payload_checksum
        await conn.close()
    finally:
        await listener.close()


class Relay:
    """A man in the middle: terminates the client's TLS with its own certificate, opens its own
    TLS connection to the listener, and copies bytes both ways unchanged."""

    def __init__(self, target: tuple) -> None:
        self.target = target
        self.relayed = [0, 0]  # bytes client -> listener, listener -> client
        self._server = None
        self._tasks: set = set()

    async def start(self) -> tuple:
        inside = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        inside.load_cert_chain(RELAY_CERT, RELAY_KEY)
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=inside)
        return self._server.sockets[0].getsockname()[:2]

    async def _serve(self, client_r, client_w) -> None:
        self._tasks.add(asyncio.current_task())
        outside = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        outside.check_hostname, outside.verify_mode = False, ssl.CERT_NONE
        server_r, server_w = await asyncio.open_connection(*self.target, ssl=outside)
        try:
            await asyncio.gather(self._copy(client_r, server_w, 0), self._copy(server_r, client_w, 1))
        except asyncio.CancelledError:
            pass  # close(); the streams' callback would report a cancelled task as an error
        finally:
            for w in (client_w, server_w):
                w.close()

    async def _copy(self, src, dst, way: int) -> None:
        try:
            while data := await src.read(65536):
                self.relayed[way] += len(data)
                dst.write(data)
                await dst.drain()
        except (OSError, ssl.SSLError):
            pass
        finally:
            dst.close()

    async def close(self) -> None:
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


@pytest.mark.timeout(60)
async def test_a_relaying_man_in_the_middle_is_refused_on_both_ends():
    """Without a CA the client accepts the relay's certificate, and the relay holds the token
    handshake's bytes in the clear; the binding still tells both ends that they see different
    listener certificates, and neither trusts the connection."""
    tls = TLSConfig(CERT, KEY, unauthenticated=True)
    listener, accepted = await _echo_listener(tls)
    relay = Relay(listener.address)
    try:
        address = await relay.start()
        async with asyncio.timeout(30):
            with pytest.raises(ChannelBindingError) as client_side:
                await connect(*address, rank=0, config=_config(tls))
            await listener.wait_refused(1, timeout=30)
        server_side = listener.refused[0]
        for end in (client_side.value, server_side):
            assert "TLS channel binding mismatch between rank" in str(end)
            assert "man in the middle" in str(end)
        assert type(server_side) is ChannelBindingError and "refused the connection" in str(client_side.value)
        assert accepted == [] and relay.relayed[0] > 0 and relay.relayed[1] > 0  # it did relay
        print(f"client: {client_side.value}\nlistener: {server_side}")
    finally:
        await relay.close()
        await listener.close()
