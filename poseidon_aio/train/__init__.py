"""torch integration: layer discovery, backward hooks, host staging and the Trainer (the only place
that knows torch.nn)."""

from .layers import Layer, discover
from .settings import OptimizerConfig
from .step import StepStats
from .trace import TraceConfig
from .trainer import Trainer

__all__ = ["Layer", "OptimizerConfig", "StepStats", "TraceConfig", "Trainer", "discover"]
