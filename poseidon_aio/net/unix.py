"""Where two workers on one host meet: an abstract Unix socket, and the dial that puts a
:class:`Connection` on shared-memory rings through it (:mod:`poseidon_aio.net.shm`).

The listening socket lives in Linux's abstract namespace: its name is no file, so nothing is
ever left in ``/tmp`` or ``/dev/shm``, and the kernel drops it with its last descriptor, however
the process ends. Any process in the host's network namespace can dial such a name, so the
token handshake runs on the rings exactly as on TCP; the peer's pid (``SO_PEERCRED``) only names
it in messages.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
import struct
import sys
from typing import Optional

from .config import NetConfig
from .connection import Connection
from .dial import raise_dial_failure, ready
from .handshake import PROTOCOL_VERSION, Role
from .shaper import Shaper
from .shm import AVAILABLE as SHM_AVAILABLE
from .shm import open_link

#: Whether this platform has abstract Unix socket names and the shared-memory rings (Linux):
#: where not, hosts use TCP.
AVAILABLE = sys.platform.startswith("linux") and hasattr(socket, "AF_UNIX") and SHM_AVAILABLE
#: Every name this library binds starts so: ``/proc/net/unix`` shows them as ``@poseidon-aio/...``.
PREFIX = "poseidon-aio/"
_BACKLOG = 128
# struct ucred: pid, uid, gid.
_UCRED = struct.Struct("3i")


def enabled(config: NetConfig) -> bool:
    """Whether ``config`` and this platform put same-host peers on a Unix socket."""
    return AVAILABLE and config.same_host_link == "auto"


def new_name(rank: int) -> str:
    """A fresh abstract name for ``rank``'s listener: its pid and 64 random bits, so two jobs on
    one host (or a restarted rank) never meet one another's sockets."""
    return f"{PREFIX}{os.getpid()}-{rank}-{secrets.token_hex(8)}"


def bind(name: str, rank: int) -> socket.socket:
    """A listening, non-blocking socket on abstract name ``name``.

    Raises:
        OSError: the name is taken or Unix sockets are refused here (the message names the rank).
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind("\0" + name)
        sock.listen(_BACKLOG)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"rank {rank} cannot listen on unix socket @{name}: {exc.strerror}") from exc
    return sock


def describe_peer(sock: socket.socket, name: str) -> str:
    """``"pid 4242 on @poseidon-aio/..."``: an accepted socket has no address, its peer has a pid."""
    try:
        pid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))[0]
    except (OSError, AttributeError):
        return f"unix socket @{name}"
    return f"pid {pid} on unix socket @{name}"


async def connect_unix(
    name: str,
    *,
    rank: int,
    config: NetConfig,
    process_shaper: Optional[Shaper] = None,
    protocol: int = PROTOCOL_VERSION,
) -> Connection:
    """Dial the listener of abstract name ``name`` on this host, set up the shared-memory rings
    (:mod:`poseidon_aio.net.shm`) and complete the handshake over them.

    Raises:
        PeerTimeout: no connection within ``config.connect_timeout`` or no handshake within
            ``config.handshake_timeout``.
        ConnectionLost: nobody listens on that name here (its ``__cause__`` is the
            ``OSError``); e.g. the peer is in another network namespace or on another machine.
        AuthenticationError, VersionMismatch, HandshakeError: the handshake was refused, or the
            listener offered no ring we may map.

    >>> # conn = await connect_unix(listener.unix_name, rank=1, config=NetConfig(token=TOKEN))
    """
    loop = asyncio.get_running_loop()
    conn = Connection(Role.CLIENT, rank, config, process_shaper=process_shaper, protocol=protocol, same_host=True)
    conn.peer_address = f"unix socket @{name}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        async with asyncio.timeout(config.connect_timeout):
            await loop.sock_connect(sock, "\0" + name)
            await open_link(sock, conn, first=True, peer=conn.peer_address, ring_bytes=config.same_host_ring_bytes)
    except BaseException as exc:
        sock.close()
        conn._discard()
        raise_dial_failure(exc, rank, f"unix socket @{name}", config.connect_timeout)
    return await ready(conn)
