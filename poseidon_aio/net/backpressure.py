"""Whose turn it is to write when the transport is full: senders served by priority.

Above the write high-water mark the transport calls ``pause_writing``; senders then wait here,
lowest ``priority`` value first and FIFO within a priority, and each write (or
``resume_writing``) lets the next one go while writing is not paused.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools

from .endpoint import silence


class WriteTurns:
    """The senders of one connection waiting for the transport to take more.

    >>> # if turns.busy: await turns.wait(priority); transport.write(...); turns.wake()
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.paused = False  # between the transport's pause_writing and resume_writing
        self._loop = loop
        self._waiters: list = []  # heap of (priority, arrival, future)
        self._seq = itertools.count()

    @property
    def busy(self) -> bool:
        """Whether a sender must wait: writing is paused, or others wait before it."""
        return self.paused or bool(self._waiters)

    async def wait(self, priority: int) -> None:
        """Wait for this sender's turn; raises what :meth:`fail` was given."""
        fut = self._loop.create_future()
        heapq.heappush(self._waiters, (priority, next(self._seq), fut))
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.wake()  # pass the turn we were given on
            raise

    def wake(self) -> None:
        """Give the next waiting sender its turn, unless writing is paused."""
        while self._waiters and not self.paused:
            fut = heapq.heappop(self._waiters)[2]
            if not fut.done():
                fut.set_result(None)
                return

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False
        self.wake()

    def fail(self, exc: BaseException) -> None:
        """Fail every waiting sender with ``exc`` (the connection ended)."""
        for _, _, fut in self._waiters:
            if not fut.done():
                fut.set_exception(exc)
                silence(fut)
        self._waiters.clear()
