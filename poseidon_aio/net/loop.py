"""Event loop selection: uvloop where the platform has it, asyncio's own loop otherwise; and
:class:`Offload`, which decides whether recurring work leaves the loop's thread."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import sys
import threading
import time
from concurrent.futures import Executor
from typing import Any, Callable, Coroutine, Hashable, Optional, TypeVar

from ..errors import ConnectionLost, PoseidonError
from .endpoint import silence

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
    SIGTERM (a launcher stopping the job) cancels ``main``, so a trainer leaves the job and its
    parameter server cleanly, and ends the process with one line and exit code 143. A rank whose
    step failed because a peer was stopped by a signal waits up to ``SIGNAL_GRACE_S`` for its own
    before it reports the peer's.

    >>> async def answer(): return 42
    >>> run(answer())
    42
    """
    terminated = _STOPPED_BY
    terminated.clear()
    running: dict = {}  # the task of ``main`` and its loop, while it runs

    def stop(signum, frame) -> None:
        # A Python-level handler, as asyncio.Runner's for SIGINT: it runs at the main thread's
        # next bytecode, so a peer's GOODBYE that the loop takes first (the launcher stops
        # every rank) is still seen as this rank's SIGTERM, not as the peer's error.
        terminated.append(signal.Signals(signum).name)
        # Every rank is being stopped: the peers a shard or a link loses now are no news.
        logging.getLogger("poseidon_aio").setLevel(logging.ERROR)
        if running:
            with contextlib.suppress(RuntimeError):  # (the loop closed meanwhile)
                running["loop"].call_soon_threadsafe(running["task"].cancel)

    async def until_terminated() -> T:
        running.update(task=asyncio.current_task(), loop=asyncio.get_running_loop())
        try:
            return await main
        finally:
            running.clear()

    try:
        previous = signal.signal(signal.SIGTERM, stop)
    except ValueError:  # not the main thread: the caller handles its signals
        previous = None
    rank = os.environ.get("RANK", "?")
    try:
        with asyncio.Runner(loop_factory=new_event_loop, debug=debug) as runner:
            return runner.run(until_terminated())
    except BaseException as exc:
        if not terminated and previous is not None and _peer_signal(exc):
            # A peer was stopped by a signal: the launcher stopping the job signals its ranks one
            # after another, so this rank's own may be on its way; its line is then that one.
            deadline = time.monotonic() + SIGNAL_GRACE_S
            while not terminated and time.monotonic() < deadline:
                time.sleep(0.01)
        if terminated:
            _say(f"poseidon_aio rank {rank}: stopped by {terminated[0]}")
            raise SystemExit(128 + signal.Signals[terminated[0]]) from None
        if not isinstance(exc, PoseidonError) or os.environ.get(ERRORS_ENV) != "brief":
            raise
        _say(f"poseidon_aio rank {rank}: {type(exc).__name__}: {exc}")
        raise SystemExit(1) from None
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


# How long a rank whose peer was stopped by a signal waits for its own before it reports the
# peer's: longer than a launcher takes between one rank's signal and the next, even on a busy host.
SIGNAL_GRACE_S = 2.0
_STOPPED_BY: list = []  # the signal that is stopping this process under run(), once one has come


def stopped_by() -> Optional[str]:
    """The name of the signal stopping this process (``"SIGTERM"``) under :func:`run`, else None:
    a trainer that is being left tells its peers so, instead of just closing its links."""
    return _STOPPED_BY[0] if _STOPPED_BY else None


def _peer_signal(exc: BaseException) -> Optional[str]:
    """The signal a peer said it was stopped by, where ``exc`` (or an error it came from) is the
    loss of that peer (:attr:`ConnectionLost.peer_signal`)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, ConnectionLost) and exc.peer_signal:
            return exc.peer_signal
        exc = exc.__cause__ or exc.__context__
    return None


def _say(line: str) -> None:
    """One line on stderr in one write: the ranks of a job share the launcher's stderr, and a
    line written in pieces (print writes the newline apart) interleaves with another rank's."""
    sys.stderr.flush()
    os.write(sys.stderr.fileno(), (line + "\n").encode(errors="replace"))


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
# A run kept on the loop is timed only every this many runs: the thread's CPU clock is a system
# call (no vDSO), two a run on every layer of every step; work that grows still leaves the loop
# within this many runs.
INLINE_SAMPLE_EVERY = 16


