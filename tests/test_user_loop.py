"""What a DDP user's training loop needs of the trainer, across real worker processes: the modules'
modes left alone, one forward a step, the user's collectives, and one-line errors for misuse."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from .support.cluster import run_workers

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["wfbp", "poseidon"])
def test_a_frozen_batchnorm_stays_frozen_and_each_step_runs_one_forward_and_the_optimizer_on_the_caller_s_thread(
    mode,
):
    from .support.loopworkers import frozen_bn_worker

    steps = 4
    res = run_workers(2, frozen_bn_worker, 5, steps, mode, timeout=120)
    for rank, out in res.items():
        assert out["forwards"] == steps, f"rank {rank} ran {out['forwards']} forwards in {steps} steps"
        # As in a DDP user's loop: the trainer's threads move bytes, the caller's computes.
        assert out["forward_threads"] == [out["caller"]], f"rank {rank}: a forward ran off the caller's thread"
        assert out["optimizer_threads"] == [out["caller"]], f"rank {rank}: the optimizer ran off the caller's thread"
        assert not out["bn_training"], f"rank {rank}: the trainer put the frozen BatchNorm back in training mode"
        assert out["model_training"], f"rank {rank}: the trainer changed the model's mode"
        assert out["bn_unchanged"], f"rank {rank}: the frozen BatchNorm's statistics changed"


@pytest.mark.slow
def test_all_reduce_and_barrier_give_every_rank_the_same_bits_in_rank_order():
    from .support.loopworkers import collectives_worker

    world = 3
    res = run_workers(world, collectives_worker, timeout=120)
    assert [res[r]["rank"] for r in range(world)] == list(range(world))
    assert {res[r]["world"] for r in range(world)} == {world}
    values = [res[r]["values"] for r in range(world)]
    for op in ("mean", "sum", "max", "min"):
        want = _rank_order(values, op)
        for r in range(world):
            assert res[r][f"float32 {op}"].tobytes() == want.tobytes(), f"rank {r}'s {op} differs"
    for r in range(world):
        np.testing.assert_array_equal(res[r]["int64 sum"], [6, 30])
        np.testing.assert_array_equal(res[r]["bfloat16 mean"], np.full((2, 2), 1.5))


@pytest.mark.slow
def test_an_all_reduce_of_another_size_names_the_rank_that_gave_it():
    from .support.loopworkers import mismatched_worker

    res = run_workers(2, mismatched_worker, timeout=120)
    assert res[0].startswith("RemoteProtocolError: rank 0: collective 0: rank 1 sent 3 float32 values, this rank 2")
    assert res[1].startswith("RemoteProtocolError: rank 1: collective 0: rank 0 sent 2 float32 values, this rank 3")


@pytest.mark.slow
def test_an_all_reduce_a_rank_never_joins_times_out_naming_that_rank(tmp_path):
    from .support.loopworkers import absent_worker

    res = run_workers(2, absent_worker, str(tmp_path / "rank0-done"), timeout=120)
    assert res[0].startswith("SyncTimeout: rank 0: collective 0 (all_reduce or barrier) heard nothing from rank(s) [1]")
    assert res[1] == "rank 0 is done"


@pytest.mark.slow
@pytest.mark.parametrize(
    "how, message",
    [
        ("numpy", "ConfigError: step() got inputs of type numpy.ndarray: the model takes tensors"),
        ("array", "ConfigError: step() got a batch of type ndarray: with loss_fn a batch is an (inputs, targets)"),
        ("no await", "ConfigError: rank 0: trainer.step(batch) at clock 0 was called without await"),
        ("no await at the end", "ConfigError: rank 0: trainer.step(batch) at clock 1 was called without await"),
        ("no targets", "no error"),
        ("mean of ints", "ConfigError: all_reduce(op='mean') of a int64 tensor: give a float tensor, or op='sum'"),
    ],
)
def test_a_misused_trainer_says_what_to_do_in_one_line(how, message):
    from .support.loopworkers import misuse_worker

    res = run_workers(1, misuse_worker, how, timeout=60)
    assert res[0].startswith(message), res[0]
    assert "\n" not in res[0]


def _rank_order(values: list, op: str) -> np.ndarray:
    if op == "max":
        return np.maximum.reduce(values)
    if op == "min":
        return np.minimum.reduce(values)
    out = values[0].copy()
    for v in values[1:]:
        out += v
    return out / len(values) if op == "mean" else out


USER_RUNS = [
    ("wfbp", "wfbp", None),
    ("poseidon", "poseidon", None),  # HybComm's choice on loopback
    ("mixed", "poseidon", {"0": "sfb", "2": "allreduce", "4": "ps"}),  # SFB, all-reduce and PS side by side
]


@pytest.mark.slow
@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    workers=st.integers(2, 3),
    accumulate=st.integers(1, 4),
    clip=st.sampled_from([None, 0.05]),
    seed=st.integers(0, 1000),
)
@example(workers=2, accumulate=4, clip=0.05, seed=3)
def test_the_user_s_loop_with_accumulation_clipping_and_a_scaler_equals_one_process(workers, accumulate, clip, seed):
    from .support.loopworkers import user_loop_single, user_loop_worker

    spec = {"kind": "mlp", "inputs": 12, "hidden": [16, 8], "classes": 3}
    steps = 3
    res = run_workers(workers, user_loop_worker, spec, seed, steps, accumulate, clip, USER_RUNS, timeout=240)
    reference = user_loop_single(spec, seed, workers, steps, accumulate, clip)
    for label, _, _ in USER_RUNS:
        params, schemes = res[0][label]["params"], res[0][label]["schemes"]
        for r in range(1, workers):
            assert all(a.tobytes() == b.tobytes() for a, b in zip(params, res[r][label]["params"])), (
                f"{label}: rank {r}'s replica differs from rank 0's (schemes {schemes})"
            )
        for a, ref in zip(params, reference):
            np.testing.assert_allclose(
                a, ref, rtol=1e-5, atol=1e-5, err_msg=f"{label} differs from one process (schemes {schemes})"
            )


@pytest.mark.slow
def test_the_user_s_backward_starts_each_layer_s_sync_in_wfbp_and_none_in_naive():
    from .support.loopworkers import user_overlap_worker

    wfbp = run_workers(2, user_overlap_worker, "wfbp", timeout=120)
    naive = run_workers(2, user_overlap_worker, "naive", timeout=120)
    for rank in (0, 1):
        # The first step plans after its backward; in some later step a sync began while the
        # user's backward was still running (which one is up to the machine's load).
        assert wfbp[rank][0] == 0 and max(wfbp[rank][1:]) > 0, f"rank {rank}: {wfbp[rank]}"
        assert naive[rank] == [0, 0, 0, 0], f"rank {rank}: {naive[rank]}"


@pytest.mark.slow
def test_the_short_form_takes_the_caller_s_autocast_and_a_scaler_and_skips_an_inf_step_on_every_rank():
    from .support.loopworkers import short_form_amp_worker, user_loop_single

    spec = {"kind": "mlp", "inputs": 12, "hidden": [16], "classes": 3}
    seed, steps, clip = 4, 4, 0.05
    res = run_workers(2, short_form_amp_worker, spec, seed, 1, clip, None, timeout=120)
    # One fp32 step with a scaler and clipping is one process's step.
    for a, ref in zip(res[0]["params"][0], user_loop_single(spec, seed, 2, 1, 1, clip)):
        np.testing.assert_allclose(a, ref, rtol=1e-5, atol=1e-6)
    res = run_workers(2, short_form_amp_worker, spec, seed, steps, clip, 2, timeout=120)
    assert res[0]["dtypes"] == ["torch.bfloat16", "torch.float32"], "the caller's autocast did not reach the forward"
    for r in (0, 1):
        scales, params = res[r]["scales"], res[r]["params"]
        assert scales[2] == scales[1] / 2, f"rank {r}: the scaler did not back off at the inf step: {scales}"
        assert all(a.tobytes() == b.tobytes() for a, b in zip(params[2], params[1])), f"rank {r} stepped on an inf"
        assert any(a.tobytes() != b.tobytes() for a, b in zip(params[3], params[2])), f"rank {r} stopped stepping"
    for a, b in zip(res[0]["params"][-1], res[1]["params"][-1]):
        assert a.tobytes() == b.tobytes(), "the replicas differ"


def _code(path: Path) -> list:
    """The script's lines after its module docstring."""
    text = path.read_text()
    return text[text.index('"""', 3) + 3 :].splitlines()


