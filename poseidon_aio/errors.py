"""One exception hierarchy for the whole library.

Every error a user can meet derives from :class:`PoseidonError`; builtin co-bases let callers
catch them the usual way too (``except ConnectionError`` catches :class:`ConnectionLost`).

We distinguish what *we* did wrong (:class:`LocalProtocolError`: we tried to encode or send
something the protocol forbids) from what a *peer* sent wrong (:class:`RemoteProtocolError` and
its :class:`FrameError`). Messages say what happened, where (rank, key, clock, address) and what
to do about it.
"""

from __future__ import annotations

from typing import Optional

__all__ = [
    "PoseidonError",
    "ConfigError",
    "ProtocolError",
    "LocalProtocolError",
    "RemoteProtocolError",
    "FrameError",
    "HandshakeError",
    "AuthenticationError",
    "VersionMismatch",
    "WireVersionMismatch",
    "ChannelBindingError",
    "ConnectionLost",
    "PeerTimeout",
    "StoreUnavailable",
    "StartupAborted",
    "SyncTimeout",
    "CheckpointError",
    "ManifestMismatch",
    "TopologyMismatch",
    "UnknownParameter",
    "WorkerLeft",
]


class PoseidonError(Exception):
    """Root of every error raised by poseidon_aio."""


class ConfigError(PoseidonError, ValueError):
    """A setting is invalid (raised before any process talks to another)."""


class UnknownParameter(ConfigError, KeyError):
    """A name that is not a parameter of the model's manifest."""

    def __str__(self) -> str:  # KeyError would print the message in quotes
        return str(self.args[0]) if self.args else ""


class TopologyMismatch(ConfigError):
    """The launcher's hosts do not make a job of equal hosts (a host runs another number of
    workers than the others, or ranks disagree on where they run); refused at start-up."""


class ManifestMismatch(PoseidonError):
    """Ranks disagree about the model (a parameter's name, shape or dtype) or about a plan
    computed from it (the information book, the scheme or merge plan)."""


class ProtocolError(PoseidonError):
    """The wire protocol was violated, by us or by a peer."""


class LocalProtocolError(ProtocolError, ValueError):
    """We were asked to encode or send something the protocol cannot carry (a bug on this side)."""


class RemoteProtocolError(ProtocolError):
    """A peer sent bytes or messages that break the protocol."""


class FrameError(RemoteProtocolError):
    """A frame header or payload read off the wire is malformed.

    Raised by both codecs for: bad magic, unknown version, unknown kind, unknown payload dtype,
    a header checksum mismatch, a payload length over the configured maximum, a length that is
    not a whole number of dtype items, and a payload whose CRC32C does not match its header's (or
    that carries none where both ends agreed to checksum). The connection it came from must be
    closed; the process keeps serving its other connections.
    """


class HandshakeError(RemoteProtocolError):
    """The connection handshake failed; no payload byte of the peer was processed."""


class AuthenticationError(HandshakeError, PermissionError):
    """The peer does not hold the same cluster token (or refused ours)."""


class VersionMismatch(HandshakeError):
    """The peer speaks a protocol version this build does not."""


class ChannelBindingError(AuthenticationError):
    """Over TLS, the two ends see different certificates for the listener: something in between
    terminates TLS on each side and relays (a man in the middle). The handshake is refused."""


class WireVersionMismatch(FrameError, VersionMismatch):
    """The peer's frames are of another wire version (an older or newer poseidon_aio release)."""


class ConnectionLost(PoseidonError, ConnectionError):
    """A connection closed or broke while something was waiting on it.

    Attributes:
        peer_signal: the signal the peer said it was stopped by (``"SIGTERM"``), where it said
            one before it left; else None.
    """

    def __init__(self, message: str, *, peer_signal: Optional[str] = None) -> None:
        super().__init__(message)
        self.peer_signal = peer_signal


class PeerTimeout(PoseidonError, TimeoutError):
    """A peer stayed silent longer than the idle timeout, or a connect/handshake took too long."""


class StoreUnavailable(PeerTimeout):
    """No rendezvous store answered at ``MASTER_ADDR:MASTER_PORT`` before the deadline.

    Attributes:
        address: ``"host:port"`` that was tried.
        reason: what was wrong there: ``"nothing listening"`` (every connect was refused),
            ``"not a rendezvous store"`` (something accepts TCP connections but does not answer
            like a ``TCPStore``) or ``"no answer"`` (connects neither succeeded nor were refused:
            a wrong address, a firewall, or a name that does not resolve).
    """

    def __init__(self, message: str, *, address: str = "", reason: str = "") -> None:
        super().__init__(message)
        self.address = address
        self.reason = reason


class StartupAborted(PoseidonError, RuntimeError):
    """Another rank failed during start-up and published why; this rank stopped waiting for it.

    Attributes:
        rank: the rank that failed.
        reason: its error, as it published it (type and message).
    """

    def __init__(self, message: str, *, rank: int = -1, reason: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.reason = reason


class SyncTimeout(PoseidonError, TimeoutError):
    """A synchronization (push, pull, aggregate) did not complete in time."""


class WorkerLeft(PoseidonError, ConnectionError):
    """Another worker left the job (or fell too far behind); BSP cannot go on without it."""


class CheckpointError(PoseidonError):
    """A checkpoint is missing, corrupt, or belongs to another model or cluster shape."""
