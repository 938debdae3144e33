"""Event loop selection: uvloop where the platform has it, asyncio's own loop otherwise; and
:class:`Offload`, which decides whether recurring work leaves the loop's thread."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from concurrent.futures import Executor
from typing import Any, Callable, Coroutine, Hashable, Optional, TypeVar

from ..errors import PoseidonError

try:
    import uvloop
except ImportError:  # pragma: no cover - e.g. Windows
    uvloop = None

T = TypeVar("T")

LOOP = "uvloop" if uvloop is not None else "asyncio"


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A new uvloop loop if uvloop is installed, else a default asyncio loop."""
    return uvloop.new_event_loop() if uvloop is not None else asyncio.new_event_loop()


ERRORS_ENV = "POSEIDON_ERRORS"


def run(main: Coroutine[Any, Any, T], *, debug: bool | None = None) -> T:
    """Run ``main`` to completion on a fresh uvloop (or asyncio) loop and return its result.

    Under ``poseidon-aio run`` (which sets ``POSEIDON_ERRORS=brief`` unless given ``--debug``) a
    :class:`~poseidon_aio.errors.PoseidonError` ends the process with one line on stderr naming
    the rank and the cause, instead of a traceback per rank; other exceptions (bugs) keep theirs.

    >>> async def answer(): return 42
    >>> run(answer())
    42
    """
    try:
        with asyncio.Runner(loop_factory=new_event_loop, debug=debug) as runner:
            return runner.run(main)
    except PoseidonError as exc:
        if os.environ.get(ERRORS_ENV) != "brief":
            raise
        print(f"poseidon_aio rank {os.environ.get('RANK', '?')}: {type(exc).__name__}: {exc}", file=sys.stderr)
        raise SystemExit(1) from None


def is_uvloop(loop: asyncio.AbstractEventLoop) -> bool:
    return type(loop).__module__.startswith("uvloop")


# A hop to a worker thread and back costs the loop a wake-up each way and, on a host with fewer
# free cores than busy threads, context switches and a turn of the GIL for the thread woken: as
# much as a small layer's top-k selection, codec pass or SGD step costs itself (bench/RESULTS.md,
# "Work that stays on the loop"). Below this budget the work runs where it is asked for; above
# it, the loop keeps moving bytes while a worker thread computes (NumPy and torch release the GIL
# in their kernels).
INLINE_BUDGET_S = 0.5e-3
OFFLOAD_KEYS = 4096  # how many pieces of work one Offload remembers the cost of


class Offload:
    """Recurring work (a layer's codec pass, the optimizer's step), run on ``executor`` or, once
    measured to take less than ``budget_s`` of CPU, on the calling thread: the event loop's.

    A piece of work is known by its ``key``; its first run goes to the executor, and every run
    records the CPU time it took there (the thread's own time: a preempted run is not charged for
    the wait), so work that grows moves back off the loop at its next run. Where the result is
    computed does not change its bits. ``budget_s = 0`` keeps everything on the executor (a GPU's
    work waits on its streams); ``executor=None`` runs everything in place (tests).

    >>> # mine = await offload.run(("top-k", layer), step.begin)
    """

    def __init__(self, executor: Optional[Executor], budget_s: float = INLINE_BUDGET_S) -> None:
        self._executor = executor
        self._budget = budget_s
        self._took: dict = {}  # key -> CPU seconds of its last run; at most OFFLOAD_KEYS keys

    def inline(self, key: Hashable) -> bool:
        """Whether ``key``'s next run stays on the calling thread."""
        took = self._took.get(key)
        return self._executor is None or (took is not None and took < self._budget)

    async def run(self, key: Hashable, fn: Callable, *args):
        """``fn(*args)``, here or on the executor (see the class)."""
        if self._executor is None:
            return fn(*args)
        if self.inline(key):
            return self._timed(key, fn, args)
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._timed, key, fn, args)

    def _timed(self, key: Hashable, fn: Callable, args: tuple):
        started = time.thread_time()
        try:
            return fn(*args)
        finally:
            if key in self._took or len(self._took) < OFFLOAD_KEYS:  # past the bound: left on the executor
                self._took[key] = time.thread_time() - started
