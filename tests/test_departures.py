"""A step's guard against peers that have finished: WorkerLeft the moment one that finished before
the step says so, the step's own work cancelled; the work's result where none did."""

from __future__ import annotations

import asyncio
import json
import types
import warnings

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from poseidon_aio.cluster.departures import FINISHED_KEY, Departures
from poseidon_aio.errors import WorkerLeft
from poseidon_aio.wire import Kind

from .support.memtransport import run_async


class Link:
    """A peer's mesh link as Departures uses it: its expected control frames, set by the test."""

    def __init__(self) -> None:
        self.expected: dict = {}

    def expect(self, kind, key, clock):
        assert kind is Kind.CONTROL and clock == 0
        self.expected[key] = asyncio.get_running_loop().create_future()
        return self.expected[key]

    def finish(self, steps: int) -> None:
        payload = json.dumps({"steps": steps}).encode()
        self.expected[FINISHED_KEY].set_result(types.SimpleNamespace(payload=payload))


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    finished=st.lists(st.one_of(st.none(), st.integers(0, 6)), min_size=1, max_size=4),
    step=st.integers(0, 5),
    told_before=st.booleans(),
)
def test_a_guarded_step_fails_at_once_exactly_when_a_peer_finished_before_it(finished, step, told_before):
    async def main():
        links = {q + 1: Link() for q in range(len(finished))}
        departures = Departures(0, links)
        cleaned, release = [], asyncio.Event()

        async def work():
            try:
                await release.wait()  # the step's syncs, in flight until every peer has spoken
                return "synced"
            except asyncio.CancelledError:
                cleaned.append(True)
                raise

        def tell():
            for q, steps in enumerate(finished, start=1):
                if steps is not None:
                    links[q].finish(steps)

        if told_before:
            tell()
            await asyncio.sleep(0)  # the notices' callbacks
        guarded = asyncio.ensure_future(departures.guard(work(), step))
        await asyncio.sleep(0)
        if not told_before:
            tell()
            await asyncio.sleep(0)
        await asyncio.sleep(0)
        release.set()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a coroutine closed unawaited would warn
            try:
                return await asyncio.wait_for(guarded, 5), cleaned, departures
            except WorkerLeft as left:
                return left, cleaned, departures

    got, cleaned, departures = run_async(main())
    early = [q for q, n in enumerate(finished, start=1) if n is not None and n <= step]
    if not early:
        assert got == "synced" and not cleaned
        return
    assert isinstance(got, WorkerLeft), got
    named = int(str(got).split()[1])
    assert named in early and f"rank 0 is at step {step + 1}" in str(got)
    if told_before:
        assert named == min(early) and not cleaned  # refused before the work began
    else:
        assert cleaned == [True]  # the work was cancelled where it waited, not left running
    assert not departures._listeners  # the guard's listener is gone with it


def test_cancelling_a_guarded_step_cancels_it_and_is_not_a_departure():
    async def main():
        links = {1: Link()}
        departures = Departures(0, links)
        guarded = asyncio.ensure_future(departures.guard(asyncio.sleep(60), 3))
        await asyncio.sleep(0)
        links[1].finish(2)  # the departure and the caller's cancel, in one pass of the loop
        guarded.cancel()
        with pytest.raises(asyncio.CancelledError):
            await guarded
        assert not departures._listeners

    run_async(main())
