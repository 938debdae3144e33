"""Calls handed from other threads to the event loop (train.handoff.Handoff): every call runs
once, on the loop, in its thread's order, at the loop's next pass; one wake-up per burst."""

from __future__ import annotations

import asyncio
import sys
import threading

import pytest

from poseidon_aio.train.handoff import Handoff


class _CountingLoop:
    """The running loop, counting its wake-ups from other threads (uvloop's methods cannot be patched)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.wakeups = 0

    def call_soon_threadsafe(self, fn, *args):
        self.wakeups += 1
        return self.loop.call_soon_threadsafe(fn, *args)

    def call_exception_handler(self, context: dict) -> None:
        self.loop.call_exception_handler(context)


async def _until(predicate, timeout: float = 60.0) -> None:
    # A bound on a hang, not a timing: 8 threads switching every microsecond beside a CPU hog are slow.
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.001)


async def test_calls_from_many_threads_each_run_once_on_the_loop_in_each_threads_order():
    loop = asyncio.get_running_loop()
    counting = _CountingLoop(loop)
    handoff = Handoff(counting)
    here = threading.get_ident()
    ran: list = []

    def record(thread: int, i: int) -> None:
        assert threading.get_ident() == here
        ran.append((thread, i))

    threads, calls = 8, 2000
    start = threading.Barrier(threads)

    def hooks(thread: int) -> None:
        start.wait()
        for i in range(calls):
            handoff.call(record, thread, i)

    # Switch threads as often as the interpreter allows, so hooks interleave with the drain at
    # every point, between the drain clearing its flag and taking the queue included.
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        workers = [threading.Thread(target=hooks, args=(t,)) for t in range(threads)]
        for w in workers:
            w.start()
        await _until(lambda: not any(w.is_alive() for w in workers))
    finally:
        sys.setswitchinterval(interval)
    await _until(lambda: len(ran) >= threads * calls)  # nothing is left undrained
    await asyncio.sleep(0.01)
    assert len(ran) == threads * calls  # and nothing runs twice
    for t in range(threads):
        assert [i for thread, i in ran if thread == t] == list(range(calls))
    assert counting.wakeups < threads * calls  # calls rode on pending wake-ups


async def test_a_burst_wakes_the_loop_once_and_runs_at_its_next_pass():
    loop = asyncio.get_running_loop()
    counting = _CountingLoop(loop)
    handoff = Handoff(counting)
    ran: list = []
    for i in range(5):  # the loop does not run between these: one burst
        handoff.call(ran.append, i)
    assert counting.wakeups == 1 and ran == []
    await asyncio.sleep(0)  # the loop's next pass
    assert ran == [0, 1, 2, 3, 4]
    handoff.call(ran.append, 5)  # the drain cleared the flag: a new call wakes the loop again
    assert counting.wakeups == 2
    handoff.drain()  # (the trainer drains after the backward: what is queued runs now)
    assert ran == [0, 1, 2, 3, 4, 5]
    await asyncio.sleep(0)
    assert ran == [0, 1, 2, 3, 4, 5]


async def test_a_failing_call_is_reported_and_the_rest_still_run():
    loop = asyncio.get_running_loop()
    reported: list = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda loop, context: reported.append(context))
    try:
        handoff = Handoff(loop)
        ran: list = []
        handoff.call(lambda: 1 / 0)
        handoff.call(ran.append, "after")
        await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(previous)
    assert ran == ["after"]
    assert len(reported) == 1 and isinstance(reported[0]["exception"], ZeroDivisionError)


def test_a_closed_loop_refuses_the_call_and_a_later_one_still_tries():
    loop = asyncio.new_event_loop()
    loop.close()
    handoff = Handoff(loop)
    for _ in range(2):
        with pytest.raises(RuntimeError):
            handoff.call(print)
