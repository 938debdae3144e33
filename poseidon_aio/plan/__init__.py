"""Analysis apart from runtime: the cost model, HybComm's choice, the MG-WFBP planners, the
compression planner, the model traces and the simulator.

Pure decisions on numbers every rank agrees on: no torch, no asyncio, no I/O (a test imports every
module here and checks). ``poseidon_aio.sync`` carries these decisions out during a step and may
import this package; nothing here imports ``sync``, ``net``, ``ps`` or ``train``.

Modules: ``cost`` (ATC'17 Table 1, BestScheme and the time model), ``hybcomm`` (every layer's
scheme), ``mgwfbp`` (MG-WFBP's timeline and planners), ``merging`` (the plan from measured warm-up
steps), ``lossy`` (compression settings and when a lossy scheme wins), ``models`` (the papers'
networks as shapes and FLOPs) and ``simulator`` (one iteration, simulated).
"""

from .cost import (
    HYBCOMM_SCHEMES,
    LOSSY_SCHEMES,
    PAPER_SCHEMES,
    Hosts,
    LayerKind,
    LayerShape,
    Link,
    Scheme,
    best_scheme,
    hybcomm_choice,
    layer_cost,
)
from .hybcomm import Mode, PlanLayer, choose_schemes
from .lossy import Compression, CompressionConfig, ComputeCosts, LossyPlanner, Weighing
from .merging import CALIBRATION_SIZES, MergeConfig, MergeKind, MergePlanner, link_of

__all__ = [
    "CALIBRATION_SIZES",
    "Compression",
    "CompressionConfig",
    "ComputeCosts",
    "HYBCOMM_SCHEMES",
    "Hosts",
    "LOSSY_SCHEMES",
    "LayerKind",
    "LayerShape",
    "Link",
    "LossyPlanner",
    "MergeConfig",
    "MergeKind",
    "MergePlanner",
    "Mode",
    "PAPER_SCHEMES",
    "PlanLayer",
    "Scheme",
    "Weighing",
    "best_scheme",
    "choose_schemes",
    "hybcomm_choice",
    "layer_cost",
    "link_of",
]
