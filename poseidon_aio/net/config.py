"""Settings of the connection layer: one dataclass, validated, with defaults that work."""

from __future__ import annotations

import functools
import hashlib
import ssl
from dataclasses import dataclass, field
from typing import Optional

from ..errors import ConfigError
from ..wire import DEFAULT_MAX_PAYLOAD
from .shaper import ShaperConfig
from .shm import RING_BYTES, ring_size_problem

# How workers on one host connect (NetConfig.same_host_link).
SAME_HOST_LINKS = ("auto", "tcp")


@dataclass
class TLSConfig:
    """TLS for every connection (stdlib ``ssl``), on top of the token handshake.

    The token handshake runs inside TLS and covers the listener's certificate as each end sees
    it, so a relay that terminates TLS on both sides is refused (``ChannelBindingError``).

    Args:
        certfile, keyfile: this process's certificate chain and key (PEM).
        cafile: CA bundle that signs the peers' certificates; listeners require client
            certificates too (mutual TLS). Required unless ``unauthenticated``.
        check_hostname: verify the dialled host name against the certificate. Off by default:
            cluster peers are usually dialled by IP address; the token handshake still runs inside.
        unauthenticated: TLS without a CA: no certificate is checked, and who a peer is rests on
            the cluster token alone (README, "Security", says what this leaves open).
    Raises:
        ConfigError: no ``cafile`` and not ``unauthenticated``, or both.

    >>> TLSConfig("cert.pem", "key.pem", cafile="ca.pem").unauthenticated
    False
    """

    certfile: str
    keyfile: str
    cafile: Optional[str] = None
    check_hostname: bool = False
    unauthenticated: bool = False

    def __post_init__(self) -> None:
        if not self.cafile and not self.unauthenticated:
            raise ConfigError(
                "TLS without a CA cannot tell a peer from an impostor: give TLSConfig(cafile=...) "
                "(POSEIDON_TLS_CA; `poseidon-aio run --tls` makes one), or opt into encryption "
                "without authentication with TLSConfig(unauthenticated=True) "
                "(POSEIDON_TLS_UNAUTHENTICATED=1); README, Security, says what that leaves open"
            )
        if self.cafile and self.unauthenticated:
            raise ConfigError("TLSConfig takes a cafile or unauthenticated=True, not both")

    @functools.cached_property
    def fingerprint(self) -> str:
        """SHA-256 (hex) of this process's certificate, DER-encoded: what the handshake binds.

        Raises:
            ConfigError: ``certfile`` cannot be read or holds no PEM certificate.
        """
        try:
            with open(self.certfile, encoding="ascii") as f:
                pem = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"TLSConfig.certfile {self.certfile}: cannot read it ({exc})") from None
        # The chain's first certificate is the one TLS presents.
        start, end = pem.find(ssl.PEM_HEADER), pem.find(ssl.PEM_FOOTER)
        if start < 0 or end < start:
            raise ConfigError(f"TLSConfig.certfile {self.certfile} holds no PEM certificate")
        return hashlib.sha256(ssl.PEM_cert_to_DER_cert(pem[start : end + len(ssl.PEM_FOOTER)])).hexdigest()

    def server_context(self) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(self.certfile, self.keyfile)
        if self.cafile:
            ctx.load_verify_locations(self.cafile)
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def client_context(self) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.check_hostname = self.check_hostname
        if self.cafile:
            ctx.load_verify_locations(self.cafile)
            ctx.load_cert_chain(self.certfile, self.keyfile)
        else:
            ctx.verify_mode = ssl.CERT_NONE
        return ctx


