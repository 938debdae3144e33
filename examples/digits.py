"""Train a small CNN with a fully-connected head on scikit-learn's handwritten digits, data-parallel.

    poseidon-aio run -n 4 examples/digits.py            # 4 local workers (torchrun underneath)
    poseidon-aio run -n 4 examples/digits.py --compression auto --plan-bandwidth 100mbit

Every epoch, one seeded permutation of the 1437 training images is cut into global batches of
``--batch`` images; worker ``r`` of ``P`` trains on the ``r``-th slice of each. The convolutions
sync through the parameter server; the FC layer whose sufficient factors are cheaper than its
gradient goes by sufficient factor broadcasting. Rank 0 then trains the same model in one process on
the same global batches for the same epochs, and prints both test accuracies (360 held-out images).

``--compression auto`` (or ``fp16``, ``powersgd``, ``topk``) lets the planner weigh lossy schemes
per layer; the accuracy guard is then 0.5 points of the exact single-process run on the mean over
seeds (``python -m bench accuracy``: one lossy run is a sample, up to 1.1 points either side). On
loopback the measured link is fast and "auto" may rightly keep every layer exact:
``--plan-bandwidth 100mbit`` plans for a stated link instead (the bytes still cross loopback), so
the guard exercises compression.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch
from torch import nn

import poseidon_aio
from poseidon_aio.units import parse_rate


def build_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 128),
        nn.ReLU(),
        nn.Linear(128, 10),
    )


def load(seed: int):
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    test, train = order[:360], order[360:]
    return (x[train], y[train]), (x[test], y[test])


def global_batches(n: int, batch: int, epoch: int, seed: int):
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1000 + epoch))
    for i in range(n // batch):
        yield perm[i * batch : (i + 1) * batch]


def accuracy(model: nn.Module, data) -> float:
    model.eval()
    with torch.no_grad():
        return float((model(data[0]).argmax(1) == data[1]).float().mean()) * 100


def make_optimizer(model: nn.Module):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return opt, torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1)


def single_process(args, train, test) -> float:
    model = build_model(args.seed)
    opt, sched = make_optimizer(model)
    sched.T_max = args.epochs
    for epoch in range(args.epochs):
        model.train()
        for idx in global_batches(len(train[1]), args.batch, epoch, args.seed):
            opt.zero_grad()
            nn.functional.cross_entropy(model(train[0][idx]), train[1][idx]).backward()
            opt.step()
        sched.step()
    return accuracy(model, test)


async def distributed(args, train, test):
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} must be a multiple of the {world} workers")
    local = args.batch // world
    model = build_model(args.seed)
    opt, sched = make_optimizer(model)
    sched.T_max = args.epochs
    steps = len(train[1]) // args.batch
    bar, every = None, 0
    if rank == 0 and not args.quiet:
        if sys.stdout.isatty():
            from tqdm import tqdm

            bar = tqdm(
                total=steps * args.epochs,
                desc=f"{world} workers, {args.mode}",
                unit="step",
                file=sys.stdout,
                mininterval=1.0,
            )
        else:  # a log file: a line per tenth of the run, not a bar redrawn with carriage returns
            every = max(1, steps * args.epochs // 10)
    started, stalled, moved, schemes = time.perf_counter(), 0.0, {}, {}
    compression = None
    if args.compression != "none":
        from poseidon_aio.plan import CompressionConfig, Link

        link = (
            Link.of_bandwidth(args.plan_bandwidth / 8, 1e-4) if args.plan_bandwidth else None
        )  # 100 us a round: a LAN's
        compression = CompressionConfig(args.compression, link=link)
    async with poseidon_aio.Trainer(
        model, opt, nn.functional.cross_entropy, mode=args.mode, compression=compression
    ) as trainer:
        for epoch in range(args.epochs):
            losses = []
            for idx in global_batches(len(train[1]), args.batch, epoch, args.seed):
                mine = idx[rank * local : (rank + 1) * local]
                stats = await trainer.step((train[0][mine], train[1][mine]))
                losses.append(stats.loss)
                stalled += stats.stall_s
                schemes = stats.schemes
                for k, v in stats.bytes.items():
                    moved[k] = moved.get(k, 0) + v
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(epoch=epoch + 1, loss=f"{np.mean(losses):.3f}")
                elif every and (stats.clock + 1) % every == 0:
                    print(
                        f"step {stats.clock + 1}/{steps * args.epochs} epoch {epoch + 1} loss {np.mean(losses):.3f}",
                        flush=True,
                    )
            sched.step()
    if bar is not None:
        bar.close()
    return model, time.perf_counter() - started, stalled, moved, schemes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch", type=int, default=64, help="global batch (split over the workers)")
    parser.add_argument("--mode", default="poseidon", choices=["naive", "wfbp", "poseidon"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--compression",
        default="none",
        choices=["none", "auto", "fp16", "powersgd", "topk"],
        help="lossy gradient compression (mode poseidon)",
    )
    parser.add_argument(
        "--plan-bandwidth",
        type=parse_rate,
        help="plan as if each link were this, e.g. 100mbit (default: the link measured at start)",
    )
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if "RANK" not in os.environ:
        raise SystemExit("start with: poseidon-aio run -n 4 examples/digits.py (it sets RANK, WORLD_SIZE, ...)")
    train, test = load(args.seed)
    model, elapsed, stalled, moved, schemes = poseidon_aio.run(distributed(args, train, test))
    if int(os.environ["RANK"]) != 0:
        return 0
    ours = accuracy(model, test)
    world = int(os.environ["WORLD_SIZE"])
    print(f"layer schemes: {schemes}")
    print(
        f"{world} workers: {elapsed:.1f} s, {stalled:.1f} s stalled on communication, rank 0 moved "
        + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in moved.items())
    )
    single = single_process(args, train, test)
    how = args.mode if args.compression == "none" else f"{args.mode}, compression {args.compression}"
    print(
        f"test accuracy: {world} workers ({how}) {ours:.2f}%   "
        f"single process, same global batch and epochs {single:.2f}%"
    )
    if args.compression != "none":
        lossy = {k: v for k, v in schemes.items() if v in ("fp16", "powersgd", "topk")}
        print(f"lossy layers: {lossy or 'none'}")
    # Exact schemes differ from one process by float32 summation order only: 1 point (3.6 of 360
    # images) is already generous. A lossy scheme moves the trajectory, and where one run ends is
    # a sample: top-k at 1 % ended up to 1.1 points either side of exact over 20 seeds, mean -0.14.
    # Its guard, 0.5 points, is on the mean over seeds (python -m bench accuracy); one run fails
    # only past 2 points, beyond any seed measured.
    diff = ours - single
    if args.compression == "none":
        ok = abs(diff) <= 1.0
        print("OK: within 1 point" if ok else "MISMATCH: more than 1 point apart")
        return 0 if ok else 1
    ok = abs(diff) <= 2.0
    print(
        f"{'OK' if ok else 'MISMATCH'}: {diff:+.2f} points from exact "
        "(this run; the guard of 0.5 points is on the mean over seeds: python -m bench accuracy)"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
