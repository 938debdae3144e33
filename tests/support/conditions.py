"""Waiting on state in tests: poll a condition with a generous bound, never sleep a fixed time."""

from __future__ import annotations

import asyncio
from typing import Callable


async def until(predicate: Callable[[], bool], *, timeout: float = 30.0, what: str = "the condition") -> None:
    """Return once ``predicate()`` holds; fail the test if it does not within ``timeout`` seconds.

    The bound is generous on purpose: on a loaded machine a step that takes milliseconds can take
    seconds, and a test must not fail for that; only a condition that never comes should fail it.
    """
    try:
        async with asyncio.timeout(timeout):
            while not predicate():
                await asyncio.sleep(0.01)
    except TimeoutError:
        raise AssertionError(f"{what} did not happen within {timeout} s") from None
