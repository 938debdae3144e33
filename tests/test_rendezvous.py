"""Every wait at start-up ends when it says, with an error that says why.

A rank pointed at a port with nothing listening, at a listener that never answers, or waiting for
a key nobody publishes fails within its timeout (plus a margin for a loaded machine), naming the
address or the key; a store call stuck for good does not hold up the process's exit; a token
mismatch in the worker mesh fails every rank at once, each saying so.

Bounds are upper bounds only, with ``MARGIN`` seconds to spare: a loaded machine may be slow, never
fast. Times are measured inside the process that waits.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch.distributed  # noqa: F401 - as in a trainer; the rendezvous deadline starts after it

from poseidon_aio.cluster import ClusterEnv, Rendezvous
from poseidon_aio.errors import ConfigError, PeerTimeout, StartupAborted, StoreUnavailable

from .support.cluster import collect, free_port, start_workers
from .support.rdzvworkers import mesh_worker, stuck_exit_script

TIMEOUT = 2.0
MARGIN = 5.0


def _env(rank: int, port: int, world: int = 2) -> ClusterEnv:
    return ClusterEnv(rank=rank, world_size=world, local_rank=rank, master_addr="127.0.0.1", master_port=port)


@contextmanager
def silent_listener():
    """A socket that accepts TCP connections (the kernel does) and never answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    try:
        yield sock.getsockname()[1]
    finally:
        sock.close()


async def _timed(coro):
    started = time.monotonic()
    async with asyncio.timeout(TIMEOUT + 2 * MARGIN):
        try:
            await coro
        except Exception as exc:  # noqa: BLE001 - returned for the test to inspect
            return exc, time.monotonic() - started
    raise AssertionError("expected an error")


async def test_nothing_listening_fails_within_the_timeout_saying_so():
    port = free_port()
    exc, took = await _timed(Rendezvous(_env(1, port), timeout=TIMEOUT).start())
    assert isinstance(exc, StoreUnavailable), exc
    assert exc.reason == "nothing listening" and "nothing listening" in str(exc)
    assert f"127.0.0.1:{port}" in str(exc) and "rank 1" in str(exc)
    assert took < TIMEOUT + MARGIN


async def test_a_listener_that_never_answers_is_not_a_rendezvous_store():
    with silent_listener() as port:
        exc, took = await _timed(Rendezvous(_env(1, port), timeout=TIMEOUT).start())
    assert isinstance(exc, StoreUnavailable), exc
    assert exc.reason == "not a rendezvous store" and "not a rendezvous store" in str(exc)
    assert f"127.0.0.1:{port}" in str(exc)
    assert took < TIMEOUT + MARGIN


async def test_rank_0_on_a_taken_port_says_so_at_once():
    with silent_listener() as port:
        exc, took = await _timed(Rendezvous(_env(0, port), timeout=TIMEOUT).start())
    assert isinstance(exc, ConfigError) and "MASTER_PORT" in str(exc) and str(port) in str(exc)
    assert took < TIMEOUT + MARGIN


async def test_a_late_master_is_waited_for():
    port = free_port()
    worker = Rendezvous(_env(1, port), timeout=20.0)
    joining = asyncio.ensure_future(worker.start())
    await asyncio.sleep(0.5)  # connects are refused meanwhile
    master = Rendezvous(_env(0, port), timeout=20.0)
    async with asyncio.timeout(30):
        await master.start()
        await joining
        await worker.publish("hello", "world")
        assert await master.read("hello", who="rank 1") == "world"
        await asyncio.gather(worker.leave(), master.leave())


async def test_a_key_nobody_publishes_times_out_naming_who_and_the_key():
    rdzv = Rendezvous(_env(0, free_port()), timeout=TIMEOUT)
    async with asyncio.timeout(TIMEOUT + MARGIN):
        await rdzv.start()
    exc, took = await _timed(rdzv.read("addr/shard/1", who="the host of shard 1"))
    assert isinstance(exc, PeerTimeout) and not isinstance(exc, StoreUnavailable), exc
    assert "rank 0: the host of shard 1 did not publish 'addr/shard/1'" in str(exc)
    assert took < TIMEOUT + MARGIN
    await rdzv.leave(0.1)


