"""A fault-injecting TCP proxy for adversity tests (asyncpg keeps one; this is ours).

Put it between a worker and a parameter-server shard: it forwards bytes both ways, except at the
points a :class:`FaultPlan` names, where it delays, drops, truncates, duplicates, resets or flips
a bit.

Two layers, as in the library:

* :class:`FaultStream` is sans-IO: one direction's bytes in, :class:`Forward`, :class:`Hold` and
  :class:`Cut` actions out. It follows the frame boundaries of the original stream (the length
  field of the 44-byte wire header), so a fault can name "the 3rd PUSH frame", whole or from a
  byte inside it.
* :class:`FaultProxy` is the asyncio adapter: a listener that dials the target for every
  connection it accepts and pumps each direction through its own :class:`FaultStream`.

Faults are placed on frames, not on times, so a plan hits the same bytes on every run whatever the
machine's load; only what the endpoints then make of it may depend on timing.
"""

from __future__ import annotations

import asyncio
import enum
import heapq
import random
import socket
import struct
from collections import Counter
from dataclasses import dataclass, field, fields
from typing import Optional, Sequence

from poseidon_aio.errors import FrameError
from poseidon_aio.wire import HEADER_SIZE, Header, Kind, decode_header

# Frames whose payload is model data: a byte-level fault that garbles one of these may garble
# training results, where a garbled heartbeat or notice can only end the connection.
DATA_KINDS = frozenset({Kind.PUSH, Kind.AGGREGATE, Kind.PARAMS, Kind.FACTORS})
# Payloads are at most 1 GiB by default (wire.DEFAULT_MAX_PAYLOAD); the proxy only reads lengths,
# so it accepts anything up to the u64 field and never allocates by it.
_ANY_LENGTH = (1 << 64) - 1
_READ_BYTES = 64 * 1024


class Direction(enum.Enum):
    """Which way bytes flow through the proxy."""

    UP = "up"  # dialler -> target: a worker's HELLO, PULL, PUSH, heartbeats
    DOWN = "down"  # target -> dialler: a shard's CHALLENGE, PARAMS/AGGREGATE, notices, heartbeats


class FaultKind(enum.Enum):
    DELAY = "delay"  # hold the stream for `seconds`, then forward everything in order
    DROP = "drop"  # discard `frames` whole frames, or `nbytes` bytes, or (neither) everything on
    TRUNCATE = "truncate"  # forward up to the point, then close both sides (FIN)
    DUPLICATE = "duplicate"  # forward `frames` whole frames or `nbytes` bytes, then the same again
    RESET = "reset"  # forward up to the point, then abort both sides with RST (SO_LINGER 0)
    FLIP = "flip"  # invert bit `bit` of the byte at the point, as a bad NIC, switch or RAM would


