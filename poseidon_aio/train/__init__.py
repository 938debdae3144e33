"""torch integration: layer discovery, backward hooks, host staging and the Trainer (the only place
that knows torch.nn)."""

from .layers import Layer, discover
from .trace import TraceConfig
from .trainer import StepStats, Trainer

__all__ = ["Layer", "StepStats", "TraceConfig", "Trainer", "discover"]
