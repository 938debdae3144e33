"""Accepting connections: :class:`Listener` and :func:`listen`.

The listener runs its own accept loop (``sock_accept``, then ``connect_accepted_socket``, with TLS
when configured) instead of the loop's own servers, which create the protocol only once TLS is up:
too late to start the handshake deadline at accept, and to refuse a connection before any TLS
state exists for it. Beyond ``NetConfig.max_pending_handshakes`` connections handshaking at once,
new sockets are closed as soon as they are accepted.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
from collections import deque
from typing import Awaitable, Callable, Optional

from ..errors import ConnectionLost, PeerTimeout, PoseidonError
from .config import NetConfig
from .connection import Connection
from .handshake import PROTOCOL_VERSION, Role
from .shaper import Shaper
from .shm import open_link
from .unix import bind as bind_unix
from .unix import describe_peer, new_name
from .unix import enabled as unix_enabled

log = logging.getLogger("poseidon_aio.net")

# A flood of connections beyond max_pending_handshakes logs one line per this many seconds.
_TURN_AWAY_LOG_EVERY = 10.0
# Connections the kernel queues for a listener before our accept loop takes them.
_BACKLOG = 128
# After accept() fails for lack of file descriptors, wait this long before trying again (as
# asyncio's own servers do): retrying at once would spin the loop.
_ACCEPT_RETRY_DELAY = 1.0


class Listener:
    """A listening socket whose authenticated connections go to a callback.

    Attributes:
        address: ``(host, port)`` actually bound (port 0 picks a free one).
        connections: the open, authenticated connections.
        refused: the errors of handshakes that failed (most recent 100).
        on_refused: ``None``, or ``f(conn, error)`` called for each of those as it fails (the
            worker mesh uses it to stop waiting for a rank whose connection was refused).
        refused_total: handshakes that failed since the listener started.
        turned_away: connections closed at accept because ``max_pending_handshakes`` were
            already handshaking.
    """

    def __init__(
        self,
        rank: int,
        on_connection: Callable[[Connection], Optional[Awaitable[None]]],
        max_pending_handshakes: int = 128,
    ) -> None:
        self.rank = rank
        self.address: tuple = ("", 0)
        self.connections: set = set()
        self.refused: deque = deque(maxlen=100)
        self.on_refused: Optional[Callable[[Connection, PoseidonError], None]] = None
        self.refused_total = 0
        self.turned_away = 0
        self.max_pending_handshakes = max_pending_handshakes
        self._on_connection = on_connection
        #: The abstract name of the Unix socket it also accepts on (same-host peers), or ``None``.
        self.unix_name: Optional[str] = None
        self._socks: list = []
        self._accepting: list = []
        self._tasks: set = set()
        self._handshaking: set = set()
        self._refusal_waiters: list = []
        self._turned_away_logged = (float("-inf"), 0)  # (loop time, turned_away) of the last log line

    @property
    def pending_handshakes(self) -> int:
        """Connections accepted whose handshake has not ended yet."""
        return len(self._handshaking)

    async def wait_refused(self, count: int = 1, timeout: float = 10.0) -> None:
        """Wait until ``refused_total`` reaches ``count``: for tests and monitors of the listener.

        Args:
            count: refusals since the listener started (not since this call).
            timeout: seconds to wait at most.
        Raises:
            PeerTimeout: fewer refusals than ``count`` within ``timeout``.

        >>> # await listener.wait_refused(1, timeout=10); listener.refused[0]
        """
        if self.refused_total >= count:
            return
        entry = (count, asyncio.get_running_loop().create_future())
        self._refusal_waiters.append(entry)
        try:
            async with asyncio.timeout(timeout):
                await entry[1]
        except TimeoutError:
            raise PeerTimeout(
                f"rank {self.rank}'s listener refused {self.refused_total} handshakes within {timeout} s, not {count}"
            ) from None
        finally:
            self._refusal_waiters.remove(entry)

    def _serve(
        self,
        sock: socket.socket,
        make_connection: Callable[[], Connection],
        tls,
        handshake_timeout: float,
        unix_name: Optional[str] = None,
    ) -> None:
        """Accept on ``sock`` too: the TCP socket (``address``), or an abstract Unix one."""
        self._socks.append(sock)
        if unix_name is None:
            self.address = sock.getsockname()[:2]
        else:
            self.unix_name = unix_name
        accepting = self._accept(sock, make_connection, tls, handshake_timeout)
        task = asyncio.get_running_loop().create_task(accepting)
        task.add_done_callback(self._accept_ended)
        self._accepting.append(task)

    async def _accept(
        self, lsock: socket.socket, make_connection: Callable[[], Connection], tls, handshake_timeout: float
    ) -> None:
        # The loop's own servers (create_server with ssl=) create the protocol only once TLS is
        # up: too late to start the handshake deadline, and to refuse a connection before its TLS
        # state (asyncio's is a 256 KiB buffer per socket) exists. So the listener accepts itself.
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, addr = await loop.sock_accept(lsock)
            except (ConnectionAbortedError, InterruptedError):
                continue  # the peer left before we took it
            except OSError as exc:  # EMFILE, ENFILE, ENOBUFS: out of descriptors or memory
                log.error(
                    "rank %s: accepting a connection failed: %s; trying again in %s s",
                    self.rank,
                    exc,
                    _ACCEPT_RETRY_DELAY,
                )
                await asyncio.sleep(_ACCEPT_RETRY_DELAY)
                continue
            if len(self._handshaking) >= self.max_pending_handshakes:
                sock.close()
                self._turn_away()
            else:
                self._take(sock, addr, make_connection, tls, handshake_timeout)

    def _take(self, sock: socket.socket, addr: tuple, make_connection, tls, handshake_timeout: float) -> None:
        # Not inlined in _accept: its suspended frame would keep the last connection alive.
        conn = make_connection()  # the handshake deadline runs from here
        if sock.family == socket.AF_UNIX:
            conn.peer_address = describe_peer(sock, self.unix_name)
        else:
            conn.peer_address = f"{addr[0]}:{addr[1]}"
        self._handshaking.add(conn)
        task = asyncio.get_running_loop().create_task(self._admit(conn, sock, tls, handshake_timeout))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _accept_ended(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error(
                "rank %s: the listener on %s stopped accepting connections",
                self.rank,
                self.address,
                exc_info=task.exception(),
            )

    def _turn_away(self) -> None:
        self.turned_away += 1
        now = asyncio.get_running_loop().time()
        last_time, last_count = self._turned_away_logged
        if now - last_time >= _TURN_AWAY_LOG_EVERY:
            log.warning(
                "rank %s: %d handshakes already in progress (NetConfig.max_pending_handshakes); "
                "closed %d new connections at once since the last report",
                self.rank,
                len(self._handshaking),
                self.turned_away - last_count,
            )
            self._turned_away_logged = (now, self.turned_away)

    def _record_refusal(self, exc: BaseException) -> None:
        # Tracebacks hold the frames that raised, and those hold the refused Connection (with its
        # 64 KiB scratch buffer): kept in `refused`, 100 of them would outlive their sockets.
        chain: Optional[BaseException] = exc
        cleared: set = set()
        while chain is not None and id(chain) not in cleared:
            cleared.add(id(chain))
            chain.__traceback__ = None
            chain = chain.__cause__ or chain.__context__
        self.refused.append(exc)
        self.refused_total += 1
        for count, fut in self._refusal_waiters:
            if self.refused_total >= count and not fut.done():
                fut.set_result(None)

    async def _admit(self, conn: Connection, sock: socket.socket, tls, handshake_timeout: float) -> None:
        loop = asyncio.get_running_loop()
        try:
            try:
                if sock.family == socket.AF_UNIX:  # a worker of this host: shared-memory rings
                    async with asyncio.timeout(handshake_timeout):
                        await open_link(
                            sock, conn, first=False, peer=conn.peer_address, ring_bytes=conn.config.same_host_ring_bytes
                        )
                else:
                    await loop.connect_accepted_socket(
                        lambda: conn, sock, ssl=tls, ssl_handshake_timeout=handshake_timeout if tls else None
                    )
            except Exception as exc:  # noqa: BLE001 - ssl.SSLError, OSError: this connection only
                sock.close()
                conn._transport_failed(exc, tls is not None)
            await conn.wait_ready()
        except PoseidonError as exc:
            self._record_refusal(exc)
            log.warning("rank %s refused a connection from %s: %s", self.rank, conn.peer_address, exc)
            if self.on_refused is not None:
                self.on_refused(conn, exc)
            return
        finally:
            self._handshaking.discard(conn)
        self.connections.add(conn)
        conn.on_close(self.connections.discard)
        try:
            result = self._on_connection(conn)
            if result is not None:
                await result
        except ConnectionLost:
            if conn.error is None:
                raise
            log.debug("rank %s: handler for %s ended with its connection", self.rank, conn.where)
        except Exception as exc:  # noqa: BLE001 - the callback's failure ends its connection only
            log.exception("rank %s: connection handler for %s failed", self.rank, conn.where)
            conn._fail(exc, "abort")

    async def close(self) -> None:
        """Stop listening, close every connection and wait for the handler tasks to finish."""
        for task in self._accepting:
            task.cancel()
        await asyncio.gather(*self._accepting, return_exceptions=True)
        for sock in self._socks:
            sock.close()
        for conn in list(self.connections):
            await conn.close()
        pending = list(self._handshaking)
        for task in list(self._tasks):
            task.cancel()
        for conn in pending:
            conn._discard()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def __aenter__(self) -> "Listener":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


async def listen(
    host: str,
    port: int,
    *,
    rank: int,
    config: NetConfig,
    on_connection: Callable[[Connection], Optional[Awaitable[None]]],
    process_shaper: Optional[Shaper] = None,
    protocol: int = PROTOCOL_VERSION,
    same_host: bool = False,
) -> Listener:
    """Listen on ``host:port``; call ``on_connection(conn)`` for each authenticated connection.

    Binds the first address ``host`` resolves to (``""``: every interface of the first family).
    With ``same_host``, where ``config.same_host_link`` and the platform allow it
    (:func:`~poseidon_aio.net.unix.enabled`), it also accepts peers of this host on a fresh
    abstract Unix socket, named in ``Listener.unix_name`` (``None`` otherwise), whose connections
    run on shared-memory rings (:mod:`poseidon_aio.net.shm`) with the same handshake and
    handlers; TLS stays on TCP (those bytes never leave the host's memory).

    A handshake that fails (or does not finish within ``config.handshake_timeout`` of accept) is
    logged and recorded in ``Listener.refused``; the listener keeps serving. Beyond
    ``config.max_pending_handshakes`` connections handshaking at once, new ones are closed at
    accept and counted in ``Listener.turned_away``. If ``on_connection`` returns an awaitable it
    runs as a task owned by the listener.

    >>> # listener = await listen("127.0.0.1", 0, rank=1, config=cfg, on_connection=serve_peer)
    """
    loop = asyncio.get_running_loop()
    tls = config.tls.server_context() if config.tls else None
    family, kind, proto, _, address = (
        await loop.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(_BACKLOG)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"rank {rank} cannot listen on {host}:{port}: {exc.strerror}") from exc

    def connection(same_host: bool = False) -> Connection:
        return Connection(
            Role.SERVER, rank, config, process_shaper=process_shaper, protocol=protocol, same_host=same_host
        )

    listener = Listener(rank, on_connection, config.max_pending_handshakes)
    listener._serve(sock, connection, tls, config.handshake_timeout)
    if same_host and unix_enabled(config):
        name = new_name(rank)
        try:
            unix_sock = bind_unix(name, rank)
        except OSError:
            await listener.close()
            raise
        listener._serve(
            unix_sock, functools.partial(connection, same_host=True), None, config.handshake_timeout, unix_name=name
        )
    return listener