async def test_an_abort_stops_every_wait_with_the_reason_and_the_first_one_is_kept():
    port = free_port()
    master, worker = Rendezvous(_env(0, port), timeout=30.0), Rendezvous(_env(1, port), timeout=30.0)
    async with asyncio.timeout(MARGIN * 2):
        await master.start()
        await worker.start()
        waiting = asyncio.ensure_future(master.scoped("mesh").read("addr/mesh/1", who="rank 1"))
        await asyncio.sleep(0.1)
        await worker.scoped("ps0").abort(ValueError("the model differs"))
        await worker.abort(ValueError("an echo of the first failure"))
        await worker.abort(StartupAborted("not republished"))
        exc, took = await _timed(waiting)
        assert isinstance(exc, StartupAborted), exc
        assert exc.rank == 1 and exc.reason == "ValueError: the model differs"
        assert "rank 1 failed during start-up: ValueError: the model differs" in str(exc)
        assert took < MARGIN  # not the 30 s timeout
        with pytest.raises(StartupAborted, match="the model differs"):
            await master.check_aborted("testing")
        await asyncio.gather(worker.leave(), master.leave())


async def test_a_stuck_store_call_times_out():
    class Stuck:
        def set(self, key, value):
            time.sleep(TIMEOUT + MARGIN)  # ends after the test, in a daemon thread

    rdzv = Rendezvous(_env(1, 1), timeout=TIMEOUT)
    rdzv._store = Stuck()
    exc, took = await _timed(rdzv.publish("k", "v"))
    assert isinstance(exc, PeerTimeout) and "did not answer" in str(exc) and "publishing 'k'" in str(exc)
    assert took < TIMEOUT + MARGIN


def test_a_process_with_stuck_store_calls_exits_promptly():
    root = Path(__file__).resolve().parent.parent
    with silent_listener() as port:
        proc = subprocess.run(
            [sys.executable, "-c", stuck_exit_script(port)],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHONPATH": str(root)},
        )
        exited = time.monotonic()
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = {line.split()[0]: line.split()[1:] for line in proc.stdout.splitlines()}
    assert lines["start"][0] == "not-a-rendezvous-store"
    assert "publish" in lines
    stuck, returned = int(lines["stuck"][0]), float(lines["stuck"][1])
    assert stuck >= 2, "the test needs store calls still stuck when the process exits"
    assert exited - returned < MARGIN, f"exit took {exited - returned:.1f} s after main returned"


@pytest.mark.slow
def test_mismatched_tokens_fail_both_ranks_at_once_saying_why():
    timeout = 30.0
    tokens = {0: b"A" * 32, 1: b"B" * 32}
    procs, out = start_workers(2, mesh_worker, tokens, timeout)
    res = collect(procs, out, timeout=timeout + 60)
    for rank, (kind, message, took) in res.items():
        assert kind in ("AuthenticationError", "StartupAborted"), (rank, kind, message)
        assert "token" in message and "rank 1" in message and "127.0.0.1:" in message, (rank, message)
        assert took < timeout / 2, (rank, took, message)
    assert res[1][0] == "AuthenticationError"  # it dialled: it hears the refusal itself


@pytest.mark.slow
def test_a_bad_token_on_one_rank_fails_every_rank_at_once():
    timeout = 30.0
    tokens = {0: b"A" * 32, 1: b"A" * 32, 2: b"B" * 32}
    procs, out = start_workers(3, mesh_worker, tokens, timeout)
    res = collect(procs, out, timeout=timeout + 60)
    for rank, (kind, message, took) in res.items():
        assert kind in ("AuthenticationError", "StartupAborted"), (rank, kind, message)
        assert "token" in message and "rank 2" in message, (rank, message)
        assert took < timeout / 2, (rank, took, message)
    # Rank 1's own connections are fine: only the abort key can tell it.
    assert res[1][0] == "StartupAborted"
