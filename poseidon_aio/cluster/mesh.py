"""A full mesh of authenticated connections between the workers (sufficient factor broadcasting).

Every worker listens once; rank ``i`` dials every lower rank and is dialled by every higher one, so
each pair shares exactly one connection, used in both directions. Two ranks the topology puts on
one host connect over a Unix socket (``cluster.links``): every scheme's traffic inside a host goes
over these connections.

Start-up fails fast rather than at the deadline when it cannot succeed: when this rank's listener
refuses a rank it is waiting for (a wrong token: the dialler hears it at once, and so do we), and
when another rank published a start-up failure on the rendezvous store.
"""

from __future__ import annotations

import asyncio
import time
from typing import Optional

from ..errors import ConnectionLost, PeerTimeout, PoseidonError, RemoteProtocolError
from ..net import Listener, NetConfig, listen
from .launcher import advertise_host
from .links import dial, publish_listener
from .rendezvous import Rendezvous

# While waiting for higher ranks to dial in, look at the store's abort key every 0.25 s: another
# rank's failure reaches this one that fast, for about 4 store round trips a second.
_ABORT_POLL = 0.25


class Mesh:
    """``peers``: ``{rank: Connection}`` for every other worker. Build with :meth:`start`."""

    def __init__(self) -> None:
        self.peers: dict = {}
        self._listener: Optional[Listener] = None

    @classmethod
    async def start(
        cls, rdzv: Rendezvous, net: NetConfig, *, timeout: float = 60.0, process_shaper=None, topology=None
    ) -> "Mesh":
        """Listen, publish this rank's address, dial every lower rank, wait for every higher one.

        Args:
            rdzv: a started :class:`Rendezvous` (a ``scoped`` view keeps the mesh's keys apart).
            net: connection settings; every rank needs the same ``token``.
            timeout: seconds to wait for every higher rank to dial in.
            process_shaper: a :class:`~poseidon_aio.net.Shaper` shared by the process's connections.
            topology: the job's hosts (:class:`~poseidon_aio.cluster.topology.Topology`): where
                they run several workers, every connection's messages name the peer's host and
                local rank, and ranks on one host connect over a Unix socket
                (``NetConfig.same_host_link``).
        Returns:
            The mesh, with a connection to every other rank in ``peers``.
        Raises:
            AuthenticationError: a peer's token differs from ours, seen from either end (the
                message names the rank and its address).
            HandshakeError, ConnectionLost: another failure to connect or admit a rank.
            StartupAborted: another rank failed during start-up (its reason is in the message).
            PeerTimeout: a rank did not join within ``timeout`` s.

        On failure this rank publishes why (:meth:`Rendezvous.abort`) and closes what it opened.

        >>> # mesh = await Mesh.start(rdzv.scoped("mesh"), NetConfig(token=TOKEN))
        """
        self = cls()
        try:
            await self._join(rdzv, net, timeout, process_shaper, topology)
        except BaseException as exc:
            await rdzv.abort(exc)
            await self.close()
            raise
        if topology is not None and topology.by_host:
            for rank, conn in self.peers.items():
                conn.peer_host = f" ({topology.locate(rank)})"
        return self

    async def _join(self, rdzv: Rendezvous, net: NetConfig, timeout: float, process_shaper, topology) -> None:
        env = rdzv.env
        world = env.world_size
        hosts = topology if topology is not None and topology.by_host else None
        # Resolves when every higher rank has dialled in; fails when one of them was refused.
        joined = asyncio.get_running_loop().create_future()

        def accept(conn) -> None:
            if not env.rank < conn.peer_rank < world or conn.peer_rank in self.peers:
                conn.fail(RemoteProtocolError(f"rank {conn.peer_rank} may not dial rank {env.rank}'s mesh"))
                return
            self.peers[conn.peer_rank] = conn
            if len(self.peers) == world - 1 and not joined.done():
                joined.set_result(None)

        def refused(conn, error: PoseidonError) -> None:
            # The claimed rank is not authenticated: a stranger can fail our start-up this way,
            # but only while we wait for that rank, and the message says where it came from.
            rank = conn.claimed_rank
            if rank is None or not env.rank < rank < world or rank in self.peers or joined.done():
                return
            joined.set_exception(
                type(error)(
                    f"rank {env.rank}: rank {rank} (from {conn.peer_address}) could not join the worker mesh: {error}"
                )
            )

        host = advertise_host(env.master_addr)
        self._listener = await listen(
            host,
            0,
            rank=env.rank,
            config=net,
            on_connection=accept,
            process_shaper=process_shaper,
            same_host=hosts is not None,
        )
        self._listener.on_refused = refused
        try:
            await publish_listener(rdzv, f"addr/mesh/{env.rank}", host, self._listener)
            for peer in range(env.rank):
                if joined.done():
                    break  # a refusal: it is raised below
                try:
                    self.peers[peer] = await dial(
                        rdzv,
                        f"addr/mesh/{peer}",
                        who=f"rank {peer}",
                        same_host=hosts is not None and hosts.same_host(peer, env.rank),
                        rank=env.rank,
                        config=net,
                        process_shaper=process_shaper,
                    )
                except (ConnectionLost, PeerTimeout):
                    # A peer that gave up closes its listener: its reason beats our "refused".
                    await rdzv.check_aborted(f"dialling rank {peer}'s worker mesh")
                    raise
            if len(self.peers) == world - 1 and not joined.done():
                joined.set_result(None)
            deadline = time.monotonic() + timeout
            while not joined.done():
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(world)) - set(self.peers) - {env.rank})
                    raise PeerTimeout(
                        f"rank {env.rank}: ranks {missing} did not join the worker mesh within {timeout} s: "
                        f"are they running, and can they reach {host}:{self._listener.address[1]}?"
                    )
                await asyncio.wait({joined}, timeout=min(left, _ABORT_POLL))
                if not joined.done():
                    await rdzv.check_aborted("waiting for higher ranks to join the worker mesh")
            joined.result()
        finally:
            if joined.done() and not joined.cancelled():
                joined.exception()  # retrieved here whichever error is raised
            else:
                joined.cancel()

    async def close(self) -> None:
        """Close every connection and the listener."""
        for conn in self.peers.values():
            await conn.close()
        if self._listener is not None:
            await self._listener.close()