@dataclass(frozen=True)
class Fault:
    """One fault in one direction.

    It starts ``skew`` bytes after the first byte of the ``frame``-th frame (from 0) of kind
    ``frame_kind`` (of any kind when ``None``; heartbeats then count, and they depend on timing).
    A ``skew`` past that frame's end lands in whatever frames follow.

    Args:
        frames: DROP/DUPLICATE: this many whole frames of ``frame_kind`` (frames of other kinds
            in between pass untouched); needs ``skew == 0``.
        nbytes: DROP/DUPLICATE: this many bytes from the start point, whatever they belong to.
        seconds: DELAY: how long the stream is held.
        bit: FLIP: which bit (0 least significant) of the byte at the start point is inverted.

    A DROP with neither ``frames`` nor ``nbytes`` is a black hole: nothing more gets through in
    that direction, not even the end of the connection (a partitioned network loses FINs too).
    """

    kind: FaultKind
    direction: Direction
    frame: int = 0
    frame_kind: Optional[Kind] = None
    skew: int = 0
    frames: Optional[int] = None
    nbytes: Optional[int] = None
    seconds: float = 0.0
    bit: int = 0

    def __post_init__(self) -> None:
        if self.frame < 0 or self.skew < 0:
            raise ValueError(f"{self}: frame and skew must be >= 0")
        spans = (self.frames is not None) + (self.nbytes is not None)
        if any(v is not None and v < 1 for v in (self.frames, self.nbytes)):
            raise ValueError(f"{self}: frames and nbytes must be >= 1")
        if self.frames is not None and self.skew:
            raise ValueError(f"{self}: a span of whole frames must start on a frame boundary (skew 0)")
        if self.kind is FaultKind.DELAY and not self.seconds > 0:
            raise ValueError(f"{self}: a delay needs seconds > 0")
        if self.kind is FaultKind.DUPLICATE and spans != 1:
            raise ValueError(f"{self}: a duplicate needs exactly one of frames or nbytes")
        if self.kind is FaultKind.DROP and spans > 1:
            raise ValueError(f"{self}: a drop takes frames or nbytes, not both")
        if self.kind in (FaultKind.DELAY, FaultKind.TRUNCATE, FaultKind.RESET, FaultKind.FLIP) and spans:
            raise ValueError(f"{self}: only drops and duplicates span bytes or frames")
        if not 0 <= self.bit < 8:
            raise ValueError(f"{self}: bit must be 0..7")

    @property
    def mangles(self) -> bool:
        """True if it can leave a frame with other bytes than were sent: a flipped bit, or a
        dropped or repeated byte span that does not follow frame boundaries."""
        return self.kind is FaultKind.FLIP or (
            self.kind in (FaultKind.DROP, FaultKind.DUPLICATE) and self.nbytes is not None
        )

    @property
    def black_hole(self) -> bool:
        return self.kind is FaultKind.DROP and self.frames is None and self.nbytes is None

    def __str__(self) -> str:
        where = f"{self.frame_kind.name if self.frame_kind else 'frame'} #{self.frame}"
        if self.skew:
            where += f" +{self.skew} B"
        what = {
            FaultKind.DELAY: f"delay {self.seconds} s",
            FaultKind.TRUNCATE: "truncate",
            FaultKind.RESET: "reset",
            FaultKind.FLIP: f"flip bit {self.bit}",
        }.get(self.kind)
        if what is None:
            span = (
                "everything on"
                if self.black_hole
                else (f"{self.frames} frame(s)" if self.frames else f"{self.nbytes} B")
            )
            what = f"{self.kind.value} {span}"
        return f"{what} at {where} ({self.direction.value})"


@dataclass(frozen=True)
class FaultPlan:
    """The faults a proxy injects into each connection it forwards.

    Faults of one direction take effect in the order of their start points; one that falls due
    while a drop or duplicate span of its direction is open waits until that span closes.
    """

    faults: tuple = ()
    seed: Optional[int] = None  # set by random(), to name the plan in reports

    def of(self, direction: Direction) -> list:
        return [f for f in self.faults if f.direction is direction]

    @property
    def mangles(self) -> bool:
        return any(f.mangles for f in self.faults)

    @property
    def delays_only(self) -> bool:
        return all(f.kind is FaultKind.DELAY for f in self.faults)

    def __str__(self) -> str:
        body = "; ".join(map(str, self.faults)) or "no faults"
        return f"plan {self.seed}: {body}" if self.seed is not None else body

    @classmethod
    def random(
        cls,
        seed: int,
        targets: dict,
        *,
        count: tuple = (1, 3),
        max_delay: float = 0.5,
        kinds: Sequence[FaultKind] = tuple(FaultKind),
    ) -> "FaultPlan":
        """A plan drawn from ``random.Random(seed)``: the same seed gives the same plan.

        Args:
            targets: ``{Direction: (frame_kind, count, frame_bytes)}``: which frames of each
                direction faults may land in, how many of them a run sends, and their size
                (header included); skews stay inside those frames, and a flip inside a payload.
            count: least and most faults in the plan.
            max_delay: longest delay, in seconds.
            kinds: the fault kinds to draw from.
        """
        rng = random.Random(seed)
        drawn = []
        for _ in range(rng.randint(*count)):
            direction = rng.choice(sorted(targets, key=lambda d: d.value))
            frame_kind, count, frame_bytes = targets[direction]
            kind = rng.choice(list(kinds))
            whole = rng.random() < 0.5
            spec = dict(kind=kind, direction=direction, frame=rng.randrange(count), frame_kind=frame_kind)
            spec["skew"] = 0 if whole else rng.randrange(1, frame_bytes)
            if kind is FaultKind.FLIP:
                # In the payload; in the header where there is none (its own CRC-32 catches that).
                spec["skew"] = rng.randrange(HEADER_SIZE if frame_bytes > HEADER_SIZE else 0, frame_bytes)
                spec["bit"] = rng.randrange(8)
            elif kind is FaultKind.DELAY:
                spec["seconds"] = round(rng.uniform(0.05, max_delay), 2)
            elif kind is FaultKind.DUPLICATE or (kind is FaultKind.DROP and rng.random() < 0.75):
                if whole:
                    spec["frames"] = rng.randint(1, 2)
                else:
                    spec["nbytes"] = rng.randint(1, 64)
            drawn.append(Fault(**spec))
        return cls(tuple(drawn), seed)


