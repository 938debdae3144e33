"""Launch real worker processes the way torchrun would: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT in each one's environment, a fresh TCPStore port per job.

``run_workers(world, target, *args)`` starts ``target(rank, *args)`` in ``world`` processes and
returns each rank's return value (or raises with the rank's traceback). Results travel back over a
multiprocessing queue: a test harness channel, never the data path.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import time
import traceback

from poseidon_aio.cluster.launcher import free_port

JOB_TOKEN = "tests-cluster-token-0123456789abcdef"


# What every child needs before it can run a line of a test: importing these costs 1.2-1.6 s of CPU
# per process (torch most of it), 3-5 s on two cores beside a CPU hog, and a suite starts a few
# hundred children. The fork server imports them once; each child is then a fork of it (tens of
# ms). A fork server, not plain fork: it is forked from a clean process before any test runs, so no
# child inherits pytest's event loops, sockets or threads. What a child needs from its parent
# travels explicitly (``env`` below, the target's arguments), never through an inherited os.environ.
PRELOAD = [
    "torch",
    "numpy",
    "poseidon_aio.train",
    "poseidon_aio.ps",
    "tests.support.procs",
    "tests.support.psworkers",
    "tests.support.trainworkers",
    "tests.support.lossyworkers",
    "tests.support.faultworkers",
    "tests.support.rdzvworkers",
]


def mp_context():
    """The multiprocessing context every test child starts from (a fork server with ``PRELOAD``)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _entry(rank: int, env: dict, out, target, args) -> None:
    os.environ.update(env)
    try:
        out.put((rank, "ok", target(rank, *args)))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent with its traceback
        out.put((rank, "error", (type(exc).__name__, str(exc), traceback.format_exc())))


class WorkerFailed(AssertionError):
    def __init__(self, rank: int, kind: str, message: str, tb: str) -> None:
        super().__init__(f"rank {rank} raised {kind}: {message}\n{tb}")
        self.rank, self.kind, self.message = rank, kind, message


def rank_env(rank: int, world: int, port: int) -> dict:
    """What a launcher gives rank ``rank`` of a one-host job on loopback."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        # The launcher hands every worker the job's token (never through the store).
        "POSEIDON_TOKEN": JOB_TOKEN,
    }


def start_workers(world: int, target, *args, port: int | None = None, env=None):
    """``env``: more variables for every rank, a dict or a function of the rank (called here, in
    the parent)."""
    ctx = mp_context()
    out = ctx.Queue()
    port = port or free_port()
    procs = []
    for rank in range(world):
        penv = {**rank_env(rank, world, port), **((env(rank) if callable(env) else env) or {})}
        p = ctx.Process(target=_entry, args=(rank, penv, out, target, args), daemon=True)
        p.start()
        procs.append(p)
    return procs, out


def collect(procs, out, timeout: float = 90.0, expect_errors: bool = False) -> dict:
    results, errors = collect_all(procs, out, timeout, tolerate=expect_errors)
    if errors and not expect_errors:
        rank = min(errors)
        raise WorkerFailed(rank, *errors[rank])
    return errors if expect_errors else results


def collect_all(procs, out, timeout: float = 90.0, tolerate: bool = True) -> tuple:
    """``(results, errors)`` by rank; a worker that died (``tolerate``) is an error ``("died", ...)``."""
    deadline = time.monotonic() + timeout
    results, errors = {}, {}
    try:
        while len(results) + len(errors) < len(procs):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"workers {sorted(set(range(len(procs))) - set(results) - set(errors))} "
                    f"did not finish within {timeout} s"
                )
            try:
                rank, status, value = out.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [
                    r
                    for r, p in enumerate(procs)
                    if p.exitcode not in (None, 0) and r not in results and r not in errors
                ]
                if dead and not tolerate:
                    raise AssertionError(f"worker(s) {dead} died with exit codes {[procs[r].exitcode for r in dead]}")
                for r in dead:
                    errors[r] = ("died", f"exit code {procs[r].exitcode}", "")
                continue
            (results if status == "ok" else errors)[rank] = value
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
    return results, errors


def run_workers(world: int, target, *args, timeout: float = 90.0, **kwargs) -> dict:
    procs, out = start_workers(world, target, *args, **kwargs)
    return collect(procs, out, timeout)
