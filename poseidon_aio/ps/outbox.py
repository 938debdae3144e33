"""What a shard owes one worker: frames queued in order, sent by one writer task, bounded in bytes.

A shard replies to every worker at every clock. A worker that is slow to read, gone, or not yet
connected cannot take its replies as fast as the others make the shard produce them (under a
straggler policy the shard goes on without it), so its queue would grow by a clock's replies per
clock without end. The outbox counts the payload bytes it holds and reports when they pass the
limit; the shard then applies its straggler policy (eject the worker, or fail the job naming it).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Callable, Optional

from ..net import Endpoint
from ..wire import Kind

log = logging.getLogger("poseidon_aio.ps")


def frame_bytes(frame: tuple) -> int:
    payload = frame[1]
    return len(payload) if isinstance(payload, (bytes, bytearray)) else payload.nbytes


class Outbox:
    """Frames ``(kind, payload, key, clock, dtype)`` for worker ``rank``, sent in the order queued.

    Args:
        rank: the worker.
        limit: payload bytes it may hold before :meth:`put` reports an overflow.
        on_sent: called with ``(kind, payload bytes, link)`` once a frame is handed to the link.
    """

    def __init__(self, rank: int, limit: int, on_sent: Callable[[Kind, int, Endpoint], None]) -> None:
        self.rank = rank
        self.limit = limit
        self.nbytes = 0
        self.max_nbytes = 0
        self._frames: deque = deque()  # (frame, its payload bytes): sized once, when queued
        self._conn: Optional[Endpoint] = None
        self._writer: Optional[asyncio.Task] = None
        self._on_sent = on_sent

    def __len__(self) -> int:
        return len(self._frames)

    def put(self, frames: list) -> bool:
        """Queue ``frames``; return ``False`` if the outbox now holds more than its limit."""
        for frame in frames:
            nbytes = frame_bytes(frame)
            self._frames.append((frame, nbytes))
            self.nbytes += nbytes
        self.max_nbytes = max(self.max_nbytes, self.nbytes)
        self._wake()
        return self.nbytes <= self.limit

    def attach(self, conn: Endpoint) -> None:
        """Send over ``conn`` from now on (what was queued first)."""
        self._conn = conn
        self._wake()

    def detach(self) -> None:
        """The link is gone: keep the frames (bounded) for a later :meth:`attach`."""
        self._conn = None

    def clear(self) -> None:
        """Drop every queued frame (the worker was ejected or the shard is closing)."""
        self._frames.clear()
        self.nbytes = 0
        if self._writer is not None:
            self._writer.cancel()

    async def close(self) -> None:
        self.clear()
        if self._writer is not None:
            await asyncio.gather(self._writer, return_exceptions=True)

    def _wake(self) -> None:
        if not self._frames or self._conn is None or (self._writer is not None and not self._writer.done()):
            return
        # Frames that can go out at once go now, in order; a writer task takes over only when
        # the link makes us wait (most replies on a healthy link never do).
        conn = self._conn
        try:
            while self._frames:
                (kind, payload, key, clock, dtype), nbytes = self._frames[0]
                if not conn.try_send(kind, payload, key=key, clock=clock, dtype=dtype, priority=_PRIORITY.get(kind, 1)):
                    break
                self._frames.popleft()
                self.nbytes -= nbytes
                self._on_sent(kind, nbytes, conn)
        except ConnectionError:
            return  # the link is gone; its loss is reported by the link, the frames stay queued
        if self._frames:
            self._writer = asyncio.ensure_future(self._write(conn))
            self._writer.add_done_callback(_quiet)

    async def _write(self, conn: Endpoint) -> None:
        # One writer per worker keeps its frames in order (a notice before the data it concerns)
        # and holds one send at a time: a task per frame would pin every payload of a slow worker.
        while self._frames and self._conn is conn:
            entry = self._frames[0]
            (kind, payload, key, clock, dtype), nbytes = entry
            await conn.send(kind, payload, key=key, clock=clock, dtype=dtype, priority=_PRIORITY.get(kind, 1))
            if self._frames and self._frames[0] is entry:  # not cleared meanwhile
                self._frames.popleft()
                self.nbytes -= nbytes
            self._on_sent(kind, nbytes, conn)


# A notice goes before the data it concerns (1: every other kind); a dict's get, as it runs a frame.
_PRIORITY = {Kind.CONTROL: 0}


def _quiet(task: asyncio.Task) -> None:
    # A send to a link that broke fails with ConnectionLost, which that link already reported;
    # anything else is a bug worth a traceback.
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None and not isinstance(exc, ConnectionError):
        log.error("outbox writer failed", exc_info=exc)
