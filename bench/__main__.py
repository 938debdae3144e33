"""``python -m bench <name>``: the benchmarks. Each prints a markdown table and, as its last line,
one JSON object with the figures (ratios taken in the same run)."""

from __future__ import annotations

import importlib
import sys

BENCHES = {
    "transport": "bench.transport",
    "ps": "bench.ps",
    "train": "bench.train",
    "mgwfbp": "bench.mgwfbp",
    "soak": "bench.soak",
    "simulate": "bench.simulate",
    "compress": "bench.compress",
    "paper": "bench.paper",
    "patterns": "bench.patterns",
    "accuracy": "bench.accuracy",
    "hosts": "bench.hosts",
    "profile": "bench.profile",
    "inside": "bench.inside",
    "idle": "bench.idle",
}


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in BENCHES:
        sys.exit(f"usage: python -m bench {{{','.join(BENCHES)}}} [options]")
    module = importlib.import_module(BENCHES[sys.argv[1]])
    module.main(sys.argv[2:])


if __name__ == "__main__":
    main()
