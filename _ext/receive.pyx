# cython: language_level=3, boundscheck=False, wraparound=False
"""Compiled twin of ``poseidon_aio/net/receive.py``: same contract, same errors, same messages.

Per read (``get_buffer``, ``buffer_updated``) and per frame, the common path runs in C: the
decoder's methods are C calls, each header's destination is looked up in the expectations from
the decoder's own C hook, the counters and the time of the last read are C fields, and an
expected frame completes its future here. Python is called for what is rare or policy: handshake
and control frames, the handler and the inbox, the handler's ``limit``/``allocate`` hooks, ingress
shaping, a change of the socket's receive mark, and errors. A :class:`Landing` is completed by a
C call, and its callback is the first Python the frame meets.
"""

from posix.time cimport CLOCK_MONOTONIC, clock_gettime, timespec

from poseidon_aio.wire._ccodec cimport FrameDecoder

from poseidon_aio.net.receive import (
    LINK_KINDS, SINK_SIZE, decode_failure, over_budget, unclaimed_too_large,
)
from poseidon_aio.net.sockopts import LOWAT_MAX, LOWAT_MIN
from poseidon_aio.wire.layout import Kind

cdef object _HEARTBEAT = Kind.HEARTBEAT
cdef frozenset _LINK_KINDS = LINK_KINDS
cdef Py_ssize_t _LOWAT_MIN = LOWAT_MIN
cdef Py_ssize_t _LOWAT_MAX = LOWAT_MAX


cdef inline double _monotonic() noexcept nogil:
    # time.monotonic()'s clock, without building a float object through a Python call.
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return <double>ts.tv_sec + <double>ts.tv_nsec * 1e-9


