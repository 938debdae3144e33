"""A shard's pushes as they arrive, in pure Python: the reference and the fallback.

Per push the shard's link calls three hooks: ``limit`` and ``allocate`` when the header arrives
(the largest payload it takes; the receive slot the kernel writes it into) and ``on_frame`` once
it is complete. The tally answers them: which worker's push each message's clock holds, which are
still landing, whether a push is late, a repeat or from a rank that does not push that message,
and, once every pusher is in, hands the message to the shard to finalize (``KVShard._advance``).
The compiled twin in ``_ext/tally.pyx`` (``poseidon_aio.ps._ctally``) has the same contract, the
same errors and the same tests; it answers a push in C and calls Python only for what is rare or
policy (a clock's first push arms its timers, a complete one is finalized). :data:`TALLY` says
which is active: ``"cython"`` with the compiled codec, ``"python"`` otherwise.

The tally shares the shard's state (its dicts and sets, by reference): the shard finalizes,
drops stragglers and reports losses; the tally only reads and records pushes.
"""

from __future__ import annotations

import logging
from contextlib import suppress

import numpy as np

from ..errors import RemoteProtocolError
from ..wire import CODEC, DTYPE_BY_NAME, Kind
from .slots import Pending

log = logging.getLogger("poseidon_aio.ps")

# The kinds whose frames carry exactly their message: any other size is refused when the header
# arrives, before a peer with a different model makes the shard receive the payload.
SIZED_KINDS = frozenset({Kind.PUSH, Kind.PARAMS, Kind.PULL})


class Tally:
    """The pushes of ``shard`` (a :class:`~poseidon_aio.ps.shard.KVShard`), clock by clock."""

    def __init__(self, shard) -> None:
        self._shard = shard
        self._messages = shard._messages
        self._nbytes = {mid: m.nbytes for mid, m in shard._messages.items()}
        self._wire_dtype = {mid: DTYPE_BY_NAME[m.dtype] for mid, m in shard._messages.items()}
        self._numel = shard._numel
        self._dtype = shard._dtype
        self._pushers = shard._pushers
        self._rebuilt = shard._rebuilt
        self._factored = shard._factored
        self._finalized = shard._finalized
        self._busy = shard._busy
        self._pending = shard._pending
        self._departed = shard._departed
        self._lags = shard._lags
        self._slots = shard._slots
        self._stats = shard.stats
        self._loop = shard._loop
        # Deadlines and ejections let a clock finalize short of its pushers: then the shard looks
        # at every push; otherwise only a push that completes its clock can finalize anything.
        self._every_push = shard.config.stragglers.enabled

    # -- the link's hooks -------------------------------------------------------------------

    def limit(self, conn, header):
        """The payload a frame of this header may carry: exactly its message, for the kinds that
        carry one (``None``, no opinion, for the others)."""
        if header.kind not in SIZED_KINDS:
            return None  # factors: K rows, judged once received; other kinds: on_frame refuses them
        return self._message(conn.peer_rank, header)

    def allocate(self, conn, header):
        """The receive slot a push's payload lands in, or ``None`` (its own buffer)."""
        if header.kind is not Kind.PUSH:
            return None
        mid, clock = header.key, header.clock
        if mid not in self._messages or mid in self._rebuilt or header.length != self._nbytes[mid]:
            return None
        if self._settled(mid, clock):
            return None
        rank = conn.peer_rank
        if rank not in self._pushers[mid]:
            return None
        p = self._pending_for(mid, clock)
        if rank in p.have or rank in p.landing:
            return None
        p.landing.add(rank)
        return p.slots[rank]

    def on_frame(self, conn, frame) -> None:
        """A complete frame: a push is tallied here, any other kind goes to the shard."""
        header = frame.header
        if header.kind is not Kind.PUSH:
            self._shard._on_frame(conn, frame)
            return
        rank, mid = conn.peer_rank, header.key
        self._message(rank, header)
        if mid in self._rebuilt or rank not in self._pushers[mid]:
            self._shard._refuse_push(rank, frame)
        self._stats.bytes_in += header.length
        if not conn.is_local:
            self._stats.remote_bytes_in += header.length
        self.arrived(rank, mid, frame, None)

    # -- the state ----------------------------------------------------------------------------

    def arrived(self, rank: int, mid: int, frame, factors) -> None:
        """Rank ``rank``'s contribution to message ``mid`` at the frame's clock: pushes and factors
        (``factors``: their ``(u, v)``) alike are checked against the clock, kept, timed, and
        finalize the clock once complete."""
        clock = frame.header.clock
        if self._settled(mid, clock):
            self._stats.late_discarded += 1
            log.info(
                "shard %d: discarded rank %d's late %s of message %d at clock %d",
                self._shard.index,
                rank,
                frame.header.kind.name,
                mid,
                clock,
            )
            return
        p = self._pending_for(mid, clock)
        if rank in p.have:
            raise RemoteProtocolError(
                f"rank {rank} sent {frame.header.kind.name} for message {mid} twice at clock {clock}"
            )
        pushers = self._pushers[mid]
        for gone in self._departed:
            if gone in pushers and gone not in p.have:  # BSP cannot finalize without it: say so now
                self._shard._report_departed(gone, [rank])
        if factors is not None:
            p.slots[rank] = factors
        elif rank in p.landing:  # received into its slot
            p.landing.discard(rank)
        else:  # it came before its clock was opened, or in process: its own buffer is kept
            p.slots[rank] = np.frombuffer(frame.payload, dtype=self._dtype[mid])
        p.have.add(rank)
        now = self._loop.time()
        if len(p.have) == 1:
            p.first_at = now
            self._shard._arm_timers(mid, clock, p)
        if len(p.have) == len(pushers):
            self._lags.append(now - p.first_at)
        elif not self._every_push:
            return
        self._shard._advance(mid)

    def _settled(self, mid: int, clock: int) -> bool:
        """No push counts for this clock any more: it has finalized, or its finalization is under
        way (``_advance`` only ever starts the clock after the last finalized one, and has already
        taken its pending entry: a repeat that reached :meth:`_pending_for` would open a new one that
        never finalizes)."""
        done = self._finalized[mid]
        return clock <= done or (clock == done + 1 and mid in self._busy)

    def _pending_for(self, mid: int, clock: int) -> Pending:
        """Message ``mid``'s clock in flight, opened (with its receive slots) if it is not yet."""
        p = self._pending.get((mid, clock))
        if p is None:
            slots = {} if mid in self._factored else self._slots.take(mid, self._numel[mid], self._dtype[mid])
            p = self._pending[(mid, clock)] = Pending(slots)
        return p

    def _message(self, rank: int, header) -> int:
        # The message's size where the header matches it; the shard words the refusal otherwise.
        mid, length = header.key, header.length
        if mid in self._messages and not (
            length and (length != self._nbytes[mid] or header.dtype != self._wire_dtype[mid])
        ):
            return self._nbytes[mid]
        return self._shard._message(rank, header).nbytes  # (raises)


TALLIES: dict = {"python": Tally}
with suppress(ImportError):
    from ._ctally import Tally as _CompiledTally  # type: ignore[import-not-found]

    TALLIES["cython"] = _CompiledTally

#: Which tally a shard is built on: the compiled one only beside the compiled codec, so
#: ``POSEIDON_NO_EXTENSIONS=1`` forces both twins.
TALLY = "cython" if CODEC == "cython" and "cython" in TALLIES else "python"
