# cython: language_level=3, boundscheck=False, wraparound=False
"""Compiled twin of ``poseidon_aio/ps/tally.py``: same contract, same errors, same messages.

A push's checks and bookkeeping run in C: the message's size and pushers, the clock's state and
its Pending, the byte counters, through the C API, with no Python frame. Python is called for
what is rare or policy: a clock's first push arms its timers, a complete clock is finalized, and
a refusal, a late push or a departed peer is worded by the shard.
"""

import logging

import numpy as np

from poseidon_aio.errors import RemoteProtocolError
from poseidon_aio.ps.slots import Pending
from poseidon_aio.ps.tally import SIZED_KINDS
from poseidon_aio.wire.layout import DTYPE_BY_NAME, Kind

cdef object _PUSH = Kind.PUSH
cdef frozenset _SIZED = SIZED_KINDS
cdef object _frombuffer = np.frombuffer
cdef object log = logging.getLogger("poseidon_aio.ps")


cdef class Tally:
    """Compiled tally (see the pure-Python twin for the contract)."""

    cdef object _shard
    cdef dict _messages
    cdef dict _nbytes
    cdef dict _wire_dtype
    cdef dict _numel
    cdef dict _dtype
    cdef dict _pushers
    cdef set _rebuilt
    cdef dict _factored
    cdef dict _finalized
    cdef set _busy
    cdef dict _pending
    cdef dict _departed
    cdef object _lags
    cdef object _slots
    cdef object _stats
    cdef object _loop
    cdef bint _every_push

    def __init__(self, shard):
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
        self._every_push = shard.config.stragglers.enabled

    # -- the link's hooks -------------------------------------------------------------------

    def limit(self, conn, header):
        if header.kind not in _SIZED:
            return None
        return self._message(conn.peer_rank, header)

    def allocate(self, conn, header):
        cdef object mid, clock, rank, nbytes, p
        if header.kind is not _PUSH:
            return None
        mid = header.key
        clock = header.clock
        nbytes = self._nbytes.get(mid)
        if nbytes is None or mid in self._rebuilt or header.length != nbytes:
            return None
        if self._settled(mid, clock):
            return None
        rank = conn.peer_rank
        if rank not in self._pushers[mid]:
            return None
        p = self._pending_for(mid, clock)
        if rank in p.have or rank in p.landing:
            return None
        (<set>p.landing).add(rank)
        return p.slots[rank]

    def on_frame(self, conn, frame):
        cdef object header = frame.header
        cdef object rank, mid, length, stats
        if header.kind is not _PUSH:
            self._shard._on_frame(conn, frame)
            return
        rank = conn.peer_rank
        mid = header.key
        self._message(rank, header)
        if mid in self._rebuilt or rank not in self._pushers[mid]:
            self._shard._refuse_push(rank, frame)
        length = header.length
        stats = self._stats
        stats.bytes_in += length
        if not conn.is_local:
            stats.remote_bytes_in += length
        self._arrived(rank, mid, frame, header, None)

    # -- the state ----------------------------------------------------------------------------

    def arrived(self, rank, mid, frame, factors):
        self._arrived(rank, mid, frame, frame.header, factors)

    cdef _arrived(self, rank, mid, frame, header, factors):
        cdef object clock = header.clock
        cdef object p, pushers, now
        cdef set have
        cdef Py_ssize_t count
        if self._settled(mid, clock):
            self._stats.late_discarded += 1
            log.info(
                "shard %d: discarded rank %d's late %s of message %d at clock %d",
                self._shard.index, rank, header.kind.name, mid, clock,
            )
            return
        p = self._pending_for(mid, clock)
        have = p.have
        if rank in have:
            raise RemoteProtocolError(f"rank {rank} sent {header.kind.name} for message {mid} twice at clock {clock}")
        pushers = self._pushers[mid]
        if self._departed:
            for gone in self._departed:
                if gone in pushers and gone not in have:  # BSP cannot finalize without it: say so now
                    self._shard._report_departed(gone, [rank])
        if factors is not None:
            p.slots[rank] = factors
        elif rank in p.landing:  # received into its slot
            (<set>p.landing).discard(rank)
        else:  # it came before its clock was opened, or in process: its own buffer is kept
            p.slots[rank] = _frombuffer(frame.payload, dtype=self._dtype[mid])
        have.add(rank)
        now = self._loop.time()
        count = len(have)
        if count == 1:
            p.first_at = now
            self._shard._arm_timers(mid, clock, p)
        if count == len(pushers):
            self._lags.append(now - p.first_at)
        elif not self._every_push:
            return
        self._shard._advance(mid)

    cdef bint _settled(self, mid, clock) except -1:
        cdef object done = self._finalized[mid]
        return clock <= done or (clock == done + 1 and mid in self._busy)

    cdef object _pending_for(self, mid, clock):
        cdef object key = (mid, clock)
        cdef object p = self._pending.get(key)
        if p is None:
            slots = {} if mid in self._factored else self._slots.take(mid, self._numel[mid], self._dtype[mid])
            p = Pending(slots)
            self._pending[key] = p
        return p

    cdef object _message(self, rank, header):
        cdef object mid = header.key
        cdef object length = header.length
        cdef object nbytes = self._nbytes.get(mid)
        if nbytes is not None and not (length and (length != nbytes or header.dtype != self._wire_dtype[mid])):
            return nbytes
        return self._shard._message(rank, header).nbytes  # (raises)
