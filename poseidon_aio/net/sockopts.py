"""Options on a connection's TCP socket that follow the traffic: the receive mark (SO_RCVLOWAT).

A connection's receive core (:meth:`~poseidon_aio.net.receive.ReceiveCore._tune_lowat`) picks
the mark; :class:`~poseidon_aio.net.connection.Connection` sets it through the socket
:func:`option_socket` returns.
"""

from __future__ import annotations

import os
import socket
import sys

# SO_RCVLOWAT steps for a payload being received: below the minimum a payload's rest is not worth
# a system call; the maximum is well under half of Linux's receive buffer, which the kernel keeps
# at least twice the mark.
LOWAT_OPT = getattr(socket, "SO_RCVLOWAT", None) if sys.platform.startswith("linux") else None
LOWAT_MIN = 64 * 1024
LOWAT_MAX = 256 * 1024


def option_socket(sock) -> tuple:
    """A socket object on which ``setsockopt`` is one system call, and whether it is our own.

    asyncio's transports hand out a wrapper of their socket; uvloop's hands out a stand-in
    whose every ``setsockopt`` builds and detaches a ``socket.socket``, and the receive mark
    changes twice a large frame. For uvloop we keep a socket on a duplicate of the descriptor
    instead: options are the socket's, not the descriptor's, so they reach the transport's, and
    closing ours leaves it open."""
    if isinstance(sock, socket.socket) or type(sock).__module__.startswith("asyncio"):
        return sock, False
    return socket.socket(sock.family, sock.type, sock.proto, fileno=os.dup(sock.fileno())), True
