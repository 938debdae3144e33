"""Worker bodies for the parameter-server integration tests (run in child processes forked from the tests' fork
server, tests/support/cluster.py)."""

from __future__ import annotations

import asyncio
import hashlib

import numpy as np

from poseidon_aio.cluster import Manifest, ParamSpec, StartupConfig
from poseidon_aio.net import run
from poseidon_aio.ps import PSConfig, PSNode


def manifest_of(shapes) -> Manifest:
    return Manifest(ParamSpec(f"p{i}", tuple(s)) for i, s in enumerate(shapes))


def grad(rank: int, clock: int, param: int, shape) -> np.ndarray:
    return np.random.default_rng([rank, clock, param]).standard_normal(shape, dtype=np.float32)


def digest(arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def aggregate_worker(rank: int, shapes, clocks: int, config: PSConfig, order_seed: int):
    """Push every parameter each clock (in a per-rank random order); return the aggregates."""

    async def main():
        manifest = manifest_of(shapes)
        async with await PSNode.start(manifest, config) as node:
            out = {}
            rng = np.random.default_rng([order_seed, rank])
            for clock in range(clocks):
                await node.client.gate(clock)
                params = list(range(len(shapes)))
                rng.shuffle(params)
                tasks = []
                for i in params:
                    g = grad(rank, clock, i, shapes[i])
                    o = np.empty_like(g)
                    tasks.append(node.client.push([i], [g], [o], clock))
                    out[(clock, i)] = o
                    await asyncio.sleep(float(rng.random()) * 0.002)
                await asyncio.gather(*tasks)
            return {k: v for k, v in out.items()}, node.book.max_over_mean()

    return run(main())


def ssp_worker(rank: int, shapes, config: PSConfig, schedules):
    """Run each delay schedule for its clocks; record what the SSP gate let through."""

    async def main():
        manifest = manifest_of(shapes)
        seen, results = [], {}
        async with await PSNode.start(manifest, config) as node:
            clock, tasks = 0, []
            for schedule in schedules:
                for delay in schedule[rank]:
                    await node.client.gate(clock)
                    seen.append((clock, node.client.complete_through))
                    await asyncio.sleep(delay)
                    for i, shape in enumerate(shapes):
                        out = np.empty(shape, dtype=np.float32)
                        results[(clock, i)] = out
                        tasks.append(node.client.push([i], [grad(rank, clock, i, shape)], [out], clock))
                    clock += 1
            await asyncio.gather(*tasks)
        return seen, {k: v.tobytes() for k, v in results.items()}

    return run(main())


def straggler_worker(rank: int, shapes, config: PSConfig, slow_rank: int, slow_clock: int, clocks: int):
    """``slow_rank`` holds its push of ``slow_clock`` back until the shards have dropped it from
    that clock (an event, not a pause: on a loaded machine no sleep is surely long enough)."""

    async def main():
        manifest = manifest_of(shapes)
        out, dropped = {}, {}
        async with await PSNode.start(manifest, config) as node:
            for clock in range(clocks):
                await node.client.gate(clock)
                if rank == slow_rank and clock == slow_clock:
                    async with asyncio.timeout(60):
                        while slow_clock not in node.client.dropped:
                            await asyncio.sleep(0.01)
                tasks = []
                for i, shape in enumerate(shapes):
                    out[(clock, i)] = np.empty(shape, dtype=np.float32)
                    tasks.append(node.client.push([i], [grad(rank, clock, i, shape)], [out[(clock, i)]], clock))
                for result in await asyncio.gather(*tasks):
                    dropped.setdefault(clock, set()).update(result.dropped)
            late = node.shard.stats.late_discarded if node.shard else 0
        return {k: v.tobytes() for k, v in out.items()}, dropped, late

    return run(main())


def sgd_worker(rank: int, shapes, config: PSConfig, clocks: int, crash_at):
    """Server-side SGD on a toy objective: grad = 0.1 * w + noise(rank, clock)."""
    import os

    async def main():
        manifest = manifest_of(shapes)
        params = list(range(len(shapes)))
        async with await PSNode.start(manifest, config) as node:
            w = [np.random.default_rng([7, i]).standard_normal(s, dtype=np.float32) for i, s in enumerate(shapes)]
            if node.resumed:
                await node.client.pull(params, w, node.start_clock)
            else:
                await node.client.broadcast(params, w, node.start_clock)
            for clock in range(node.start_clock, clocks):
                await node.client.gate(clock)
                g = [np.float32(0.1) * w[i] + grad(rank, clock, i, shapes[i]) for i in params]
                new = [np.empty_like(x) for x in w]
                await node.client.push(params, g, new, clock)
                w = new
                if clock == crash_at:
                    await asyncio.sleep(0.5)  # let the shard's checkpoint writer finish
                    os._exit(137)  # killed, mid-job: no goodbye, no barrier
            return node.start_clock, node.resumed, digest(w)

    return run(main())


def mismatch_worker(rank: int, shapes_by_rank):
    async def main():
        async with await PSNode.start(manifest_of(shapes_by_rank[rank]), PSConfig(), startup=StartupConfig(timeout=20)):
            pass

    return run(main())


def leaving_worker(rank: int, shapes, config: PSConfig, leaver: int):
    import os

    async def main():
        async with await PSNode.start(manifest_of(shapes), config) as node:
            if rank == leaver:
                os._exit(1)
            await asyncio.sleep(0.2)
            g = [grad(rank, 0, i, s) for i, s in enumerate(shapes)]
            await node.client.push(list(range(len(shapes))), g, [np.empty_like(x) for x in g], 0)

    return run(main())


def stalled_worker(rank: int, shapes, config: PSConfig, pause: float):
    async def main():
        async with await PSNode.start(manifest_of(shapes), config) as node:
            if rank == 1:
                await asyncio.sleep(pause)
            g = [grad(rank, 0, i, s) for i, s in enumerate(shapes)]
            await node.client.push(list(range(len(shapes))), g, [np.empty_like(x) for x in g], 0)

    return run(main())


def shard_process(rank: int, index_base: int, workers: int):
    """A standalone shard: ``rank`` here is its position among the shard processes."""
    import os

    from poseidon_aio.ps.server import serve_shard

    return run(
        serve_shard(
            rank + index_base,
            master_addr="127.0.0.1",
            master_port=int(os.environ["MASTER_PORT"]),
            workers=workers,
            timeout=60,
        )
    )
