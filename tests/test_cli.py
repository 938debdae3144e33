"""The command line: explain's worked cases, and the main job through `poseidon-aio run`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.accuracy import ACCURACY

ROOT = Path(__file__).resolve().parent.parent


def cli(*args, timeout=60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "poseidon_aio.cli", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


def test_explain_reproduces_the_atc17_worked_case():
    out = json.loads(cli("explain", "--fc", "4096x4096", "--workers", "8", "--batch", "32", "--json").stdout)
    layer = out["layers"][0]
    assert layer["choice"] == "sfb"
    assert round(layer["sfb"] / 1e6, 1) == 3.7 and round(layer["ps_worker"] / 1e6, 0) == 34


def test_explain_reproduces_the_2015_alexnet_case():
    out = json.loads(cli("explain", "--fc", "4096x4096", "--workers", "4", "--batch", "256", "--json").stdout)
    layer = out["layers"][0]
    assert [round(layer[k] / 1e6, 1) for k in ("cluster_sfb", "cluster_ps", "cluster_adam")] == [18.9, 134.2, 75.5]


def test_explain_a_preset_keeps_convolutions_on_the_ps():
    out = json.loads(cli("explain", "--model", "vgg19", "--workers", "8", "--batch", "32", "--json").stdout)
    kinds = {row["kind"]: set() for row in out["layers"]}
    for row in out["layers"]:
        kinds[row["kind"]].add(row["choice"])
    assert kinds["conv"] == {"ps"} and "sfb" in kinds["fc"]
    assert cli("explain").returncode == 2


def test_explain_weighs_all_reduce_with_the_link_and_keeps_the_paper_s_choice():
    out = json.loads(
        cli(
            "explain",
            "--model",
            "vgg19",
            "--workers",
            "8",
            "--batch",
            "32",
            "--bandwidth",
            "1gbit",
            "--alpha",
            "100",
            "--json",
        ).stdout
    )
    rows = {row["name"]: row for row in out["layers"]}
    # 4 M floats in and out for a 1 M-float layer on 8 workers: 2 M each way, a ring's bytes.
    assert all(abs(r["allreduce"] - 4 * r["ps_worker"] / 2 * 7 / 8) < 1 for r in rows.values())
    assert {r["hybcomm"] for r in rows.values() if r["kind"] == "conv"} <= {"allreduce", "ps"}
    assert "allreduce" in {r["hybcomm"] for r in rows.values()}
    assert all(
        r["hybcomm"] == min(r["predicted_s"], key=r["predicted_s"].get) or r["hybcomm"] == r["choice"]
        for r in rows.values()
    )
    paper = json.loads(cli("explain", "--model", "vgg19", "--workers", "8", "--schemes", "ps,sfb", "--json").stdout)
    assert all(r["hybcomm"] == r["choice"] for r in paper["layers"])  # the paper's HybComm, reachable


@pytest.mark.slow
def test_the_main_job_runs_through_poseidon_aio_run_over_tls_with_one_trace(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("POSEIDON_TOKEN", None)  # `run` draws the job's token itself
    trace = tmp_path / "digits.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "poseidon_aio.cli",
            "run",
            "--tls",
            "--trace",
            str(trace),
            "-n",
            "2",
            "examples/digits.py",
            "--epochs",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "test accuracy: 2 workers (poseidon)" in done.stdout and "OK: within 1 point" in done.stdout
    found = ACCURACY.search(done.stdout)  # `python -m bench accuracy` reads the figures off this line
    assert found and 0 < float(found.group(1)) <= 100 and 0 < float(found.group(2)) <= 100, done.stdout[-2000:]
    # Not a terminal: progress comes as whole lines, never a bar redrawn with carriage returns.
    assert "\r" not in done.stdout and done.stdout.count("loss") >= 5
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1}


@pytest.mark.slow
def test_a_failing_job_says_why_in_one_line_per_rank():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "poseidon_aio.cli", "run", "-n", "2", "tests/data/mismatched_ranks.py"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
        env=env,
    )
    assert done.returncode == 1
    lines = [line for line in done.stderr.splitlines() if line.startswith("poseidon_aio rank")]
    assert lines and all("ManifestMismatch" in line and "rank 1's model differs" in line for line in lines), (
        done.stderr[-3000:]
    )
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "poseidon-aio run: rank(s)" in done.stderr


def test_info_names_versions_and_interfaces():
    out = cli("info").stdout
    assert "versions: python" in out and "torch" in out and "interfaces: " in out and "lo 127.0.0.1" in out


def test_version():
    done = cli("--version")
    assert done.returncode == 0 and done.stdout.startswith("poseidon-aio 0."), done


def test_a_port_in_use_is_one_line_before_any_worker_starts():
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = cli("run", "-n", "2", "--master-port", str(port), "tests/data/steps_until_stopped.py")
    assert done.returncode == 2
    assert done.stderr.startswith(f"poseidon-aio run: --master-port {port} cannot be used here"), done.stderr
    assert done.stderr.count("\n") == 1, done.stderr


@pytest.mark.slow
def test_sigterm_stops_every_rank_quietly_with_one_line_each():
    import signal

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    job = subprocess.Popen(
        [sys.executable, "-m", "poseidon_aio.cli", "run", "-n", "2", "tests/data/steps_until_stopped.py"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=env,
    )
    try:
        ready = set()
        while len(ready) < 2:  # (each rank's first step done; the pipe ends if the job dies first)
            line = job.stdout.readline()
            assert line, f"the job ended before both ranks were ready: {job.stderr.read()[-3000:]}"
            ready.add(line.strip())
        job.send_signal(signal.SIGTERM)
        _, err = job.communicate(timeout=120)
    finally:
        job.kill()
    assert job.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "Traceback" not in err and "never retrieved" not in err, err[-3000:]
    # (asyncio's debug mode, which the suite runs in, may add its slow-callback warnings)
    assert sorted(line for line in err.splitlines() if line.startswith("poseidon")) == [
        "poseidon-aio run: stopped by SIGTERM; every rank was stopped",
        "poseidon_aio rank 0: stopped by SIGTERM",
        "poseidon_aio rank 1: stopped by SIGTERM",
    ], err[-3000:]


def _ranks_until_stopped(world: int) -> list:
    """``world`` ranks of tests/data/steps_until_stopped.py started one by one (no launcher), each
    past its first step."""
    from .support.cluster import free_port, rank_env

    port = free_port()
    jobs = []
    for rank in range(world):
        env = {**os.environ, "PYTHONPATH": str(ROOT), **rank_env(rank, world, port), "POSEIDON_ERRORS": "brief"}
        script = ["tests/data/steps_until_stopped.py"]
        jobs.append(
            subprocess.Popen(
                [sys.executable, *script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env
            )
        )
    for job in jobs:
        line = job.stdout.readline()
        if not line:
            for j in jobs:
                j.kill()
            raise AssertionError(f"a rank ended before its first step: {job.stderr.read()[-3000:]}")
    return jobs


def _poseidon_lines(job) -> tuple:
    try:
        _, err = job.communicate(timeout=120)
    finally:
        job.kill()
    assert "Traceback" not in err, err[-3000:]
    return job.returncode, [line for line in err.splitlines() if line.startswith("poseidon")]


@pytest.mark.slow
def test_a_rank_signalled_after_its_peer_still_says_it_was_stopped():
    # A launcher signals its ranks one after another; here rank 1's comes 0.5 s after rank 0's,
    # long after rank 0 has told it why it leaves: rank 1 still ends as stopped, not failed.
    import signal
    import time

    jobs = _ranks_until_stopped(2)
    try:
        jobs[0].send_signal(signal.SIGTERM)
        time.sleep(0.5)
        jobs[1].send_signal(signal.SIGTERM)
        got = [_poseidon_lines(job) for job in jobs]
    finally:
        for job in jobs:
            job.kill()
    assert got == [(143, [f"poseidon_aio rank {r}: stopped by SIGTERM"]) for r in range(2)], got


@pytest.mark.slow
def test_a_rank_whose_peer_alone_was_stopped_says_so_and_fails():
    import signal

    jobs = _ranks_until_stopped(2)
    try:
        jobs[0].send_signal(signal.SIGTERM)
        got = [_poseidon_lines(job) for job in jobs]
    finally:
        for job in jobs:
            job.kill()
    assert got[0] == (143, ["poseidon_aio rank 0: stopped by SIGTERM"]), got
    code, lines = got[1]
    assert code == 1 and len(lines) == 1, got
    assert "rank 1" in lines[0] and "rank 0" in lines[0] and "stopped by SIGTERM" in lines[0], got


def _hosts_job(commands: list, env: dict) -> list:
    """Start one launcher per emulated host (all on loopback), wait for all; the ranks' lines."""
    jobs = [
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
        for cmd in commands
    ]
    outs = []
    for job in jobs:
        try:
            out, err = job.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for j in jobs:
                j.kill()
            raise
        assert job.returncode == 0, out[-2000:] + err[-3000:]
        outs += re.findall(r"rank \d+ hosts \[.*?\]\] digest [0-9a-f]{16}", out)
    return outs


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["poseidon-aio run", "torchrun c10d"])
def test_a_job_over_two_hosts_starts_from_each_host_and_agrees(launcher):
    # 2 hosts x 2 workers, each host's launcher started on its own (here both on loopback): the
    # topology reaches every rank, and SFB and all-reduce between the hosts leave every replica equal.
    from .support.cluster import JOB_TOKEN, free_port

    env = {**os.environ, "PYTHONPATH": str(ROOT), "POSEIDON_TOKEN": JOB_TOKEN, "OMP_NUM_THREADS": "1"}
    port = free_port()
    if launcher == "poseidon-aio run":
        commands = [
            [sys.executable, "-m", "poseidon_aio.cli", "run", "--nnodes", "2", "--node-rank", str(i)]
            + ["--master-addr", "127.0.0.1", "--master-port", str(port), "-n", "2", "tests/data/hosts_job.py"]
            for i in range(2)
        ]
    else:
        commands = [
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2"]
            + ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "hosts-test"]
            + ["tests/data/hosts_job.py"]
            for _ in range(2)
        ]
    lines = _hosts_job(commands, env)
    assert len(lines) == 4, lines
    hosts = {line.split(" hosts ")[1].split(" digest ")[0] for line in lines}
    digests = {line.split(" digest ")[1] for line in lines}
    assert hosts == {"[[0, 1], [2, 3]]"} and len(digests) == 1, lines


