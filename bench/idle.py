"""``python -m bench idle``: the CPU the same work costs back to back and after the thread slept.

A step's fixed machinery runs once a step: every 4 ms on a CPU-bound row, every 22-300 ms where a
100 Mbit link sets the step. Between steps the thread sleeps, and whatever it had in the core's
caches and predictors is another thread's (or another guest's) by the time it wakes. This bench
times one fixed piece of work (its thread's CPU) back to back and after each of several sleeps,
the gaps interleaved round by round: Python calls like the step machinery's (method calls, dict
lookups, small allocations) and one torch op over a CNN's gradient (the C++ side of a step).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

GAPS_MS = (0.0, 4.0, 22.0, 50.0)


class _Part:
    """Something the step machinery keeps: a few attributes and a dict it looks things up in."""

    def __init__(self, n: int) -> None:
        self.by_key = {k: [k] for k in range(n)}
        self.count = 0

    def note(self, key: int) -> int:
        self.count += len(self.by_key.get(key, ()))
        return self.count


def python_calls(parts: list, calls: int) -> None:
    per = calls // len(parts)
    for part in parts:
        for key in range(per):
            part.note(key)


def torch_op(a: torch.Tensor, b: torch.Tensor) -> None:
    a.add_(b).mul_(0.5)


def measure(work, gap_s: float, iterations: int) -> float:
    """The median CPU of one ``work()`` (thread time, µs) with ``gap_s`` of sleep before each."""
    spent = []
    for _ in range(iterations):
        if gap_s:
            time.sleep(gap_s)
        start = time.thread_time_ns()
        work()
        spent.append(time.thread_time_ns() - start)
    return statistics.median(spent) / 1e3


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench idle", description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1000, help="Python calls a piece of work")
    parser.add_argument("--floats", type=int, default=66_557, help="float32 elements the torch op adds (the CNN's)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iterations", type=int, default=40, help="pieces of work a gap and round")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    parts = [_Part(50) for _ in range(max(1, args.calls // 5))]
    a, b = torch.zeros(args.floats), torch.ones(args.floats)
    works = {"python": lambda: python_calls(parts, args.calls), "torch": lambda: torch_op(a, b)}
    rounds = {name: {gap: [] for gap in GAPS_MS} for name in works}
    for _ in range(args.rounds):
        for name, work in works.items():
            for gap in GAPS_MS:
                rounds[name][gap].append(measure(work, gap / 1e3, args.iterations))
    print(f"CPU of one piece of work, µs: median of {args.rounds} rounds (min–max); ÷ back to back\n")
    print("| work | " + " | ".join(f"after {g:g} ms" if g else "back to back" for g in GAPS_MS) + " |")
    print("|---|" + "---|" * len(GAPS_MS))
    figures = {}
    for name, by_gap in rounds.items():
        base = statistics.median(by_gap[0.0])
        cells = []
        for gap, xs in by_gap.items():
            med = statistics.median(xs)
            cells.append(f"{med:.1f} ({min(xs):.1f}–{max(xs):.1f})" + (f", {med / base:.2f} ×" if gap else ""))
            if gap:
                figures[f"{name}_after_{gap:g}ms_vs_back_to_back"] = round(med / base, 2)
        label = f"{args.calls} Python calls" if name == "python" else f"torch add_ and mul_ of {args.floats} floats"
        print(f"| {label} | " + " | ".join(cells) + " |")
    print(json.dumps({"bench": "idle", **figures}))


if __name__ == "__main__":
    main()
