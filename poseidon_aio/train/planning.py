"""Planning the communication: every layer's scheme (the same on every rank), the link it is
planned for, the syncers that carry it out, and the parameter server they use."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import replace
from typing import Optional

import torch

from .. import kernels
from ..cluster import Manifest
from ..cluster.book import pipeline_bytes_for, spread_bytes_for
from ..cluster.job import Job
from ..cluster.topology import Topology
from ..errors import CheckpointError
from ..ps import PSNode
from ..plan import Hosts, Link, MergeKind, Mode, Scheme, choose_schemes, link_of
from ..sync import Feedback, Merging, SyncContext, syncer_class
from ..sync.runtime import calibrate, loop_cpu_per_byte
from . import compression as lossy
from .dispatch import SchemePlan
from .settings import Settings
from .staging import Staging

log = logging.getLogger("poseidon_aio.train")


class Planning:
    """Decides the schemes and builds the syncers (and the parameter server) for them.

    Args:
        settings: the trainer's resolved settings.
        layers, named: the model's layers and ``[(name, parameter)]`` in manifest order.
        job: the joined job (rank, peers, rendezvous).
        staging: host buffers for a GPU model's tensors.
        compute, reduce: the compute thread's and the reconstruction thread's executors.
        shaper: the process's bandwidth budget, if any.
        feedback: the lossy schemes' error feedback, kept across rebuilds.
    """

    def __init__(
        self,
        settings: Settings,
        layers: list,
        named: list,
        job: Job,
        staging: Staging,
        compute,
        reduce,
        shaper,
        feedback: Feedback,
    ) -> None:
        self.settings = settings
        self.layers = layers
        self.named = named
        self.job = job
        self.rank, self.world = job.rank, job.world
        self.staging = staging
        self.compute = compute
        self.reduce = reduce
        self.shaper = shaper
        self.feedback = feedback
        self.plan: Optional[SchemePlan] = None
        self.syncers: dict = {}
        self.node: Optional[PSNode] = None
        self.server_owned: set = set()  # manifest indices whose values the shards' SGD sends
        self.generation = 0  # syncers built so far, less one: names the parameter server's scope
        self.calibration: list = []  # round trips on the links between hosts (between workers, flat)
        self.inside_calibration: list = []  # round trips inside a host, where hosts run several workers
        self.loop_cpu_per_byte = 0.0  # the event loop's CPU per byte in or out, measured at start
        self.compression_plan: dict = {}  # {layer name: Weighing}
        self._kernel_flop = 0.0  # seconds per FLOP of the sufficient-factor kernel, measured at start
        self._link: Optional[Link] = None  # rank 0's alpha and beta, once agreed
        self._inside: Optional[Link] = None  # rank 0's host's inside link, once agreed
        self._shard_bytes_seen = 0

    @property
    def hosts_topology(self):
        """The job's topology where its hosts run several workers and the trainer goes by host
        (``Trainer(hosts="launcher")``); else ``None``: every worker a peer of its own."""
        topo = self.job.topology
        return topo if self.settings.hosts == "launcher" and topo.by_host else None

    async def agreed_hosts(self) -> Optional[Hosts]:
        """The cost model's :class:`Hosts` (rank 0's host's inside link), or ``None`` where flat."""
        topo = self.hosts_topology
        if topo is None:
            return None
        if self._inside is None:
            if self.rank == 0:
                link = link_of(self.inside_calibration, 0.0)
                await self.job.rendezvous.publish("hosts-link", json.dumps([link.alpha, link.beta]))
            alpha, beta = json.loads(await self.job.rendezvous.read("hosts-link", who="rank 0"))
            self._inside = Link(alpha, beta)
        return Hosts(len(topo.hosts), topo.local_size, self._inside)

    async def calibrate(self) -> None:
        """Measure the links (alpha, beta, the loop's CPU per byte) and the SF kernel, while the
        links are idle: HybComm and the merge planner plan on them."""
        s = self.settings
        if self.world > 1 and (s.merge.planned or s.mode is Mode.POSEIDON):
            cpu: list = []
            topo = self.hosts_topology
            # Where hosts run several workers, the link between hosts is measured by local rank
            # j of every host round the hosts, and the link inside a host round its ranks.
            across = [h[topo.local_rank_of(self.rank)] for h in topo.hosts] if topo is not None else None
            if across is None or len(across) > 1:
                self.calibration = await calibrate(
                    self.rank, self.world, self.job.peers, s.merge.calibration_sizes, s.ps.sync_timeout, cpu, across
                )
            if topo is not None:
                self.inside_calibration = await calibrate(
                    self.rank,
                    self.world,
                    self.job.peers,
                    s.merge.calibration_sizes,
                    s.ps.sync_timeout,
                    None if across is None or len(across) > 1 else cpu,
                    topo.local_peers(self.rank),
                )
                if len(across) == 1:  # one host: its inside link is the only one
                    self.calibration = self.inside_calibration
            self.loop_cpu_per_byte = loop_cpu_per_byte(cpu)
        if self.world > 1 and s.mode is Mode.POSEIDON:
            loop = asyncio.get_running_loop()
            self._kernel_flop = await loop.run_in_executor(self.reduce, time_reconstruction, self.world)

    async def choose(self, rows: dict, restored: Optional[dict]) -> SchemePlan:
        """Every layer's scheme: a checkpoint's, or HybComm's on the planning step's ``rows`` (K
        per layer, the largest of any rank) and the agreed link; checked to be the same on every
        rank."""
        s = self.settings
        if restored:
            if set(restored) != {layer.name for layer in self.layers}:
                raise CheckpointError(
                    f"rank {self.rank}: the checkpoint's scheme plan names other layers than this model has"
                )
            by_name = restored
        else:
            loop = asyncio.get_running_loop()
            seen = await self.job.rendezvous.exchange("rows", json.dumps(rows), range(self.world))
            k = {name: max(json.loads(seen[r]).get(name, 0) for r in seen) for name in rows}
            on_compute = lambda fn, *args: loop.run_in_executor(self.compute, fn, *args)  # noqa: E731
            planner = await lossy.agreed_planner(s.compression, self.job.rendezvous, self.rank, self.world, on_compute)
            stated = s.compression.link if s.compression is not None else None
            by_name = choose_schemes(
                [lossy.plan_layer(layer) for layer in self.layers],
                k,
                mode=s.mode,
                workers=self.world,
                shards=s.ps.shards_for(self.world),
                overrides=s.overrides,
                link=stated or await self.agreed_link(),
                candidates=s.hybcomm,
                chunk_bytes=s.ps.chunk_bytes,
                compression=planner,
                report=self.compression_plan,
                hosts=await self.agreed_hosts() if s.mode is Mode.POSEIDON and self.world > 1 else None,
                merged=s.merge.kind is not MergeKind.NONE,
            )
            if self.compression_plan:
                log.info("rank %d: lossy plan\n%s", self.rank, lossy.describe(self.compression_plan))
        plan = SchemePlan(self.layers, {layer.index: Scheme(by_name[layer.name]) for layer in self.layers})
        await self.job.rendezvous.check_digest("scheme plan", json.dumps(plan.names))
        log.info("rank %d: schemes %s", self.rank, json.dumps(plan.names))
        self.plan = plan
        return plan

    def first_groups(self, saved: dict) -> dict:
        """The merge groups to start with: one message per layer (one for all with ``single``),
        or the plans in force when the checkpoint ``saved`` them."""
        groups = {}
        for scheme in self.plan.mergeable():
            groups[scheme] = [[layer.index] for layer in self.plan.layers_of(scheme)]
            if self.settings.merge.kind is MergeKind.SINGLE:
                groups[scheme] = [[i for g in groups[scheme] for i in g]]
            if saved.get(scheme.value):
                by_layer = {layer.name: layer.index for layer in self.plan.layers_of(scheme)}
                if sorted(n for g in saved[scheme.value] for n in g) != sorted(by_layer):
                    raise CheckpointError(
                        f"rank {self.rank}: the checkpoint's {scheme.value} merge plan names other layers than this "
                        f"model syncs by {scheme.value}"
                    )
                groups[scheme] = [[by_layer[n] for n in g] for g in saved[scheme.value]]
        return groups

    async def agreed_link(self) -> Link:
        """Rank 0's measured alpha and beta, on every rank: each rank measures its own, and one
        plan needs one link."""
        if self._link is None:
            if self.rank == 0:
                link = link_of(self.calibration, self._kernel_flop)
                await self.job.rendezvous.publish("hybcomm-link", json.dumps([link.alpha, link.beta, link.flop]))
            alpha, beta, flop = json.loads(await self.job.rendezvous.read("hybcomm-link", who="rank 0"))
            self._link = Link(alpha, beta, flop)
        return self._link

    async def build(self, groups: dict, clock: int, saved_shard: Optional[dict] = None) -> dict:
        """One syncer per scheme in use, each mergeable one wrapped in :class:`Merging` with its
        ``groups``; the parameter server (re)started with one message per PS group and shard
        when a scheme keeps layers there. Returns the syncers."""
        s = self.settings
        if s.ps.server_sgd is not None:
            self.server_owned = {i for layer in self.plan.layers_of(Scheme.PS) for i in layer.param_ids}
        on_ps = self.plan.on_ps()
        ps_index = {i: j for j, i in enumerate(i for layer in on_ps for i in layer.param_ids)}
        if on_ps:
            await self._start_ps(on_ps, ps_index, groups.get(Scheme.PS, []), clock, saved_shard)
        ctx = SyncContext(
            self.rank,
            self.world,
            self.job.peers,
            s.ps.sync_timeout,
            node=self.node,
            ps_index=ps_index,
            reconstruct=kernels.reconstruct,
            executor=self.reduce,
            chunk_bytes=s.ps.chunk_bytes,
            allreduce=s.allreduce.algorithm,
            compression=s.compression,
            feedback=self.feedback,
            topology=self.hosts_topology,
        )
        syncers = {scheme: syncer_class(scheme).build(ctx) for scheme in self.plan.used()}
        if s.merge.kind is not MergeKind.NONE:
            for scheme, scheme_groups in groups.items():
                syncers[scheme] = Merging(syncers[scheme], scheme_groups)
        self.syncers = syncers
        return syncers

    async def close_ps(self, failed: bool = False) -> None:
        if self.node is None:
            return
        if failed:
            await self.node.abandon()
        else:
            await self.node.close()
        self.node = None

    def count_shard_bytes(self, into: dict) -> None:
        """Add the payload bytes this rank's shard moved over the network for the others."""
        shard = self.node.shard if self.node is not None else None
        if shard is None:
            return
        moved = shard.stats.remote_bytes_in + shard.stats.remote_bytes_out
        into["ps"] = into.get("ps", 0) + moved - self._shard_bytes_seen
        self._shard_bytes_seen = moved

    def merge_groups(self) -> list:
        """The messages of mergeable schemes in force: lists of layer names, model order."""
        out = []
        for scheme in self.plan.mergeable() if self.plan else ():
            syncer = self.syncers.get(scheme)
            if isinstance(syncer, Merging):
                out += [[self.layers[i].name for i in g] for g in syncer.groups]
            else:
                out += [[layer.name] for layer in self.plan.layers_of(scheme)]
        return out

    def saved_plans(self) -> dict:
        """What a checkpoint keeps of the plan: every layer's scheme, the merge groups of merged
        schemes (layer names) and the server-side state of the shard this rank hosts."""
        merged = {scheme: syncer for scheme, syncer in self.syncers.items() if isinstance(syncer, Merging)}
        return {
            "schemes": dict(self.plan.names) if self.plan else {},
            "groups": {
                scheme.value: [[self.layers[i].name for i in g] for g in syncer.groups]
                for scheme, syncer in merged.items()
            },
            "shard": self.node.shard.state() if self.node is not None and self.node.shard is not None else {},
        }

    def groups_in_force(self, scheme: Scheme) -> list:
        syncer = self.syncers[scheme]
        return (
            syncer.groups if isinstance(syncer, Merging) else [[layer.index] for layer in self.plan.layers_of(scheme)]
        )

    async def _start_ps(self, on_ps: list, ps_index: dict, groups: list, clock: int, saved: Optional[dict]) -> None:
        names = [[n for i in g for n, _ in self.layers[i].params] for g in groups if len(g) > 1]
        factored = [[n for n, _ in layer.params] for layer in on_ps if self.plan.factored(layer)]
        layers = [[n for n, _ in layer.params] for layer in on_ps if len(layer.params) > 1]
        manifest = Manifest.of_arrays(self.named[i] for i in sorted(ps_index, key=ps_index.get))
        config = self.settings.ps
        if names and None in (config.group_spread_bytes, config.group_pipeline_bytes):  # rank 0's link: one value
            link = await self.agreed_link()
            spread = config.group_spread_bytes
            if spread is None:
                spread = spread_bytes_for(link.alpha, link.beta, config.shards_for(self.world))
            pipeline = config.group_pipeline_bytes or pipeline_bytes_for(link.beta, spread)
            config = replace(config, group_spread_bytes=spread, group_pipeline_bytes=pipeline)
        self.node = await PSNode.start(
            manifest,
            config,
            net=self.settings.net,
            groups=names or None,
            layers=layers,
            start_clock=clock,
            rendezvous=self.job.rendezvous.scoped(f"ps{self.generation}"),
            process_shaper=self.shaper,
            factored=factored or None,
            shard_state={k: v.numpy() for k, v in saved.items()} if saved else None,
            topology=self.hosts_topology or Topology.flat(self.world),
        )
        self._shard_bytes_seen = 0
        if self.settings.ps.server_sgd is not None and not self.node.resumed and self.rank == 0:
            # The shards start from rank 0's parameters (everyone's, after the start-up broadcast);
            # a rank's PARAMS frame reaches each shard before its first push on the same link.
            owned = sorted(self.server_owned)
            values = [self.staging.host(("param", i), self.named[i][1].detach()) for i in owned]
            await self.node.client.broadcast([ps_index[i] for i in owned], values, clock)


def time_reconstruction(world: int) -> float:
    """Seconds per FLOP of the sufficient-factor kernel on this device: the fastest of three
    rebuilds of a 1024 x 1024 layer from ``world`` ranks' 64 rows (~0.5 GFLOP at 4 ranks: long
    enough to time; the kernel the trainer will call, so a replaced one is what is timed)."""
    rows, side = 64, 1024
    us = [torch.randn(rows, side) for _ in range(world)]
    vs = [torch.randn(rows, side) for _ in range(world)]
    out_w, out_b = torch.empty(side, side), torch.empty(side)
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        kernels.reconstruct(us, vs, 1.0 / world, out_w, out_b)
        best = min(best, time.perf_counter() - started)
    return best / (2.0 * rows * world * side * side)