# -- actions: what the I/O layer does with a direction's bytes ---------------------------------


@dataclass(frozen=True)
class Forward:
    data: bytes


@dataclass(frozen=True)
class Hold:
    seconds: float


@dataclass(frozen=True)
class Cut:
    reset: bool  # True: abort both sides with RST; False: close both (FIN)


@dataclass
class FaultCounters:
    """What a stream (or, summed, a proxy) did.

    ``corrupted`` is ``(kind, key, clock)`` of the first data frame a mangling fault may have
    altered: the one it started in, or else the next one (the receiver reads garbage from the
    fault on, so nothing after it can be trusted either).
    """

    bytes_in: int = 0
    bytes_out: int = 0
    bytes_dropped: int = 0
    bytes_duplicated: int = 0
    frames_seen: int = 0
    held_seconds: float = 0.0
    cuts: int = 0
    bits_flipped: int = 0
    fired: list = field(default_factory=list)
    unfired: list = field(default_factory=list)
    corrupted: Optional[tuple] = None

    def __add__(self, other: "FaultCounters") -> "FaultCounters":
        out = FaultCounters()
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if f.name == "corrupted":
                setattr(out, f.name, a if a is not None else b)
            else:
                setattr(out, f.name, a + b)
        return out


class _Span:
    __slots__ = ("fault", "end", "left", "recording")

    def __init__(self, fault: Fault, end: Optional[int]) -> None:
        self.fault = fault
        self.end = end  # byte offset where a byte span closes; None for frame spans and black holes
        self.left = fault.frames  # frames still to cover, for frame spans
        self.recording = bytearray()


