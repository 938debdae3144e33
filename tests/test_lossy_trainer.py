"""Gradient compression across real worker processes: replicas identical, runs repeatable (and
PowerSGD's and top-k's the same bits with their layers merged), fp16 close to one process, error feedback
through a checkpoint."""

from __future__ import annotations

import numpy as np
import pytest

from poseidon_aio.plan import CompressionConfig, Link

from .support.cluster import run_workers
from .support.trainworkers import single_process, train_worker

pytestmark = pytest.mark.slow

# Plan for a 100 Mbit link with 100 us a round, whatever loopback measures, and let layers of
# 64 elements and up go lossy: every method then has layers to act on in these small models.
SLOW = Link.of_bandwidth(12.5e6, 1e-4)
METHODS = ("fp16", "powersgd", "topk", "auto")
LR, MOMENTUM = 0.05, 0.9  # trainworkers.make_optimizer


# Compression compute as this machine measures it (best of 3, unloaded). Given, not measured, so
# that "auto" plans the same on a loaded machine and the -again runs can be compared bit for bit.
COMPUTE = {"fp16": (0.0, 2e-8), "powersgd": (4e-5, 1e-8), "topk": (0.0, 2e-8)}


def _config(method: str) -> CompressionConfig:
    return CompressionConfig(method, rank=2, ratio=0.1, min_elements=64, link=SLOW, compute=COMPUTE)


def test_every_method_keeps_replicas_identical_repeats_bit_for_bit_and_fp16_tracks_one_process():
    from .support.lossyworkers import max_gradient

    spec = {"kind": "cnn", "channels": 4, "side": 8, "hidden": [32], "classes": 3}
    workers, seed, steps, size = 3, 11, 3, 4
    runs = []
    for method in METHODS:
        runs.append((method, "poseidon", None, None, {"compression": _config(method)}))
        runs.append((f"{method}-again", "poseidon", None, None, {"compression": _config(method)}))
    # PowerSGD's and top-k's layers in one message (MG-WFBP's "single"): the same bits as each on its own
    runs.append(("powersgd-merged", "poseidon", None, "single", {"compression": _config("powersgd")}))
    runs.append(("topk-merged", "poseidon", None, "single", {"compression": _config("topk")}))
    res = run_workers(workers, train_worker, spec, seed, runs, steps, size, {}, timeout=300)
    for label, *_ in runs:
        params = res[0][label]["params"]
        for r in range(1, workers):
            assert all(a.tobytes() == b.tobytes() for a, b in zip(params, res[r][label]["params"])), (
                f"{label}: rank {r}'s replica differs from rank 0's"
            )
    for method in METHODS:
        first, again = res[0][method]["params"], res[0][f"{method}-again"]["params"]
        assert all(a.tobytes() == b.tobytes() for a, b in zip(first, again)), f"{method}: the same seed gave other bits"
        schemes = res[0][method]["schemes"]
        lossy = [s for s in schemes.values() if s in ("fp16", "powersgd", "topk")]
        assert lossy, f"{method}: no layer went lossy ({schemes})"
        if method != "auto":
            assert set(lossy) == {method}
        assert all(res[0][method]["bytes"].get(s, 0) > 0 for s in lossy)
    for method in ("powersgd", "topk"):
        merged = res[0][f"{method}-merged"]
        assert any(len(g) > 1 and all(merged["schemes"][n] == method for n in g) for g in merged["groups"]), merged[
            "groups"
        ]
        assert all(a.tobytes() == b.tobytes() for a, b in zip(res[0][method]["params"], merged["params"])), (
            f"{method}: merged layers gave other bits"
        )
    # fp16 against one process. Each step's aggregate is off by at most two float16 roundings
    # (a peer's contribution and the mean), (1 + 2^-11)^2 - 1 < 2^-10 relative, so at most
    # 2^-10 G per element, G the largest gradient. SGD with momentum m moves a parameter over
    # 3 steps by lr (v0 + v1 + v2) = lr ((1 + m + m^2) g0 + (1 + m) g1 + g2): 3 + 2m + m^2 = 5.61
    # gradient-sized terms, each off by at most 2^-10 G. A factor 2 covers the gradients' own
    # drift once the parameters differ by that much (weight decay 1e-4 adds nothing visible).
    bound = 2 * LR * (3 + 2 * MOMENTUM + MOMENTUM**2) * 2**-10 * max_gradient(spec, seed, workers, steps, size)
    reference = single_process(spec, seed, workers, steps, size)
    worst = max(float(np.abs(a - ref).max()) for a, ref in zip(res[0]["fp16"]["params"], reference))
    assert worst <= bound, f"fp16 is {worst} from one process, over the bound {bound}"


@pytest.mark.timeout(400)
def test_a_killed_compressed_run_resumes_with_its_error_feedback_bitwise_equal(tmp_path):
    from .support.cluster import collect, start_workers
    from .support.lossyworkers import lossy_checkpoint_worker

    steps, seed = 6, 4
    clean = run_workers(
        2, lossy_checkpoint_worker, [("clean", str(tmp_path / "clean"), None)], seed, steps, timeout=180
    )
    schemes = clean[0]["clean"]["schemes"]
    assert schemes["fc1"] == "powersgd" and schemes["fc2"] == "topk" and schemes["conv"] == "topk"
    directory = str(tmp_path / "crash")
    procs, out = start_workers(2, lossy_checkpoint_worker, [("crash", directory, 4)], seed, steps)
    collect(procs, out, timeout=120, expect_errors=True)  # killed after step 4: saved at clocks 2 and 4
    assert [p.exitcode for p in procs] != [0, 0]
    resumed = run_workers(2, lossy_checkpoint_worker, [("crash", directory, None)], seed, steps, timeout=180)
    for r in range(2):
        got, ref = resumed[r]["crash"], clean[r]["clean"]
        assert got["start"] == 4 and got["restored"] == 3  # the three lossy layers' state came back
        for name in ref["state"]:
            assert ref["state"][name].tobytes() == got["state"][name].tobytes(), (
                f"rank {r}'s {name} differs after resuming"
            )
        assert sorted(ref["feedback"]) == sorted(got["feedback"])
        for key in ref["feedback"]:
            assert ref["feedback"][key].tobytes() == got["feedback"][key].tobytes(), (
                f"rank {r}'s error feedback {key} differs"
            )