@pytest.mark.slow
def test_the_slurm_example_starts_one_torchrun_a_host(tmp_path):
    # examples/slurm.sbatch under stand-ins for srun (one task a node, all on this machine, each
    # with its own SLURM_NODEID) and scontrol: 2 hosts x 2 workers agree, as with torchrun.
    from .support.cluster import JOB_TOKEN, free_port

    shims = tmp_path / "bin"
    shims.mkdir()
    (shims / "scontrol").write_text("#!/bin/bash\necho 127.0.0.1\necho 127.0.0.1\n")
    (shims / "srun").write_text(
        "#!/bin/bash\n"
        "while [[ $1 == --* ]]; do shift; done\n"
        "pids=()\n"
        'for ((i = 0; i < SLURM_NNODES; i++)); do SLURM_NODEID=$i "$@" & pids+=($!); done\n'
        'rc=0; for p in "${pids[@]}"; do wait "$p" || rc=1; done; exit $rc\n'
    )
    for shim in shims.iterdir():
        shim.chmod(0o755)
    token = tmp_path / "token"
    token.write_text(JOB_TOKEN)
    token.chmod(0o600)
    env = {
        **os.environ,
        "PATH": f"{shims}:{Path(sys.executable).parent}:{os.environ['PATH']}",
        "PYTHONPATH": str(ROOT),
        "SLURM_NNODES": "2",
        "SLURM_JOB_NODELIST": "node[0-1]",
        "MASTER_PORT": str(free_port()),
        "NPROC": "2",
        "POSEIDON_TOKEN_FILE": str(token),
    }
    env.pop("POSEIDON_TOKEN", None)
    lines = _hosts_job([["bash", "examples/slurm.sbatch", "tests/data/hosts_job.py"]], env)
    assert len(lines) == 4, lines
    assert {line.split(" hosts ")[1].split(" digest ")[0] for line in lines} == {"[[0, 1], [2, 3]]"}
    assert len({line.split(" digest ")[1] for line in lines}) == 1, lines
