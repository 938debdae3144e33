"""A connection's receive core in pure Python: the reference and the fallback.

Per read the event loop calls ``get_buffer`` and ``buffer_updated``. The core drives the
:class:`~poseidon_aio.wire.FrameDecoder`, counts bytes and frames, notes when bytes last came,
judges each header as it arrives (where its payload lands, whether it fits the memory budget),
follows a large payload with the socket's receive mark, and hands each complete frame to the
future (or :class:`Landing`) that expects it. The compiled twin in ``_ext/receive.pyx``
(``poseidon_aio.net._creceive``) has the same contract, the same errors and one shared test suite;
it does this work in C and calls Python only for what is rare or policy.
:mod:`poseidon_aio.net.core` picks one.

A class built on a core (:class:`~poseidon_aio.net.connection.Connection`) is also an
:class:`~poseidon_aio.net.endpoint.Endpoint`, whose ``_allocate``, ``_to_handler``, ``_to_inbox``,
``_claimed_late`` and ``_fail`` the core calls, and provides:

* ``_on_handshake_frame(frame)``: each frame until ``_handshaken`` is set;
* ``_on_control_frame(frame)``: GOODBYE, ERROR, or a handshake kind after the handshake
  (a HEARTBEAT ends at the core: its bytes already kept the link alive);
* ``_shape_ingress(nbytes)``: each read, only while ``_ingress`` holds token buckets;
* ``_set_lowat(value)``: only while ``_lowat_sock`` is set, and only when the wanted receive mark
  changes;
* ``where`` and ``rank``, for messages.
"""

from __future__ import annotations

import time

from ..errors import FrameError, PoseidonError
from ..wire import FrameDecoder, Header, Kind
from .sockopts import LOWAT_MAX, LOWAT_MIN

# Where bytes still arriving on a link that has ended are read to and dropped: never buffered.
SINK_SIZE = 64 * 1024
# Frames of the link's own protocol that the layer above decides on; HEARTBEAT needs no one.
LINK_KINDS = frozenset({Kind.HELLO, Kind.CHALLENGE, Kind.AUTH, Kind.WELCOME, Kind.GOODBYE, Kind.ERROR})


class ReceiveCore:
    """Pure-Python receive core (see the module's docstring for what a subclass provides)."""

    def _init_receive(self, *, max_payload: int, memory_budget: int, decoder=FrameDecoder) -> None:
        """Set up the receive state; ``max_payload`` holds until the handshake raises it.

        ``decoder``: the active codec's ``FrameDecoder`` class, or the other's (tests run both).
        """
        self._decoder = decoder(max_payload=max_payload, allocate=self._destination)
        self._memory_budget = memory_budget
        self._handshaken = False
        self._bytes_received = 0
        self._frames_received = 0
        #: ``time.monotonic()`` of the last read (the heartbeat tick's idle timeout reads it).
        self._last_recv = time.monotonic()
        self._ingress: list = []
        self._lowat_sock = None
        self._lowat = 1
        self._sink = None

    # -- what the loop calls ----------------------------------------------------------------

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._exc is not None:
            if self._sink is None:
                self._sink = memoryview(bytearray(SINK_SIZE))
            return self._sink
        return self._decoder.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        if self._exc is not None:
            return  # read into the sink: the link has ended
        decoder = self._decoder
        decoder.buffer_updated(nbytes)
        self._bytes_received += nbytes
        self._last_recv = time.monotonic()
        if self._ingress:
            self._shape_ingress(nbytes)
        try:
            while self._exc is None and (frame := decoder.next_frame()) is not None:
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

    def _destination(self, header: Header):
        if not self._handshaken:
            return None
        try:
            dest = self._allocate(header)
            if dest is None and header.length > self._memory_budget:
                raise unclaimed_too_large(self, header)
        except Exception as exc:  # noqa: BLE001 - the layer above refused the header: end this link only
            self._fail(exc, "error")
            raise
        return dest

    def _on_frame(self, frame) -> None:
        if not self._handshaken:
            self._on_handshake_frame(frame)
            return
        kind = frame.header.kind
        if kind is Kind.HEARTBEAT:
            return
        if kind in LINK_KINDS:
            self._on_control_frame(frame)
            return
        self._dispatch(frame)

    # -- per read ---------------------------------------------------------------------------

    def _tune_lowat(self) -> None:
        """Wake the loop for a large payload in 256 KiB steps, not at every segment: the kernel
        reports the socket readable once ``SO_RCVLOWAT`` bytes are in (or at EOF or an error).
        A payload's bytes are of no use before the last of them, and each wake-up is a pass of
        the loop and a ``buffer_updated`` with the GIL held. Never above what the payload still
        needs, so the frame's last bytes always wake us."""
        want = self._decoder.payload_remaining
        lowat = min(want, LOWAT_MAX) if want >= LOWAT_MIN else 1
        if lowat != self._lowat:
            self._set_lowat(lowat)

    def _check_budget(self) -> None:
        # Only a payload the decoder buffers itself grows with what the peer sends; the inbox
        # alone stops growing at inbox_high_water (reading pauses), which is within the budget.
        own = self._decoder.own_payload_bytes
        if not own or self._exc is not None or self._inbox_bytes + own <= self._memory_budget:
            return
        self._fail(over_budget(self, own), "error")


