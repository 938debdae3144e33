"""Event loop selection: uvloop where the platform has it, asyncio's own loop otherwise."""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Any, Coroutine, TypeVar

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
