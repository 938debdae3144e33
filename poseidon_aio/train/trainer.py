"""The Poseidon trainer: ``await trainer.step(batch)`` with wait-free backprop and hybrid communication.

A facade: forward and backward run on one compute thread while the event loop moves bytes, and
each job of a step belongs to a helper of its own: :mod:`.dispatch` (hooks -> buckets -> syncers),
:mod:`.apply` (results -> ``param.grad`` -> the optimizer), :mod:`.planning` (schemes, link,
syncers, parameter server), :mod:`.merging` (MG-WFBP's warm-up, plans and trials),
:mod:`.replicas` (rank 0's tensors everywhere) and :mod:`.checkpoint`.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional

import torch
from torch import nn

from ..cluster import ClusterEnv, Manifest, Rendezvous, StartupConfig
from ..cluster.job import Job
from ..errors import ConfigError
from ..net import NetConfig, Shaper
from ..net.credentials import config_from_env
from ..ps import PSConfig
from ..plan import HYBCOMM_SCHEMES, CompressionConfig, MergeConfig, Mode
from ..sync import AllReduceConfig, Feedback
from . import checkpoint
from . import compression as lossy
from .apply import Applier
from .dispatch import Dispatch
from .layers import discover
from .merging import MergeTuning
from .planning import Planning
from .replicas import Replicas
from .settings import OptimizerConfig, resolve
from .staging import Staging
from .step import Aggregates, StepState, StepStats
from .trace import TraceConfig, Tracer

log = logging.getLogger("poseidon_aio.train")


class Trainer:
    """Data-parallel training of ``model`` across the job's worker processes.

    Args:
        model: the module every rank builds identically (parameters and buffers are broadcast
            from rank 0 at start). CPU or CUDA: a GPU model's bytes go through pinned host buffers.
        optimizer: any ``torch.optim`` optimizer; it steps on the averaged gradients.
        loss_fn: ``loss_fn(model(inputs), targets)`` -> scalar tensor, for ``(inputs, targets)`` batches.
        batch_loss: ``batch_loss(model, batch)`` -> scalar tensor, for any other batch, as given
            to :meth:`step`. Give exactly one of ``loss_fn`` and ``batch_loss``.
        mode: a :class:`~poseidon_aio.sync.Mode` (or its name); default ``poseidon``.
        ps: :class:`~poseidon_aio.ps.PSConfig` (shards, chunk size, staleness, stragglers). With
            ``server_sgd`` the shards own the parameters of PS layers and apply SGD to them; your
            optimizer then steps only the other layers, and merging is off.
        net: :class:`~poseidon_aio.net.NetConfig` (its ``bandwidth``: a budget for all of this
            process's connections); by default the token (and TLS files) come from the
            environment (``POSEIDON_TOKEN`` / ``POSEIDON_TOKEN_FILE``).
        schemes: per-layer overrides, ``{"head.fc1": "ps" | "sfb" | "allreduce" | "rows" | "adam"}``.
        hybcomm: the schemes mode ``poseidon`` weighs per layer (default: PS, SFB, all-reduce and
            rows; ``("ps", "sfb")`` is the paper's HybComm).
        merge: :class:`~poseidon_aio.sync.MergeConfig` (planner, measured steps, trials).
        allreduce: :class:`~poseidon_aio.sync.AllReduceConfig` (ring, direct or auto).
        optimizer_config: :class:`OptimizerConfig` (early steps on landed layers).
        startup: :class:`~poseidon_aio.cluster.StartupConfig` (how long ranks wait for each other).
        trace: :class:`TraceConfig` (default: a trace only if ``$POSEIDON_TRACE`` is set).
        broadcast_buffers: after every step, rank 0's buffers (BatchNorm statistics) to every rank.
        compression: lossy compression, opt-in: ``"auto"``, ``"fp16"``, ``"powersgd"``, ``"topk"``
            or a :class:`~poseidon_aio.sync.CompressionConfig`; mode ``poseidon`` only.
        env: the launcher environment (default: ``RANK``, ``WORLD_SIZE``, ... from the environment).
        rendezvous: an already started :class:`Rendezvous`, to run several trainers over one store.

    Raises:
        ConfigError: an invalid setting or combination (the message names it).

    >>> # async with Trainer(model, torch.optim.SGD(model.parameters(), 0.1), F.cross_entropy) as trainer:
    >>> #     for batch in loader:
    >>> #         stats = await trainer.step(batch)
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Optional[Callable] = None,
        *,
        batch_loss: Optional[Callable[[nn.Module, Any], torch.Tensor]] = None,
        mode: Mode | str = Mode.POSEIDON,
        ps: Optional[PSConfig] = None,
        net: Optional[NetConfig] = None,
        schemes: Optional[dict] = None,
        hybcomm=HYBCOMM_SCHEMES,
        merge: Optional[MergeConfig] = None,
        allreduce: Optional[AllReduceConfig] = None,
        optimizer_config: Optional[OptimizerConfig] = None,
        startup: Optional[StartupConfig] = None,
        trace: Optional[TraceConfig] = None,
        broadcast_buffers: bool = True,
        compression: CompressionConfig | str | None = None,
        env: Optional[ClusterEnv] = None,
        rendezvous: Optional[Rendezvous] = None,
    ) -> None:
        if (loss_fn is None) == (batch_loss is None):
            raise ConfigError("give the Trainer exactly one of loss_fn (for (inputs, targets) batches) and batch_loss")
        self.settings = resolve(
            mode, ps, net, merge, compression, schemes, hybcomm, allreduce, optimizer_config, startup, broadcast_buffers
        )
        self.model, self.optimizer = model, optimizer
        self.loss_fn, self.batch_loss = loss_fn, batch_loss
        #: Error feedback of the lossy schemes, per layer (kept across syncer rebuilds, checkpointed).
        self.feedback = Feedback()
        self.tracer = Tracer(trace or TraceConfig())
        self.env, self._given_rdzv = env, rendezvous
        self.clock = 0
        self.layers = discover(model)
        self._named = [(n, p) for layer in self.layers for n, p in layer.params]
        index = {id(p): i for i, (_, p) in enumerate(self._named)}
        for layer in self.layers:
            layer.param_ids = [index[id(p)] for _, p in layer.params]
        self._buffers = list(model.buffers())
        self.staging = Staging()
        #: Payload bytes on the network per scheme since start (the shard's replies included).
        self.bytes_total: dict = {}
        self._job: Optional[Job] = None
        self._dispatch: Optional[Dispatch] = None
        self._planning: Optional[Planning] = None
        self._merging: Optional[MergeTuning] = None
        self._started = False
        self._inflight: list = []  # steps whose syncs may still be moving (SSP)
        self._restored: dict = {}

    # -- life -------------------------------------------------------------------------------

    async def __aenter__(self) -> "Trainer":
        await self.start()
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        await self.close(failed=exc_type is not None)

    async def start(self) -> None:
        """Join the job: rendezvous, manifest check, worker mesh, rank 0's parameters and buffers
        everywhere, the links measured.

        Raises:
            ConfigError: no cluster token is set (see ``net``).
            StoreUnavailable, PeerTimeout, ManifestMismatch, AuthenticationError: start-up failed
                here; this rank then publishes why, so the others stop waiting at once.
            StartupAborted: another rank failed during start-up (its reason is in the message).
        """
        try:
            await self._join()
        except Exception as exc:
            if self._dispatch is not None:
                self._dispatch.remove()
            if self._job is not None:  # (Job.join publishes its own failures)
                await self._job.rendezvous.abort(exc)
                await self._job.leave(failed=True)
            for pool in (getattr(self, "_compute", None), getattr(self, "_reduce", None)):
                if pool is not None:
                    pool.shutdown(wait=False)
            raise

    async def _join(self) -> None:
        s = self.settings
        if s.net is None:
            s.net = config_from_env()  # before anything waits: a missing token fails at once
        # A new thread has no current CUDA device: give ours the model's before their first kernel.
        device = next((p.device for _, p in self._named if p.is_cuda), None)
        init = None if device is None else functools.partial(torch.cuda.set_device, device)
        self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="poseidon-compute", initializer=init)
        self._reduce = ThreadPoolExecutor(max_workers=1, thread_name_prefix="poseidon-reconstruct", initializer=init)
        shaper = Shaper.from_config(s.net.bandwidth) if s.net.bandwidth is not None else None
        self._manifest = Manifest.of_arrays(self._named)
        timeout = s.startup.timeout
        self._job = await Job.join(
            self._manifest, s.net, timeout=timeout, env=self.env, rendezvous=self._given_rdzv, shaper=shaper
        )
        self.rank, self.world = self._job.rank, self._job.world
        self.tracer.rank, self.tracer.world = self.rank, self.world
        await self.tracer.align(self._job.peers, timeout)
        self._replicas = Replicas(self.rank, self.world, self._job.peers, self.staging, self._reduce, s.ps.sync_timeout)
        # Every parameter, frozen ones too, and every buffer: replicas must start identical.
        await self._replicas.broadcast([*self.model.parameters(), *self._buffers])
        self._aggregates = Aggregates([p for _, p in self._named], s.ps.staleness, self.staging)
        self._dispatch = Dispatch(self.layers, self.settings.mode, self.staging, self._aggregates, self._reduce)
        self._applier = Applier(
            s, self.optimizer, self._named, self.staging, self._aggregates, self._compute, self._dispatch.gpu
        )
        self._planning = Planning(
            s, self.layers, self._named, self._job, self.staging, self._compute, self._reduce, shaper, self.feedback
        )
        await self._planning.calibrate()
        self._started = True

    async def close(self, failed: bool = False) -> None:
        """Finish in-flight steps, write the trace, leave the job."""
        if not self._started:
            return
        self._started = False
        try:
            if not failed:
                await self._drain()
                if self.world > 1:
                    # Every rank's syncs are over before any rank closes a link: a rank whose last
                    # step was done could otherwise reset a link a peer still reads that step from.
                    await self._job.rendezvous.barrier("trainer-done")
                self._planning.count_shard_bytes(self.bytes_total)
        finally:
            self._dispatch.remove()
            await self.tracer.write(None if failed else self._job.peers, self.settings.ps.sync_timeout)
            await self._planning.close_ps(failed)
            await self._job.leave(failed)
            self._compute.shutdown(wait=True)
            self._reduce.shutdown(wait=True)

    # -- checkpoints ------------------------------------------------------------------------

    async def save(self, directory: str, *, keep: int = 2) -> int:
        """Checkpoint the job at the current clock; every rank must call it at the same clock.

        Each rank writes its own file (model, optimizer, clock, torch's RNG state, the scheme and
        merge plans, and the server-side optimizer state of the shard it hosts) under
        ``directory/step-<clock>/``, atomically; steps in flight under SSP are applied first.
        Older checkpoints but the newest ``keep`` are removed once every rank has this one.

        Returns:
            The clock saved (the next step's clock).
        Raises:
            ConfigError: called before :meth:`start`, or ``keep`` < 1.
        """
        if not self._started:
            raise ConfigError("start the trainer before saving it: `async with Trainer(...) as trainer:`")
        if keep < 1:
            raise ConfigError("save(keep=...) must keep at least the checkpoint it writes")
        await self._drain()
        p = self._planning
        # The snapshot is taken before the barrier below, so no rank can push the next clock into
        # its shard before its state is copied.
        compression = lossy.checkpoint_state(self.feedback, self.settings.compression)
        state = checkpoint.snapshot(
            self.clock, self.model, self.optimizer, p.saved_plans(), self.merge_info, compression
        )
        clock, loop, digest = self.clock, asyncio.get_running_loop(), self._manifest.digest()
        await loop.run_in_executor(
            self._compute, checkpoint.write, directory, clock, self.rank, self.world, digest, state
        )
        await self._job.rendezvous.barrier(f"checkpoint/{clock}")
        await loop.run_in_executor(self._compute, checkpoint.prune, directory, self.rank, keep)
        log.info("rank %d: checkpoint at clock %d in %s", self.rank, clock, directory)
        return clock

    async def restore(self, directory: str) -> int:
        """Resume from the newest checkpoint in ``directory`` that every rank has; call it after
        :meth:`start` and before the first step, on every rank.

        Returns:
            The clock the job resumes at.
        Raises:
            CheckpointError: no checkpoint common to every rank, or one that does not match this
                model or world size (the message names the ranks and clocks).
            ConfigError: called before :meth:`start` or after a step.
        """
        if not self._started or self._merging is not None:
            raise ConfigError("restore() goes after start() and before the first step")
        on_compute = functools.partial(asyncio.get_running_loop().run_in_executor, self._compute)
        digest = self._manifest.digest()
        clock = await checkpoint.newest_everywhere(
            directory, self._job.rendezvous, self.rank, self.world, digest, on_compute
        )
        state = await on_compute(checkpoint.read, directory, clock, self.rank)
        checkpoint.load(state, self.model, self.optimizer)
        schemes = state.get("schemes") or {}
        lossy.restore_state(self.feedback, self.settings.compression, state.get("compression"), schemes)
        self.clock = clock
        self._restored = state
        log.info("rank %d: resumed from the checkpoint at clock %d in %s", self.rank, clock, directory)
        return clock

    # -- the step ---------------------------------------------------------------------------

    async def step(self, batch) -> StepStats:
        """One iteration on this rank's ``batch``: ``(inputs, targets)`` with ``loss_fn``, anything
        with ``batch_loss``.

        Returns:
            :class:`StepStats` (loss, timings, bytes per scheme, dropped ranks).
        Raises:
            SyncTimeout, ConnectionLost, WorkerLeft: a sync did not complete (the message names
                the layer, the clock and the peer or shard).
            ConfigError: called before :meth:`start`, or a batch ``loss_fn`` cannot take.
        """
        self._check(batch)
        if self._merging is None:  # the first step plans
            await self._plan(batch)
        state = StepState(self.clock, time.perf_counter(), self._aggregates.of(self.clock))
        self._merging.begin(state.clock)
        loss = await self._forward_backward(state, batch)  # the hooks start each layer's sync
        self._dispatch.launch_rest(state)
        self._inflight.append(state)
        if self.settings.broadcast_buffers and self._buffers:
            # This step's forward updated them (BatchNorm statistics); the next forward reads them.
            await self._replicas.broadcast(self._buffers, clock=state.clock)
        while self._inflight and self._inflight[0].clock <= state.clock - self.settings.ps.staleness:
            await self._apply(self._inflight.pop(0))
        state.done = time.perf_counter()
        self.clock += 1
        await self._merging.end(state, self.clock)
        if state not in self._inflight:  # (a step still syncing, under SSP, is traced when applied)
            self.tracer.step(state.clock, state.started, state.compute_end, state.spans, state.done, state.work)
        return state.stats(loss, self._planning.plan.names)

    def _check(self, batch) -> None:
        if not self._started:
            raise ConfigError("start the trainer first: `async with Trainer(...) as trainer:`")
        if self.loss_fn is not None and not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise ConfigError(
                f"step() got a batch of type {type(batch).__name__}: with loss_fn a batch is an (inputs, targets) "
                "pair; for dicts or several tensors give the Trainer batch_loss=lambda model, batch: <scalar loss>"
            )

    async def _plan(self, batch) -> None:
        """Every layer's scheme (the same on every rank), the syncers, and MG-WFBP's measurement."""
        p, saved = self._planning, self._restored.get("groups") or {}
        plan = await p.choose(batch, self.model, self._loss, self._dispatch.captures, self._restored.get("schemes"))
        self._merging = MergeTuning(self.settings, p, self._rebuild, self.merge_info)
        self._dispatch.route(plan, await p.build(p.first_groups(saved), self.clock, self._restored.get("shard")))
        self._applier.plan, self._applier.server_owned = plan, p.server_owned
        self._merging.start(saved)

    async def _rebuild(self, groups: dict) -> None:
        """New syncers (and a new parameter server) with these merge groups, from the next clock."""
        p = self._planning
        await self._drain()
        p.count_shard_bytes(self.bytes_total)
        await p.close_ps()
        p.generation += 1
        self._dispatch.route(p.plan, await p.build(groups, self.clock))

    def _loss(self, batch) -> torch.Tensor:
        if self.batch_loss is not None:
            return self.batch_loss(self.model, batch)
        inputs, targets = batch
        return self.loss_fn(self.model(inputs), targets)

    async def _forward_backward(self, state: StepState, batch) -> float:
        self._dispatch.arm(state)
        loss = await asyncio.get_running_loop().run_in_executor(self._compute, self._gradients, state, batch)
        state.compute_end = time.perf_counter()
        return loss

    def _gradients(self, state: StepState, batch) -> float:
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss = self._loss(batch)
        state.forward_end = time.perf_counter()
        loss.backward()
        return float(loss.detach())

    async def _apply(self, state: StepState) -> None:
        await self._applier.apply(state)
        # Its bytes into the totals; a step that returned before its syncs were in (SSP) into
        # the trace, now that every sync has ended.
        self._planning.count_shard_bytes(state.bytes)
        for scheme, n in state.bytes.items():
            self.bytes_total[scheme] = self.bytes_total.get(scheme, 0) + n
        if state.done is not None:
            end = max([state.done, *(s.end or 0.0 for s in state.spans)])
            self.tracer.step(state.clock, state.started, state.compute_end, state.spans, end, state.work)

    async def _drain(self) -> None:
        """Apply every step still in flight (SSP leaves up to ``staleness`` of them)."""
        while self._inflight:
            await self._apply(self._inflight.pop(0))

    # -- what a caller may read -------------------------------------------------------------

    @property
    def merge_info(self) -> dict:
        """The merge plan in force: groups of layer names, the fitted model, the predicted times."""
        return self._merging.info if self._merging is not None else json.loads(self._restored.get("merge_info", "{}"))

    @property
    def merge_groups(self) -> list:
        """The messages of mergeable schemes in force: lists of layer names, model order."""
        return self._planning.merge_groups() if self._planning is not None else []

    @property
    def compression_plan(self) -> dict:
        """The lossy plan: ``{layer name: Weighing}`` (candidates, predicted seconds, choice, why)."""
        return self._planning.compression_plan if self._planning is not None else {}
