"""Worker processes for the fault-injection suite, and the pool that drives them.

Three child processes (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set as torchrun would) meet at
one TCPStore for the pool's whole life and run one :class:`Case` at a time, each on a fresh event
loop under its own key prefix (``Rendezvous.scoped``): a case that fails leaves nothing behind
for the next, and each case runs on warm processes instead of three fresh ones (2-3 s each on two
cores). Every rank hosts one shard (the co-located default); a case names which rank's connection
to which remote shard goes through a :class:`~tests.support.faultproxy.FaultProxy`, which runs on that
rank's own loop.

Cases and outcomes travel over multiprocessing queues: a test harness channel, never the data path.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import multiprocessing
import queue
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Optional

import numpy as np

from poseidon_aio.cluster import ClusterEnv, Rendezvous
from poseidon_aio.errors import (
    ConnectionLost,
    PeerTimeout,
    RemoteProtocolError,
    StartupAborted,
    SyncTimeout,
    WorkerLeft,
)
from poseidon_aio.net import NetConfig, run
from poseidon_aio.ps import PSConfig, PSNode, ServerSGD

from .cluster import collect, mp_context, start_workers
from .faultproxy import Direction, FaultPlan, FaultProxy
from .psworkers import digest, grad, manifest_of

WORLD = 3
# Shard 0 holds two 960-byte messages of these (InformationBook, 1 KiB chunks, 3 shards): per clock
# a worker sends it 2 PUSH frames of 1000 bytes (header included) and gets 2 PARAMS frames back.
SHAPES = [(40, 30), (30,), (12, 5)]
CHUNK_BYTES = 1024
CLOCKS = 4
FRAME_BYTES = 1000
TOKEN = b"poseidon-fault-suite-token-0123456789"
# Start-up of a case on warm processes takes ~0.2 s; 10 s covers a loaded machine 50 times over,
# and bounds how long survivors wait in PSNode.close() for a rank that failed.
RENDEZVOUS_TIMEOUT = 10.0
# The pool's own store connection: three cold processes importing torch on two busy cores.
POOL_START_TIMEOUT = 90.0
SYNC_TIMEOUT = 8.0
IDLE_TIMEOUT = 3.0
HEARTBEAT = 0.5

# What the suite accepts as a documented end: the PoseidonError family a user is told to expect
# from a broken network (ConnectionLost, FrameError and the rest of RemoteProtocolError,
# PeerTimeout, SyncTimeout) and WorkerLeft.
DOCUMENTED = (ConnectionLost, RemoteProtocolError, PeerTimeout, SyncTimeout, WorkerLeft, StartupAborted)


def net_config() -> NetConfig:
    # A heartbeat goes out after 0.25 s of send silence, so a healthy peer is never silent for
    # more than ~0.3 s; 3 s of silence (10x that) ends a connection with PeerTimeout.
    return NetConfig(
        token=TOKEN,
        heartbeat_interval=HEARTBEAT,
        idle_timeout=IDLE_TIMEOUT,
        connect_timeout=3.0,
        handshake_timeout=3.0,
        close_timeout=2.0,
    )


def ps_config() -> PSConfig:
    return PSConfig(
        chunk_bytes=CHUNK_BYTES,
        server_sgd=ServerSGD(lr=0.05, momentum=0.9, weight_decay=1e-4),
        sync_timeout=SYNC_TIMEOUT,
    )


@dataclass(frozen=True)
class Case:
    """One run of the job.

    Args:
        name: unique per pool: the rendezvous key prefix.
        plans: ``{(rank, shard): FaultPlan}``: that rank reaches that (remote) shard through a proxy.
        pauses: ``{(rank, clock): seconds}`` a rank waits before pushing that clock.
        clocks: how many clocks of server-side SGD to run.
    """

    name: str
    plans: dict = field(default_factory=dict)
    pauses: dict = field(default_factory=dict)
    clocks: int = CLOCKS


@dataclass
class Outcome:
    """How one rank's run of a case ended.

    ``completed`` maps each clock this rank finished to a digest of its parameters after it;
    ``proxies`` maps ``"shard/direction"`` to the proxy's counters (as a dict); ``leftover`` is
    what this rank's shard still waited for once every clock was through (nothing, if the shard
    kept its books straight).
    """

    rank: int
    error: Optional[str] = None
    message: str = ""
    documented: bool = True
    traceback: str = ""
    elapsed: float = 0.0
    completed: dict = field(default_factory=dict)
    proxies: dict = field(default_factory=dict)
    leftover: dict = field(default_factory=dict)
    loop_errors: list = field(default_factory=list)
    logged_tracebacks: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error is None


class ProxiedRendezvous:
    """A rendezvous view that sends this rank's connections to some shards through proxies.

    Everything is delegated to ``inner``, except that reading ``addr/shard/{s}`` for a shard in
    ``plans`` starts a :class:`FaultProxy` to the published address and returns the proxy's.
    """

    def __init__(self, inner: Rendezvous, plans: dict) -> None:
        self._inner = inner
        self._plans = plans
        self.proxies: dict = {}

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    async def read(self, name: str, *, who: str, deadline: Optional[float] = None) -> str:
        value = await self._inner.read(name, who=who, deadline=deadline)
        prefix, _, shard = name.rpartition("/")
        if prefix != "addr/shard" or int(shard) not in self._plans:
            return value
        host, port = value.rsplit(":", 1)
        proxy = await FaultProxy((host, int(port)), self._plans[int(shard)]).start()
        self.proxies[int(shard)] = proxy
        return f"{proxy.address[0]}:{proxy.address[1]}"

    async def close_proxies(self) -> dict:
        report = {}
        for shard, proxy in self.proxies.items():
            await proxy.close()
            for d in Direction:
                report[f"{shard}/{d.value}"] = asdict(proxy.counters(d))
        return report


class _TracebackLog(logging.Handler):
    """Keeps every log record that carries a traceback: an exception somebody only logged."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info:
            self.records.append(self.format(record))


