"""Authenticated connection handshake, sans-IO: frames in, frames out, no asyncio.

HMAC-SHA256 challenge-response on the shared cluster token, with a fresh 32-byte nonce from each
side so that a recorded handshake cannot be replayed to either end::

    dialer (client)                                        listener (server)
    HELLO {protocol, rank, nonce_c, tls_c, checksum_c} ->
                                                       <-  CHALLENGE {protocol, rank, nonce_s,
                                                                      tls_s, checksum_s, proof_s}
    AUTH {proof_c}                                     ->
                                                       <-  WELCOME {}

    T       = nonce_c | nonce_s | rank_c | rank_s | tls | checksum_c | checksum_s
    proof_s = HMAC(token, "poseidon-aio/server" | T)
    proof_c = HMAC(token, "poseidon-aio/client" | T)

Both proofs are bound to both nonces and both ranks, and labelled by role so one side's proof can
never be reflected back as the other's. The server proves the token first, so a client never
reveals anything to an impostor.

``tls`` is the TLS channel binding: the SHA-256 of the listener's certificate as this end sees
it (the server: its own; the client: the one it was presented), empty without TLS. A relay that
terminates TLS on each side must present the client a certificate of its own, since it lacks
the listener's key, so the two ends' bindings differ: each end names its view in its first
message, the other refuses a mismatch ("binding"), and a relay that rewrote those fields is still
caught by the proofs, which it cannot make without the token. Python's ``ssl`` offers neither
RFC 9266's tls-exporter nor, for TLS 1.3, a defined tls-unique; the certificate binding works on
TLS 1.2 and 1.3 alike. ``checksum_*`` say whether each end asks for payload CRC32Cs; the
connection checksums when either does (:attr:`Handshake.checksum`).

Either side refuses with an ERROR frame whose JSON payload says why (``{"reason": "auth" |
"binding" | "version" | "protocol", "message": ...}``) and raises the matching
:class:`HandshakeError`. Until WELCOME no data frame is accepted and payloads are capped at
``HANDSHAKE_MAX_PAYLOAD`` bytes.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import json
import os
from typing import Optional

from ..errors import (
    AuthenticationError,
    ChannelBindingError,
    HandshakeError,
    LocalProtocolError,
    VersionMismatch,
)
from ..wire import DType, Frame, Kind

PROTOCOL_VERSION = 2
NONCE_BYTES = 32
# Handshake messages are ~200 bytes of JSON; 4 KiB leaves room and caps what an unauthenticated
# peer can make us buffer.
HANDSHAKE_MAX_PAYLOAD = 4096


class Role(enum.Enum):
    CLIENT = "client"
    SERVER = "server"


class State(enum.Enum):
    START = "start"
    SENT_HELLO = "sent-hello"
    SENT_CHALLENGE = "sent-challenge"
    SENT_AUTH = "sent-auth"
    READY = "ready"
    FAILED = "failed"


# (role, state, frame kind received) -> state after handling it.
TRANSITIONS = {
    (Role.CLIENT, State.SENT_HELLO, Kind.CHALLENGE): State.SENT_AUTH,
    (Role.CLIENT, State.SENT_AUTH, Kind.WELCOME): State.READY,
    (Role.SERVER, State.START, Kind.HELLO): State.SENT_CHALLENGE,
    (Role.SERVER, State.SENT_CHALLENGE, Kind.AUTH): State.READY,
}

_ERRORS = {
    "auth": AuthenticationError,
    "binding": ChannelBindingError,
    "version": VersionMismatch,
    "protocol": HandshakeError,
}


def _proof(token: bytes, label: str, transcript: list) -> bytes:
    msg = b"|".join([f"poseidon-aio/{label}".encode(), *transcript])
    return hmac.new(token, msg, hashlib.sha256).digest()


class Handshake:
    """One side of the handshake.

    Args:
        role: ``Role.CLIENT`` for the side that dialled, ``Role.SERVER`` for the listener.
        rank: this process's rank.
        token: the cluster token (bytes, at least 16 of them).
        peer: text naming the peer's address, for error messages.
        protocol: the protocol version to announce (tests use another to check refusal).
        checksum: whether this end asks for payload CRC32Cs.
        tls: the channel binding, once TLS is up (set it before :meth:`start`): the SHA-256 hex
            of the listener's certificate as this end sees it; empty without TLS.

    Drive it with :meth:`start` (frames to send first) and :meth:`receive` (frames to send in
    reply); each returns a list of ``(kind, payload_bytes)``. After a refusal, :attr:`error` is
    set and the returned list holds the ERROR frame to send before closing.

    >>> c = Handshake(Role.CLIENT, 0, b"0123456789abcdef")
    >>> s = Handshake(Role.SERVER, 1, b"0123456789abcdef")
    """

    def __init__(
        self,
        role: Role,
        rank: int,
        token: bytes,
        *,
        peer: str = "peer",
        protocol: int = PROTOCOL_VERSION,
        checksum: bool = False,
        tls: str = "",
    ) -> None:
        if not isinstance(token, bytes) or len(token) < 16:
            raise LocalProtocolError("the cluster token must be at least 16 bytes")
        self.role = role
        self.rank = rank
        self.peer = peer
        self.peer_rank: Optional[int] = None
        self.state = State.START
        self.error: Optional[HandshakeError] = None
        self._token = token
        self._protocol = protocol
        self._nonce = os.urandom(NONCE_BYTES)
        self._peer_nonce = b""
        self.tls = tls
        self._checksum = checksum
        self._peer_checksum = False

    @property
    def checksum(self) -> bool:
        """Whether the connection checksums payloads: either end asked (valid once READY)."""
        return self._checksum or self._peer_checksum

    @property
    def ready(self) -> bool:
        return self.state is State.READY

    def start(self) -> list:
        if self.role is Role.SERVER:
            return []
        self._move(State.START, State.SENT_HELLO)
        return [
            self._msg(
                Kind.HELLO,
                protocol=self._protocol,
                rank=self.rank,
                nonce=self._nonce.hex(),
                tls=self.tls,
                checksum=self._checksum,
            )
        ]

    def receive(self, frame: Frame) -> list:
        """Handle one frame received before READY; return the frames to send in reply.

        Raises:
            HandshakeError (or a subclass): the peer refused us, or sent something that is not
                the next handshake message. :attr:`error` holds it too.
        """
        if self.state in (State.READY, State.FAILED):
            raise LocalProtocolError(f"handshake is {self.state.value}; it takes no more frames")
        if frame.kind is Kind.ERROR:
            try:
                info = self._parse(frame, {"reason": str, "message": str})
                cls = _ERRORS.get(info["reason"], HandshakeError)
                self.error = cls(f"{self.peer} refused the connection: {info['message']}")
            except _Malformed as exc:
                self.error = HandshakeError(f"{self.peer} refused the connection: {exc}")
            self.state = State.FAILED
            raise self.error
        after = TRANSITIONS.get((self.role, self.state, frame.kind))
        if after is None:
            return self._refuse(
                "protocol",
                f"unexpected {frame.kind.name} frame in handshake state {self.state.value} "
                f"(a {self.role.value} expects "
                f"{' or '.join(k.name for (r, s, k) in TRANSITIONS if r is self.role and s is self.state)})",
            )
        handler = getattr(self, f"_on_{frame.kind.name.lower()}")
        try:
            return handler(frame, after)
        except _Malformed as exc:
            return self._refuse("protocol", f"malformed handshake from {self.peer}: {exc}")

    # -- per message ------------------------------------------------------------------------

    def _on_hello(self, frame: Frame, after: State) -> list:
        info = self._parse(frame, {"protocol": int, "rank": int, "nonce": str})
        if info["protocol"] != self._protocol:
            return self._refuse(
                "version",
                f"rank {info['rank']} at {self.peer} speaks protocol version {info['protocol']}, "
                f"rank {self.rank} speaks {self._protocol}: run the same poseidon_aio release everywhere",
            )
        self.peer_rank = info["rank"]
        self._peer_nonce = self._nonce_from(info["nonce"])
        self._peer_checksum = self._flag(frame, info, "checksum")
        if info.get("tls") != self.tls:
            return self._refuse_binding(info.get("tls"))
        proof = _proof(self._token, "server", self._transcript())
        self._move(self.state, after)
        return [
            self._msg(
                Kind.CHALLENGE,
                protocol=self._protocol,
                rank=self.rank,
                nonce=self._nonce.hex(),
                tls=self.tls,
                checksum=self._checksum,
                proof=proof.hex(),
            )
        ]

    def _on_challenge(self, frame: Frame, after: State) -> list:
        info = self._parse(frame, {"protocol": int, "rank": int, "nonce": str, "proof": str})
        if info["protocol"] != self._protocol:
            return self._refuse(
                "version",
                f"{self.peer} (rank {info['rank']}) speaks protocol version {info['protocol']}, "
                f"rank {self.rank} speaks {self._protocol}: run the same poseidon_aio release everywhere",
            )
        self.peer_rank = info["rank"]
        self._peer_nonce = self._nonce_from(info["nonce"])
        self._peer_checksum = self._flag(frame, info, "checksum")
        if info.get("tls") != self.tls:
            return self._refuse_binding(info.get("tls"))
        expected = _proof(self._token, "server", self._transcript())
        if not hmac.compare_digest(expected.hex(), info["proof"]):
            return self._refuse(
                "auth",
                f"rank {self.peer_rank} at {self.peer} failed to prove the cluster token to rank "
                f"{self.rank}: give every process the same token",
            )
        self._move(self.state, after)
        proof = _proof(self._token, "client", self._transcript())
        return [self._msg(Kind.AUTH, proof=proof.hex())]

    def _on_auth(self, frame: Frame, after: State) -> list:
        info = self._parse(frame, {"proof": str})
        expected = _proof(self._token, "client", self._transcript())
        if not hmac.compare_digest(expected.hex(), info["proof"]):
            return self._refuse(
                "auth",
                f"rank {self.peer_rank} at {self.peer} failed to prove the cluster token to rank "
                f"{self.rank}: give every process the same token",
            )
        self._move(self.state, after)
        return [self._msg(Kind.WELCOME)]

    def _on_welcome(self, frame: Frame, after: State) -> list:
        self._parse(frame, {})
        self._move(self.state, after)
        return []

    # -- helpers ----------------------------------------------------------------------------

    def _transcript(self) -> list:
        """What both proofs cover, in the client's order whichever end computes it."""
        client = self.role is Role.CLIENT
        nonce_c, nonce_s = (self._nonce, self._peer_nonce) if client else (self._peer_nonce, self._nonce)
        rank_c, rank_s = (self.rank, self.peer_rank) if client else (self.peer_rank, self.rank)
        sum_c, sum_s = (self._checksum, self._peer_checksum) if client else (self._peer_checksum, self._checksum)
        return [
            nonce_c,
            nonce_s,
            str(rank_c).encode(),
            str(rank_s).encode(),
            self.tls.encode(),
            b"1" if sum_c else b"0",
            b"1" if sum_s else b"0",
        ]

    def _flag(self, frame: Frame, info: dict, name: str) -> bool:
        value = info.get(name)
        if not isinstance(value, bool):
            raise _Malformed(f"{frame.kind.name} field {name!r} must be true or false")
        return value

    def _refuse_binding(self, theirs) -> list:
        if not isinstance(theirs, str):
            raise _Malformed("field 'tls' must be a string")

        def seen(fingerprint: str) -> str:
            return f"a certificate with SHA-256 {fingerprint[:16]}..." if fingerprint else "no TLS"

        listener = self.rank if self.role is Role.SERVER else self.peer_rank
        return self._refuse(
            "binding",
            f"TLS channel binding mismatch between rank {self.rank} and rank {self.peer_rank} at "
            f"{self.peer}: for rank {listener}'s listener, rank {self.rank} sees {seen(self.tls)} and "
            f"rank {self.peer_rank} sees {seen(theirs)}, so something between them terminates TLS and "
            "relays it (a man in the middle); refused. Check the network path between these hosts",
        )

    def _move(self, before: State, after: State) -> None:
        if self.state is not before:
            raise LocalProtocolError(f"illegal handshake transition {self.state.value} -> {after.value}")
        self.state = after

    def _msg(self, kind: Kind, **fields) -> tuple:
        return (kind, json.dumps(fields, separators=(",", ":")).encode())

    def _refuse(self, reason: str, message: str) -> list:
        self.error = _ERRORS[reason](message)
        self.state = State.FAILED
        return [self._msg(Kind.ERROR, reason=reason, message=message)]

    def _nonce_from(self, text: str) -> bytes:
        try:
            nonce = bytes.fromhex(text)
        except ValueError:
            nonce = b""
        if len(nonce) != NONCE_BYTES:
            raise _Malformed(f"nonce must be {NONCE_BYTES} bytes of hex")
        return nonce

    @staticmethod
    def _parse(frame: Frame, schema: dict) -> dict:
        name = frame.kind.name
        if frame.header.dtype is not DType.JSON:
            raise _Malformed(f"{name} payload must be JSON")
        try:
            info = json.loads(bytes(frame.payload).decode("utf-8")) if frame.header.length else {}
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise _Malformed(f"{name} payload is not valid JSON ({exc})") from None
        if not isinstance(info, dict):
            raise _Malformed(f"{name} payload must be a JSON object")
        for field, kind in schema.items():
            value = info.get(field)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise _Malformed(f"{name} field {field!r} must be {kind.__name__}")
        return info


class _Malformed(Exception):
    """A handshake message that does not parse; turned into a "protocol" refusal."""
