"""The trainer with its model on a CUDA GPU: the staging of gradients through host buffers, the
CuPy reconstruction of SFB layers, and every scheme, across real worker processes.

These run only where torch sees a GPU (the CI machines have none: they skip with the reason). The
CPU path is the tested reference; here the GPU path must give the same replicas on every rank,
bit for bit, and the single-process CPU result within float32 reordering.
"""

from __future__ import annotations

import pytest
import torch

from poseidon_aio import kernels

from .support.cluster import run_workers
from .support.trainworkers import run_failures, single_process, train_worker

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="no CUDA GPU on this machine: the GPU path of the trainer cannot run"
    ),
]

CUDA = {"device": "cuda"}
RUNS = [
    ("naive", "naive", None, None, CUDA),
    ("wfbp", "wfbp", None, None, CUDA),
    ("mgwfbp", "mgwfbp", None, None, CUDA),
    ("poseidon", "poseidon", None, None, CUDA),
    ("adam", "poseidon", "adam-first-linear", None, CUDA),
    ("allreduce", "poseidon", "every-allreduce", None, CUDA),
    ("mixed", "poseidon", "mixed", None, CUDA),  # SFB (the CuPy kernel), all-reduce and PS side by side
]

SPECS = [
    {"kind": "mlp", "inputs": 40, "hidden": [96, 48], "classes": 6},
    {"kind": "cnn", "channels": 4, "side": 8, "hidden": [32], "classes": 5},
]


def test_sfb_layers_on_a_gpu_are_rebuilt_by_the_cupy_kernel():
    if not kernels.cuda_available():
        pytest.skip("CuPy cannot run here: SFB on a GPU falls back to the torch kernel")
    assert kernels.kernel_for(torch.empty(2, 2, device="cuda")) == "cupy"


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s["kind"])
@pytest.mark.parametrize("workers", [2, 3])
def test_every_mode_on_a_gpu_keeps_replicas_identical_and_equals_one_process(spec, workers):
    seed, steps, size = 11, 3, 4
    res = run_workers(workers, train_worker, spec, seed, RUNS, steps, size, {}, timeout=300)
    reference = single_process(spec, seed, workers, steps, size)
    # Every run checked, every failure named (with its schemes): a GPU is rarely at hand to rerun.
    failures = [f for label, *_ in RUNS for f in run_failures(res, label, spec, reference, workers)]
    assert not failures, "\n".join(failures)
    assert "sfb" in res[0]["mixed"]["schemes"].values(), res[0]["mixed"]["schemes"]


AMP_RUNS = [
    ("loop", "loop", None),  # the user's loop: no_sync, synchronize, unscale, clip, scaler.step
    ("loop-mixed", "loop", {"0": "sfb", "2": "allreduce", "4": "ps"}),  # SFB's factors in fp16 too
    ("step", "step", None),  # step(batch, scaler=) under the caller's autocast
]


def amp_failures(res: dict, workers: int, inf_at: int, half: str) -> list:
    """What a DDP user expects of mixed precision: the forward ran in half precision, every rank
    skipped the step whose averaged gradient held an inf and halved its scale, training went on,
    and the replicas stayed bit for bit equal."""
    wrong = []
    for label, *_ in AMP_RUNS:
        for r in range(workers):
            run = res[r][label]
            scales, params = run["scales"], run["params"]
            if f"torch.{half}" not in run["dtypes"]:
                wrong.append(f"{label}: rank {r}'s forward ran in {run['dtypes']}, not {half}")
            if scales[inf_at] != scales[inf_at - 1] / 2:
                wrong.append(f"{label}: rank {r}'s scaler did not back off at the inf step: {scales}")
            if any(a.tobytes() != b.tobytes() for a, b in zip(params[inf_at], params[inf_at - 1])):
                wrong.append(f"{label}: rank {r} stepped on an inf")
            if all(a.tobytes() == b.tobytes() for a, b in zip(params[-1], params[inf_at])):
                wrong.append(f"{label}: rank {r} stopped stepping after the inf")
            if any(a.tobytes() != b.tobytes() for a, b in zip(params[-1], res[0][label]["params"][-1])):
                wrong.append(f"{label}: rank {r}'s replica differs from rank 0's")
    return wrong


@pytest.mark.parametrize("workers", [2, 3])
def test_fp16_autocast_and_a_grad_scaler_on_a_gpu_skip_an_inf_step_on_every_rank_alike(workers):
    from .support.loopworkers import amp_worker

    spec = {"kind": "mlp", "inputs": 40, "hidden": [96, 48], "classes": 6}
    res = run_workers(workers, amp_worker, spec, 11, 5, "cuda", "float16", AMP_RUNS, 2, timeout=300)
    failures = amp_failures(res, workers, 2, "float16")
    assert not failures, "\n".join(failures)
