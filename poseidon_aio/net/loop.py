"""Event loop selection: uvloop where the platform has it, asyncio's own loop otherwise."""

from __future__ import annotations

import asyncio
from typing import Any, Coroutine, TypeVar

try:
    import uvloop
except ImportError:  # pragma: no cover - e.g. Windows
    uvloop = None

T = TypeVar("T")

LOOP = "uvloop" if uvloop is not None else "asyncio"


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A new uvloop loop if uvloop is installed, else a default asyncio loop."""
    return uvloop.new_event_loop() if uvloop is not None else asyncio.new_event_loop()


def run(main: Coroutine[Any, Any, T], *, debug: bool | None = None) -> T:
    """Run ``main`` to completion on a fresh uvloop (or asyncio) loop and return its result.

    >>> async def answer(): return 42
    >>> run(answer())
    42
    """
    with asyncio.Runner(loop_factory=new_event_loop, debug=debug) as runner:
        return runner.run(main)


def is_uvloop(loop: asyncio.AbstractEventLoop) -> bool:
    return type(loop).__module__.startswith("uvloop")
