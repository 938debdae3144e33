"""``python -m bench soak``: does a long run hold its memory? RSS of every worker over 20 k steps.

Two worker processes train a small CNN with BatchNorm and an FC head (mode ``poseidon``: the
convolutions by PS, the FC layer by SFB, MG-WFBP merging after 3 steps) on synthetic batches, once
with tracing off and once with tracing on (a ring of ``--ring`` events). Each rank samples its
resident set size (``/proc/self/status`` VmRSS) every ``--every`` steps. Growth is measured from
the end of warm-up (``--warmup`` steps: allocator pools, the merge plan and the trace ring filling
are start-up, not leaks) to the last step; the figure per run is the largest rank's.

Last line: one JSON object with ``rss_growth_pct`` per run and ``max_rss_growth_pct``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import tempfile
import time

from bench import free_port, rank_env


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _worker(rank: int, world: int, port: int, steps: int, every: int, trace: str, ring: int, out) -> None:
    os.environ.update(rank_env(rank, world, port))
    import torch
    from torch import nn

    import poseidon_aio
    from poseidon_aio.train import TraceConfig

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(16 * 4 * 4, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(16, 1, 8, 8, generator=g), torch.randint(0, 10, (16,), generator=g)) for _ in range(8)]

    async def main():
        samples = []
        trace_config = TraceConfig(trace or None, ring=ring)
        async with poseidon_aio.Trainer(model, opt, nn.functional.cross_entropy, trace=trace_config) as trainer:
            started = time.perf_counter()
            for t in range(steps):
                await trainer.step(batches[t % len(batches)])
                if (t + 1) % every == 0:
                    samples.append((t + 1, rss_bytes()))
            elapsed = time.perf_counter() - started
        return samples, elapsed

    out.put((rank, *poseidon_aio.run(main())))


def soak(world: int, steps: int, every: int, trace: str, ring: int) -> tuple:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, steps, every, trace, ring, out)) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    for _ in procs:
        rank, samples, elapsed = out.get(timeout=3600)
        results[rank] = (samples, elapsed)
    for p in procs:
        p.join(60)
    return results


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench soak", description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--warmup", type=int, default=2_000)
    parser.add_argument("--every", type=int, default=1_000)
    parser.add_argument("--ring", type=int, default=20_000, help="trace events kept per rank in the traced run")
    args = parser.parse_args(argv)
    if args.warmup % args.every or args.warmup >= args.steps:
        parser.error("--warmup must be a multiple of --every and below --steps")
    with tempfile.TemporaryDirectory(prefix="bench-soak-") as tmp:  # the traced run's file goes with it
        runs = {"trace off": "", f"trace on (ring {args.ring})": os.path.join(tmp, "soak.json")}
        print(
            f"# bench soak: {args.workers} workers, {args.steps} steps, "
            f"RSS every {args.every} steps, growth from step {args.warmup}"
        )
        print(
            f"# {platform.machine()}, {os.cpu_count()} cores, "
            f"Python {platform.python_version()}, {time.strftime('%Y-%m-%d')}"
        )
        print()
        print("| run | steps/s | RSS at warm-up (MiB) | RSS at end (MiB) | growth (largest rank) |")
        print("|---|---|---|---|---|")
        figures = {}
        for label, trace in runs.items():
            results = soak(args.workers, args.steps, args.every, trace, args.ring)
            worst = None
            for rank, (samples, elapsed) in results.items():
                at = dict(samples)
                start, end = at[args.warmup], samples[-1][1]
                growth = (end - start) / start * 100
                if worst is None or growth > worst[0]:
                    worst = (growth, start, end, args.steps / elapsed)
            growth, start, end, rate = worst
            figures[label] = round(growth, 2)
            print(f"| {label} | {rate:.0f} | {start / 2**20:.1f} | {end / 2**20:.1f} | {growth:+.2f} % |")
        print()
        print(
            json.dumps(
                {
                    "bench": "soak",
                    "workers": args.workers,
                    "steps": args.steps,
                    "warmup": args.warmup,
                    "rss_growth_pct": figures,
                    "max_rss_growth_pct": max(figures.values()),
                }
            )
        )


if __name__ == "__main__":
    main()
