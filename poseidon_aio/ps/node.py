"""One worker process's parameter server: rendezvous, its co-located shard, its client.

    async with await PSNode.start(manifest, PSConfig()) as node:
        result = await node.client.push([0, 1], [w_grad, b_grad], [w_out, b_out], clock=0)

Start-up, on every rank: read the launcher's environment, meet at the TCPStore, compare manifests
(a mismatch fails every rank, naming the parameter), compute the information book and compare its
digest, agree on the start clock (the newest checkpoint every shard completed, with server-side
SGD), host shard ``rank`` if ``rank < P2``, connect to every shard, and pass a barrier so no push
reaches a shard before every worker can receive its reply.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Optional, Sequence

from ..cluster.book import InformationBook
from ..cluster.manifest import Manifest
from ..cluster.launcher import ClusterEnv, advertise_host
from ..cluster.rendezvous import Rendezvous, StartupConfig
from ..cluster.topology import Topology
from ..cluster.links import dial, publish_listener
from ..errors import ConnectionLost, PoseidonError, StartupAborted
from ..net import LocalLink, NetConfig, listen
from ..net.credentials import config_from_env
from . import checkpoint
from .client import PSClient
from .config import PSConfig
from .shard import KVShard

log = logging.getLogger("poseidon_aio.ps")


async def agree_on_start(rdzv: Rendezvous, config: PSConfig, book: InformationBook, index, start_clock: int):
    """The start clock every rank uses, and the checkpointed state of shard ``index``.

    With server-side SGD and a checkpoint directory, each shard's host publishes the clocks it has
    complete checkpoints for; the job resumes from the newest clock every shard has. Returns
    ``(clock, state)`` where ``state`` is the shard's arrays, ``None`` (resumed, no shard here)
    or ``False`` (fresh start).
    """
    state = False
    if config.server_sgd is not None and config.checkpoint_dir:
        if index is not None:
            mine = checkpoint.complete_clocks(config.checkpoint_dir, index, book.digest())
            await rdzv.publish(f"ckpt/shard/{index}", ",".join(map(str, mine)))
        by_shard = {}
        for s in range(book.shards):
            text = await rdzv.read(f"ckpt/shard/{s}", who=f"the host of shard {s}")
            by_shard[s] = [int(c) for c in text.split(",") if c]
        resume = checkpoint.newest_common(by_shard)
        if resume is not None:
            start_clock = resume
            state = checkpoint.read(config.checkpoint_dir, index, resume, book.digest()) if index is not None else None
            log.info("rank %d: resuming from the checkpoint at clock %d", rdzv.env.rank, resume)
    return start_clock, state


async def host_shard(rdzv, index, rank, book, config, net, start_clock, state, shaper=None, same_host=False):
    """Start shard ``index`` of ``book`` listening on this host; publish its address. Returns
    ``(shard, listener)``. With ``same_host`` (a shard on a worker of a host of several) it also
    takes that host's workers on a Unix socket."""
    host = advertise_host(rdzv.env.master_addr)
    shard = KVShard(index, book, config, start_clock=start_clock, state=state or None)
    listener = await listen(
        host, 0, rank=rank, config=net, on_connection=shard.attach, process_shaper=shaper, same_host=same_host
    )
    await publish_listener(rdzv, f"addr/shard/{index}", host, listener)
    return shard, listener


