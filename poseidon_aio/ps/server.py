"""A standalone shard process: ``poseidon-aio shard --index S`` (or :func:`serve_shard`).

It meets the workers at the same TCPStore (``MASTER_ADDR``/``MASTER_PORT``), takes the job's
settings and manifest from what rank 0 published there (the token from its own environment, as
every worker: ``POSEIDON_TOKEN`` or ``POSEIDON_TOKEN_FILE``), checks that it computes the same
information book, hosts shard ``S`` and ends when every worker has connected and left.
"""

from __future__ import annotations

import asyncio
import json
import logging

from ..cluster.book import InformationBook
from ..cluster.manifest import Manifest
from ..cluster.launcher import ClusterEnv
from ..cluster.rendezvous import Rendezvous
from ..cluster.topology import Topology
from ..errors import ConfigError, ManifestMismatch, PeerTimeout
from ..net.credentials import config_from_env
from .config import PSConfig
from .node import agree_on_start, host_shard

log = logging.getLogger("poseidon_aio.ps")


async def serve_shard(index: int, *, master_addr: str, master_port: int, workers: int, timeout: float = 300.0) -> dict:
    """Host shard ``index`` of the job whose workers meet at ``master_addr:master_port``.

    Args:
        workers: P1, the number of worker processes (their ``WORLD_SIZE``).
        timeout: seconds to wait for the workers to show up.
    Returns:
        The shard's statistics (finalized keys, drops, late pushes) when the job ends.
    Raises:
        ConfigError: the index is outside the job's shards, or the job does not use standalone shards.
        ManifestMismatch: this process computes another information book than the workers.
        PeerTimeout: the workers did not come.
    """
    net = config_from_env()  # before anything waits: a missing token fails at once
    # A shard is not a worker: it takes a rank past the workers' for its connections' names.
    env = ClusterEnv(
        rank=workers + index, world_size=workers, local_rank=0, master_addr=master_addr, master_port=master_port
    )
    rdzv = Rendezvous(env, timeout=timeout)
    await rdzv.start()
    try:
        shard, listener = await _join(rdzv, index, workers, net, env)
    except Exception as exc:
        await rdzv.abort(exc)  # the workers stop waiting for this shard, and hear why
        raise
    log.info(
        "shard %d serving %d messages for %d workers on %s",
        index,
        len(shard.book.messages_of_shard(index)),
        workers,
        listener.address,
    )
    try:
        try:
            await asyncio.wait_for(shard.wait_all_joined(), timeout)
        except TimeoutError:
            missing = sorted(set(range(workers)) - shard.joined)
            raise PeerTimeout(f"shard process {index}: workers {missing} did not connect within {timeout} s") from None
        # Then as long as the job runs; dead workers' connections end by the idle timeout.
        await shard.wait_all_left()
    finally:
        await listener.close()
        await shard.close()
    return {
        "finalized": shard.stats.finalized,
        "dropped": shard.stats.dropped,
        "late_discarded": shard.stats.late_discarded,
    }


async def _join(rdzv: Rendezvous, index: int, workers: int, net, env: ClusterEnv) -> tuple:
    """Take the job's settings and manifest from the store, check the book, host the shard."""
    setup = json.loads(await rdzv.read("ps-setup", who="rank 0"))
    config = PSConfig.from_json(setup["config"])
    if not config.standalone_shards or not 0 <= index < (config.shards or 0):
        raise ConfigError(
            f"shard process {index}: the job runs {config.shards} shards "
            f"{'in their own processes' if config.standalone_shards else 'inside its workers'}"
        )
    manifest = Manifest.from_json(await rdzv.read("manifest/0", who="rank 0"))
    book = InformationBook(
        manifest,
        workers=workers,
        shards=config.shards,
        chunk_bytes=config.chunk_bytes,
        groups=setup["groups"] or None,
        layers=setup.get("layers") or None,
        placement=config.placement,
        factored=setup.get("factored") or None,
        spread_bytes=config.spread_bytes(),
        pipeline_bytes=config.group_pipeline_bytes,
        topology=Topology(setup["hosts"]),
    )
    theirs = await rdzv.read("digest/information book/0", who="rank 0")
    if theirs != book.digest():
        raise ManifestMismatch(
            f"shard process {index} computes another information book than rank 0: same poseidon_aio release?"
        )
    _, state = await agree_on_start(rdzv, config, book, index, 0)
    start_clock = int(await rdzv.read("digest/start clock/0", who="rank 0"))
    shard, listener = await host_shard(rdzv, index, env.rank, book, config, net, start_clock, state)
    return shard, listener


__all__ = ["serve_shard"]
