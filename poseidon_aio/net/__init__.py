"""asyncio connections: framing on the wire codec, authenticated handshake, shaping.

Everything that imports asyncio or socket lives here and above; ``wire`` stays sans-IO.
"""

from .config import NetConfig, TLSConfig
from .connection import Connection, ConnectionStats
from .dial import connect
from .endpoint import Endpoint
from .handshake import PROTOCOL_VERSION, Role
from .listener import Listener, listen
from .local import LocalLink
from .loop import LOOP, new_event_loop, run
from .shaper import Shaper, ShaperConfig, TokenBucket
from .unix import connect_unix

__all__ = [
    "LOOP",
    "PROTOCOL_VERSION",
    "Connection",
    "Endpoint",
    "LocalLink",
    "ConnectionStats",
    "Listener",
    "NetConfig",
    "Role",
    "Shaper",
    "ShaperConfig",
    "TLSConfig",
    "TokenBucket",
    "connect",
    "connect_unix",
    "listen",
    "new_event_loop",
    "run",
]
