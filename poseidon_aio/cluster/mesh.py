"""A full mesh of authenticated connections between the workers (sufficient factor broadcasting).

Every worker listens once; rank ``i`` dials every lower rank and is dialled by every higher one, so
each pair shares exactly one connection, used in both directions.
"""

from __future__ import annotations

import asyncio
from typing import Optional

from ..errors import PeerTimeout, RemoteProtocolError
from ..net import Listener, NetConfig, connect, listen
from .rendezvous import Rendezvous, advertise_host


class Mesh:
    """``peers``: ``{rank: Connection}`` for every other worker. Build with :meth:`start`."""

    def __init__(self) -> None:
        self.peers: dict = {}
        self._listener: Optional[Listener] = None

    @classmethod
    async def start(cls, rdzv: Rendezvous, net: NetConfig, *, timeout: float = 60.0, process_shaper=None) -> "Mesh":
        self = cls()
        env = rdzv.env
        world = env.world_size
        everyone = asyncio.Event()
        if world == 1:
            everyone.set()

        def accept(conn) -> None:
            if not env.rank < conn.peer_rank < world or conn.peer_rank in self.peers:
                conn.fail(RemoteProtocolError(f"rank {conn.peer_rank} may not dial rank {env.rank}'s mesh"))
                return
            self.peers[conn.peer_rank] = conn
            if len(self.peers) == world - 1:
                everyone.set()

        host = advertise_host(env.master_addr)
        self._listener = await listen(host, 0, rank=env.rank, config=net, on_connection=accept, process_shaper=process_shaper)
        await rdzv.publish(f"addr/mesh/{env.rank}", f"{host}:{self._listener.address[1]}")
        for peer in range(env.rank):
            h, p = (await rdzv.read(f"addr/mesh/{peer}", who=f"rank {peer}")).rsplit(":", 1)
            self.peers[peer] = await connect(h, int(p), rank=env.rank, config=net, process_shaper=process_shaper)
        if len(self.peers) == world - 1:
            everyone.set()
        try:
            await asyncio.wait_for(everyone.wait(), timeout)
        except TimeoutError:
            missing = sorted(set(range(world)) - set(self.peers) - {env.rank})
            raise PeerTimeout(f"rank {env.rank}: ranks {missing} did not join the worker mesh within {timeout} s") from None
        return self

    async def close(self) -> None:
        for conn in self.peers.values():
            await conn.close()
        if self._listener is not None:
            await self._listener.close()
