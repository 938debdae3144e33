"""Calls handed from the backward's thread to the event loop, one wake-up of the loop per burst."""

from __future__ import annotations

import asyncio
import collections
from typing import Callable


class Handoff:
    """Runs calls queued from any thread on ``loop``, in the order they were queued.

    A backward's hooks come in bursts. ``call_soon_threadsafe`` per hook costs the hook's thread a
    write to the loop's wake-up descriptor and the loop a pass each; here a call queued while a
    wake-up is still pending rides on it, and the loop runs everything queued when it wakes, so a
    call still runs at the loop's first pass after it was queued (no waiting for more, no timer).

    >>> # handoff = Handoff(loop); handoff.call(launch, state, layer)  # from the backward's hook
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._calls: collections.deque = collections.deque()  # (fn, args); append/popleft are atomic
        self._woken = False  # a drain is scheduled on the loop and has not begun

    def call(self, fn: Callable, *args) -> None:
        """Queue ``fn(*args)`` to run on the loop (any thread)."""
        # Queued before the flag is read, and the drain clears the flag before it takes calls: so a
        # call either sits in the queue before a pending drain begins or schedules a drain itself.
        self._calls.append((fn, args))
        if self._woken:
            return
        self._woken = True
        try:
            self._loop.call_soon_threadsafe(self.drain)
        except RuntimeError:  # the loop is closed: as call_soon_threadsafe itself would
            self._woken = False
            raise

    def drain(self) -> None:
        """Run every call queued so far, oldest first (on the loop)."""
        self._woken = False
        calls = self._calls
        while calls:
            fn, args = calls.popleft()
            try:
                fn(*args)
            except Exception as exc:  # noqa: BLE001 - one call's failure is reported as the loop reports a callback's
                self._loop.call_exception_handler(
                    {"message": f"Exception in callback {getattr(fn, '__qualname__', fn)!r}", "exception": exc}
                )
