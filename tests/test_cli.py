"""The command line: explain's worked cases, and the main job through `poseidon-aio run`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def cli(*args, timeout=60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "poseidon_aio.cli", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


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


@pytest.mark.slow
def test_the_main_job_runs_through_poseidon_aio_run():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "poseidon_aio.cli", "run", "-n", "2", "examples/digits.py", "--epochs", "2", "--quiet"],
        capture_output=True, text=True, timeout=240, cwd=ROOT, env=env,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "test accuracy: 2 workers (poseidon)" in done.stdout and "OK: within 1 point" in done.stdout
