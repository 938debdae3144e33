"""Cluster shape: the model manifest, the information book, and the rendezvous."""

from .book import DEFAULT_CHUNK_BYTES, InformationBook, KVPair, Message
from .manifest import Manifest, ManifestMismatch, ParamSpec
from .rendezvous import ClusterEnv, Rendezvous, advertise_host

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
    "advertise_host",
]
