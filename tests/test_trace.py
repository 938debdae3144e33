"""The trace's memory: nothing without a path, a bounded ring with one (issue 9, 2b)."""

import time

from poseidon_aio.plan.cost import Scheme
from poseidon_aio.train.trace import Span, TraceConfig, Tracer


def _steps(tracer: Tracer, n: int) -> None:
    for clock in range(n):
        now = time.perf_counter()
        spans = [Span(f"layer{i}", Scheme.PS, now, now, now) for i in range(3)]
        tracer.step(clock, now, now, spans, now, [("rebuild fc", now, now)])


def test_nothing_is_recorded_without_a_trace_path(monkeypatch):
    monkeypatch.delenv("POSEIDON_TRACE", raising=False)
    tracer = Tracer(TraceConfig())
    assert not tracer.on
    _steps(tracer, 1_000)
    assert len(tracer.events) == 0


def test_a_trace_keeps_its_newest_events_up_to_the_ring(tmp_path):
    tracer = Tracer(TraceConfig(str(tmp_path / "t.json"), ring=50))
    _steps(tracer, 1_000)
    assert len(tracer.events) == 50
    assert tracer.events[-1]["name"] == "rebuild fc" and tracer.events[-1]["args"]["clock"] == 999
