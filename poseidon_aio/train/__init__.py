"""torch integration: layer discovery, backward hooks and the Trainer (the only place that knows
torch.nn)."""

from .layers import Layer, discover
from .trainer import MODES, StepStats, Trainer

__all__ = ["MODES", "Layer", "StepStats", "Trainer", "discover"]
