"""The bench's replayed models (bench/models.py): what a replay keeps and what it leaves out.

The benches' replayed rows stand for a device at a stated rate; these tests pin what makes that
true: every layer's gradient arrives, in the real backward's order, with the real shapes where an
implementation reads them, and the replayed time owed is the time slept.
"""

from __future__ import annotations

import pytest
import torch

from bench import models
from bench.models import build, replay


@pytest.mark.parametrize("name", ["fc", "cnn", "resnet", "transformer"])
def test_a_replayed_model_gives_every_layer_its_gradient_in_the_real_backward_order(name):
    model, batch, _ = build(name, seed=0)
    real = model(batch[0])
    # The order in which the real backward finishes each layer's gradients.
    finished = []
    owners = {m: n for n, m in model.named_modules() if any(True for _ in m.parameters(recurse=False))}
    hooks = [
        p.register_post_accumulate_grad_hook(lambda p, n=n: finished.append(n))
        for m, n in owners.items()
        for p in m.parameters(recurse=False)
    ]
    real.float().mean().backward()
    real_order = list(dict.fromkeys(finished))
    for h in hooks:
        h.remove()
    model.zero_grad(set_to_none=True)
    finished.clear()

    replay(model, batch, tflops=1e3)
    hooks = [
        p.register_post_accumulate_grad_hook(lambda p, n=n: finished.append(n))
        for m, n in owners.items()
        for p in m.parameters(recurse=False)
    ]
    out = model(batch[0])
    assert out.shape == real.shape
    out.float().mean().backward()
    for h in hooks:
        h.remove()
    # Every parameter got its layer's replayed gradient, and the layers finished as in the real
    # backward: what WFBP overlaps, and what MG-WFBP's planner measures, keeps its order.
    for m in owners:
        for p, g in zip(m.parameters(recurse=False), m.replay_grads):
            assert torch.equal(p.grad, g)
    assert list(dict.fromkeys(finished)) == real_order


def test_a_replayed_layer_sees_its_real_input_shape():
    """Sufficient factors read an FC layer's input rows: the chain feeds each layer zeros of the
    shape its real input had (the CNN's classifier gets the flattened rows, not the pooled maps)."""
    model, batch, _ = build("cnn", seed=0)
    seen = {}
    head = model[-1]

    def record(module, inputs, output):
        seen.setdefault("x", inputs[0].shape)

    head.register_forward_hook(record)
    model(batch[0])
    real = seen.pop("x")
    replay(model, batch, tflops=1e3)
    model(batch[0])
    assert seen["x"] == real == (batch[0].shape[0], head.in_features)


def test_the_replay_clock_sleeps_what_is_owed(monkeypatch):
    """Many tiny layers: each sleep is at least a grain, and an overshoot is paid back by the
    layers after, so the time slept tracks the time owed instead of one timer slack per layer."""
    now = [0.0]

    def sleep(seconds):  # a sleep that overshoots by 60 us, as Linux's timer slack does
        now[0] += seconds + 60e-6

    monkeypatch.setattr(models.time, "sleep", sleep)
    monkeypatch.setattr(models.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(models._Clock, "debt", 0.0)
    owed = 0.0
    for i in range(1000):
        seconds = (i % 7 + 1) * 3e-6
        owed += seconds
        models._Clock.spend(seconds)
    assert abs(now[0] - owed) <= models._Clock.grain + 60e-6
    assert now[0] > 0.9 * owed