cdef class ReceiveCore:
    """Compiled receive core (see the pure-Python twin for the contract).

    The fields the receive path reads per frame are C fields here, Endpoint's expectations,
    handler and inbox size included; Endpoint's Python methods reach the same fields as
    attributes.
    """

    cdef public object _exc
    cdef public dict _expected
    cdef public object _landing
    cdef public object _handler
    cdef public object _handler_kinds
    cdef public object _allocate_unclaimed
    cdef public object _limit_unclaimed
    cdef public Py_ssize_t _inbox_bytes
    cdef public bint _handshaken
    cdef public double _last_recv
    cdef public Py_ssize_t _memory_budget
    cdef public unsigned long long _bytes_received
    cdef public unsigned long long _frames_received
    cdef public list _ingress
    cdef public object _lowat_sock
    cdef public Py_ssize_t _lowat
    cdef public object _sink
    cdef readonly FrameDecoder _decoder

    def _init_receive(self, *, max_payload, memory_budget):
        """Set up the receive state; ``max_payload`` holds until the handshake raises it."""
        cdef _LinkDecoder decoder = _LinkDecoder(max_payload=max_payload)
        decoder.core = self
        self._decoder = decoder
        self._memory_budget = memory_budget
        self._handshaken = False
        self._bytes_received = 0
        self._frames_received = 0
        self._last_recv = _monotonic()
        self._ingress = []
        self._lowat_sock = None
        self._lowat = 1
        self._sink = None

    # -- what the loop calls ----------------------------------------------------------------

    def get_buffer(self, Py_ssize_t sizehint):
        if self._exc is not None:
            if self._sink is None:
                self._sink = memoryview(bytearray(SINK_SIZE))
            return self._sink
        return self._decoder.get_buffer(sizehint)

    def buffer_updated(self, Py_ssize_t nbytes):
        cdef FrameDecoder decoder = self._decoder
        if self._exc is not None:
            return  # read into the sink: the link has ended
        decoder.buffer_updated(nbytes)
        self._bytes_received += nbytes
        self._last_recv = _monotonic()
        if self._ingress:
            self._shape_ingress(nbytes)
        try:
            while self._exc is None:
                frame = decoder.next_frame()
                if frame is None:
                    break
                self._frames_received += 1
                self._on_frame(frame)
        except Exception as exc:
            if self._exc is None:  # else _destination ended the link already, saying why
                self._fail(*decode_failure(self, exc))
            return
        if self._lowat_sock is not None:
            self._tune_lowat()
        self._check_budget()

    # -- per header and per frame -----------------------------------------------------------

    cdef object _destination(self, header):
        cdef object entry, into, dest = None
        if not self._handshaken:
            return None
        try:
            ident = (header.kind, header.key, header.clock)
            entry = self._expected.get(ident)
            self._landing = None
            if entry is not None:
                into = (<tuple>entry)[1]
                if into is not None and memoryview(into).nbytes == header.length:
                    self._landing = ident
                    dest = into
                # else: a wrong-sized `into` fails that future alone, when the frame is complete
            elif self._handler is not None and (
                self._limit_unclaimed is not None or self._allocate_unclaimed is not None
            ):
                dest = self._allocate(header)  # Endpoint's: the handler's hooks
            if dest is None and header.length > self._memory_budget:
                raise unclaimed_too_large(self, header)
        except Exception as exc:
            self._fail(exc, "error")
            raise
        return dest

    cdef _on_frame(self, frame):
        cdef object entry, fut, into
        if not self._handshaken:
            self._on_handshake_frame(frame)
            return
        header = frame.header
        kind = header.kind
        if kind is _HEARTBEAT:
            return
        if kind in _LINK_KINDS:
            self._on_control_frame(frame)
            return
        ident = (kind, header.key, header.clock)
        entry = self._expected.pop(ident, None)
        if entry is not None:
            fut, into = <tuple>entry
            landed = self._landing is not None and self._landing == ident
            self._landing = None
            if type(fut) is Landing:
                if (<Landing>fut)._done:
                    return
                if into is not None and not landed:
                    self._claimed_late(frame, fut, into)
                    return
                (<Landing>fut)._land(frame, None)
                return
            if fut.done():
                return
            if into is not None and not landed:
                self._claimed_late(frame, fut, into)
                return
            fut.set_result(frame)
            return
        if self._handler is not None and (self._handler_kinds is None or kind in self._handler_kinds):
            self._to_handler(frame)
            return
        self._to_inbox(frame)

    # -- per read ---------------------------------------------------------------------------

    cdef _tune_lowat(self):
        # See the twin: wake the loop for a large payload in steps of the receive mark.
        cdef FrameDecoder decoder = self._decoder
        cdef Py_ssize_t want = 0, lowat = 1
        if decoder._dest is not None and decoder._start == decoder._end:
            want = decoder._length - decoder._filled
        if want >= _LOWAT_MIN:
            lowat = want if want < _LOWAT_MAX else _LOWAT_MAX
        if lowat != self._lowat:
            self._set_lowat(lowat)

    cdef _check_budget(self):
        cdef FrameDecoder decoder = self._decoder
        cdef Py_ssize_t own = decoder._destcap if decoder._owned else 0
        if not own or self._exc is not None or self._inbox_bytes + own <= self._memory_budget:
            return
        self._fail(over_budget(self, own), "error")


cdef class _LinkDecoder(FrameDecoder):
    """The decoder of one core: it asks that core where each payload lands, by a C call."""

    cdef ReceiveCore core

    cdef object _destination_for(self, header):
        return self.core._destination(header)


cdef class Landing:
    """Compiled landing (see the pure-Python twin for the contract): the compiled core completes
    it by a C call."""

    cdef object _callback
    cdef object _tag
    cdef bint _done
    cdef bint _cancelled
    cdef object _exc
    cdef public object _link
    cdef public object _ident

    def __init__(self, callback, tag=None):
        self._callback = callback
        self._tag = tag

    cdef inline _land(self, frame, exc):
        self._done = True
        self._exc = exc
        self._callback(self._tag, frame, exc)

    def done(self):
        return self._done

    def cancelled(self):
        return self._cancelled

    def exception(self):
        return self._exc

    def set_result(self, frame):
        if not self._done:
            self._land(frame, None)

    def set_exception(self, exc):
        if not self._done:
            self._land(None, exc)

    def cancel(self):
        if self._done:
            return False
        self._done = self._cancelled = True
        if self._link is not None:
            self._link._forget(self._ident, self)
        return True