@dataclass
class NetConfig:
    """How connections behave.

    Args:
        token: the cluster token, shared by every process (>= 16 bytes). Connections whose peer
            cannot prove it are refused before any payload byte is processed.
        heartbeat_interval: seconds of send silence after which a HEARTBEAT goes out.
        idle_timeout: seconds without a received byte after which the peer counts as dead.
        connect_timeout, handshake_timeout, close_timeout: bounds on those waits, in seconds.
        max_payload: largest payload accepted after the handshake (before it: 4 KiB), for any
            frame. The layer above can lower it per frame with the ``limit`` hook of
            :meth:`~poseidon_aio.net.Endpoint.set_handler`; a frame over its limit ends the
            connection as soon as its header arrives.
        write_high_water, write_low_water: transport buffer limits; above the high mark senders
            wait, so a slow reader bounds the sender's memory at about high mark + one frame.
        inbox_high_water: received bytes nobody has taken yet above which reading pauses, so a
            slow consumer pushes back through TCP instead of growing memory.
        memory_budget: most bytes one connection may hold for frames nobody has claimed: the
            inbox plus the payload of the frame being received, where no destination was
            registered for it (bytes landing in a buffer given to ``expect(into=...)`` or the
            ``allocate`` hook are the caller's and do not count). Default 256 MiB: four times
            ``inbox_high_water``, so a healthy link pauses reading long before it gets here. A
            frame that cannot fit ends the connection when its header arrives, a peer that pushes
            past it when it does; raise it, or register a destination, for larger unclaimed frames.
            Must be at least ``inbox_high_water``.
        max_pending_handshakes: connections a listener lets handshake at once (TLS included);
            beyond it new connections are closed as soon as they are accepted, counted in
            ``Listener.turned_away``. Each pending one is dropped after ``handshake_timeout``,
            so silent or slow peers hold at most this many slots, and memory, at a time.
        shaper: per-connection bandwidth caps.
        bandwidth: one budget for all of this process's connections together (outbound and
            inbound bytes/s, a per-message start-up), shared by the worker mesh and the
            parameter server's links; ``None``: no process-wide cap.
        tls: TLS settings, or ``None`` for plain TCP.
        payload_checksum: put a CRC32C of every payload in its frame and check it on receipt,
            so that corruption the TCP checksum misses (NICs, switches, memory) fails the step
            instead of reaching the model. A connection checksums when either end asks for it
            and neither uses TLS (TLS's own MAC covers every byte).
        same_host_link: how two workers the job's topology puts on one host connect: ``"auto"``
            over a Unix stream socket where the platform has abstract ones (Linux;
            :mod:`poseidon_aio.net.unix`), else loopback TCP; ``"tcp"``: always TCP. Per
            process: a dialler that says ``"tcp"``, or a listener that offers no Unix socket,
            makes that pair's link TCP.
        same_host_ring_bytes: the shared-memory ring this process writes into on such a link, in
            bytes (the peer's, which it reads, is the peer's own setting): a whole number of pages,
            64 KiB to 1 GiB. A frame larger than the ring goes through it in pieces.

    >>> NetConfig(token=b"x" * 16).idle_timeout
    30.0
    """

    token: bytes
    heartbeat_interval: float = 2.0
    idle_timeout: float = 30.0
    connect_timeout: float = 10.0
    handshake_timeout: float = 10.0
    close_timeout: float = 5.0
    max_payload: int = DEFAULT_MAX_PAYLOAD
    write_high_water: int = 4 << 20
    write_low_water: int = 1 << 20
    inbox_high_water: int = 64 << 20
    memory_budget: int = 256 << 20
    max_pending_handshakes: int = 128
    shaper: ShaperConfig = field(default_factory=ShaperConfig)
    bandwidth: Optional[ShaperConfig] = None
    tls: Optional[TLSConfig] = None
    payload_checksum: bool = True
    same_host_link: str = "auto"
    same_host_ring_bytes: int = RING_BYTES

    def __post_init__(self) -> None:
        if isinstance(self.token, str):
            self.token = self.token.encode()
        if not isinstance(self.token, bytes) or len(self.token) < 16:
            raise ConfigError("NetConfig.token must be at least 16 bytes shared by every process")
        for name in ("heartbeat_interval", "idle_timeout", "connect_timeout", "handshake_timeout", "close_timeout"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"NetConfig.{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.idle_timeout < 2 * self.heartbeat_interval:
            raise ConfigError(
                f"NetConfig.idle_timeout ({self.idle_timeout}s) must be at least twice "
                f"heartbeat_interval ({self.heartbeat_interval}s), or healthy peers time out"
            )
        if not 0 <= self.write_low_water <= self.write_high_water:
            raise ConfigError("NetConfig needs 0 <= write_low_water <= write_high_water")
        if self.max_payload < 1 or self.inbox_high_water < 1:
            raise ConfigError("NetConfig.max_payload and inbox_high_water must be >= 1 byte")
        if self.memory_budget < self.inbox_high_water:
            raise ConfigError(
                f"NetConfig.memory_budget ({self.memory_budget} bytes) must be at least "
                f"inbox_high_water ({self.inbox_high_water} bytes): reading must pause before a "
                "connection reaches its budget, or a slow consumer ends healthy connections"
            )
        if problem := ring_size_problem(self.same_host_ring_bytes):
            raise ConfigError(f"NetConfig.same_host_ring_bytes: {problem}")
        if self.same_host_link not in SAME_HOST_LINKS:
            raise ConfigError(
                f"NetConfig.same_host_link must be one of {', '.join(SAME_HOST_LINKS)}, got {self.same_host_link!r}"
            )
        if self.max_pending_handshakes < 1:
            raise ConfigError(f"NetConfig.max_pending_handshakes must be >= 1, got {self.max_pending_handshakes}")
