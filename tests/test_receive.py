"""The receive cores (net/receive.py and its compiled twin): same deliveries, same errors.

Each core runs under a probe, an Endpoint that records what a Connection would do with the
core's calls, fed by hand as uvloop feeds a BufferedProtocol: no loop turns, no sockets. The
pure-Python core runs with both codecs' decoders; every other core must match it exactly.
"""

from __future__ import annotations

import asyncio
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from poseidon_aio.errors import RemoteProtocolError
from poseidon_aio.net.core import LANDINGS, RECEIVE_CORES
from poseidon_aio.net.endpoint import Endpoint
from poseidon_aio.net.sockopts import LOWAT_MAX, LOWAT_MIN
from poseidon_aio.wire import CODECS, Kind, encode_frame, encode_header

MAX_PAYLOAD = 4096
BUDGET = 2500
WHERE = "rank 0 at probe"


def _probe_class(core):
    class Probe(core, Endpoint):
        where = WHERE

        def __init__(self, loop, decoder=None, *, handshaken=True, lowat=False, ingress=False, max_payload=MAX_PAYLOAD):
            self._init_endpoint(loop, 1, inbox_high_water=1 << 20)
            extra = {} if decoder is None else {"decoder": decoder}
            self._init_receive(max_payload=max_payload, memory_budget=BUDGET, **extra)
            self._handshaken = handshaken
            self.events: list = []
            if lowat:
                self._lowat_sock = object()
            if ingress:
                self._ingress = ["bucket"]

        def _on_handshake_frame(self, frame):
            self.events.append(("handshake", frame.kind.name, bytes(frame.payload)))

        def _on_control_frame(self, frame):
            self.events.append(("control", frame.kind.name))

        def _shape_ingress(self, nbytes):
            self.events.append(("ingress", nbytes))

        def _set_lowat(self, value):
            self.events.append(("lowat", value))
            self._lowat = value

        def _fail(self, exc, how, cause=None):
            if self._exc is not None:
                return
            self._exc = exc
            self.events.append(("fail", type(exc).__name__, str(exc), how, type(cause).__name__))
            self._fail_waiters()

    Probe.__name__ = f"Probe[{core.__module__}]"
    return Probe


def _cores() -> dict:
    """Every core and decoder pairing, the pure-Python pair first (the reference)."""
    twin = _probe_class(RECEIVE_CORES["python"])
    cores = {"python/python": lambda loop, **kw: twin(loop, CODECS["python"].FrameDecoder, **kw)}
    if "cython" in CODECS:
        cores["python/cython"] = lambda loop, **kw: twin(loop, CODECS["cython"].FrameDecoder, **kw)
    if "cython" in RECEIVE_CORES:
        compiled = _probe_class(RECEIVE_CORES["cython"])
        cores["cython/cython"] = lambda loop, **kw: compiled(loop, **kw)
    return cores


CORES = _cores()
# The Landing each core completes: its own twin's.
LANDING_OF = {name: LANDINGS[name.split("/")[0]] for name in CORES}


def _feed(probe, stream: bytes, chunks: list) -> None:
    """Hand ``stream`` to the probe as the loop would: get_buffer, write, buffer_updated."""
    offset, i = 0, 0
    while offset < len(stream):
        want = chunks[i % len(chunks)]
        i += 1
        buf = probe.get_buffer(-1)
        n = min(len(buf), want, len(stream) - offset)
        buf[:n] = stream[offset : offset + n]
        probe.buffer_updated(n)
        offset += n


def _outcome(fut) -> tuple:
    if not fut.done():
        return ("pending",)
    if fut.exception() is not None:
        return ("error", type(fut.exception()).__name__, str(fut.exception()))
    frame = fut.result()
    return ("frame", frame.header, bytes(frame.payload))


def _landed(calls: list) -> tuple:
    """A landing's outcome as ``_outcome`` words a future's: it is called back at most once."""
    assert len(calls) <= 1, calls
    if not calls:
        return ("pending",)
    frame, exc = calls[0]
    if exc is not None:
        return ("error", type(exc).__name__, str(exc))
    return ("frame", frame.header, bytes(frame.payload))


def _frame_bytes(item) -> bytes:
    kind, key, clock, size, crc, shape = item
    if shape == "oversize":  # a header announcing more than max_payload, and nothing after it
        return encode_header(kind, rank=0, key=key, clock=clock, length=MAX_PAYLOAD + 8, payload_crc=0)
    payload = bytes((key * 31 + clock * 7 + i) & 0xFF for i in range(size))
    data = bytearray(encode_frame(kind, payload, rank=0, key=key, clock=clock, checksum=crc))
    if shape == "bad-crc" and size:
        data[-1] ^= 0x01
    elif shape == "bad-header":
        data[20] ^= 0x10
    return bytes(data)


