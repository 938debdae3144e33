"""The trace: typed spans of every step, a bounded ring per rank, one Chrome/Perfetto file per job.

Nothing is recorded without a trace path. With one, each rank keeps its newest events (a ring of
``TraceConfig.ring``), on a clock aligned at start-up to rank 0's (NTP's estimate over the mesh);
at close every rank sends its events to rank 0, which writes one file where every rank is a
process (``pid`` = rank). A job that failed, or a rank whose events do not arrive, writes
``<trace>.rank<r>.json`` instead.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections import deque
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..errors import ConfigError, PoseidonError, SyncTimeout
from ..plan.cost import Scheme
from ..wire import DType, Kind

log = logging.getLogger("poseidon_aio.train")

TRACE_ENV = "POSEIDON_TRACE"
# Mesh frames of the clock alignment and the gathering: a key no layer or buffer index reaches.
_KEY = (1 << 32) - 1
_GATHER_CLOCK = 1 << 62
_PINGS = 8


@dataclass
class TraceConfig:
    """Args:
    path: where rank 0 writes the trace on close; default ``$POSEIDON_TRACE``
        (``poseidon-aio run --trace PATH``), none: nothing is recorded.
    ring: the most events each rank keeps (its newest); ~150 bytes each.
    """

    path: Optional[str] = None
    ring: int = 200_000

    def __post_init__(self) -> None:
        self.path = self.path or os.environ.get(TRACE_ENV) or None
        if self.ring < 1:
            raise ConfigError("TraceConfig.ring must be >= 1 event")


@dataclass(slots=True)
class Span:
    """One sync of a step: a layer (or merged group) from ready to synchronized."""

    label: str
    scheme: Scheme
    ready: float
    start: float
    end: float = 0.0


class Tracer:
    """Args:
    config: :class:`TraceConfig`.
    rank, world: this worker and how many there are.
    """

    def __init__(self, config: TraceConfig, rank: int = 0, world: int = 1) -> None:
        self.config = config
        self.rank = rank
        self.world = world
        self.events: deque = deque(maxlen=config.ring)
        self._t0 = time.perf_counter()

    @property
    def on(self) -> bool:
        return self.config.path is not None

    def step(self, clock: int, started: float, compute_end: float, spans: list, done: float, work: list = ()) -> None:
        """Record a step: its forward+backward, every sync from ready to done, and the compute the
        syncs did themselves (SFB's rebuilds, on their own thread: they overlap the backward) or
        that ran while syncs were moving (the optimizer's early steps)."""
        if not self.on:
            return
        us = lambda t: round((t - self._t0) * 1e6, 1)  # noqa: E731
        pid, ev = self.rank, self.events
        ev.append(
            {
                "name": f"forward+backward {clock}",
                "ph": "X",
                "pid": pid,
                "tid": "compute",
                "ts": us(started),
                "dur": us(compute_end) - us(started),
            }
        )
        for s in spans:
            ev.append(
                {"name": f"{s.label} ready", "ph": "i", "s": "t", "pid": pid, "tid": "compute", "ts": us(s.ready)}
            )
            ev.append(
                {
                    "name": f"sync {s.label} ({s.scheme.value})",
                    "ph": "X",
                    "pid": pid,
                    "tid": f"sync {s.scheme.value}",
                    "ts": us(s.start),
                    "dur": us(s.end or done) - us(s.start),
                    "args": {"clock": clock},
                }
            )
        for what, start, end, *where in work:  # (what, start, end[, thread]): SFB's rebuilds by default
            ev.append(
                {
                    "name": what,
                    "ph": "X",
                    "pid": pid,
                    "tid": where[0] if where else "rebuild",
                    "ts": us(start),
                    "dur": us(end) - us(start),
                    "args": {"clock": clock},
                }
            )

    async def align(self, peers, timeout: float) -> None:
        """Put this rank's timestamps in rank 0's time base: of ``_PINGS`` round trips to rank 0,
        the fastest bounds the offset best."""
        if self.world == 1 or not self.on:
            return
        if self.rank == 0:

            async def serve(conn) -> None:
                for i in range(_PINGS):
                    await asyncio.wait_for(conn.expect(Kind.DATA, _KEY, i), timeout)
                    now = np.array([time.perf_counter(), self._t0])
                    await conn.send(Kind.DATA, now, key=_KEY, clock=i, dtype=DType.FLOAT64)

            try:
                await asyncio.gather(*(serve(conn) for conn in peers.values()))
            except TimeoutError:
                raise SyncTimeout(
                    f"rank 0: a rank did not time its trace clock against rank 0 within {timeout} s"
                ) from None
            return
        conn = peers[0]
        best = None
        for i in range(_PINGS):
            reply = conn.expect(Kind.DATA, _KEY, i)
            sent = time.perf_counter()
            await conn.send(Kind.DATA, b"", key=_KEY, clock=i)
            try:
                frame = await asyncio.wait_for(reply, timeout)
            except TimeoutError:
                raise SyncTimeout(
                    f"rank {self.rank}: rank 0 did not answer a trace clock ping within {timeout} s"
                ) from None
            back = time.perf_counter()
            remote, origin = np.frombuffer(frame.payload, dtype=np.float64)
            if best is None or back - sent < best[0]:
                best = (back - sent, remote - (sent + back) / 2, origin)
        _, offset, origin = best
        self._t0 = origin - offset  # rank 0's trace origin, read on this rank's clock

    def _file(self, rank: int) -> str:
        if self.world == 1:
            return self.config.path
        base, ext = os.path.splitext(self.config.path)
        return f"{base}.rank{rank}{ext or '.json'}"

    async def write(self, peers: Optional[dict], timeout: float) -> None:
        """Rank 0 writes every rank's events to one file; without ``peers`` (the job failed) each
        rank writes its own."""
        if not self.on:
            return
        loop = asyncio.get_running_loop()
        mine = list(self.events)
        events = {self.rank: mine}
        gathered = bool(peers) and self.world > 1
        if gathered and self.rank != 0:
            try:
                payload = json.dumps(mine).encode()
                await asyncio.wait_for(
                    peers[0].send(Kind.DATA, payload, key=_KEY, clock=_GATHER_CLOCK, dtype=DType.JSON), timeout
                )
                return
            except (PoseidonError, TimeoutError) as exc:
                log.warning(
                    "rank %d: could not send the trace to rank 0 (%s); writing %s",
                    self.rank,
                    exc,
                    self._file(self.rank),
                )
                gathered = False
        if gathered:
            waits = {r: conn.expect(Kind.DATA, _KEY, _GATHER_CLOCK) for r, conn in peers.items()}
            done, _ = await asyncio.wait(waits.values(), timeout=timeout)
            for r, fut in waits.items():
                if fut in done and fut.exception() is None:
                    try:
                        events[r] = json.loads(bytes(fut.result().payload))
                        continue
                    except ValueError:
                        log.warning("rank 0: rank %d sent trace events that are not JSON", r)
                else:
                    fut.cancel()
                    log.warning("rank 0: rank %d's trace events did not arrive; the trace has no row for it", r)
        path = self.config.path if gathered else self._file(self.rank)
        names = [{"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}} for r in sorted(events)]
        body = {"traceEvents": names + [e for r in sorted(events) for e in events[r]], "displayTimeUnit": "ms"}
        await loop.run_in_executor(None, _write_json, path, body)


def _write_json(path: str, body: dict) -> None:
    with open(path, "w") as f:
        json.dump(body, f)
