"""The model traces the simulator runs on (``plan/models.py``): the papers' parameter counts,
manifests, FLOPs, and the bench's replay of them."""

from __future__ import annotations

import os
import sys

import pytest

from poseidon_aio.errors import ConfigError
from poseidon_aio.plan.models import PRESETS, trace

# -- the model traces -------------------------------------------------------------------------------


def test_models_have_the_papers_parameter_counts():
    counts = {name: sum(s.numel for s in build()) for name, build in PRESETS.items()}
    assert counts["vgg19"] == 143_667_240
    assert counts["vgg19_22k"] == 229_052_817  # ATC'17: 229 M
    assert counts["inception_v3"] == 27_161_264  # torchvision's, AuxLogits included; ATC'17: 27 M
    assert counts["resnet152"] == 60_192_808  # torchvision's; ATC'17: 60.2 M
    assert counts["resnet50"] == 25_557_032
    assert 5e6 <= counts["googlenet"] <= 7e6


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_a_trace_is_its_manifest_layer_by_layer(name):
    tr = trace(name, batch=8)
    assert tr.manifest() == PRESETS[name]()
    assert all(layer.flops > 0 for layer in tr)
    assert trace(name, batch=16).flops == pytest.approx(2 * tr.flops)


def test_resnet50_conv1_flops_by_hand():
    # 64 filters of 3 x 7 x 7 at 112 x 112 outputs, a multiply-add each: 2 x 118 M per sample.
    assert trace("resnet50", batch=1)[0].flops == 2 * 64 * 3 * 7 * 7 * 112 * 112


def test_bench_mgwfbp_replays_the_library_trace():
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from bench.mgwfbp import ROWS, resnet50_layers

    assert resnet50_layers() == list(trace("resnet50", batch=ROWS))


def test_unknown_model_or_empty_batch_is_a_config_error():
    with pytest.raises(ConfigError, match="known"):
        trace("lenet")
    with pytest.raises(ConfigError):
        trace("vgg19", batch=0)