def test_the_port_of_a_ddp_script_changes_only_the_lines_that_make_the_trainer_and_await_it():
    import difflib

    ddp, port = _code(EXAMPLES / "ddp_loop.py"), _code(EXAMPLES / "poseidon_loop.py")
    diff = list(difflib.ndiff(ddp, port))
    removed = [line[2:] for line in diff if line.startswith("- ") and line[2:].strip()]
    added = [line[2:] for line in diff if line.startswith("+ ") and line[2:].strip()]
    assert removed and added
    for line in removed:  # DDP's own lines, and the function the await makes async
        assert any(
            w in line for w in ("torch.distributed", "dist.", "DDP", "def main():", "main()", "model.no_sync()")
        ), line
    for line in added:
        assert any(w in line for w in ("trainer", "poseidon_aio", "async def main():")), line
    assert sum("await trainer." in line for line in added) == 4  # start, synchronize, all_reduce, close


@pytest.mark.slow
def test_the_ddp_script_and_its_port_train_alike_and_save_a_bare_model(tmp_path):
    import os
    import signal
    import subprocess
    import sys

    import torch

    accuracies, states = {}, {}
    for name in ("ddp_loop", "poseidon_loop"):
        saved = tmp_path / f"{name}.pt"
        command = [sys.executable, "-m", "poseidon_aio.cli", "run", "-n", "2", f"examples/{name}.py"]
        # Its own session, so that a job that hangs is stopped whole (the launcher and its ranks),
        # within pytest's own timeout and with what it said.
        job = subprocess.Popen(
            [*command, "--epochs", "2", "--save", str(saved)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            start_new_session=True,
        )
        try:
            out, err = job.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(job.pid, signal.SIGKILL)
            out, err = job.communicate()
            pytest.fail(f"{name} did not finish in 90 s:\n{out}\n{err}"[-4000:])
        done = subprocess.CompletedProcess(job.args, job.returncode, out, err)
        assert done.returncode == 0, done.stderr[-3000:]
        last = done.stdout.strip().splitlines()[-1]
        accuracies[name] = float(last.rsplit("test accuracy ", 1)[1].rstrip("%"))
        states[name] = torch.load(saved)
    # The same global batches, exact sums in another order, bf16 autocast: a point apart at most.
    assert abs(accuracies["ddp_loop"] - accuracies["poseidon_loop"]) <= 1.0, accuracies
    assert accuracies["poseidon_loop"] > 50, accuracies
    assert states["ddp_loop"].keys() == states["poseidon_loop"].keys()
    fresh = torch.nn.BatchNorm2d(16).state_dict()
    for key in ("running_mean", "running_var", "num_batches_tracked"):  # frozen: untouched by either
        for name, state in states.items():
            assert torch.equal(state[f"bn.{key}"], fresh[key]), f"{name} changed the frozen BatchNorm's {key}"


@pytest.mark.slow
@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    batches=st.lists(st.integers(1, 6), min_size=2, max_size=3),
    form=st.sampled_from(["step", "own loop"]),
    hybcomm=st.sampled_from([("ps",), ("sfb", "allreduce")]),
)
@example(batches=[30, 29], form="step", hybcomm=("ps",))
@example(batches=[30, 29], form="step", hybcomm=("sfb", "allreduce"))
def test_ranks_with_uneven_batches_finish_or_fail_at_once_never_at_the_sync_timeout(batches, form, hybcomm):
    # The parameter server's links (a shard on every rank, "ps-done" before a rank leaves) and
    # the mesh's alone (SFB, all-reduce) end differently: both must end at once.
    from .support.loopworkers import uneven_worker

    res = run_workers(len(batches), uneven_worker, batches, form, hybcomm, timeout=120)
    fewest = min(batches)
    for r, (how, last_step_s) in res.items():
        if batches[r] == fewest:
            assert how == "finished", f"rank {r} ({batches[r]} batches): {how}"
        else:  # (it names whichever of the shortest ranks it heard from first)
            said = re.match(r"WorkerLeft: rank (\d+) finished after (\d+) steps; rank (\d+) is at step (\d+)", how)
            assert said, f"rank {r} ({batches[r]} batches): {how}"
            assert batches[int(said[1])] == fewest and said.groups()[1:] == (str(fewest), str(r), str(fewest + 1)), how
        # (the sync timeout is 60 s: an end that waited for it would take that long)
        assert last_step_s < 30, f"rank {r}'s last step took {last_step_s:.1f} s: {how}"


