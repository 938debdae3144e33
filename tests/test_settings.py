"""The trainer's settings: every invalid value or combination is refused at construction, naming
the setting (no processes: the checks run before the trainer joins a job)."""

from __future__ import annotations

import pytest
import torch

import poseidon_aio
from poseidon_aio.errors import ConfigError
from poseidon_aio.ps import ServerSGD


def _trainer(**settings):
    model = torch.nn.Linear(4, 2)
    return poseidon_aio.Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.mse_loss, **settings
    )


@pytest.mark.parametrize(
    "make, names",
    [
        (lambda: _trainer(mode="bogus"), "Trainer(mode=...)"),
        (lambda: _trainer(hybcomm=("ps", "carrier-pigeon")), "Trainer(hybcomm=...)"),
        (lambda: _trainer(mode="wfbp", compression="fp16"), "Trainer(compression=...)"),
        (lambda: _trainer(mode="wfbp", merge=poseidon_aio.MergeConfig(kind="single")), "MergeConfig.kind"),
        (
            lambda: _trainer(
                ps=poseidon_aio.PSConfig(server_sgd=ServerSGD(0.1)), merge=poseidon_aio.MergeConfig(kind="single")
            ),
            "PSConfig.server_sgd",
        ),
        (lambda: _trainer(ps=poseidon_aio.PSConfig(checkpoint_dir="/tmp/x")), "PSConfig.checkpoint_dir"),
        (lambda: _trainer(batch_loss=lambda model, batch: model(batch).sum()), "or batch_loss, not both"),
        (lambda: poseidon_aio.AllReduceConfig("tree"), "AllReduceConfig.algorithm"),
        (lambda: poseidon_aio.OptimizerConfig(early_step_bytes=0), "OptimizerConfig.early_step_bytes"),
        (lambda: poseidon_aio.StartupConfig(timeout=0), "StartupConfig.timeout"),
        (lambda: poseidon_aio.PSConfig(sync_timeout=0), "PSConfig.sync_timeout"),
        (lambda: poseidon_aio.PSConfig(staleness=-1), "PSConfig.staleness"),
        (lambda: poseidon_aio.MergeConfig(after=0), "MergeConfig.after"),
    ],
)
def test_an_invalid_setting_gets_a_config_error_that_names_it(make, names):
    with pytest.raises(ConfigError) as refused:
        make()
    assert names in str(refused.value)


def test_the_defaults_resolve_to_the_papers_system():
    trainer = _trainer()
    s = trainer.settings
    assert s.mode.value == "poseidon" and s.merge.kind.value == "best" and s.allreduce.algorithm == "auto"
    assert s.optimizer.early_step_bytes == 4 << 20 and s.startup.timeout == 60.0
    assert _trainer(mode="wfbp").settings.merge.kind.value == "none"
