"""Repeat the GPU runs that once failed now and then: Project Adam's scheme (4 runs a round) and
SFB beside all-reduce and PS (1 run), 3 worker processes on one GPU, an MLP and a CNN, each run
checked as ``tests/test_gpu.py`` checks it: against the single-process CPU reference (within
float32 reordering) and across ranks (bit for bit).

Run from the repository root where torch sees a GPU, after ``scripts/gpu-check.sh`` built the
codec: ``PYTHONPATH=$PWD python3 scripts/gpu-repeat.py SECONDS [TAG]``. It prints a line per run
and a summary; ``CUDA_LAUNCH_BLOCKING=1`` in front runs every kernel synchronously (a failure that
goes away then is an ordering between streams). ``DEV=cpu`` runs the same on CPU tensors staged as
on a GPU (to try the script without one).
"""

import os
import sys
import time

from tests.support.cluster import run_workers
from tests.support.trainworkers import run_failures, single_process, train_worker

SPECS = [
    {"kind": "mlp", "inputs": 40, "hidden": [96, 48], "classes": 6},
    {"kind": "cnn", "channels": 4, "side": 8, "hidden": [32], "classes": 5},
]


def main() -> None:
    budget = float(sys.argv[1]) if len(sys.argv) > 1 else 120
    tag = sys.argv[2] if len(sys.argv) > 2 else "gpu"
    where = {"device": "cuda"} if os.environ.get("DEV", "cuda") == "cuda" else {"device": "cpu", "force_staging": True}
    workers, seed, steps, size = 3, 11, 3, 4
    refs = {s["kind"]: single_process(s, seed, workers, steps, size) for s in SPECS}
    start, rnd, fails, total = time.time(), 0, 0, 0
    while time.time() - start < budget:
        for spec in SPECS:
            runs = [(f"adam{i}", "poseidon", "adam-first-linear", None, where) for i in range(4)]
            runs.append(("mixed", "poseidon", "mixed", None, where))
            t = time.time()
            res = run_workers(workers, train_worker, spec, seed, runs, steps, size, {}, timeout=300)
            for label, *_ in runs:
                wrong = run_failures(res, label, spec, refs[spec["kind"]], workers)  # tests/test_gpu.py's checks
                total += 1
                fails += bool(wrong)
                print(
                    f"{tag} round {rnd} {spec['kind']} {label}: " + ("FAIL: " + "; ".join(wrong) if wrong else "ok"),
                    flush=True,
                )
            print(f"{tag} round {rnd} {spec['kind']}: {time.time() - t:.1f} s", flush=True)
        rnd += 1
    print(f"{tag}: {fails} of {total} runs failed", flush=True)
    sys.exit(1 if fails else 0)


if __name__ == "__main__":
    main()
