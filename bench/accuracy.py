"""``python -m bench accuracy``: issue 13's accuracy guard, lossy compression against exact
training on real data, over several seeds.

Every run is ``examples/digits.py`` as a user starts it, ``poseidon-aio run -n 4 examples/digits.py
--compression METHOD --plan-bandwidth 100mbit --seed S``: 4 worker processes over loopback sockets
train the digits CNN for 12 epochs, then rank 0 trains the same model in one process on the same
global batches (exact, the reference) and prints both test accuracies on the 360 held-out images.
One image is 0.28 points. ``--plan-bandwidth`` makes the lossy planner weigh the schemes for a 100
Mbit link (on loopback's measured rate "auto" rightly keeps every layer exact).

Why seeds. A lossy scheme moves the training's trajectory, and on 360 test images the end of a
moved trajectory lands a few images either side of the exact one: the same 12 epochs with
top-k at 1 % on the FC layer, emulated in one process over 20 seeds, ended -1.1 to +1.1 points from
exact (mean -0.14), with top-k at 5 % -1.1 to +0.6, with fp16 -0.6 to +0.6, while reordering exact
float32 sums moved two of the 20 by one image; with real processes PowerSGD ended -0.8 to +0.6
over 10 seeds (bench/RESULTS.md, "The accuracy guard over seeds", 2026-11-25). So one run's
difference is a sample; the guard is the mean over seeds, and every seed is shown.

``--emulate`` studies the spread fast, in one process: the example's model, data, optimizer and
batches, P workers' gradients computed one after another on the same replica, every matrix of at
least 16 384 elements (``CompressionConfig.min_elements``: on this model the 512 -> 128 FC layer)
synced by the library's own arithmetic (``TopKStep`` with each worker's error feedback; fp16 by
the half codec's ``encode``/``expand`` and a rank-order float32 mean), the rest by an exact
rank-order mean. ``exact`` there sums the ranks in reverse order (float32 order only). Variants:
``fp16``, ``topk`` or ``topk:RATIO``, ``topk-warmup:STEPS`` (DGC's density warm-up: 25 %, 6.25 %,
1.56 %, STEPS steps each, then the ratio), ``topk-after:STEPS`` (exact for the first STEPS steps,
as DDP's PowerSGD hook's ``start_powerSGD_iter``). 20 seeds take about a minute a variant.

The last line is one JSON object: per method the mean, standard deviation and largest absolute
difference (points) and the lossy layers chosen; ``mean_diff_points_auto`` is the guard's figure
(goal: within 0.5 points).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import time
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ACCURACY = re.compile(r"test accuracy: .*? ([0-9.]+)%\s+single process.*? ([0-9.]+)%")
LOSSY = re.compile(r"lossy layers: (.*)")


def seeds_of(text: str) -> list:
    """``"0-4"`` or ``"0,3,7"``."""
    if "-" in text:
        first, last = (int(x) for x in text.split("-"))
        return list(range(first, last + 1))
    return [int(x) for x in text.split(",")]


def summary_of(diffs: list) -> dict:
    """Mean, sd and largest absolute difference (points) of one method's runs, and the runs."""
    return {
        "mean": round(statistics.mean(diffs), 3),
        "sd": round(statistics.stdev(diffs), 3) if len(diffs) > 1 else 0.0,
        "max_abs": round(max(abs(d) for d in diffs), 3),
        "diffs": diffs,
    }


def one_run(method: str, seed: int, args) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "poseidon_aio.cli",
        "run",
        "-n",
        str(args.workers),
        "examples/digits.py",
        "--quiet",
        "--seed",
        str(seed),
        "--epochs",
        str(args.epochs),
        "--compression",
        method,
    ]
    if method != "none":
        cmd += ["--plan-bandwidth", args.plan_bandwidth]
    started = time.perf_counter()
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"{method}, seed {seed}: no result within {args.timeout} s ({' '.join(cmd)})") from None
    found = ACCURACY.search(done.stdout)
    if found is None:  # the example exits 1 on a missed per-run check, but then it printed both
        raise SystemExit(
            f"{method}, seed {seed}: no accuracies in its output (exit {done.returncode}):\n"
            f"{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
        )
    ours, single = float(found.group(1)), float(found.group(2))
    lossy = LOSSY.search(done.stdout)
    return {
        "method": method,
        "seed": seed,
        "ours": ours,
        "single": single,
        "diff": round(ours - single, 4),
        "lossy": lossy.group(1) if lossy else "",
        "wall_s": round(time.perf_counter() - started, 1),
    }