@pytest.mark.slow
def test_a_checkpoint_restores_at_another_world_size(tmp_path):
    import torch

    from .support.loopworkers import resize_worker

    run_workers(2, resize_worker, str(tmp_path), 3, timeout=120)
    saved = torch.load(next(tmp_path.glob("step-*/rank-0.pt")), weights_only=True)
    res = run_workers(3, resize_worker, str(tmp_path), 0, timeout=120)
    for r in range(3):
        assert res[r]["clock"] == 3 and res[r]["next_clock"] == 4
        for a, b in zip(res[r]["params"], saved["model"].values()):
            assert a.tobytes() == b.numpy().tobytes(), f"rank {r}'s model is not rank 0's saved one"
        momentum = [s["momentum_buffer"] for s in saved["optimizer"]["state"].values()]
        for a, b in zip(res[r]["momentum"], momentum):
            assert a.tobytes() == b.numpy().tobytes(), f"rank {r}'s optimizer is not rank 0's saved one"


@pytest.mark.slow
def test_fp16_gradients_travel_as_fp16():
    from .support.loopworkers import half_worker

    full = run_workers(2, half_worker, "float32", timeout=120)
    half = run_workers(2, half_worker, "float16", timeout=120)
    for r in (0, 1):
        assert half[r][1] == ["torch.float16"] * 4
        assert half[r][0]["ps"] * 2 == full[r][0]["ps"], (half[r][0], full[r][0])
