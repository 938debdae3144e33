"""Shared test machinery.

* ``codec``: every codec test runs against both twins (aiohttp's PARSERS pattern). Where the
  compiled codec did not build, its cases skip and say why.
* Every async test runs twice, on asyncio's own loop and on uvloop, through pytest-asyncio's loop
  factory hook; each loop records calls to its exception handler and the test fails if there was
  one (asyncpg's rule: an exception nobody retrieved is a bug).
* pytest-timeout bounds every test (pyproject: 120 s), and async tests add their own tighter
  ``asyncio.timeout`` around each wait on another process.
"""

from __future__ import annotations

import asyncio

import pytest

from poseidon_aio.wire import CODECS

try:
    import uvloop
except ImportError:  # pragma: no cover - platforms without uvloop
    uvloop = None

_handler_calls: list = []


def _recording_loop(factory):
    def make():
        loop = factory()

        def handler(loop, context):
            _handler_calls.append(context)
            loop.default_exception_handler(context)

        loop.set_exception_handler(handler)
        return loop

    return make


@pytest.hookimpl(optionalhook=True)  # pytest-asyncio's hook: unknown where it is not installed
def pytest_asyncio_loop_factories(config, item):
    factories = {"asyncio": _recording_loop(asyncio.new_event_loop)}
    if uvloop is not None:
        factories["uvloop"] = _recording_loop(uvloop.new_event_loop)
    return factories


@pytest.fixture(autouse=True)
def _no_unhandled_loop_errors():
    _handler_calls.clear()
    yield
    calls = list(_handler_calls)
    _handler_calls.clear()
    assert not calls, f"the event loop's exception handler was called: {calls}"


@pytest.fixture(scope="session", params=["python", "cython"])
def codec(request):
    if request.param not in CODECS:
        pytest.skip("the compiled codec is not built (no compiler, or POSEIDON_NO_EXTENSIONS=1)")
    return CODECS[request.param]


def pytest_report_header(config):
    from poseidon_aio.net import LOOP
    from poseidon_aio.net.core import RECEIVE_CORE
    from poseidon_aio.wire import CODEC

    return f"poseidon_aio: codec {CODEC}, receive core {RECEIVE_CORE}, default loop {LOOP}"
