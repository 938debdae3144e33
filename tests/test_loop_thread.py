"""``net.loop.LoopThread``: the trainer's event loop on a thread of its own, driven from the caller's."""

from __future__ import annotations

import asyncio
import threading

import pytest

from poseidon_aio.net.loop import LoopThread, is_uvloop


async def test_a_coroutine_runs_on_the_thread_s_loop_of_the_caller_s_kind_and_returns_its_result():
    thread = LoopThread()
    try:

        async def where():
            loop = asyncio.get_running_loop()
            return threading.current_thread().name, is_uvloop(loop), loop.get_debug()

        caller = asyncio.get_running_loop()
        assert await thread.run(where()) == ("poseidon-loop", is_uvloop(caller), caller.get_debug())
    finally:
        await thread.close()
    assert thread.loop.is_closed()


async def test_init_runs_on_the_thread_before_any_coroutine():
    ran = []
    thread = LoopThread(init=lambda: ran.append(threading.current_thread().name))
    try:

        async def seen():
            return list(ran)

        assert await thread.run(seen()) == ["poseidon-loop"]
    finally:
        await thread.close()


async def test_an_exception_there_is_raised_here():
    thread = LoopThread()
    try:

        async def fails():
            raise KeyError("layer fc1")

        with pytest.raises(KeyError, match="layer fc1"):
            await thread.run(fails())
    finally:
        await thread.close()


async def test_cancelling_the_wait_cancels_the_coroutine_there_and_returns_once_it_has_unwound():
    thread = LoopThread()
    started, unwound = threading.Event(), []
    try:

        async def long():
            started.set()
            try:
                await asyncio.sleep(3600)
            finally:
                await asyncio.sleep(0.05)  # cleanup that itself awaits
                unwound.append(True)

        waiter = asyncio.ensure_future(thread.run(long()))
        await asyncio.get_running_loop().run_in_executor(None, started.wait)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert unwound == [True]  # (the caller's next step never races the cleanup)
    finally:
        await thread.close()


async def test_close_cancels_what_still_runs_there_and_ends_the_thread():
    thread = LoopThread()
    cancelled = []

    async def forever():
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    await thread.run(_spawn(forever))
    await thread.close()
    assert cancelled == [True]
    assert not thread._thread.is_alive()


async def _spawn(fn):
    asyncio.ensure_future(fn())
    await asyncio.sleep(0)
