"""The trainer's settings: the optimizer's own, and the one place the configs the trainer takes
are checked against each other."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

from ..cluster import StartupConfig
from ..errors import ConfigError
from ..net import NetConfig
from ..ps import PSConfig
from ..plan import HYBCOMM_SCHEMES, CompressionConfig, MergeConfig, MergeKind, Mode, Scheme
from ..sync import AllReduceConfig


@dataclass
class OptimizerConfig:
    """How the trainer drives your optimizer.

    Args:
        early_step_bytes: under BSP on the CPU, with a per-parameter ``torch.optim`` optimizer
            (SGD, Adam, ...) and no step hooks, the optimizer steps the parameters whose syncs
            have landed while others are still moving, once they hold this many bytes; the last
            ones are stepped after the last sync. Every parameter gets the bits one step over
            all of them gives. ``None``: one step after every sync.
        clip_grad_norm: in ``step()``, the averaged gradients' total 2-norm is clipped to this
            (``torch.nn.utils.clip_grad_norm_``, after a GradScaler's unscale) before the
            optimizer steps; the step is then one step over every parameter. In your own loop,
            clip after ``synchronize()`` yourself.
    """

    # The update streams ~3 bytes for each byte of parameters: 4 MiB is well above the cost of
    # the hop to the compute thread and back.
    early_step_bytes: Optional[int] = 4 << 20
    clip_grad_norm: Optional[float] = None

    def __post_init__(self) -> None:
        if self.early_step_bytes is not None and self.early_step_bytes < 1:
            raise ConfigError(f"OptimizerConfig.early_step_bytes must be >= 1 (None: off), got {self.early_step_bytes}")
        if self.clip_grad_norm is not None and not self.clip_grad_norm > 0:
            raise ConfigError(f"OptimizerConfig.clip_grad_norm must be > 0 (None: off), got {self.clip_grad_norm}")


@dataclass
class Settings:
    """Every setting of one trainer, checked together (:func:`resolve`)."""

    mode: Mode
    ps: PSConfig
    net: Optional[NetConfig]
    merge: MergeConfig
    compression: Optional[CompressionConfig]
    overrides: dict
    hybcomm: tuple
    allreduce: AllReduceConfig = field(default_factory=AllReduceConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    startup: StartupConfig = field(default_factory=StartupConfig)
    broadcast_buffers: bool = True
    hosts: str = "launcher"


HOSTS = ("launcher", "flat")


def resolve(
    mode,
    ps: Optional[PSConfig],
    net: Optional[NetConfig],
    merge: Optional[MergeConfig],
    compression,
    schemes: Optional[dict],
    hybcomm=HYBCOMM_SCHEMES,
    allreduce: Optional[AllReduceConfig] = None,
    optimizer: Optional[OptimizerConfig] = None,
    startup: Optional[StartupConfig] = None,
    broadcast_buffers: bool = True,
    hosts: str = "launcher",
) -> Settings:
    """The trainer's settings, defaults filled in and checked against each other.

    Raises:
        ConfigError: an invalid value or combination (the message names the setting).
    """
    try:
        mode = Mode(mode)
    except ValueError:
        raise ConfigError(f"Trainer(mode=...) must be one of {[m.value for m in Mode]}, got {mode!r}") from None
    ps = ps or PSConfig()
    if ps.checkpoint_dir:
        raise ConfigError(
            "PSConfig.checkpoint_dir is the parameter server's own checkpointing (PSNode); with the Trainer "
            "use `await trainer.save(directory)` and `await trainer.restore(directory)`, which cover the model, "
            "the optimizer, the clock and the shards' server-side state"
        )
    merge = merge or MergeConfig()
    if ps.server_sgd is not None and merge.kind not in (None, MergeKind.NONE):
        raise ConfigError(
            "with PSConfig.server_sgd the shards own the parameters and their optimizer state per message; "
            "merging would re-cut the messages mid-training: use MergeConfig(kind='none')"
        )
    if merge.kind is None:
        merging = mode in (Mode.MGWFBP, Mode.POSEIDON) and ps.server_sgd is None
        merge = replace(merge, kind=MergeKind.BEST if merging else MergeKind.NONE)
    if merge.kind is not MergeKind.NONE and mode in (Mode.NAIVE, Mode.WFBP):
        raise ConfigError(
            f"MergeConfig.kind: mode {mode.value!r} sends every layer on its own; "
            "merging is mode 'mgwfbp' or 'poseidon'"
        )
    try:
        hybcomm = tuple(Scheme(c) for c in hybcomm)
    except ValueError:
        raise ConfigError(
            f"Trainer(hybcomm=...) names a scheme that does not exist: {list(hybcomm)}; "
            f"known: {[s.value for s in Scheme]}"
        ) from None
    if hosts not in HOSTS:
        raise ConfigError(f"Trainer(hosts=...) must be one of {list(HOSTS)}, got {hosts!r}")
    compression = CompressionConfig.of(compression)
    if compression is not None and mode is not Mode.POSEIDON:
        raise ConfigError(
            f"Trainer(compression=...) is weighed per layer by HybComm: use mode 'poseidon', not {mode.value!r}"
        )
    return Settings(
        mode=mode,
        ps=ps,
        net=net,
        merge=merge,
        compression=compression,
        overrides=dict(schemes or {}),
        hybcomm=hybcomm,
        allreduce=allreduce or AllReduceConfig(),
        optimizer=optimizer or OptimizerConfig(),
        startup=startup or StartupConfig(),
        broadcast_buffers=broadcast_buffers,
        hosts=hosts,
    )
