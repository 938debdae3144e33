"""The handshake as a sans-IO state machine: no sockets, frames passed by hand."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from poseidon_aio.errors import (
    AuthenticationError,
    ChannelBindingError,
    HandshakeError,
    LocalProtocolError,
    VersionMismatch,
)
from poseidon_aio.net.handshake import Handshake, Role, State
from poseidon_aio.wire import DType, Frame, Header, Kind

TOKEN = b"a-cluster-token-of-32-bytes-long"


def frame(kind, payload: bytes, dtype=DType.JSON) -> Frame:
    return Frame(Header(kind, 0, 0, 0, len(payload), dtype), memoryview(payload))


def deliver(sender_out, receiver):
    out = []
    for kind, payload in sender_out:
        out += receiver.receive(frame(kind, payload))
    return out


def run_pair(client, server):
    to_server = client.start()
    while to_server:
        to_client = deliver(to_server, server)
        if server.error:
            return to_client
        to_server = deliver(to_client, client) if to_client else []
        if client.error:
            return to_server
    return []


def test_matching_tokens_complete_with_ranks_exchanged():
    client, server = Handshake(Role.CLIENT, 3, TOKEN), Handshake(Role.SERVER, 8, TOKEN)
    run_pair(client, server)
    assert client.state is State.READY and server.state is State.READY
    assert client.peer_rank == 8 and server.peer_rank == 3


def test_client_refuses_a_server_without_the_token_and_says_why():
    client, server = Handshake(Role.CLIENT, 0, TOKEN), Handshake(Role.SERVER, 1, b"another-token-0123456789")
    refusal = run_pair(client, server)
    assert isinstance(client.error, AuthenticationError)
    assert server.state is State.SENT_CHALLENGE  # it never learns anything from the client
    with pytest.raises(AuthenticationError, match="refused the connection"):
        deliver(refusal, server)


def test_replayed_client_messages_fail_against_a_fresh_server_nonce():
    client, server = Handshake(Role.CLIENT, 0, TOKEN), Handshake(Role.SERVER, 1, TOKEN)
    hello = client.start()
    challenge = deliver(hello, server)
    auth = deliver(challenge, client)
    assert deliver(auth, server)[0][0] is Kind.WELCOME
    fresh = Handshake(Role.SERVER, 1, TOKEN)
    deliver(hello, fresh)
    deliver(auth, fresh)
    assert isinstance(fresh.error, AuthenticationError)


def test_replayed_server_messages_fail_against_a_fresh_client_nonce():
    client, server = Handshake(Role.CLIENT, 0, TOKEN), Handshake(Role.SERVER, 1, TOKEN)
    challenge = deliver(client.start(), server)
    fresh = Handshake(Role.CLIENT, 0, TOKEN)
    fresh.start()
    deliver(challenge, fresh)
    assert isinstance(fresh.error, AuthenticationError)


def test_a_proof_cannot_be_reflected_as_the_other_role():
    client, server = Handshake(Role.CLIENT, 0, TOKEN), Handshake(Role.SERVER, 1, TOKEN)
    challenge = deliver(client.start(), server)
    proof = json.loads(challenge[0][1])["proof"]
    deliver([(Kind.AUTH, json.dumps({"proof": proof}).encode())], server)
    assert isinstance(server.error, AuthenticationError)


def test_version_mismatch_is_refused_by_the_server():
    client = Handshake(Role.CLIENT, 0, TOKEN, protocol=3)
    server = Handshake(Role.SERVER, 1, TOKEN)
    refusal = run_pair(client, server)
    assert isinstance(server.error, VersionMismatch)
    with pytest.raises(VersionMismatch, match="protocol version 3"):
        deliver(refusal, client)


@pytest.mark.parametrize("kind", [Kind.PUSH, Kind.WELCOME, Kind.AUTH, Kind.HEARTBEAT])
def test_out_of_order_frames_are_refused_naming_both_states(kind):
    server = Handshake(Role.SERVER, 1, TOKEN)
    reply = server.receive(frame(kind, b"{}"))
    assert isinstance(server.error, HandshakeError)
    message = json.loads(reply[0][1])["message"]
    assert f"unexpected {kind.name}" in message and "state start" in message and "HELLO" in message


@given(payload=st.binary(max_size=300))
def test_garbage_hello_is_a_protocol_refusal_never_a_crash(payload):
    server = Handshake(Role.SERVER, 1, TOKEN)
    reply = server.receive(frame(Kind.HELLO, payload))
    assert reply[0][0] is Kind.ERROR and isinstance(server.error, HandshakeError)


def test_short_tokens_and_finished_handshakes_are_local_errors():
    with pytest.raises(LocalProtocolError, match="at least 16 bytes"):
        Handshake(Role.CLIENT, 0, b"short")
    client, server = Handshake(Role.CLIENT, 0, TOKEN), Handshake(Role.SERVER, 1, TOKEN)
    run_pair(client, server)
    with pytest.raises(LocalProtocolError, match="takes no more frames"):
        client.receive(frame(Kind.WELCOME, b"{}"))


# -- what the proofs bind beyond the token: the TLS channel and the checksum choice ------------

LISTENER_CERT, RELAY_CERT = "ab" * 32, "cd" * 32


def test_the_same_view_of_the_listener_certificate_completes():
    client = Handshake(Role.CLIENT, 0, TOKEN, tls=LISTENER_CERT)
    server = Handshake(Role.SERVER, 1, TOKEN, tls=LISTENER_CERT)
    run_pair(client, server)
    assert client.ready and server.ready


def test_a_relayed_tls_channel_is_refused_by_the_listener_before_it_proves_anything():
    """The client was shown the relay's certificate: the listener refuses at HELLO, so a relay
    learns no proof it could test token guesses against."""
    client = Handshake(Role.CLIENT, 0, TOKEN, tls=RELAY_CERT)
    server = Handshake(Role.SERVER, 1, TOKEN, tls=LISTENER_CERT)
    refusal = run_pair(client, server)
    assert isinstance(server.error, ChannelBindingError)
    assert "proof" not in json.loads(refusal[0][1])["message"]
    assert "man in the middle" in str(server.error) and "cdcdcdcdcdcdcdcd" in str(server.error)
    with pytest.raises(ChannelBindingError, match="refused the connection: TLS channel binding mismatch"):
        deliver(refusal, client)


def _rewrite(messages, **fields):
    kind, payload = messages[0]
    return [(kind, json.dumps({**json.loads(payload), **fields}).encode())]


def test_a_relay_that_rewrites_the_binding_fields_fails_the_proofs():
    """A relay that tells each end what it expects to hear still cannot make the proofs match."""
    client = Handshake(Role.CLIENT, 0, TOKEN, tls=RELAY_CERT)
    server = Handshake(Role.SERVER, 1, TOKEN, tls=LISTENER_CERT)
    challenge = deliver(_rewrite(client.start(), tls=LISTENER_CERT), server)
    deliver(_rewrite(challenge, tls=RELAY_CERT), client)
    assert isinstance(client.error, AuthenticationError) and not server.error


@pytest.mark.parametrize("mine,theirs", [(True, True), (True, False), (False, True), (False, False)])
def test_payloads_are_checksummed_when_either_end_asks(mine, theirs):
    client = Handshake(Role.CLIENT, 0, TOKEN, checksum=mine)
    server = Handshake(Role.SERVER, 1, TOKEN, checksum=theirs)
    run_pair(client, server)
    assert client.ready and server.ready
    assert client.checksum == server.checksum == (mine or theirs)


def test_turning_off_the_peers_checksums_in_transit_fails_the_proofs():
    client = Handshake(Role.CLIENT, 0, TOKEN, checksum=True)
    server = Handshake(Role.SERVER, 1, TOKEN, checksum=False)
    challenge = deliver(_rewrite(client.start(), checksum=False), server)
    deliver(challenge, client)
    assert isinstance(client.error, AuthenticationError)
