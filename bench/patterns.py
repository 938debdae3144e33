"""``python -m bench patterns``: what the traffic pattern of an all-reduce costs on a capped link, plain sockets.

No poseidon_aio code: four processes, each in its own network namespace behind tc tbf (both
directions, bench/netns.py), move the bytes of one all-reduce of ``--mib`` per worker with asyncio
streams in three patterns, each repeat after a one-byte barrier:

* ``ring``: 2 (P - 1) steps, each sending a slice of b / P to rank + 1 and receiving one from
  rank - 1 (gloo's pattern): one flow leaves and one arrives per worker;
* ``mesh``: two rounds, each sending b / P to every other rank at once and receiving b / P from
  each (a reduce-scatter straight to the owners, then the owners' all-gather): P - 1 flows each
  way per worker;
* ``pairwise``: the mesh's bytes in P - 1 steps per round, step k to rank + k (one flow each way
  at a time, a different peer every step).

Every pattern moves 2 (P - 1) b / P each way per worker; the bound is that ÷ the rate. The figure is
the median over repeats of the slowest rank (the first repeat is dropped: connection warm-up).

``fan_in_efficiency`` turns the ring and the mesh into what the simulator's ``FlowEfficiency``
takes: the fraction of its rate a link delivers with one sender into it (the ring) and with P - 1
(the mesh), at each P asked; ``bench paper`` measures it on its emulation's links.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time

from poseidon_aio.units import parse_rate

PATTERNS = ("ring", "mesh", "pairwise")
RATES = {link: parse_rate(link) / 8 for link in ("100mbit", "1gbit")}  # bytes/s
PORT = 29555


async def _worker(rank: int, world: int, pattern: str, slice_bytes: int, repeats: int) -> list:
    from bench import netns

    addrs = [netns.address(i) for i in range(world)]
    incoming: dict = {}

    async def accepted(reader, writer):
        incoming[int((await reader.readexactly(4)).decode())] = reader

    server = await asyncio.start_server(accepted, addrs[rank], PORT)
    out = {}
    for q in range(world):
        if q == rank:
            continue
        for _ in range(100):  # the others may not listen yet
            try:
                _, writer = await asyncio.open_connection(addrs[q], PORT)
                break
            except OSError:
                await asyncio.sleep(0.1)
        else:
            raise TimeoutError(f"rank {rank}: rank {q} at {addrs[q]}:{PORT} did not answer within 10 s")
        writer.write(str(rank).encode().rjust(4))
        out[q] = writer
    async with asyncio.timeout(30):
        while len(incoming) < world - 1:
            await asyncio.sleep(0.01)
    payload = memoryview(bytes(slice_bytes))

    async def send(q: int, n: int) -> None:
        out[q].write(payload[:n])
        await out[q].drain()

    async def exchange(sends: list, recvs: list, n: int) -> None:
        await asyncio.gather(*(send(q, n) for q in sends), *(incoming[q].readexactly(n) for q in recvs))

    others = [q for q in range(world) if q != rank]
    times = []
    for _ in range(repeats):
        await exchange(others, others, 1)  # a barrier
        started = time.perf_counter()
        if pattern == "ring":
            for _ in range(2 * (world - 1)):
                await exchange([(rank + 1) % world], [(rank - 1) % world], slice_bytes)
        elif pattern == "mesh":
            for _ in range(2):
                await exchange(others, others, slice_bytes)
        else:
            for _ in range(2):
                for k in range(1, world):
                    await exchange([(rank + k) % world], [(rank - k) % world], slice_bytes)
        times.append(time.perf_counter() - started)
    # drain() returns with up to a high-water mark of bytes still in our buffer: a rank that left
    # now could take a peer's last bytes with it (seen: 6 872 of a 15.6 MB slice). A last barrier:
    # a peer's byte comes after it has read all of ours.
    await exchange(others, others, 1)
    for writer in out.values():
        writer.close()
    server.close()
    return times


def measure(world: int, rate: str, slice_bytes: int, repeats: int, patterns=PATTERNS) -> dict:
    """``{pattern: seconds}``: each pattern once on ``world`` fresh namespaces capped at ``rate`` (tc
    syntax), the median over ``repeats`` of the slowest rank (a first, warm-up repeat dropped)."""
    from bench import netns

    out = {}
    for pattern in patterns:
        with netns.hosts(world, rate) as names:
            cfgs = [
                dict(rank=i, world=world, pattern=pattern, slice=slice_bytes, repeats=repeats + 1) for i in range(world)
            ]
            procs = [
                subprocess.Popen(
                    ["ip", "netns", "exec", ns, sys.executable, "-m", "bench", "patterns", "--worker", json.dumps(c)],
                    stdout=subprocess.PIPE,
                    text=True,
                )
                for ns, c in zip(names, cfgs)
            ]
            per_rank = [json.loads(p.communicate(timeout=600)[0]) for p in procs]
        out[pattern] = statistics.median(max(r[i] for r in per_rank) for i in range(1, repeats + 1))
    return out


def fan_in_efficiency(worlds, rate_bits: float, seconds: float = 1.0, repeats: int = 3) -> dict:
    """``{senders: fraction of the rate delivered}`` on links capped at ``rate_bits``: from a ring
    (one sender into each down-link; the median over ``worlds``) and an all-to-all (``mesh``: P - 1
    senders) at each P of ``worlds`` above 2, each moving ``seconds`` of bytes a round; fraction =
    the bound (bytes each way ÷ rate) ÷ the time. What ``plan.simulator.FlowEfficiency`` takes."""
    rate = f"{rate_bits / 1e3:.0f}kbit"
    ones, points = [], {}
    for world in sorted({int(w) for w in worlds if int(w) >= 2}):
        slice_bytes = max(1 << 16, int(rate_bits / 8 * seconds / (world - 1)))
        bound = 2 * (world - 1) * slice_bytes / (rate_bits / 8)
        times = measure(world, rate, slice_bytes, repeats, ("ring", "mesh") if world > 2 else ("ring",))
        ones.append(min(1.0, bound / times["ring"]))
        if world > 2:
            points[world - 1] = round(min(1.0, bound / times["mesh"]), 3)
    if ones:
        points[1] = round(statistics.median(ones), 3)
    return dict(sorted(points.items()))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench patterns", description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--links", default="100mbit,1gbit")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument(
        "--mib", type=float, default=2.6, help="bytes all-reduced per worker, MiB (2.6: the transformer of bench train)"
    )
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=2, help="each pattern this many times, interleaved")
    args = parser.parse_args(argv)
    if args.worker:
        cfg = json.loads(args.worker)
        times = asyncio.run(_worker(cfg["rank"], cfg["world"], cfg["pattern"], cfg["slice"], cfg["repeats"]))
        print(json.dumps(times))
        return {}
    from bench import netns

    capped, why = netns.available()
    if not capped:
        sys.exit(f"bench patterns needs network namespaces: {why}")
    world = args.workers
    slice_bytes = int(args.mib * (1 << 20)) // world
    summary, lines = {}, []
    for link in args.links.split(","):
        bound = 2 * (world - 1) * slice_bytes / RATES[link]
        medians = {p: [] for p in PATTERNS}
        for _ in range(args.rounds):
            for pattern, seconds in measure(world, link, slice_bytes, args.repeats).items():
                medians[pattern].append(seconds)
        lines += [
            f"{world} workers, {link}, {args.mib} MiB all-reduced each, plain asyncio sockets: "
            f"seconds (median over {args.repeats} of the slowest rank, per round)",
            "",
            "| pattern | "
            + " | ".join(f"round {i + 1}" for i in range(args.rounds))
            + " | ÷ bound (rounds' min–max) |",
            "|---|" + "---|" * (args.rounds + 1),
        ]
        for pattern in PATTERNS:
            ratio = statistics.median(medians[pattern]) / bound
            summary[f"{pattern}_over_bound_{link}"] = round(ratio, 3)
            lo, hi = min(medians[pattern]) / bound, max(medians[pattern]) / bound
            cells = " | ".join(f"{m:.3f}" for m in medians[pattern])
            lines.append(f"| {pattern} | {cells} | {ratio:.2f} ({lo:.2f}–{hi:.2f}) |")
        lines += [f"bound: {bound:.3f} s", ""]
    print("\n".join(lines))
    result = {
        "bench": "patterns",
        "workers": world,
        "mib": args.mib,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        **summary,
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
