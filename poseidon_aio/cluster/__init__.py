"""Cluster shape: where this process runs, the model manifest, the information book, and the
rendezvous.

The rendezvous (asyncio, sockets) loads on first use, so the planners can read the book and the
manifest without an event loop.
"""

from .book import DEFAULT_CHUNK_BYTES, InformationBook, KVPair, Message
from .launcher import ClusterEnv, advertise_host
from .manifest import Manifest, ManifestMismatch, ParamSpec

_LAZY = {
    "Rendezvous": "poseidon_aio.cluster.rendezvous",
    "StartupConfig": "poseidon_aio.cluster.rendezvous",
}

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "ClusterEnv",
    "InformationBook",
    "KVPair",
    "Manifest",
    "ManifestMismatch",
    "Message",
    "ParamSpec",
    "Rendezvous",
    "StartupConfig",
    "advertise_host",
]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'poseidon_aio.cluster' has no attribute {name!r}")