def _example():
    spec = importlib.util.spec_from_file_location("digits_example", os.path.join(ROOT, "examples", "digits.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ratio_at(variant: str, step: int, ratio: float) -> Optional[float]:
    """Top-k's density at ``step`` under ``variant``; ``None``: exact this step."""
    name, _, arg = variant.partition(":")
    if name == "topk":
        return float(arg) if arg else ratio
    if name == "topk-warmup":
        stage = step // int(arg)
        return max(ratio, 0.25 ** (stage + 1)) if stage < 3 else ratio
    if name == "topk-after":
        return None if step < int(arg) else ratio
    raise SystemExit(f"unknown variant {variant!r}")


def emulate(digits, variant: str, seed: int, workers: int, epochs: int, batch: int = 64, ratio: float = 0.01) -> float:
    """Test accuracy after training the example's (``digits``, the loaded module) model as
    ``workers`` workers would under ``variant`` (one process; see the module's docstring)."""
    import numpy as np
    import torch
    from torch import nn

    from poseidon_aio.plan.lossy import MIN_ELEMENTS
    from poseidon_aio.sync.compress import Feedback, TopKStep, rank_order_mean
    from poseidon_aio.wire import half

    train, test = digits.load(seed)
    model = digits.build_model(seed)
    opt, sched = digits.make_optimizer(model)
    sched.T_max = epochs
    params = list(model.parameters())
    lossy = [i for i, p in enumerate(params) if p.dim() >= 2 and p.numel() >= MIN_ELEMENTS]
    feedback = [Feedback() for _ in range(workers)]
    local, step = batch // workers, 0
    for epoch in range(epochs):
        model.train()
        for idx in digits.global_batches(len(train[1]), batch, epoch, seed):
            grads = []
            for r in range(workers):
                mine = idx[r * local : (r + 1) * local]
                opt.zero_grad(set_to_none=True)
                nn.functional.cross_entropy(model(train[0][mine]), train[1][mine]).backward()
                grads.append([p.grad.numpy().copy() for p in params])
            order = list(reversed(range(workers))) if variant == "exact" else list(range(workers))
            mean = [rank_order_mean([grads[r][i] for r in order]) for i in range(len(params))]
            for i in lossy if variant != "exact" else ():
                if variant == "fp16":
                    mean[i] = rank_order_mean([half.expand(half.encode(g[i].reshape(-1))) for g in grads]).reshape(
                        params[i].shape
                    )
                    continue
                density = _ratio_at(variant, step, ratio)
                if density is None:
                    continue
                steps = [TopKStep(str(i), [g[i]], density, feedback[r]) for r, g in enumerate(grads)]
                parts = [s.begin() for s in steps]
                mean[i] = [s.finish(parts) for s in steps][0][0]
            for p, g in zip(params, mean):
                p.grad = torch.from_numpy(np.ascontiguousarray(g, dtype=np.float32))
            opt.step()
            step += 1
        sched.step()
    return digits.accuracy(model, test)


def run_emulation(args, seeds) -> dict:
    import torch

    torch.set_num_threads(1)
    digits = _example()
    print("| variant | seeds | differences from one process, exact (points) | mean | sd | largest abs |")
    print("|---|---|---|---|---|---|")
    out = {}
    reference = {}
    for variant in args.emulate.split(","):
        diffs = []
        for seed in seeds:
            if seed not in reference:
                reference[seed] = digits_single(digits, seed, args.epochs)
            diffs.append(round(emulate(digits, variant, seed, args.workers, args.epochs) - reference[seed], 4))
        s = out[variant] = summary_of(diffs)
        print(
            f"| {variant} | {args.seeds} | {' '.join(f'{d:+.2f}' for d in diffs)} | "
            f"{s['mean']:+.2f} | {s['sd']:.2f} | {s['max_abs']:.2f} |",
            flush=True,
        )
    return {"emulated": True, "workers": args.workers, "epochs": args.epochs, "seeds": seeds, "variants": out}


def digits_single(digits, seed: int, epochs: int) -> float:
    """The example's own one-process exact run."""
    args = argparse.Namespace(seed=seed, epochs=epochs, batch=64)
    train, test = digits.load(seed)
    return digits.single_process(args, train, test)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench accuracy", description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="auto", help="comma list of none, auto, fp16, powersgd, topk")
    parser.add_argument("--seeds", default="0-4", help="e.g. 0-4 or 0,3,7")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--plan-bandwidth", default="100mbit")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument(
        "--emulate",
        help="comma list of variants to emulate in one process instead (see above), e.g. exact,fp16,topk,topk:0.05",
    )
    args = parser.parse_args(argv)
    methods, seeds = args.methods.split(","), seeds_of(args.seeds)
    if args.emulate:
        out = run_emulation(args, seeds)
        print(json.dumps(out))
        return out
    runs = []
    print("| method | seed | 4 workers % | one process, exact % | difference (points) | lossy layers |")
    print("|---|---|---|---|---|---|")
    for method in methods:
        for seed in seeds:
            r = one_run(method, seed, args)
            runs.append(r)
            print(
                f"| {method} | {seed} | {r['ours']:.2f} | {r['single']:.2f} | {r['diff']:+.2f} | {r['lossy'] or '-'} |",
                flush=True,
            )
    summary = {}
    print()
    print("| method | mean difference | sd | largest abs | seeds |")
    print("|---|---|---|---|---|")
    for method in methods:
        diffs = [r["diff"] for r in runs if r["method"] == method]
        s = summary[method] = summary_of(diffs)
        print(f"| {method} | {s['mean']:+.2f} | {s['sd']:.2f} | {s['max_abs']:.2f} | {len(diffs)} |")
    out = {
        "workers": args.workers,
        "epochs": args.epochs,
        "seeds": seeds,
        "plan_bandwidth": args.plan_bandwidth,
        "methods": summary,
        "runs": runs,
    }
    for method, s in summary.items():
        out[f"mean_diff_points_{method}"] = s["mean"]
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