class FaultStream:
    """One direction of a proxied connection, sans-IO: :meth:`feed` bytes, get actions.

    Bytes are forwarded as soon as the decision about them is known; at a frame boundary that
    means once the frame's 44-byte header is in (a sender writes its header and payload together,
    so this never waits on the sender).

    >>> s = FaultStream([Fault(FaultKind.DUPLICATE, Direction.UP, frame=0, frame_kind=Kind.PUSH, frames=1)])
    >>> # actions = s.feed(data); s.counters.bytes_duplicated
    """

    def __init__(self, faults: Sequence[Fault]) -> None:
        self.counters = FaultCounters()
        self.offset = 0  # bytes of the original stream consumed
        self._buf = bytearray()
        self._tracking = True  # False once the original stream stops parsing (never, between peers)
        self._frame: Optional[Header] = None
        self._frame_start = 0
        self._frame_end = 0
        self._seen_all = 0
        self._seen: Counter = Counter()
        self._armed = list(enumerate(faults))  # (plan order, fault) whose start frame has not come yet
        self._due: list = []  # heap of (start offset, plan order, fault)
        self._span: Optional[_Span] = None
        self._corrupt_next = False
        self._flip = 0  # XOR mask for the next byte emitted
        self._cut = False

    @property
    def black_holed(self) -> bool:
        return self._span is not None and self._span.fault.black_hole

    @property
    def cut(self) -> bool:
        return self._cut

    def feed(self, data: bytes) -> list:
        """Take the next bytes of the original stream; return the actions to perform, in order."""
        self.counters.bytes_in += len(data)
        if self._cut:
            return []  # nothing follows a truncation or a reset
        self._buf += data
        out: list = []
        while self._buf and not self._cut:
            if self._tracking and self.offset == self._frame_end:
                if len(self._buf) < HEADER_SIZE:
                    break
                self._enter_frame(bytes(self._buf[:HEADER_SIZE]))
            self._fire_due(out)
            if self._cut:
                break
            n = self._piece_length()
            piece = bytes(self._buf[:n])
            del self._buf[:n]
            self._emit(piece, out)
            self.offset += n
            self._close_span(out)
        return _coalesce(out)

    def finish(self) -> FaultCounters:
        """The counters, with the faults that never came due listed as unfired."""
        self.counters.unfired = [str(f) for _, f in self._armed] + [
            str(f) for _, _, f in sorted(self._due, key=lambda d: d[:2])
        ]
        return self.counters

    # -- frames -----------------------------------------------------------------------------

    def _enter_frame(self, raw: bytes) -> None:
        try:
            header = decode_header(raw, _ANY_LENGTH)
        except FrameError:
            self._tracking = False  # not a poseidon_aio stream: frame-placed faults cannot come due
            return
        self._frame, self._frame_start = header, self.offset
        self._frame_end = self.offset + HEADER_SIZE + header.length
        index_all, index_kind = self._seen_all, self._seen[header.kind]
        self._seen_all += 1
        self._seen[header.kind] += 1
        self.counters.frames_seen += 1
        for order, f in list(self._armed):
            index = index_all if f.frame_kind is None else index_kind
            if (f.frame_kind is None or f.frame_kind is header.kind) and index == f.frame:
                self._armed.remove((order, f))
                heapq.heappush(self._due, (self.offset + f.skew, order, f))
        if self._corrupt_next and header.kind in DATA_KINDS:
            self._mark_corrupted()

    def _matches(self, frame_kind: Optional[Kind]) -> bool:
        return frame_kind is None or (self._frame is not None and self._frame.kind is frame_kind)

    def _mark_corrupted(self) -> None:
        h = self._frame
        self.counters.corrupted = (h.kind.name, h.key, h.clock)
        self._corrupt_next = False

    # -- faults -----------------------------------------------------------------------------

    def _fire_due(self, out: list) -> None:
        while self._due and self._due[0][0] <= self.offset and self._span is None:
            f = self._due[0][2]
            if f.frames is not None and not (self.offset == self._frame_start and self._matches(f.frame_kind)):
                return  # a span of whole frames opens on a boundary of its kind's frame
            heapq.heappop(self._due)
            self.counters.fired.append(f"{f} at byte {self.offset}")
            if f.kind is FaultKind.DELAY:
                out.append(Hold(f.seconds))
                self.counters.held_seconds += f.seconds
            elif f.kind is FaultKind.FLIP:
                self._flip = 1 << f.bit
                if self.counters.corrupted is None and self._tracking and self._frame is not None:
                    if self._frame.kind in DATA_KINDS:
                        self._mark_corrupted()
            elif f.kind in (FaultKind.TRUNCATE, FaultKind.RESET):
                out.append(Cut(reset=f.kind is FaultKind.RESET))
                self.counters.cuts += 1
                self._cut = True
                return
            else:
                self._span = _Span(f, self.offset + f.nbytes if f.nbytes is not None else None)
                if f.mangles and self.counters.corrupted is None:
                    self._corrupt_next = True
                    if self._tracking and self._frame is not None and self._frame.kind in DATA_KINDS:
                        self._mark_corrupted()

    def _piece_length(self) -> int:
        n = len(self._buf)
        if self._tracking:
            n = min(n, self._frame_end - self.offset)
        later = [start for start, _, _ in self._due if start > self.offset]
        if later:
            n = min(n, min(later) - self.offset)
        if self._span is not None and self._span.end is not None:
            n = min(n, self._span.end - self.offset)
        return n

    def _emit(self, piece: bytes, out: list) -> None:
        if self._flip and piece:
            piece = bytes([piece[0] ^ self._flip]) + piece[1:]
            self._flip = 0
            self.counters.bits_flipped += 1
        span = self._span
        covered = span is not None and (span.fault.frames is None or self._matches(span.fault.frame_kind))
        if covered and span.fault.kind is FaultKind.DROP:
            self.counters.bytes_dropped += len(piece)
            return
        out.append(Forward(piece))
        self.counters.bytes_out += len(piece)
        if covered:
            span.recording += piece

    def _close_span(self, out: list) -> None:
        span = self._span
        if span is None:
            return
        if span.fault.frames is not None:
            if not (self._tracking and self.offset == self._frame_end and self._matches(span.fault.frame_kind)):
                return
            span.left -= 1
            if span.left:
                return
        elif span.end is None or self.offset < span.end:
            return
        self._span = None
        if span.fault.kind is FaultKind.DUPLICATE:
            out.append(Forward(bytes(span.recording)))
            self.counters.bytes_out += len(span.recording)
            self.counters.bytes_duplicated += len(span.recording)


def _coalesce(actions: list) -> list:
    out: list = []
    for a in actions:
        if isinstance(a, Forward) and out and isinstance(out[-1], Forward):
            out[-1] = Forward(out[-1].data + a.data)
        elif not (isinstance(a, Forward) and not a.data):
            out.append(a)
    return out


# -- the asyncio adapter ------------------------------------------------------------------------


