"""How a rank reaches another rank's listener: over a Unix socket where the job's topology puts
both on one host (:mod:`poseidon_aio.net.unix`), over TCP otherwise.

A listener publishes its TCP address under a key and its Unix socket's abstract name (or
nothing) under ``<key>/unix``, the name first, so whoever has read the address finds the name.
The launcher's word on hosts is trusted but checked once, cheaply: a name nobody listens on in
this network namespace (the "same host" is another machine, or another container) makes that
pair's link TCP, with a warning.
"""

from __future__ import annotations

import logging
from typing import Optional

from ..errors import ConnectionLost
from ..net import Connection, Listener, NetConfig, connect, connect_unix
from ..net.unix import enabled as unix_enabled
from .rendezvous import Rendezvous

log = logging.getLogger("poseidon_aio.cluster")


async def publish_listener(rdzv: Rendezvous, key: str, host: str, listener: Listener) -> None:
    """Publish ``listener``'s addresses under ``key`` (TCP) and ``key/unix`` (its Unix name)."""
    await rdzv.publish(f"{key}/unix", listener.unix_name or "")
    await rdzv.publish(key, f"{host}:{listener.address[1]}")


async def dial(
    rdzv: Rendezvous,
    key: str,
    *,
    who: str,
    same_host: bool,
    rank: int,
    config: NetConfig,
    process_shaper=None,
) -> Connection:
    """Connect to the listener published under ``key``, on its Unix socket when ``same_host``.

    Args:
        who: names the listener's owner in errors (``"rank 3"``).
        same_host: the topology puts it on this rank's host.
    Raises:
        PeerTimeout, StartupAborted: as :meth:`Rendezvous.read`, and no connection in time.
        ConnectionLost, AuthenticationError, HandshakeError: as :func:`~poseidon_aio.net.connect`.
    """
    address = await rdzv.read(key, who=who)
    name: Optional[str] = None
    if same_host and unix_enabled(config):
        name = await rdzv.read(f"{key}/unix", who=who) or None
    if name is not None:
        try:
            return await connect_unix(name, rank=rank, config=config, process_shaper=process_shaper)
        except ConnectionLost as exc:
            if not isinstance(exc.__cause__, (ConnectionRefusedError, FileNotFoundError)):
                raise
            log.warning(
                "rank %d: %s listens on no unix socket @%s in this network namespace, though the "
                "launcher puts it on this host; connecting over TCP to %s instead",
                rank,
                who,
                name,
                address,
            )
    host, port = address.rsplit(":", 1)
    return await connect(host, int(port), rank=rank, config=config, process_shaper=process_shaper)