class Offload:
    """Recurring work (a layer's codec pass, the optimizer's step), run on ``executor`` or, once
    measured to take less than ``budget_s`` of CPU, on the calling thread: the event loop's.

    A piece of work is known by its ``key``; its first run goes to the executor, and every run
    there records the CPU time it took (the thread's own time: a preempted run is not charged for
    the wait), as does every ``INLINE_SAMPLE_EVERY``-th run on the loop, so work that grows moves
    back off the loop within that many runs. Where the result is computed does not change its
    bits. ``budget_s = 0`` keeps everything on the executor (a GPU's
    work waits on its streams); ``executor=None`` runs everything in place (tests).

    >>> # mine = await offload.run(("top-k", layer), step.begin)
    """

    def __init__(self, executor: Optional[Executor], budget_s: float = INLINE_BUDGET_S) -> None:
        self._executor = executor
        self._budget = budget_s
        self._took: dict = {}  # key -> CPU seconds of its last timed run; at most OFFLOAD_KEYS keys
        self._untimed: dict = {}  # key -> its runs on the loop since it was last timed

    def inline(self, key: Hashable) -> bool:
        """Whether ``key``'s next run stays on the calling thread."""
        took = self._took.get(key)
        return self._executor is None or (took is not None and took < self._budget)

    async def run(self, key: Hashable, fn: Callable, *args):
        """``fn(*args)``, here or on the executor (see the class)."""
        if self._executor is None:
            return fn(*args)
        if self.inline(key):
            untimed = self._untimed.get(key, 0) + 1
            if untimed < INLINE_SAMPLE_EVERY:
                self._untimed[key] = untimed
                return fn(*args)
            return self._timed(key, fn, args)
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._timed, key, fn, args)

    def _timed(self, key: Hashable, fn: Callable, args: tuple):
        started = time.thread_time()
        try:
            return fn(*args)
        finally:
            if key in self._took or len(self._took) < OFFLOAD_KEYS:  # past the bound: left on the executor
                self._took[key] = time.thread_time() - started
                self._untimed[key] = 0


class LoopThread:
    """An event loop of the caller's kind (uvloop or asyncio's, its debug mode) on a thread of its
    own, and coroutines run there from the caller's loop.

    The trainer moves bytes on it while the caller's thread runs the model: the syncs that a
    user's own ``loss.backward()`` starts from its hooks then overlap the rest of that backward
    (WFBP), as they do inside ``step()``. Errors the loop's exception handler is given go to the
    caller's loop's handler.

    >>> # thread = LoopThread(); result = await thread.run(coro()); await thread.close()
    """

    def __init__(self, name: str = "poseidon-loop", init: Optional[Callable[[], None]] = None) -> None:
        caller = asyncio.get_running_loop()
        self.loop = uvloop.new_event_loop() if is_uvloop(caller) else asyncio.new_event_loop()
        self.loop.set_debug(caller.get_debug())
        self.loop.set_exception_handler(functools.partial(_forward_to, caller))
        if init is not None:  # the thread's own settings, before anything else runs there
            self.loop.call_soon(init)
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def cpu_s(self) -> float:
        """CPU seconds the thread has used so far (the loop's own work: syncs, codecs, hooks' wake-ups)."""
        try:
            return time.clock_gettime(time.pthread_getcpuclockid(self._thread.ident))
        except (AttributeError, OSError):  # no per-thread clocks here, or the thread has ended
            return 0.0

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """``await coro`` on the thread's loop. Cancelling this cancels it there, and returns once
        it has unwound (so what the caller does next never races its cleanup)."""
        caller = asyncio.get_running_loop()
        outcome = caller.create_future()
        box: list = []

        def settle(task: asyncio.Task) -> None:  # on the caller's loop
            if outcome.done():
                return
            if task.cancelled():
                outcome.cancel()
            elif task.exception() is not None:
                outcome.set_exception(task.exception())
            else:
                outcome.set_result(task.result())

        def start() -> None:  # on the thread's loop
            task = self.loop.create_task(coro)
            box.append(task)
            task.add_done_callback(lambda t: _call_soon(caller, settle, t))

        self.loop.call_soon_threadsafe(start)
        try:
            return await asyncio.shield(outcome)
        except asyncio.CancelledError:
            # ``start`` was queued first: the task exists when this runs. Its outcome is not
            # news (the caller is cancelled), but it is retrieved, so no "never retrieved" report.
            self.loop.call_soon_threadsafe(lambda: box[0].cancel())
            outcome.add_done_callback(silence)
            await asyncio.wait([outcome])
            raise

    async def close(self) -> None:
        """Cancel what still runs there, stop the loop, end the thread."""

        async def wind_down() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.loop.shutdown_asyncgens()
            await self.loop.shutdown_default_executor()

        if self.loop.is_closed():
            return
        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(wind_down(), self.loop))
        self.loop.call_soon_threadsafe(self.loop.stop)
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
        self.loop.close()


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the caller's loop is closed: nobody waits any more
        pass


def _forward_to(caller: asyncio.AbstractEventLoop, loop: asyncio.AbstractEventLoop, context: dict) -> None:
    if caller.is_closed():
        loop.default_exception_handler(context)
    else:
        _call_soon(caller, caller.call_exception_handler, context)