def _loop_error(context: dict) -> str:
    exc = context.get("exception")
    text = context.get("message", "")
    if exc is not None:
        text += ": " + "".join(traceback.format_exception(exc))
    return text


async def _train(rank: int, rdzv, case: Case, out: Outcome) -> None:
    params = list(range(len(SHAPES)))
    async with await PSNode.start(manifest_of(SHAPES), ps_config(), net=net_config(), rendezvous=rdzv) as node:
        w = [np.random.default_rng([7, i]).standard_normal(s, dtype=np.float32) for i, s in enumerate(SHAPES)]
        await node.client.broadcast(params, w, node.start_clock)
        for clock in range(node.start_clock, case.clocks):
            await node.client.gate(clock)
            pause = case.pauses.get((rank, clock))
            if pause:
                await asyncio.sleep(pause)
            # sgd_worker's toy objective: grad = 0.1 * w + noise(rank, clock).
            g = [np.float32(0.1) * w[i] + grad(rank, clock, i, SHAPES[i]) for i in params]
            new = [np.empty_like(x) for x in w]
            await node.client.push(params, g, new, clock)
            w = new
            out.completed[clock] = digest(w)
        # Every clock of every message on this rank's shard has finalized: its replies are in.
        out.leftover = node.shard.pending_ranks() if node.shard is not None else {}


