"""The benches that run the simulator (``bench simulate``, ``bench paper``'s report) and the
simulator's validation against the saved emulations of ``bench paper``."""

from __future__ import annotations

import json
import math
import os
import sys

import pytest

from poseidon_aio.plan.cost import Link
from poseidon_aio.plan.models import trace
from poseidon_aio.plan.simulator import FlowEfficiency

from .support.simulation import run


def test_bench_simulate_prints_its_tables_without_matplotlib(monkeypatch, capsys, tmp_path):
    # matplotlib is an optional extra ('.[bench]'): without it the bench still prints every
    # table and its JSON line, and says where the figures would have come from.
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from bench import simulate as bench_simulate

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    out = bench_simulate.main(["--models", "vgg19", "--max-workers", "4", "--sweep", "none", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    assert "| Poseidon |" in printed and "matplotlib is not installed" in printed
    assert printed.strip().splitlines()[-1].startswith('{"bench": "simulate"')
    assert out["figures"] == [] and not list(tmp_path.iterdir())
    assert out["speedup_mgwfbp_vs_wfbp_4_sim"] is not None


def test_bench_paper_scales_a_layer_s_matrix_and_its_factors_by_the_same_factor():
    # bench paper divides every layer's bytes and the link by s: HybComm's PS-vs-SFB comparison
    # (MN against K(M + N)) must come out as at full size, and the replayed FLOPs stay full-size.
    from bench.paper import scaled_layers

    full, scaled = scaled_layers("vgg19_22k", 32, 1), scaled_layers("vgg19_22k", 32, 16)
    assert [layer[0] for layer in full] == [layer[0] for layer in scaled]
    fc = 0
    for (_, kind, shapes, rows, flops), (_, _, shapes2, rows2, flops2) in zip(full, scaled):
        assert flops2 == flops
        if kind == "fc":
            fc += 1
            (m, n), (m2, n2) = shapes[0], shapes2[0]
            assert m * n / (m2 * n2) == pytest.approx(16, rel=0.01)
            assert rows * (m + n) / (rows2 * (m2 + n2)) == pytest.approx(16, rel=0.01)
        elif math.prod(shapes[0]) > 1 << 16:
            assert math.prod(shapes[0]) / math.prod(shapes2[0]) == pytest.approx(16, rel=0.01)
    assert fc == 3


def test_bench_paper_reports_saved_results_on_ideal_links_with_the_saved_fan_in_and_the_layer_overhead(
    monkeypatch, capsys, tmp_path
):
    # The report alone (no namespaces): the simulator beside each emulated point, on ideal links,
    # with the saved fan-in, and with the per-layer overhead one worker measured too; the JSON's
    # max error is the last column's over the points with 2 and more workers, its held-out error
    # over those with more than 2 (the 2-worker point here is far off and does not count there).
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from bench import paper

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    emulated = {
        "inception_v3|1|wfbp": {"step_s": 0.273},
        "inception_v3|2|naive": {"step_s": 2.0, "steps_s": [1.9, 2.0, 2.2]},
        "inception_v3|4|naive": {"step_s": 0.433, "steps_s": [0.431, 0.433, 0.45]},
    }
    (tmp_path / "paper-emulated.json").write_text(json.dumps(emulated))
    (tmp_path / "paper-efficiency.json").write_text(json.dumps({"1": 0.95, "3": 0.8}))
    args = [
        "--from-json",
        str(tmp_path / "paper-emulated.json"),
        "--models",
        "inception_v3",
        "--workers",
        "1,2,4",
        "--impls",
        "naive",
        "--out",
        str(tmp_path),
    ]
    out = paper.main(args)
    printed = capsys.readouterr().out
    assert (
        "| simulated, ideal links | error | simulated, measured fan-in | error "
        "| simulated, measured fan-in and layer overhead | error |" in printed
    )
    assert out["fan_in_efficiency"] == {1: 0.95, 3: 0.8}
    tr = trace("inception_v3", 32)
    link = Link.of_bandwidth(10e9 / 8, 50e-6)
    nominal = run(tr, 1, rate=4.2e12, link=link, mode="wfbp").time
    overhead = (0.273 - nominal) / (2 * len(tr))
    assert f"'inception_v3': {overhead * 1e6:.1f}" in printed
    # one worker with the overhead it was measured from is the emulated iteration itself
    assert run(tr, 1, rate=4.2e12, link=link, mode="wfbp", layer_overhead=overhead).time == pytest.approx(
        0.273, rel=1e-9
    )
    four = run(
        tr,
        4,
        rate=4.2e12,
        link=link,
        mode="naive",
        efficiency=FlowEfficiency({1: 0.95, 3: 0.8}),
        layer_overhead=overhead,
    ).time
    assert out["sim_vs_emulated_max_error_heldout"] == round(abs(four - 0.433) / 0.433, 3)
    assert out["heldout_points"] == 1 and out["sim_vs_emulated_max_error"] > 0.5  # the 2-worker point's
    assert "| inception_v3 | 4 | naive | held out | 433 (431–450 of 3) |" in printed
    assert "| inception_v3 | 2 | naive | seen | 2000 (1900–2200 of 3) |" in printed
    ideal = paper.main([*args, "--efficiency", "ideal"])
    assert (
        ideal["fan_in_efficiency"] is None
        and ideal["sim_vs_emulated_max_error_ideal_links"] == out["sim_vs_emulated_max_error_ideal_links"]
    )
    assert "| simulated, ideal links | error | simulated, layer overhead | error |" in capsys.readouterr().out


def test_bench_paper_runs_and_simulates_a_narrowed_hybcomm_beside_the_others(monkeypatch, capsys, tmp_path):
    # "poseidon:hybcomm=ps+allreduce": the trainer's mode with HybComm's schemes narrowed; the
    # simulator beside it gets the same schemes; a setting we do not have is refused up front.
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from bench import paper

    assert paper.impl_variant("poseidon:hybcomm=ps+allreduce") == ("poseidon", {"hybcomm": ("ps", "allreduce")})
    assert paper.impl_variant("ddp") == ("ddp", {})
    for bad in ("wfbp:hybcomm=ps", "poseidon:chunk=4", "poseidon:hybcomm", "gloo"):
        with pytest.raises(SystemExit, match="--impls"):
            paper.impl_variant(bad)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    narrowed = "poseidon:hybcomm=ps+allreduce"
    emulated = {
        "vgg19|1|wfbp": {"step_s": 0.9},
        "vgg19|8|poseidon": {"step_s": 0.91},
        f"vgg19|8|{narrowed}": {"step_s": 1.2},
    }
    (tmp_path / "paper-emulated.json").write_text(json.dumps(emulated))
    out = paper.main(
        [
            "--from-json",
            str(tmp_path / "paper-emulated.json"),
            "--models",
            "vgg19",
            "--workers",
            "1,8",
            "--impls",
            f"poseidon,{narrowed}",
            "--efficiency",
            "ideal",
            "--out",
            str(tmp_path),
        ]
    )
    printed = capsys.readouterr().out
    tr, link = trace("vgg19", 32), Link.of_bandwidth(10e9 / 8, 50e-6)
    for impl, extra, step in (("poseidon", {}, 0.91), (narrowed, {"hybcomm": ("ps", "allreduce")}, 1.2)):
        sim = run(tr, 8, rate=4.2e12, link=link, mode="poseidon", **extra).time
        assert (
            f"| vgg19 | 8 | {impl} | held out | {step * 1e3:.0f} ({step * 1e3:.0f}–{step * 1e3:.0f} of 1) "
            f"| {sim * 1e3:.0f} | {abs(sim - step) / step * 100:.1f} % |" in printed
        )
    assert (
        run(tr, 8, rate=4.2e12, link=link, mode="poseidon").time
        < run(tr, 8, rate=4.2e12, link=link, mode="poseidon", hybcomm=("ps", "allreduce")).time
    )
    assert out[f"speedup_vgg19_{narrowed}_8w"] == round(8 * 0.9 / 1.2, 2)


_SAVED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "data", "paper")


# Held-out points the simulator misses by more than 10 %, each with the error it must not exceed
# (bench/RESULTS.md says why): Inception-V3's WFBP at 16 workers, re-run on 2026-11-27, had its
# timed steps spread 341-742 ms over 190 TCP retransmission timeouts, which the simulator does not
# model. A new miss, or a known one growing, fails.
MISSES = {"inception_v3 16 wfbp": 0.30}


@pytest.mark.parametrize("model", ["vgg19", "vgg19_22k", "inception_v3", "resnet152"])
def test_the_simulator_predicts_the_held_out_emulations_within_10_percent(model, tmp_path):
    # The saved runs of `bench paper` (bench/data/paper) reported again against the simulator as it
    # is now. It fits a layer's overhead on the one-worker run and takes the fan-in bench patterns
    # measured on the same links; the points past two workers (4, 8, 16, every scheme) it fits
    # nothing from. A change that moves any of them past 10 % fails here. Which saved runs came
    # after the simulator's rules, and which its rules were fitted to: bench/RESULTS.md.
    from bench import paper

    out = paper.main(
        [
            "--models",
            model,
            "--workers",
            "1,2,4,8,16",
            "--out",
            str(tmp_path),
            "--from-json",
            os.path.join(_SAVED, model, "paper-emulated.json"),
        ]
    )
    assert out["fan_in_efficiency"], "the saved fan-in curve was not found beside the saved runs"
    assert out["heldout_points"] == 12 == len(out["heldout_errors"])
    over = {p: e for p, e in out["heldout_errors"].items() if e > MISSES.get(p, 0.10)}
    assert not over, f"held-out points past their bound: {over}"
