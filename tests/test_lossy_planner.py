"""The planner's rule for the lossy schemes (which layers suit them, their predicted times, the
choice), the compression settings, the trainer's refusal outside mode poseidon, and explain."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from poseidon_aio.errors import ConfigError
from poseidon_aio.plan import (
    CompressionConfig,
    ComputeCosts,
    LayerShape,
    Link,
    LossyPlanner,
    Mode,
    PlanLayer,
    Scheme,
    choose_schemes,
)
from poseidon_aio.plan.lossy import lossy_time, unsuited

# -- the planner ----------------------------------------------------------------------------------


def _conv(name: str, out: int, cin: int, k: int = 3) -> PlanLayer:
    params = ((out, cin, k, k), (out,))
    return PlanLayer(LayerShape(name, "conv", out * cin * k * k + out, 1), False, params=params)


def _fc(name: str, m: int, n: int) -> PlanLayer:
    return PlanLayer(LayerShape(name, "fc", m, n, bias=True), True, params=((m, n), (m,)))


NORM = PlanLayer(LayerShape("bn", "other", 128, 1), False, params=((64,), (64,)))
SLOW = Link.of_bandwidth(12.5e6, 1e-4)  # 100 Mbit, 100 us a round


def test_lossy_times_follow_the_documented_model():
    layer = _conv("conv", 256, 256)  # 589 824 matrix elements, 256 bias
    costs = ComputeCosts({"fp16": (1e-5, 1e-9), "powersgd": (2e-5, 2e-9), "topk": (3e-5, 3e-9)})
    config = CompressionConfig("auto", rank=4, ratio=0.01)
    d, e, p = 589_824, 256, 4
    beta, alpha = SLOW.beta, SLOW.alpha
    assert lossy_time(layer, Scheme.FP16, p, SLOW, config, costs) == pytest.approx(
        2 * alpha + beta * 1.5 * 2 * (d + e) + 1e-5 + 1e-9 * (d + e)
    )
    floats = 4 * (256 + 2304) + e
    assert lossy_time(layer, Scheme.POWERSGD, p, SLOW, config, costs) == pytest.approx(
        4 * alpha + beta * 1.5 * 4 * floats + 2e-5 + 2e-9 * d
    )
    k = 5899
    assert lossy_time(layer, Scheme.TOPK, p, SLOW, config, costs) == pytest.approx(
        alpha + beta * 3 * (4 * e + 8 * k) + 3e-5 + 3e-9 * d
    )


def test_what_suits_a_lossy_scheme():
    config = CompressionConfig("auto", rank=4)
    assert unsuited(NORM, Scheme.TOPK, config) == "no matrix parameter (a bias, a norm)"
    assert unsuited(_conv("c1", 16, 3), Scheme.FP16, config) == "432 matrix elements, under 16384"
    assert unsuited(_conv("c1", 16, 3), Scheme.FP16, config, forced=True) is None
    assert (
        unsuited(
            PlanLayer(LayerShape("x", "fc", 512, 512), True, params=((512, 512),), float32=False), Scheme.FP16, config
        )
        == "not float32"
    )
    # 10 x 4096 at rank 4: 16 424 floats of factors against 40 960: suited; at rank 8 it is not
    # cheaper than a third... and a 128 x 128 matrix at rank 64 moves as much as it holds.
    assert unsuited(_fc("head", 10, 4096), Scheme.POWERSGD, config) is None
    assert "no fewer than the 16384" in unsuited(_fc("sq", 128, 128), Scheme.POWERSGD, CompressionConfig(rank=64))


def test_auto_takes_the_least_predicted_time_and_small_layers_stay_exact():
    layers = [_conv("conv1", 16, 3), NORM, _conv("conv5", 512, 512), _fc("head", 10, 512)]
    planner = LossyPlanner(CompressionConfig("auto"), ComputeCosts())
    report: dict = {}
    plan = choose_schemes(
        layers, {"head": 32}, mode=Mode.POSEIDON, workers=4, shards=4, link=SLOW, compression=planner, report=report
    )
    assert (
        plan["conv1"] in (Scheme.PS, Scheme.ALLREDUCE)
        and plan["bn"] in (Scheme.PS, Scheme.ALLREDUCE)
        and plan["head"] in (Scheme.PS, Scheme.ALLREDUCE, Scheme.SFB)
    )
    assert plan["conv5"] in (Scheme.POWERSGD, Scheme.TOPK)
    w = report["conv5"]
    assert w.choice.value == min(w.times, key=w.times.get) and set(w.times) >= {
        "ps",
        "allreduce",
        "fp16",
        "powersgd",
        "topk",
    }
    assert report["conv1"].why.startswith("exact: ") and "fp16" not in report["conv1"].times
    # A fast link with costly compute: nothing lossy pays.
    dear = LossyPlanner(CompressionConfig("auto"), ComputeCosts({s: (1.0, 0.0) for s in ("fp16", "powersgd", "topk")}))
    fast = choose_schemes(
        layers,
        {"head": 32},
        mode=Mode.POSEIDON,
        workers=4,
        shards=4,
        link=Link.of_bandwidth(1.25e9, 1e-5),
        compression=dear,
    )
    assert not {s for s in fast.values()} & {Scheme.FP16, Scheme.POWERSGD, Scheme.TOPK}


def test_a_tie_stays_exact():
    layer = _conv("conv5", 512, 512)
    exact_t = 2 * SLOW.alpha + SLOW.beta * 2 * layer.shape.params * 4 * 3 / 4
    # Compute that makes every lossy scheme exactly as slow as the exact all-reduce.
    planner = LossyPlanner(CompressionConfig("fp16"), ComputeCosts())
    fp16_t = lossy_time(layer, Scheme.FP16, 4, SLOW, planner.config, planner.costs)
    extra = exact_t - fp16_t
    while fp16_t + extra < exact_t:  # float rounding: make it a tie, not a win by one ulp
        extra = float(np.nextafter(extra, np.inf))
    tied = LossyPlanner(
        CompressionConfig("auto"), ComputeCosts({"fp16": (extra, 0.0), "powersgd": (100.0, 0.0), "topk": (100.0, 0.0)})
    )
    w = tied.weigh(layer, 0, Scheme.ALLREDUCE, (Scheme.ALLREDUCE,), 4, 4, SLOW)
    assert w.times["fp16"] == pytest.approx(w.times["allreduce"], rel=1e-12) and w.choice is Scheme.ALLREDUCE


def test_one_named_method_goes_wherever_it_suits_and_exact_elsewhere():
    layers = [_conv("conv1", 16, 3), _conv("conv5", 512, 512), _fc("sq", 128, 128)]
    fast = Link.of_bandwidth(1.25e10, 0.0)  # even where the link would not need it
    for method in ("fp16", "topk", "powersgd"):
        plan = choose_schemes(
            layers,
            {},
            mode=Mode.POSEIDON,
            workers=4,
            shards=4,
            link=fast,
            compression=LossyPlanner(CompressionConfig(method, rank=64)),
        )
        assert plan["conv5"] is Scheme(method) and plan["conv1"] in (Scheme.PS, Scheme.ALLREDUCE)
        # 128 x 128 at rank 64: PowerSGD no cheaper than exact; the others suit it.
        assert (plan["sq"] is Scheme(method)) == (method != "powersgd")
    assert (
        choose_schemes(
            layers, {}, mode=Mode.POSEIDON, workers=1, shards=1, compression=LossyPlanner(CompressionConfig("fp16"))
        )["conv5"]
        is Scheme.PS
    )


def test_lossy_overrides_need_a_matrix_and_mode_poseidon():
    layers = [NORM, _conv("conv1", 16, 3)]
    assert (
        choose_schemes(layers, {}, mode=Mode.POSEIDON, workers=2, shards=2, overrides={"conv1": "powersgd"})["conv1"]
        is Scheme.POWERSGD
    )
    with pytest.raises(ConfigError, match="bn cannot go by topk: no matrix parameter"):
        choose_schemes(layers, {}, mode=Mode.POSEIDON, workers=2, shards=2, overrides={"bn": "topk"})
    with pytest.raises(ConfigError, match="mode 'wfbp' syncs every layer by PS"):
        choose_schemes(layers, {}, mode=Mode.WFBP, workers=2, shards=2, overrides={"conv1": "fp16"})


def test_compression_settings_are_validated_and_agreed_on():
    assert CompressionConfig.of(None) is None and CompressionConfig.of("topk").method.value == "topk"
    for bad in (
        dict(method="zip"),
        dict(rank=0),
        dict(ratio=0.0),
        dict(ratio=1.5),
        dict(min_elements=0),
        dict(link=Link(0.0, 0.0)),
    ):
        with pytest.raises(ConfigError):
            CompressionConfig(**bad)
    with pytest.raises(ConfigError):
        CompressionConfig.of(3)
    assert CompressionConfig("auto", rank=2).settings() != CompressionConfig("auto", rank=4).settings()
    costs = ComputeCosts({"topk": (1e-5, 2e-9)})
    assert ComputeCosts.from_json(costs.to_json()) == costs


def test_the_trainer_refuses_compression_outside_mode_poseidon():
    import torch

    from poseidon_aio import Trainer

    model = torch.nn.Linear(4, 2)
    with pytest.raises(ConfigError, match="use mode 'poseidon', not 'wfbp'"):
        Trainer(
            model,
            torch.optim.SGD(model.parameters(), 0.1),
            torch.nn.functional.mse_loss,
            mode="wfbp",
            compression="topk",
        )
    with pytest.raises(ConfigError, match="compression must be one of"):
        Trainer(model, torch.optim.SGD(model.parameters(), 0.1), torch.nn.functional.mse_loss, compression="zip")


def test_explain_prints_every_candidate_s_predicted_time_and_the_choice():
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "poseidon_aio.cli",
            "explain",
            "--model",
            "resnet50",
            "--workers",
            "4",
            "--bandwidth",
            "100mbit",
            "--alpha",
            "100",
            "--compression",
            "auto",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=root,
    )
    out = json.loads(done.stdout)
    rows = {r["name"]: r for r in out["layers"]}
    assert out["compression"]["method"] == "auto" and set(out["compute"]) == {"fp16", "powersgd", "topk"}
    for r in rows.values():
        assert r["choice"] == min(r["predicted_s"], key=r["predicted_s"].get) or (
            r["choice"] == r["exact"] and r["why"].startswith("exact")
        )
    assert (
        rows["bn1"]["choice"] in ("ps", "allreduce") and "topk" not in rows["bn1"]["predicted_s"]
    )  # a norm stays exact
    assert rows["layer4.0.conv2"]["choice"] in ("fp16", "powersgd", "topk")  # 2.4 M elements at 100 Mbit
    text = subprocess.run(
        [
            sys.executable,
            "-m",
            "poseidon_aio.cli",
            "explain",
            "--fc",
            "4096x4096",
            "--workers",
            "8",
            "--compression",
            "powersgd",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=root,
    ).stdout
    assert "powersgd named, and the layer suits it" in text and "1gbit links" in text


def test_a_link_with_a_flop_rate_charges_the_weight_gradient_to_lossy_schemes_too():
    # Where the link carries the device's seconds per FLOP, the exact schemes count an FC layer's
    # weight gradient (2 K M N FLOPs); a lossy scheme compresses that same gradient.
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Measured:
        alpha: float = 1e-4
        beta: float = 8e-8
        flop: float = 1e-10

    layer, config = _fc("fc", 512, 1024), CompressionConfig("auto")
    plain = lossy_time(layer, Scheme.TOPK, 4, Link(1e-4, 8e-8), config, ComputeCosts(), rows=32)
    assert lossy_time(layer, Scheme.TOPK, 4, Measured(), config, ComputeCosts(), rows=32) == pytest.approx(
        plain + 2 * 32 * 512 * 1024 * 1e-10
    )