def run_case(rank: int, store: Rendezvous, case: Case) -> Outcome:
    """Run ``case`` as ``rank`` on a fresh loop; report how it ended, never raise."""
    out = Outcome(rank)
    logged = _TracebackLog()
    logging.getLogger().addHandler(logged)
    started = time.monotonic()

    async def main():
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: out.loop_errors.append(_loop_error(ctx)))
        view = store.job(case.name)
        view.timeout = RENDEZVOUS_TIMEOUT
        rdzv = ProxiedRendezvous(view, {s: plan for (r, s), plan in case.plans.items() if r == rank})
        try:
            await _train(rank, rdzv, case, out)
        except Exception as exc:  # noqa: BLE001 - the outcome is what the test checks
            out.error, out.message = type(exc).__name__, str(exc)
            out.documented = isinstance(exc, DOCUMENTED)
            out.traceback = traceback.format_exc()
        finally:
            out.proxies = await rdzv.close_proxies()
        gc.collect()  # a future whose exception nobody read reports it when collected

    try:
        run(main())
        gc.collect()
    finally:
        logging.getLogger().removeHandler(logged)
    out.elapsed = time.monotonic() - started
    out.logged_tracebacks = logged.records
    return out


def _next_case(inbox) -> Optional[Case]:
    """The next case, or ``None`` when told to stop or when the parent is gone (checked every
    5 s, so a killed test run leaves no process waiting)."""
    parent = multiprocessing.parent_process()
    while True:
        try:
            return inbox.get(timeout=5.0)
        except queue.Empty:
            if parent is not None and not parent.is_alive():
                return None


def serve_cases(rank: int, inboxes: list, results) -> str:
    """A pool process: join the pool's store, then run each case from ``inboxes[rank]`` until
    ``None`` comes."""
    store = Rendezvous(ClusterEnv.from_env(), timeout=POOL_START_TIMEOUT)
    run(store.start())
    results.put((rank, None, "ready"))
    while (case := _next_case(inboxes[rank])) is not None:
        results.put((rank, case.name, run_case(rank, store, case)))
    run(store.leave(linger=10.0))
    return "done"


class CasePool:
    """The parent's side: start the pool, run cases on it, restart it after a hang.

    >>> # pool = CasePool(); outcomes = pool.run(Case("delay", plans={(1, 0): plan}), bound=30)
    """

    def __init__(self, world: int = WORLD) -> None:
        self.world = world
        self._procs: list = []
        self._out = None
        self._inboxes: list = []
        self._results = None

    def _start(self) -> None:
        ctx = mp_context()
        self._inboxes = [ctx.Queue() for _ in range(self.world)]
        self._results = ctx.Queue()
        self._procs, self._out = start_workers(self.world, serve_cases, self._inboxes, self._results)
        self._gather(None, POOL_START_TIMEOUT)

    def run(self, case: Case, bound: float) -> dict:
        """Run ``case`` on every rank; return ``{rank: Outcome}``.

        Raises:
            AssertionError: a rank did not report within ``bound`` + 30 s (a hang; the pool is
                killed and the next case starts a fresh one).
        """
        if not self._procs:
            self._start()
        for inbox in self._inboxes:
            inbox.put(case)
        return self._gather(case.name, bound + 30.0)

    def _gather(self, name, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        got: dict = {}
        while len(got) < self.world:
            try:
                rank, case, outcome = self._results.get(timeout=max(0.01, min(1.0, deadline - time.monotonic())))
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if p.exitcode is not None]
                if time.monotonic() < deadline and not dead:
                    continue
                self.kill()
                missing = sorted(set(range(self.world)) - set(got))
                what = f"case {name!r}" if name else "the pool's start"
                raise AssertionError(
                    f"{what}: ranks {missing} did not finish within {timeout:.0f} s (dead: {dead})"
                ) from None
            if case == name:
                got[rank] = outcome
        return got

    def kill(self) -> None:
        for p in self._procs:
            p.kill()
            p.join(10)
        self._procs = []

    def close(self) -> None:
        if not self._procs:
            return
        for inbox in self._inboxes:
            inbox.put(None)
        try:
            collect(self._procs, self._out, timeout=30)
        finally:
            self.kill()


__all__ = ["Case", "CasePool", "Outcome", "FaultPlan", "ProxiedRendezvous", "run_case", "serve_cases"]