_items = st.tuples(
    st.sampled_from([Kind.DATA, Kind.PUSH, Kind.PUSH, Kind.HEARTBEAT, Kind.GOODBYE]),
    st.integers(0, 2),
    st.integers(0, 2),
    st.integers(0, 3000),
    st.booleans(),
    st.sampled_from(["ok"] * 12 + ["bad-crc", "bad-header", "oversize"]),
)
# Which frames of the stream are expected (by index, so that most expectations meet their frame),
# with what (no buffer, one of the payload's size, or one of the wrong size), and whether by a
# future or a Landing.
_expectations = st.lists(
    st.tuples(st.integers(0, 9), st.sampled_from(["none", "right", "wrong"]), st.booleans()), max_size=6
)


def _run(make, items, expectations, handler_mode, chunks, lowat, ingress, landing_class=None) -> dict:
    loop = asyncio.new_event_loop()
    try:
        probe = make(loop, lowat=lowat, ingress=ingress)
        futures, intos, seen = [], [], set()
        for index, mode, by_landing in expectations:
            kind, key, clock, size, _, _ = items[index % len(items)]
            if (kind, key, clock) in seen or kind not in (Kind.DATA, Kind.PUSH):
                continue
            seen.add((kind, key, clock))
            into = None if mode == "none" else bytearray(size if mode == "right" else size + 1)
            intos.append(into)
            if by_landing and landing_class is not None:
                calls: list = []
                probe.expect(kind, key, clock, into=into, landing=landing_class(_record, calls))
                futures.append(calls)  # the loop never runs here: a landing is called back at once
            else:
                futures.append(probe.expect(kind, key, clock, into=into))
        handled = []
        if handler_mode != "off":

            def handler(frame):
                handled.append((frame.header, bytes(frame.payload)))
                if frame.key == 2 and frame.clock == 2:
                    raise RemoteProtocolError(f"rank 1 refuses {frame.kind.name} key 2 clock 2")

            def allocate(header):
                return bytearray(header.length) if header.key % 2 else None

            def limit(header):
                return 2000 if header.key == 0 else None

            probe.set_handler(
                handler,
                allocate=allocate if handler_mode == "hooks" else None,
                limit=limit if handler_mode == "hooks" else None,
                kinds=[Kind.PUSH],
            )
        _feed(probe, b"".join(_frame_bytes(item) for item in items), chunks)
        return {
            "futures": [_landed(f) if isinstance(f, list) else _outcome(f) for f in futures],
            "intos": [None if into is None else bytes(into) for into in intos],
            "handled": handled,
            "inbox": [(f.header, bytes(f.payload)) for f in probe._inbox],
            "inbox_bytes": probe._inbox_bytes,
            "events": probe.events,
            "counters": (probe._bytes_received, probe._frames_received),
            "error": None if probe.error is None else str(probe.error),
        }
    finally:
        loop.close()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    items=st.lists(_items, min_size=1, max_size=10),
    expectations=_expectations,
    handler_mode=st.sampled_from(["off", "plain", "hooks"]),
    chunks=st.lists(st.sampled_from([1, 3, 44, 45, 500, 4096, 65536]), min_size=1, max_size=5),
    lowat=st.booleans(),
    ingress=st.booleans(),
)
def test_every_core_delivers_what_the_pure_python_core_delivers(
    items, expectations, handler_mode, chunks, lowat, ingress
):
    """Futures and landings, into buffers, handler calls, inbox, control frames and the one-line
    error: equal."""
    results = {
        name: _run(make, items, expectations, handler_mode, chunks, lowat, ingress, LANDING_OF[name])
        for name, make in CORES.items()
    }
    reference = results.pop("python/python")
    for name, result in results.items():
        assert result == reference, name


def _record(calls: list, frame, exc) -> None:
    calls.append((frame, exc))


