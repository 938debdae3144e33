"""Entry points of the child processes of tests/test_rendezvous.py (started from the fork server of
tests/support/cluster.py).

Each returns what it saw instead of raising, with times measured inside the child, so the test
can bound the time to the error without counting the child's start-up (a torch import takes
seconds on a loaded machine).
"""

from __future__ import annotations

import time


def mesh_worker(rank: int, tokens: dict, timeout: float):
    """Rendezvous and build the worker mesh as ``Trainer.start`` does, with ``tokens[rank]``.

    Returns ``(error type, message, seconds from Mesh.start to the error)``, or ``("ok", "", s)``.
    """
    from poseidon_aio.cluster import ClusterEnv, Rendezvous
    from poseidon_aio.cluster.mesh import Mesh
    from poseidon_aio.net import NetConfig, run

    async def main():
        rdzv = Rendezvous(ClusterEnv.from_env(), timeout=timeout)
        await rdzv.start()
        started = time.monotonic()
        try:
            mesh = await Mesh.start(rdzv.scoped("mesh"), NetConfig(token=tokens[rank]), timeout=timeout)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            failed = time.monotonic() - started
            await rdzv.leave(5.0)  # as Trainer.start does: rank 0 keeps the store up for the others
            return type(exc).__name__, str(exc), failed
        await mesh.close()
        await rdzv.leave()
        return "ok", "", time.monotonic() - started

    return run(main())


def stuck_exit_script(port: int) -> str:
    """Python source for a process whose store calls get stuck for good, then exits.

    The constructor dials ``port``, where the test holds a listener that accepts and never
    answers; then a publish goes to a store whose ``set`` never returns. The process prints the
    monotonic time of each error (comparable across processes on one machine) and how many
    store threads are still stuck when it returns from main.
    """
    return f"""
import asyncio, threading, time
from poseidon_aio.cluster import ClusterEnv, Rendezvous
from poseidon_aio.errors import PeerTimeout, StoreUnavailable

class Stuck:
    def set(self, key, value):
        threading.Event().wait()

async def main():
    env = ClusterEnv(rank=1, world_size=2, local_rank=1, master_addr="127.0.0.1", master_port={port})
    rdzv = Rendezvous(env, timeout=1.0)
    try:
        await rdzv.start()
    except StoreUnavailable as exc:
        print("start", exc.reason.replace(" ", "-"), time.monotonic(), flush=True)
    rdzv._store = Stuck()
    try:
        await rdzv.publish("k", "v")
    except PeerTimeout:
        print("publish", time.monotonic(), flush=True)
    stuck = [t.name for t in threading.enumerate() if t.name.startswith("poseidon-store")]
    print("stuck", len(stuck), time.monotonic(), flush=True)

asyncio.run(main())
"""