class PSNode:
    """The parameter-server side of one worker process. Build it with :meth:`start`."""

    def __init__(self) -> None:
        self.env: ClusterEnv
        self.rank: int
        self.book: InformationBook
        self.config: PSConfig
        self.client: PSClient
        self.shard: Optional[KVShard] = None
        self.start_clock = 0
        self.resumed = False
        self._rdzv: Rendezvous
        self._listener = None
        self._shaper = None
        self._factored: list = []
        self._layers: list = []
        self._given_state: Optional[dict] = None

    @classmethod
    async def start(
        cls,
        manifest: Manifest,
        config: Optional[PSConfig] = None,
        *,
        env: Optional[ClusterEnv] = None,
        net: Optional[NetConfig] = None,
        groups: Optional[Sequence[Sequence[str]]] = None,
        layers: Optional[Sequence[Sequence[str]]] = None,
        start_clock: int = 0,
        rendezvous: Optional[Rendezvous] = None,
        process_shaper=None,
        factored: Optional[Sequence[Sequence[str]]] = None,
        shard_state: Optional[dict] = None,
        startup: Optional[StartupConfig] = None,
        topology: Optional[Topology] = None,
    ) -> "PSNode":
        """Join the job and return a ready node.

        Args:
            manifest: this rank's model manifest (must equal every other rank's).
            config: :class:`PSConfig`.
            env: the launcher environment (default: read from ``os.environ``).
            net: connection settings; without it, the token (and TLS files) come from the
                environment (``POSEIDON_TOKEN`` or ``POSEIDON_TOKEN_FILE``, see
                :mod:`poseidon_aio.net.credentials`). Secrets never go through the store.
            groups: merge groups for the information book (MG-WFBP).
            layers: the model's layers (parameter names each): a small one travels as one message.
            start_clock: the clock to start at, when no shard checkpoint says otherwise.
            rendezvous: an already started :class:`Rendezvous` (e.g. a ``scoped`` view, to run
                several nodes over one store); by default the node opens its own.
            process_shaper: a :class:`~poseidon_aio.net.Shaper` every connection of this
                process shares (the bandwidth manager's budget).
            factored: fully-connected layers (``[weight, bias]`` names) synced by the
                Project-Adam scheme (:meth:`PSClient.push_factors`).
            shard_state: the server-side optimizer state of the shard this rank hosts
                (:meth:`KVShard.state`, e.g. from a trainer checkpoint), with ``start_clock``
                the clock it was taken at.
            startup: how long the node's own rendezvous waits for the other ranks.
            topology: the workers' hosts, where the job has checked them already; by default the
                node checks them at its rendezvous (:meth:`Rendezvous.check_topology`).
        Raises:
            ConfigError, ManifestMismatch, PeerTimeout, CheckpointError: start-up failed; this
                rank then publishes why (:meth:`Rendezvous.abort`).
            StartupAborted: another rank failed during start-up (its reason is in the message).
        """
        self = cls()
        config = config or PSConfig()
        net = net or config_from_env()  # before anything waits: a missing token fails at once
        self.config = config
        if rendezvous is not None:
            self.env, self._rdzv = rendezvous.env, rendezvous
        else:
            self.env = env or ClusterEnv.from_env()
            self._rdzv = Rendezvous(self.env, timeout=(startup or StartupConfig()).timeout)
            await self._rdzv.start()
        self.rank = self.env.rank
        self._shaper = process_shaper
        self._factored = [list(f) for f in factored or ()]
        self._layers = [list(layer) for layer in layers or ()]
        self._given_state = shard_state
        self._topology = topology
        try:
            await self._join(manifest, net, groups, start_clock)
        except BaseException as exc:
            await self._rdzv.abort(exc)  # the other ranks stop waiting for us, and hear why
            await self.teardown()
            raise
        return self

    async def _join(self, manifest, net, groups, start_clock) -> None:
        rdzv, env, config = self._rdzv, self.env, self.config
        await rdzv.check_manifest(manifest)
        topology = self._topology or await rdzv.check_topology()
        if env.rank == 0:
            setup = {
                "config": config.to_json(),
                "groups": [list(g) for g in groups or ()],
                "factored": self._factored,
                "layers": self._layers,
                "hosts": topology.to_json(),
            }
            await rdzv.publish("ps-setup", json.dumps(setup))
        workers = env.world_size
        shards = config.shards_for(workers)
        self.book = InformationBook(
            manifest,
            workers=workers,
            shards=shards,
            chunk_bytes=config.chunk_bytes,
            groups=groups,
            layers=self._layers,
            placement=config.placement,
            factored=self._factored,
            spread_bytes=config.spread_bytes(),
            pipeline_bytes=config.group_pipeline_bytes,
            topology=topology,
        )
        await rdzv.check_digest("information book", self.book.digest())
        index = None if config.standalone_shards or env.rank >= shards else env.rank
        # Co-located shard s runs on rank s: on a host of several workers, its own host's reach
        # it over a Unix socket. Standalone shards run where nobody says: TCP.
        hosts = topology if topology.by_host and not config.standalone_shards else None
        start_clock, state = await agree_on_start(rdzv, config, self.book, index, start_clock)
        if state is False and self._given_state is not None:
            state = self._given_state
        await rdzv.check_digest("start clock", str(start_clock))
        self.resumed = state is not False
        self.start_clock = start_clock
        if index is not None:
            self.shard, self._listener = await host_shard(
                rdzv, index, env.rank, self.book, config, net, start_clock, state, self._shaper, hosts is not None
            )
        conns = {}
        if self.shard is not None:  # our own shard: an in-process link, no socket
            conns[index], shard_end = LocalLink.pair(env.rank, env.rank)
            self.shard.attach(shard_end)
        for s in range(shards):
            if s not in conns:
                conns[s] = await dial(
                    rdzv,
                    f"addr/shard/{s}",
                    who=f"the host of shard {s}",
                    same_host=hosts is not None and hosts.same_host(s, env.rank),
                    rank=env.rank,
                    config=net,
                    process_shaper=self._shaper,
                )
        if hosts is not None:  # a lost shard's messages name its worker's host and local rank
            for s, conn in conns.items():
                conn.peer_host = f" ({topology.locate(s)})"
        self.client = PSClient(env.rank, self.book, config, conns, start_clock=start_clock)
        await rdzv.barrier("ps-ready")

    @property
    def rendezvous(self) -> Rendezvous:
        """The rendezvous (store view) this node joined through."""
        return self._rdzv

    async def close(self) -> None:
        """Leave the job: wait until every rank is done, then close connections and the shard."""
        try:
            await self._rdzv.barrier("ps-done")
        except BaseException:
            await self.teardown()
            raise
        await self.teardown(linger=None)

    async def abandon(self) -> None:
        """Leave after this rank's step failed: it is done with every shard, so the ranks that
        finished their steps (and wait at "ps-done" for every rank) need not wait for it (a peer
        with fewer batches, whose departure failed this rank's step); then close at once."""
        await self._rdzv.arrive("ps-done")
        await self.teardown()

    async def teardown(self, linger: Optional[float] = 5.0) -> None:
        """Close connections and the shard now, without waiting for the other ranks (a failed job)."""
        client = getattr(self, "client", None)
        if client is not None:
            for conn in client.connections.values():
                await conn.close()
        if self._listener is not None:
            await self._listener.close()
        if self.shard is not None:
            await self.shard.close()
        await self._rdzv.leave(linger)

    async def __aenter__(self) -> "PSNode":
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            await self.close()
        else:
            if getattr(self, "client", None) is not None:
                self.client.fail(exc if isinstance(exc, Exception) else asyncio.CancelledError())
            # Ranks that finished their steps wait for this one at "ps-done": tell them why it
            # will not come, rather than leave them to time out naming nothing.
            await self._rdzv.abort(exc, during="training")
            told = await self._told_why(exc)
            await self.teardown()
            if told is not None:
                raise told from exc

    async def _told_why(self, exc) -> Optional[ConnectionLost]:
        """``exc`` with another rank's published failure added, where this rank lost a link: the
        link may have gone because that rank failed, and a bare "broken pipe" would not say why.
        Its own words come first: the lost link may be the fault itself (a truncated stream)."""
        if not isinstance(exc, ConnectionLost):
            return None
        try:
            await self._rdzv.check_aborted("after losing a connection")
        except StartupAborted as root:
            if root.rank != self._rdzv.env.rank:
                return ConnectionLost(f"{exc}; meanwhile rank {root.rank} failed: {root.reason}")
        except PoseidonError:
            pass  # the store is gone too: the lost link is all there is to say
        return None
