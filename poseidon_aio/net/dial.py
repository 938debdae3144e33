"""Dialling a listener: :func:`connect`, bounded by the connect and handshake timeouts."""

from __future__ import annotations

import asyncio
from typing import NoReturn, Optional

from ..errors import ConnectionLost, PeerTimeout
from .config import NetConfig
from .connection import Connection
from .handshake import PROTOCOL_VERSION, Role
from .shaper import Shaper


async def connect(
    host: str,
    port: int,
    *,
    rank: int,
    config: NetConfig,
    process_shaper: Optional[Shaper] = None,
    protocol: int = PROTOCOL_VERSION,
) -> Connection:
    """Dial a listener and complete the handshake.

    Raises:
        PeerTimeout: no TCP connection within ``config.connect_timeout`` or no handshake within
            ``config.handshake_timeout``.
        ConnectionLost: the address refused or dropped the connection.
        AuthenticationError, VersionMismatch, HandshakeError: the handshake was refused.

    >>> # conn = await connect("10.0.0.2", 29600, rank=0, config=NetConfig(token=TOKEN))
    """
    loop = asyncio.get_running_loop()
    tls = config.tls
    made: list = []

    def factory() -> Connection:
        conn = Connection(Role.CLIENT, rank, config, process_shaper=process_shaper, protocol=protocol)
        made.append(conn)
        return conn

    try:
        async with asyncio.timeout(config.connect_timeout):
            _, conn = await loop.create_connection(
                factory,
                host,
                port,
                ssl=tls.client_context() if tls else None,
                server_hostname=host if tls else None,
                ssl_handshake_timeout=config.handshake_timeout if tls else None,
            )
    except BaseException as exc:
        for made_conn in made:
            made_conn._discard()
        raise_dial_failure(exc, rank, f"{host}:{port}", config.connect_timeout)
    return await ready(conn)


def raise_dial_failure(exc: BaseException, rank: int, where: str, timeout: float) -> NoReturn:
    """Raise what a failed dial of ``where`` means to the caller: a timeout or a lost connection,
    else ``exc`` itself (a refused handshake, a cancellation)."""
    if isinstance(exc, TimeoutError):
        raise PeerTimeout(f"rank {rank} could not connect to {where} within {timeout} s") from None
    if isinstance(exc, OSError):
        raise ConnectionLost(f"rank {rank} could not connect to {where}: {exc}") from exc
    raise exc


async def ready(conn: Connection) -> Connection:
    """``conn`` once its handshake is done; aborted if the wait is cancelled."""
    try:
        return await conn.wait_ready()
    except asyncio.CancelledError:
        conn.abort()
        raise