@pytest.mark.parametrize("name", sorted(CORES))
def test_a_landing_is_called_back_on_the_receive_path_once_and_a_cancelled_one_never(name):
    loop = asyncio.new_event_loop()
    try:
        probe, landing_class = CORES[name](loop), LANDING_OF[name]
        landed, cancelled, early, lost = [], [], [], []
        into = bytearray(4)
        first = probe.expect(Kind.PUSH, 1, 1, into=into, landing=landing_class(_record, landed))
        gone = probe.expect(Kind.PUSH, 2, 1, landing=landing_class(_record, cancelled))
        assert gone.cancel() and not gone.cancel() and gone.cancelled() and gone.done()
        _feed(
            probe,
            encode_frame(Kind.PUSH, b"abcd", key=1, clock=1) + encode_frame(Kind.PUSH, b"xy", key=2, clock=1),
            [3],
        )
        (frame, exc), *more = landed  # within buffer_updated: the loop never ran
        assert not more and exc is None and frame.payload.obj is into and into == b"abcd" and first.done()
        assert cancelled == [] and [bytes(f.payload) for f in probe._inbox] == [b"xy"]  # as unexpected
        probe.expect(Kind.PUSH, 2, 1, landing=landing_class(_record, early))  # in the inbox: at once
        assert [bytes(f.payload) for f, _ in early] == [b"xy"] and not probe._inbox
        waiting = probe.expect(Kind.PUSH, 3, 1, landing=landing_class(_record, lost))
        probe._fail(RemoteProtocolError("rank 0 said stop"), "error")
        [(none, exc)] = lost
        assert none is None and type(exc).__name__ == "ConnectionLost" and waiting.exception() is exc
        assert not probe._expected
    finally:
        loop.close()


@pytest.mark.parametrize("name", sorted(CORES))
@pytest.mark.parametrize(
    "shape,match",
    [
        ("bad-header", r"^header checksum mismatch .*; from rank 0 at probe, closing that connection$"),
        ("bad-crc", r"^payload checksum mismatch in PUSH key 1 clock 2 from rank 0 .*closing that connection$"),
        ("oversize", r"^payload of 4104 bytes exceeds the maximum of 4096 .*closing that connection$"),
    ],
)
def test_bad_input_ends_the_link_with_one_line_naming_the_frame(name, shape, match):
    loop = asyncio.new_event_loop()
    try:
        probe = CORES[name](loop)
        waiting = probe.expect(Kind.PUSH, 9, 9)
        _feed(probe, _frame_bytes((Kind.PUSH, 1, 2, 64, True, shape)), [7])
        kind, error_type, text, how, cause = probe.events[-1]
        assert (kind, error_type, how, cause) == ("fail", "FrameError", "error", "FrameError")
        assert "\n" not in text
        assert re.match(match, text), text
        assert "ConnectionLost" in _outcome(waiting)[1]
        probe.get_buffer(100)[:3] = b"xyz"  # later bytes go to the sink, and nothing happens
        probe.buffer_updated(3)
        assert probe.events[-1][0] == "fail"
    finally:
        loop.close()


@pytest.mark.parametrize("name", sorted(CORES))
def test_a_large_payload_moves_the_receive_mark_only_when_it_changes(name):
    loop = asyncio.new_event_loop()
    try:
        probe = CORES[name](loop, lowat=True, max_payload=1 << 22)
        size = 3 * LOWAT_MAX + 4
        into = bytearray(size)
        fut = probe.expect(Kind.PUSH, 1, 1, into=into)
        _feed(probe, encode_frame(Kind.PUSH, bytes(range(256)) * (size // 256) + b"tail", key=1, clock=1), [65536])
        marks = [value for kind, value, *_ in probe.events if kind == "lowat"]
        assert marks[0] == LOWAT_MAX and marks[-1] == 1 and len(marks) == len(set(zip(marks, marks[1:]))) + 1
        assert all(value == 1 or LOWAT_MIN <= value <= LOWAT_MAX for value in marks)
        assert fut.result().payload.obj is into and into.endswith(b"tail")
    finally:
        loop.close()


@pytest.mark.parametrize("name", sorted(CORES))
def test_before_the_handshake_every_frame_goes_to_the_handshake_and_lands_nowhere(name):
    loop = asyncio.new_event_loop()
    try:
        probe = CORES[name](loop, handshaken=False)
        into = bytearray(3)
        fut = probe.expect(Kind.PUSH, 0, 0, into=into)
        _feed(probe, encode_frame(Kind.PUSH, b"abc") + encode_frame(Kind.HELLO, b"{}"), [5])
        assert probe.events == [("handshake", "PUSH", b"abc"), ("handshake", "HELLO", b"{}")]
        assert not fut.done() and into == bytearray(3)
    finally:
        loop.close()


def test_a_connection_is_built_on_the_compiled_core_wherever_the_compiled_codec_runs():
    from poseidon_aio.net.connection import Connection
    from poseidon_aio.net.core import RECEIVE_CORE
    from poseidon_aio.wire import CODEC

    assert issubclass(Connection, RECEIVE_CORES[RECEIVE_CORE])
    assert (RECEIVE_CORE == "cython") == (CODEC == "cython" and "cython" in RECEIVE_CORES)