class Landing:
    """An expectation that calls back on the receive path itself: no future, no pass of the loop.

    :meth:`Endpoint.expect <poseidon_aio.net.endpoint.Endpoint.expect>` takes one in place of the
    future it would make, and the receive path completes it as it would that future; then
    ``callback(tag, frame, None)`` runs at once (``callback(tag, None, error)`` where the link
    ends first), at most once. An all-reduce's chunk is summed and sent on from there, as gloo's
    C++ does, where a future would cost its callbacks a pass of the loop each. Where the frame is
    already in the inbox, the callback runs inside ``expect``. It must not raise: the receive path
    would end the link for it.
    """

    __slots__ = ("_callback", "_tag", "_done", "_cancelled", "_exc", "_link", "_ident")

    def __init__(self, callback, tag=None) -> None:
        self._callback = callback
        self._tag = tag
        self._done = False
        self._cancelled = False
        self._exc = None
        self._link = None  # where it is registered, set by expect(): cancel() takes it back
        self._ident = None

    def done(self) -> bool:
        return self._done

    def cancelled(self) -> bool:
        return self._cancelled

    def exception(self):
        return self._exc

    def set_result(self, frame) -> None:
        if not self._done:
            self._land(frame, None)

    def set_exception(self, exc: BaseException) -> None:
        if not self._done:
            self._land(None, exc)

    def _land(self, frame, exc) -> None:
        self._done = True
        self._exc = exc
        self._callback(self._tag, frame, exc)

    def cancel(self) -> bool:
        """Give it up without a call back; its frame, if it comes, goes where an unexpected one
        would."""
        if self._done:
            return False
        self._done = self._cancelled = True
        if self._link is not None:
            self._link._forget(self._ident, self)
        return True


# -- the errors both cores raise ---------------------------------------------------------------


def decode_failure(link, exc: BaseException) -> tuple:
    """``(error, how, cause)`` for :meth:`_fail` when decoding raised ``exc``; re-raises a bug."""
    if isinstance(exc, FrameError):
        return type(exc)(f"{exc}; from {link.where}, closing that connection"), "error", exc
    if isinstance(exc, PoseidonError):
        return exc, "abort", None
    raise exc


def unclaimed_too_large(link, header: Header) -> FrameError:
    """A header announcing more unclaimed payload than the memory budget allows."""
    budget = link._memory_budget
    return FrameError(
        f"{link.where} announced {header.kind.name} key {header.key} clock {header.clock} "
        f"with a {header.length}-byte payload that no buffer was registered for; rank "
        f"{link.rank} holds at most {budget} bytes of unclaimed frames per connection "
        "(NetConfig.memory_budget): register a destination for it (expect(into=...) or "
        "the allocate hook of set_handler), or raise NetConfig.memory_budget"
    )


def over_budget(link, own: int) -> FrameError:
    """The inbox plus the payload being buffered passed the memory budget."""
    header, got = link._decoder.partial
    budget = link._memory_budget
    return FrameError(
        f"{link.where} sent more unclaimed data than rank {link.rank} holds per connection "
        f"(NetConfig.memory_budget, {budget} bytes): {link._inbox_bytes} "
        f"bytes of frames nobody has taken yet, plus {own} buffered for {header.kind.name} key "
        f"{header.key} clock {header.clock} ({got} of {header.length} bytes received); take "
        "frames sooner (recv/expect), register destinations for large ones, or raise "
        "NetConfig.memory_budget"
    )
