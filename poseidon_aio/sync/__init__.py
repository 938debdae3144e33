"""Synchronization: one :class:`Syncer` per scheme, the cost model and HybComm's plan, MG-WFBP.

Below the torch integration and above the networking: buckets of host buffers in, synchronized
buffers out. Nothing here imports torch; the sufficient-factor kernel is passed in.
"""

from .adam import AdamSyncer
from .allreduce import AllReduceSyncer
from .bucket import Bucket
from .compress import Compression, CompressionConfig, Feedback
from .cost import HYBCOMM_SCHEMES, LOSSY_SCHEMES, PAPER_SCHEMES, LayerKind, LayerShape, Link, Scheme, best_scheme, hybcomm_choice, layer_cost
from .half import HalfSyncer
from .lossyplan import ComputeCosts, LossyPlanner, Weighing, measure_compute
from .merge import Merging
from .plan import Mode, PlanLayer, choose_schemes
from .powersgd import PowerSGDSyncer
from .ps import PSSyncer
from .rows import RowsSyncer
from .runtime import CALIBRATION_SIZES, MergeConfig, MergeKind, MergeRuntime
from .sfb import SFBSyncer
from .syncer import SYNCERS, SyncContext, Syncer, SyncResult, register, syncer_class
from .topk import TopKSyncer

__all__ = [
    "AdamSyncer",
    "AllReduceSyncer",
    "Compression",
    "CompressionConfig",
    "ComputeCosts",
    "Feedback",
    "HalfSyncer",
    "LOSSY_SCHEMES",
    "LossyPlanner",
    "PowerSGDSyncer",
    "TopKSyncer",
    "Weighing",
    "measure_compute",
    "HYBCOMM_SCHEMES",
    "Link",
    "PAPER_SCHEMES",
    "hybcomm_choice",
    "Bucket",
    "CALIBRATION_SIZES",
    "LayerKind",
    "LayerShape",
    "MergeConfig",
    "MergeKind",
    "MergeRuntime",
    "Merging",
    "Mode",
    "PSSyncer",
    "RowsSyncer",
    "PlanLayer",
    "SFBSyncer",
    "SYNCERS",
    "Scheme",
    "SyncContext",
    "SyncResult",
    "Syncer",
    "best_scheme",
    "choose_schemes",
    "layer_cost",
    "register",
    "syncer_class",
]
