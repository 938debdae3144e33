"""Synchronization at run time: one :class:`Syncer` per scheme, merging, calibration and agreement.

Below the torch integration and above the networking: buckets of host buffers in, synchronized
buffers out. What each layer's scheme is and how layers merge is decided in ``poseidon_aio.plan``;
this package carries the decisions out during a step. Nothing here imports torch; the
sufficient-factor kernel is passed in.
"""

from .adam import AdamSyncer
from .allreduce import AllReduceConfig, AllReduceSyncer
from .bucket import Bucket
from .compress import Feedback, measure_compute
from .half import HalfSyncer
from .hierarchical import HierarchicalAllReduce
from .hierarchical_ps import HierarchicalPS
from .hierarchical_sfb import HierarchicalSFB
from .merge import Merging
from .powersgd import PowerSGDSyncer
from .ps import PSSyncer
from .rows import RowsSyncer
from .runtime import MergeRuntime
from .sfb import SFBSyncer
from .syncer import SYNCERS, SyncContext, Syncer, SyncResult, register, syncer_class
from .topk import TopKSyncer

__all__ = [
    "AdamSyncer",
    "AllReduceConfig",
    "AllReduceSyncer",
    "Bucket",
    "Feedback",
    "HalfSyncer",
    "HierarchicalAllReduce",
    "HierarchicalPS",
    "HierarchicalSFB",
    "MergeRuntime",
    "Merging",
    "PSSyncer",
    "PowerSGDSyncer",
    "RowsSyncer",
    "SFBSyncer",
    "SYNCERS",
    "SyncContext",
    "SyncResult",
    "Syncer",
    "TopKSyncer",
    "measure_compute",
    "register",
    "syncer_class",
]
