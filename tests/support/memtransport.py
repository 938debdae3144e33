"""An in-memory transport pair: two Connections joined without sockets (unit tests).

Bytes written on one side are delivered to the other through ``get_buffer``/``buffer_updated`` in
chunks whose sizes a seeded RNG picks, one chunk per loop iteration, so tests can explore every
interleaving of frame boundaries, reads and coroutine steps deterministically.
"""

from __future__ import annotations

import asyncio
import random

from poseidon_aio.net import new_event_loop
from poseidon_aio.net.connection import Connection
from poseidon_aio.net.handshake import Role


class MemTransport(asyncio.Transport):
    def __init__(self, loop, rng: random.Random, max_chunk: int):
        super().__init__()
        self._loop = loop
        self._rng = rng
        self._max_chunk = max_chunk
        self.protocol: Connection | None = None
        self.peer: "MemTransport | None" = None
        self._pending = bytearray()
        self._high, self._low = 1 << 20, 1 << 18
        self._paused_writing = False
        self._reading = True
        self._closing = False
        self._lost = False
        self._scheduled = False

    # -- what Connection calls -------------------------------------------------------------
    def write(self, data) -> None:
        if self._closing:
            return
        self._pending += bytes(data)
        self._schedule()
        if not self._paused_writing and len(self._pending) > self._high:
            self._paused_writing = True
            self.protocol.pause_writing()

    def writelines(self, parts) -> None:
        for part in parts:
            self.write(part)

    def get_write_buffer_size(self) -> int:
        return len(self._pending)

    def set_write_buffer_limits(self, high=None, low=None) -> None:
        self._high, self._low = high, low

    def get_extra_info(self, name, default=None):
        return {"peername": ("memory", id(self) % 65536)}.get(name, default)

    def pause_reading(self) -> None:
        self._reading = False

    def resume_reading(self) -> None:
        self._reading = True
        self.peer._schedule()

    def is_reading(self) -> bool:
        return self._reading

    def is_closing(self) -> bool:
        return self._closing

    def close(self) -> None:
        self._closing = True
        self._schedule()

    def abort(self) -> None:
        self._closing = True
        self._pending.clear()
        self._finish()

    # -- delivery ---------------------------------------------------------------------------
    def _schedule(self) -> None:
        if not self._scheduled and not self._lost:
            self._scheduled = True
            self._loop.call_soon(self._deliver)

    def _deliver(self) -> None:
        self._scheduled = False
        if self._lost:
            return
        if self._pending and self.peer._reading and not self.peer._lost:
            buf = self.peer.protocol.get_buffer(-1)
            n = min(len(buf), self._rng.randint(1, self._max_chunk), len(self._pending))
            buf[:n] = self._pending[:n]
            del self._pending[:n]
            self.peer.protocol.buffer_updated(n)
            if self._paused_writing and len(self._pending) <= self._low:
                self._paused_writing = False
                self.protocol.resume_writing()
            self._schedule()
        elif not self._pending and self._closing:
            self._finish()

    def _finish(self) -> None:
        for side in (self, self.peer):
            if not side._lost:
                side._lost = True
                side._loop.call_soon(side.protocol.connection_lost, None)


async def connected_pair(
    client_config,
    server_config,
    *,
    seed: int = 0,
    max_chunk: int = 4096,
    process_shaper=None,
    client_rank: int = 0,
    server_rank: int = 1,
):
    """Two Connections, handshake done, talking through memory."""
    loop = asyncio.get_running_loop()
    rng = random.Random(seed)
    a, b = MemTransport(loop, rng, max_chunk), MemTransport(loop, rng, max_chunk)
    a.peer, b.peer = b, a
    client = Connection(Role.CLIENT, client_rank, client_config, process_shaper=process_shaper)
    server = Connection(Role.SERVER, server_rank, server_config)
    a.protocol, b.protocol = client, server
    server.connection_made(b)
    client.connection_made(a)
    async with asyncio.timeout(10):
        await asyncio.gather(client.wait_ready(), server.wait_ready())
    return client, server


def run_async(coro, timeout: float = 30):
    """Run ``coro`` on a fresh loop under a timeout (for hypothesis tests, which cannot be async)."""
    loop = new_event_loop()
    try:
        return loop.run_until_complete(asyncio.wait_for(coro, timeout))
    finally:
        loop.close()
