"""Real processes exchanging tensors over poseidon_aio connections: an all-to-all sum.

Each of ``--workers`` processes listens on 127.0.0.1, dials every lower rank (a full mesh of
authenticated connections), and for ``--rounds`` rounds sends its float32 vector to every peer,
receives theirs straight into per-peer receive buffers (zero copy), and sums them in rank order.
Every rank must end with the bitwise-same sum, equal to the float64 reference within float32
rounding. Prints a line per round and the bytes each rank moved per second.

    python examples/exchange.py --workers 4 --mib 16 --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import multiprocessing
import os
import queue
import sys
import time

import numpy as np

from poseidon_aio.net import NetConfig, connect, listen, run
from poseidon_aio.wire import CODEC, DType, Kind


def vector(rank: int, rnd: int, n: int) -> np.ndarray:
    return np.random.default_rng([rank, rnd]).standard_normal(n, dtype=np.float32)


def worker(rank: int, world: int, n: int, rounds: int, token: bytes, ports_q, addr_pipe, out_q) -> None:
    async def main():
        config = NetConfig(token=token)
        peers: dict = {}
        arrived = asyncio.Event()

        def accept(conn):
            peers[conn.peer_rank] = conn
            if len(peers) == world - 1:
                arrived.set()

        listener = await listen("127.0.0.1", 0, rank=rank, config=config, on_connection=accept)
        ports_q.put((rank, listener.address[1]))
        ports = await asyncio.to_thread(addr_pipe.recv)
        async with asyncio.timeout(60):
            for peer in range(rank):
                conn = await connect("127.0.0.1", ports[peer], rank=rank, config=config)
                accept(conn)
            if world > 1:
                await arrived.wait()
        recv = {p: np.empty(n, dtype=np.float32) for p in peers}
        moved, started = 0, time.perf_counter()
        for rnd in range(rounds):
            mine = vector(rank, rnd, n)
            waits = {p: peers[p].expect(Kind.DATA, key=0, clock=rnd, into=recv[p]) for p in peers}
            async with asyncio.timeout(120):
                await asyncio.gather(
                    *(peers[p].send(Kind.DATA, mine, key=0, clock=rnd, dtype=DType.FLOAT32) for p in peers)
                )
                await asyncio.gather(*waits.values())
            total = np.zeros(n, dtype=np.float32)
            for p in range(world):  # a fixed rank order: every rank computes the same bits
                total += mine if p == rank else recv[p]
            moved += 2 * mine.nbytes * len(peers)
            out_q.put((rank, rnd, hashlib.sha256(total.tobytes()).hexdigest()[:16], float(total[:4].sum())))
        elapsed = time.perf_counter() - started
        for conn in peers.values():
            await conn.close()
        await listener.close()
        out_q.put((rank, "done", moved / elapsed / 2**20, None))

    run(main())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--mib", type=float, default=16, help="MiB of float32 per vector")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    n = int(args.mib * 2**20) // 4
    token = os.urandom(32)
    ctx = multiprocessing.get_context("spawn")
    ports_q, out_q = ctx.Queue(), ctx.Queue()
    pipes = [ctx.Pipe() for _ in range(args.workers)]
    procs = [
        ctx.Process(target=worker, args=(r, args.workers, n, args.rounds, token, ports_q, pipes[r][1], out_q))
        for r in range(args.workers)
    ]
    for p in procs:
        p.start()
    print(f"{args.workers} processes, codec {CODEC}, {args.mib} MiB float32 per rank per round")
    ports = dict(ports_q.get(timeout=60) for _ in procs)
    for parent, _ in pipes:
        parent.send(ports)
    ok = True
    digests: dict = {}
    rates = {}
    for _ in range(args.workers * (args.rounds + 1)):
        while True:
            try:
                rank, rnd, a, b = out_q.get(timeout=1)
                break
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead:
                    for p in procs:
                        p.kill()
                    print(f"FAILED: rank(s) {dead} exited early")
                    return 1
        if rnd == "done":
            rates[rank] = a
            continue
        digests.setdefault(rnd, {})[rank] = a
        if len(digests[rnd]) == args.workers:
            same = len(set(digests[rnd].values())) == 1
            ref = sum(vector(r, rnd, n)[:4].astype(np.float64).sum() for r in range(args.workers))
            close = abs(b - ref) <= 1e-4 * max(1.0, abs(ref))
            ok &= same and close
            print(f"round {rnd}: sums bitwise identical on all ranks: {same}; matches float64 reference: {close}")
    for p in procs:
        p.join(60)
        ok &= p.exitcode == 0
    print(
        "per-rank traffic (sent + received): " + ", ".join(f"rank {r} {v:.0f} MiB/s" for r, v in sorted(rates.items()))
    )
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