def _reset(writer: asyncio.StreamWriter) -> None:
    """Abort with RST: SO_LINGER on with a zero timeout makes close() send RST, not FIN."""
    if writer.transport.is_closing():
        return
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


def _close(writer: asyncio.StreamWriter) -> None:
    if not writer.transport.is_closing():
        writer.close()


class _Ends:
    """Both sockets of one proxied connection, ended together by a cut."""

    def __init__(self, *writers: asyncio.StreamWriter) -> None:
        self.writers = writers

    def close(self) -> None:
        for w in self.writers:
            _close(w)

    def reset(self) -> None:
        for w in self.writers:
            _reset(w)


class FaultProxy:
    """A TCP proxy to ``target`` that injects ``plan`` into every connection it forwards (each
    connection gets fresh streams, so the plan counts frames per connection).

    The end of a connection on one side is passed on to the other (EOF as a half-close, RST as
    RST) unless that direction is black-holed.

    Args:
        target: ``(host, port)`` to forward to.
        plan: the :class:`FaultPlan`.
        connect_timeout: seconds to reach the target before the client's connection is reset.

    >>> # proxy = await FaultProxy(("127.0.0.1", shard_port), plan).start()
    >>> # ...dial proxy.address...; await proxy.close(); proxy.counters(Direction.UP).fired
    """

    def __init__(
        self, target: tuple, plan: FaultPlan, *, host: str = "127.0.0.1", connect_timeout: float = 5.0
    ) -> None:
        self.target = (target[0], int(target[1]))
        self.plan = plan
        self.address: tuple = ("", 0)
        self.connections = 0
        self._host = host
        self._connect_timeout = connect_timeout
        self._server: Optional[asyncio.AbstractServer] = None
        self._streams: list = []
        self._writers: set = set()
        self._tasks: set = set()

    async def start(self) -> "FaultProxy":
        self._server = await asyncio.start_server(self._serve, self._host, 0)
        self.address = self._server.sockets[0].getsockname()[:2]
        return self

    def counters(self, direction: Direction) -> FaultCounters:
        """What the proxy did in ``direction``, summed over its connections."""
        total = FaultCounters()
        for d, stream in self._streams:
            if d is direction:
                total = total + stream.finish()
        return total

    async def close(self) -> None:
        """Stop listening and abort every connection still forwarded (bounded: 5 s)."""
        if self._server is not None:
            self._server.close()
        for w in list(self._writers):
            _reset(w)
        for task in list(self._tasks):
            task.cancel()
        async with asyncio.timeout(5):
            await asyncio.gather(*self._tasks, return_exceptions=True)
            if self._server is not None:
                await self._server.wait_closed()

    async def __aenter__(self) -> "FaultProxy":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        self._writers.add(client_w)
        server_w = None
        try:
            try:
                async with asyncio.timeout(self._connect_timeout):
                    server_r, server_w = await asyncio.open_connection(*self.target)
            except (OSError, TimeoutError):
                _reset(client_w)
                return
            self._writers.add(server_w)
            self.connections += 1
            up, down = FaultStream(self.plan.of(Direction.UP)), FaultStream(self.plan.of(Direction.DOWN))
            self._streams += [(Direction.UP, up), (Direction.DOWN, down)]
            ends = _Ends(client_w, server_w)
            await asyncio.gather(self._pump(up, client_r, server_w, ends), self._pump(down, server_r, client_w, ends))
        except asyncio.CancelledError:
            pass  # close() aborted the sockets already
        finally:
            for w in (client_w, server_w):
                if w is not None:
                    _close(w)
                    self._writers.discard(w)
            self._tasks.discard(task)

    async def _pump(
        self, stream: FaultStream, src: asyncio.StreamReader, dst: asyncio.StreamWriter, ends: _Ends
    ) -> None:
        while True:
            try:
                data = await src.read(_READ_BYTES)
            except OSError:  # the source reset its connection
                if not stream.black_holed:
                    ends.reset()
                return
            if not data:
                if not stream.black_holed and not dst.transport.is_closing() and dst.can_write_eof():
                    dst.write_eof()
                return
            for action in stream.feed(data):
                if isinstance(action, Cut):
                    if action.reset:
                        ends.reset()
                    else:
                        ends.close()
                    return
                if isinstance(action, Hold):
                    await asyncio.sleep(action.seconds)
                    continue
                if dst.transport.is_closing():
                    return  # the other side is gone; its own pump passes that on
                dst.write(action.data)
                try:
                    await dst.drain()
                except OSError:
                    return
