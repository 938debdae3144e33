"""The parameter server: KV shards, the worker-side client, and the per-process node that ties them
to the rendezvous."""

from .checkpoint import CheckpointError
from .client import PSClient, PushResult, WorkerLeft
from .config import PSConfig, ServerSGD, StragglerPolicy
from .node import PSNode
from .shard import KVShard, ShardStats
from .slots import reduce_mean

__all__ = [
    "CheckpointError",
    "KVShard",
    "PSClient",
    "PSConfig",
    "PSNode",
    "PushResult",
    "ServerSGD",
    "ShardStats",
    "StragglerPolicy",
    "WorkerLeft",
    "reduce_mean",
]
