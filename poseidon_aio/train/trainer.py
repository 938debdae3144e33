"""The Poseidon trainer: ``await trainer.step(batch)`` with wait-free backprop and hybrid communication.

Threads and loops (../shared/DESIGN.md): forward and backward run on one dedicated compute thread;
the event loop keeps moving bytes meanwhile (PyTorch releases the GIL inside its kernels). Backward
hooks hand each finished layer to the loop with ``call_soon_threadsafe``; the loop wraps the layer's
buffers in a :class:`~poseidon_aio.sync.Bucket` and starts its scheme's
:class:`~poseidon_aio.sync.Syncer` at once, so upper layers' syncs overlap the backward of lower
layers (WFBP). The step awaits every sync of its clock (under SSP only those older than the
staleness bound), puts the averaged gradients in ``param.grad`` and steps the user's optimizer.

What is not the trainer's: the job's bootstrap (``cluster.Job``), the schemes and the HybComm plan
(``sync``), merging and its runtime (``sync.merge``, ``sync.runtime``), the trace (``train.trace``),
host staging of GPU tensors (``train.staging``) and checkpoint files (``train.checkpoint``).

Modes (:class:`~poseidon_aio.sync.Mode`):

* ``naive``: every layer by PS, all syncs started after the whole backward;
* ``wfbp``: every layer by PS, each started the moment its gradient exists;
* ``mgwfbp``: WFBP by PS with MG-WFBP merging after ``MergeConfig.after`` measured steps;
* ``poseidon``: WFBP + HybComm: fully-connected layers by SFB where the cost model says it moves
  fewer bytes (ATC'17 Algorithm 1), the rest by PS, merged as in ``mgwfbp``.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

import numpy as np
import torch
from torch import nn
from torch.optim import optimizer as torch_optimizer

from .. import kernels
from ..cluster import ClusterEnv, Manifest, Rendezvous
from ..cluster.book import spread_bytes_for
from ..cluster.job import Job
from ..errors import CheckpointError, ConfigError
from ..net import NetConfig, Shaper, ShaperConfig
from ..net.loop import INLINE_BUDGET_S, Offload
from ..net.credentials import config_from_env
from ..ps import PSConfig, PSNode
from ..sync import (
    HYBCOMM_SCHEMES,
    Bucket,
    CompressionConfig,
    Feedback,
    Link,
    Merging,
    MergeConfig,
    MergeKind,
    MergeRuntime,
    Mode,
    Scheme,
    SyncContext,
    choose_schemes,
    syncer_class,
)
from ..sync.runtime import calibrate, judge_trial, link_of, loop_cpu_per_byte
from ..sync import broadcast
from . import checkpoint
from . import compression as lossy
from .layers import FactorCapture, GradReady, Layer, discover
from .staging import Staging
from .trace import Span, TraceConfig, Tracer

log = logging.getLogger("poseidon_aio.train")

# Optimizers whose update of a parameter reads only that parameter, its gradient, its own state
# and its group's settings: stepping them on some parameters, then on the rest, gives every
# parameter the bits one step over all of them gives (exact types: a subclass may couple them).
_PER_PARAMETER_OPTIMIZERS = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.RMSprop,
    torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adadelta,
)


@dataclass
class StepStats:
    """What one step did.

    Attributes:
        clock: the step's iteration clock.
        loss: this rank's loss on its batch.
        compute_s: forward + backward wall time on the compute thread.
        stall_s: time after the backward spent waiting for this step's syncs (communication
            that did not overlap compute).
        overlap_s: sync time that ran while the backward was still computing.
        step_s: the whole step.
        bytes: payload bytes this rank put on and took off the network, per scheme (the
            in-process link to its own shard not counted); under SSP complete once the step has
            been applied, ``staleness`` steps later.
        dropped: ranks a shard dropped from this step's aggregation (straggler policy).
        schemes: the scheme of every layer.
    """

    clock: int
    loss: float
    compute_s: float = 0.0
    stall_s: float = 0.0
    overlap_s: float = 0.0
    step_s: float = 0.0
    bytes: dict = field(default_factory=dict)
    dropped: list = field(default_factory=list)
    schemes: dict = field(default_factory=dict)


class _Step:
    """One iteration in flight: its layer syncs and where their results land."""

    __slots__ = ("clock", "syncs", "launched", "deferred", "agg", "compute_done", "started", "forward_end", "compute_end", "spans", "work", "ready_at", "bytes", "dropped", "unused", "held", "done", "taken", "sync_ids", "stepped")

    def __init__(self, clock: int, started: float) -> None:
        self.clock = clock
        self.syncs: list = []  # awaitables of SyncResult
        self.sync_ids: list = []  # the manifest indices each of ``syncs`` lands, in the same order
        self.stepped: set = set()  # manifest indices the optimizer has stepped (_apply)
        self.launched: set = set()
        self.deferred: list = []
        self.agg: dict = {}  # manifest index -> tensor receiving the synchronized result
        self.compute_done = False
        self.started = started
        self.forward_end = self.compute_end = 0.0
        self.spans: list = []
        self.work: list = []  # (what, start, end) the syncs computed themselves (SFB's rebuilds)
        self.ready_at: dict = {}  # layer index -> when its gradient (or factors) were ready
        self.bytes: dict = {}
        self.dropped: set = set()
        self.unused: set = set()  # manifest indices this rank's backward gave no gradient
        self.held: dict = {}  # merge group -> [(layer, ready at)] of its members ready so far
        self.done: Optional[float] = None  # when step() returned
        # Staged (GPU) layers: what their syncs copy, taken where the backward made it (manifest
        # index -> (gradient, CUDA event); ("factors", layer index) -> (u, v, CUDA event)).
        self.taken: dict = {}


def step_some(optimizer: torch.optim.Optimizer, params: set, keep: bool) -> None:
    """One ``optimizer`` step on the parameters whose ``id`` is in ``params`` (``keep``) or not
    in it: every group cut to them for the step, with its own settings (read afresh: a scheduler
    may have changed them since the last step). For the optimizers of
    ``_PER_PARAMETER_OPTIMIZERS``, steps on the parts of a partition give every parameter and its
    state the bits one step on all of them gives (tests/test_step_parts.py)."""
    groups = optimizer.param_groups
    cut = [{**g, "params": [p for p in g["params"] if (id(p) in params) == keep]} for g in groups]
    optimizer.param_groups = [g for g in cut if g["params"]]
    try:
        optimizer.step()
    finally:
        optimizer.param_groups = groups


def _back_to_back(params: list) -> dict:
    """``{i: tensor}`` shaped like ``params[i]``: views of one contiguous buffer per (device,
    dtype), in the given order."""
    sizes: dict = {}
    for p in params:
        sizes[(p.device, p.dtype)] = sizes.get((p.device, p.dtype), 0) + p.numel()
    flat = {k: torch.empty(n, dtype=k[1], device=k[0]) for k, n in sizes.items()}
    offset = dict.fromkeys(flat, 0)
    views = {}
    for i, p in enumerate(params):
        k, at = (p.device, p.dtype), offset[(p.device, p.dtype)]
        views[i] = flat[k][at : at + p.numel()].view(p.shape)
        offset[k] = at + p.numel()
    return views


class Trainer:
    """Data-parallel training of ``model`` across the job's worker processes.

    Args:
        model: the module every rank builds identically (parameters and buffers are broadcast
            from rank 0 at start). CPU or CUDA: a GPU model's bytes go through pinned host buffers.
        optimizer: any ``torch.optim`` optimizer over the model's parameters; it steps on the
            averaged gradients. Step your LR scheduler yourself, as usual.
        loss_fn: ``loss_fn(model(inputs), targets)`` -> scalar tensor, for batches that are
            ``(inputs, targets)`` pairs.
        batch_loss: ``batch_loss(model, batch)`` -> scalar tensor, for any other batch (a dict,
            several tensors, your own object): the batch reaches it as you gave it to
            :meth:`step`. Give exactly one of ``loss_fn`` and ``batch_loss``.
        mode: a :class:`~poseidon_aio.sync.Mode` (or its name); default ``poseidon``.
        ps: parameter-server settings (shards, chunk size, staleness, stragglers). With
            ``server_sgd`` the shards own the parameters of PS layers and apply SGD to them;
            your optimizer then steps only the other layers, and merging is off.
        net: connection settings; by default the token (and TLS files) come from the environment
            (``POSEIDON_TOKEN`` / ``POSEIDON_TOKEN_FILE``, see :mod:`poseidon_aio.net.credentials`).
        schemes: per-layer overrides, ``{"head.fc1": "ps" | "sfb" | "allreduce" | "rows" |
            "adam"}`` (``rows``: an ``nn.Embedding``'s touched rows; ``adam``: Project Adam's
            scheme, factors pushed to the PS and full matrices pulled back, for comparison).
        hybcomm: the schemes mode ``poseidon`` weighs per layer, by their predicted time on the
            link measured at start-up: PS, SFB, all-reduce and rows by default; ``("ps", "sfb")``
            is the paper's HybComm.
        merge: :class:`~poseidon_aio.sync.MergeConfig` (planner, measured steps, calibration).
        bandwidth: the bandwidth manager, a :class:`~poseidon_aio.net.ShaperConfig` for all of
            this process's connections together (outbound bytes/s, a per-message start-up).
        trace: :class:`TraceConfig` (default: a trace only if ``$POSEIDON_TRACE`` is set).
        broadcast_buffers: at the end of every step, send rank 0's buffers (BatchNorm running
            statistics) to every rank, so replicas (and a model saved on any rank) stay identical.
        compression: lossy gradient compression, opt-in (default ``None``: every layer exact):
            ``"auto"`` (HybComm weighs fp16, PowerSGD and top-k beside the exact schemes, per
            layer, by predicted time including their measured compute), ``"fp16"``,
            ``"powersgd"`` or ``"topk"`` (that method wherever it suits a layer, exact
            elsewhere), or a :class:`~poseidon_aio.sync.CompressionConfig` (PowerSGD's rank,
            top-k's ratio, the size threshold, a stated link to plan for). Mode ``poseidon`` only.
        env: the launcher environment (default: ``RANK``, ``WORLD_SIZE``, ... from the environment).
        rendezvous: an already started :class:`Rendezvous` (a ``job`` view), to run several
            trainers one after another over one store.

    Raises:
        ConfigError: an invalid combination of settings.

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
        bandwidth: Optional[ShaperConfig] = None,
        trace: Optional[TraceConfig] = None,
        broadcast_buffers: bool = True,
        compression=None,
        env: Optional[ClusterEnv] = None,
        rendezvous: Optional[Rendezvous] = None,
    ) -> None:
        try:
            mode = Mode(mode)
        except ValueError:
            raise ConfigError(f"mode must be one of {[m.value for m in Mode]}, got {mode!r}") from None
        if (loss_fn is None) == (batch_loss is None):
            raise ConfigError("give the Trainer exactly one of loss_fn (for (inputs, targets) batches) and batch_loss")
        ps = ps or PSConfig()
        if ps.checkpoint_dir:
            raise ConfigError(
                "PSConfig.checkpoint_dir is the parameter server's own checkpointing (PSNode); with the Trainer "
                "use `await trainer.save(directory)` and `await trainer.restore(directory)`, which cover the model, "
                "the optimizer, the clock and the shards' server-side state"
            )
        merge = merge or MergeConfig()
        if ps.server_sgd is not None and merge.kind not in (None, MergeKind.NONE):
            raise ConfigError(
                "with PSConfig.server_sgd the shards own the parameters and their optimizer state per message; "
                "merging would re-cut the messages mid-training: use MergeConfig(kind='none')"
            )
        if merge.kind is None:
            merging = mode in (Mode.MGWFBP, Mode.POSEIDON) and ps.server_sgd is None
            merge = replace(merge, kind=MergeKind.BEST if merging else MergeKind.NONE)
        if merge.kind is not MergeKind.NONE and mode in (Mode.NAIVE, Mode.WFBP):
            raise ConfigError(f"mode {mode.value!r} sends every layer on its own; merging is mode 'mgwfbp' or 'poseidon'")
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.batch_loss = batch_loss
        self.mode = mode
        self.ps_config = ps
        self.net = net
        self.overrides = dict(schemes or {})
        try:
            self.hybcomm = tuple(Scheme(c) for c in hybcomm)
        except ValueError:
            raise ConfigError(f"hybcomm names a scheme that does not exist: {list(hybcomm)}; known: {[s.value for s in Scheme]}") from None
        self.merge = merge
        self.broadcast_buffers = broadcast_buffers
        self.compression = CompressionConfig.of(compression)
        if self.compression is not None and mode is not Mode.POSEIDON:
            raise ConfigError(f"compression is weighed per layer by HybComm: use mode 'poseidon', not {mode.value!r}")
        #: Error feedback of the lossy schemes, per layer (kept across syncer rebuilds, checkpointed).
        self.feedback = Feedback()
        #: The lossy plan: ``{layer name: Weighing}`` (candidates, predicted seconds, choice, why).
        self.compression_plan: dict = {}
        self.tracer = Tracer(trace or TraceConfig())
        self.env = env
        self._given_rdzv = rendezvous
        self._shaper = Shaper.from_config(bandwidth) if bandwidth is not None else None
        #: The merge plan in force: groups of layer names, the fitted model, the predicted times.
        self.merge_info: dict = {}
        self.clock = 0
        self.layers = discover(model)
        self._named = [(n, p) for layer in self.layers for n, p in layer.params]
        self._param_bytes = [p.numel() * p.element_size() for _, p in self._named]
        index = {id(p): i for i, (_, p) in enumerate(self._named)}
        for layer in self.layers:
            layer.param_ids = [index[id(p)] for _, p in layer.params]
        self._buffers = list(model.buffers())
        self.schemes: dict = {}  # layer index -> Scheme
        self._scheme_names: dict = {}  # layer name -> its scheme's name, as every step reports them
        self.staging = Staging()
        self._gpu = any(self.staging.staged(p) for _, p in self._named)
        self._syncers: dict = {}  # Scheme -> Syncer (a mergeable one wrapped in Merging)
        self._job: Optional[Job] = None
        self._node: Optional[PSNode] = None
        self._runtimes: dict = {}  # mergeable Scheme -> MergeRuntime, while measuring
        self._step_times: list = []  # this rank's step seconds in the warm-up (one message per layer)
        self._trials: list = []  # the merge plans on trial: [(planner, {Scheme: groups}, [step seconds])]
        self._trial_at = 0  # the one running now
        self._trial_from: Optional[int] = None  # the clock of its first step
        self._calibration: list = []
        self._link: Optional[Link] = None  # rank 0's alpha and beta, once agreed
        self._loop_cpu_per_byte = 0.0  # the event loop's CPU per byte in or out, measured at start
        self._kernel_flop = 0.0  # seconds per FLOP of the sufficient-factor kernel, measured at start
        self._ready: dict = {}
        self._captures: dict = {}
        self._wake_with: dict = {}  # layer index -> its merge group (more than one layer)
        self._held_lock = threading.Lock()  # a GPU backward may run hooks on several threads
        self._server_owned: set = set()  # manifest indices whose values the shards' SGD sends
        self._started = self._planned = False
        self._inflight: list = []
        self._state: Optional[_Step] = None
        self._generation = 0
        self._shard_bytes_seen = 0
        self._restored: Optional[dict] = None
        self._agg_ring: dict = {}
        self._agg_views: dict = {}  # (ring slot, parameter) -> host view of that aggregate
        #: Payload bytes on the network per scheme since start (the shard's replies included).
        self.bytes_total: dict = {}

    # -- life -------------------------------------------------------------------------------

    async def __aenter__(self) -> "Trainer":
        await self.start()
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        await self.close(failed=exc_type is not None)

    async def start(self) -> None:
        """Join the job: rendezvous, manifest check, worker mesh, rank 0's parameters and buffers
        everywhere.

        Raises:
            ConfigError: no cluster token is set (see ``net``).
            StoreUnavailable, PeerTimeout, ManifestMismatch, AuthenticationError: start-up failed
                here; this rank then publishes why, so the others stop waiting at once.
            StartupAborted: another rank failed during start-up (its reason is in the message).
        """
        try:
            await self._join()
        except Exception as exc:
            await self._abandon_start(exc)
            raise

    async def _abandon_start(self, exc: Exception) -> None:
        for hook in [*self._ready.values(), *self._captures.values()]:
            hook.remove()
        self._ready.clear()
        self._captures.clear()
        if self._job is not None:  # (Job.join publishes its own failures)
            await self._job.rendezvous.abort(exc)
            await self._job.leave(failed=True)
        for pool in (getattr(self, "_compute", None), getattr(self, "_reduce", None)):
            if pool is not None:
                pool.shutdown(wait=False)

    async def _join(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self.net is None:
            self.net = config_from_env()  # before anything waits: a missing token fails at once
        # A new thread has no current CUDA device: give ours the model's before their first kernel.
        device = next((p.device for _, p in self._named if p.is_cuda), None)
        init = None if device is None else functools.partial(torch.cuda.set_device, device)
        self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="poseidon-compute", initializer=init)
        self._reduce = ThreadPoolExecutor(max_workers=1, thread_name_prefix="poseidon-reconstruct", initializer=init)
        # A small model's optimizer step costs less than the hop to the compute thread and back:
        # it runs on the loop (the compute thread is idle by then). A GPU's waits on its streams.
        self._stepper = Offload(self._compute, budget_s=0.0 if self._gpu else INLINE_BUDGET_S)
        self._manifest = Manifest.of_arrays(self._named)
        timeout = self.ps_config.rendezvous_timeout
        self._job = await Job.join(self._manifest, self.net, timeout=timeout, env=self.env, rendezvous=self._given_rdzv, shaper=self._shaper)
        self.rank, self.world = self._job.rank, self._job.world
        self.tracer.rank, self.tracer.world = self.rank, self.world
        await self.tracer.align(self._job.peers, timeout)
        # Every parameter, frozen ones too, and every buffer: replicas must start identical.
        tensors = [*self.model.parameters(), *self._buffers]
        await self._broadcast(tensors)
        for layer in self.layers:
            self._ready[layer.index] = GradReady(layer, self._on_ready_threadsafe)
            if layer.factorable:
                self._captures[layer.index] = FactorCapture(layer, self._on_ready_threadsafe)
        if self.world > 1 and (self.merge.planned or self.mode is Mode.POSEIDON):
            # alpha and beta for HybComm and the merge planner, while the links are idle
            cpu: list = []
            self._calibration = await calibrate(self.rank, self.world, self._job.peers, self.merge.calibration_sizes, self.ps_config.sync_timeout, cpu)
            self._loop_cpu_per_byte = loop_cpu_per_byte(cpu)
        if self.world > 1 and self.mode is Mode.POSEIDON:
            self._kernel_flop = await self._loop.run_in_executor(self._reduce, _time_reconstruction, self.world)
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
                    # step was done could otherwise close while a peer was still reading that step's
                    # all-gather from it, and the peer's link was reset mid-frame (seen once in
                    # bench train: 4 workers, all layers on the all-reduce, no PS to wait for).
                    await self._job.rendezvous.barrier("trainer-done")
                if self._node is not None:
                    self._count_shard_bytes(self.bytes_total)
        finally:
            for hook in [*self._ready.values(), *self._captures.values()]:
                hook.remove()
            await self.tracer.write(None if failed else self._job.peers, self.ps_config.sync_timeout)
            await self._close_ps(failed)
            await self._job.leave(failed)
            self._compute.shutdown(wait=True)
            self._reduce.shutdown(wait=True)

    async def _drain(self) -> None:
        """Apply every step still in flight (SSP leaves up to ``staleness`` of them)."""
        while self._inflight:
            await self._apply(self._inflight.pop(0))

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
            ConfigError: called before :meth:`start`.
        """
        if not self._started:
            raise ConfigError("start the trainer before saving it: `async with Trainer(...) as trainer:`")
        if keep < 1:
            raise ConfigError("save(keep=...) must keep at least the checkpoint it writes")
        await self._drain()
        shard = self._node.shard if self._node is not None else None
        state = {
            "clock": self.clock,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "rng": torch.get_rng_state(),
            "schemes": {layer.name: self.schemes[layer.index].value for layer in self.layers if layer.index in self.schemes},
            "groups": {scheme.value: [[self.layers[i].name for i in g] for g in syncer.groups] for scheme, syncer in self._syncers.items() if isinstance(syncer, Merging)},
            "merge_info": json.dumps(self.merge_info),
            # The snapshot is taken before the barrier below, so no rank can push the next clock
            # into this shard before its state is copied.
            "shard": {k: torch.from_numpy(v) for k, v in shard.state().items()} if shard is not None else {},
            "compression": lossy.checkpoint_state(self.feedback, self.compression),
        }
        clock = self.clock
        await self._loop.run_in_executor(
            self._compute, checkpoint.write, directory, clock, self.rank, self.world, self._manifest.digest(), state
        )
        await self._job.rendezvous.barrier(f"checkpoint/{clock}")
        await self._loop.run_in_executor(self._compute, checkpoint.prune, directory, self.rank, keep)
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
        if not self._started or self._planned:
            raise ConfigError("restore() goes after start() and before the first step")
        digest = self._manifest.digest()
        mine = await self._loop.run_in_executor(self._compute, checkpoint.complete_clocks, directory, self.rank, self.world, digest)
        seen = await self._job.rendezvous.exchange("restore/clocks", json.dumps(mine), range(self.world))
        by_rank = {r: json.loads(text) for r, text in seen.items()}
        clock = checkpoint.newest_common(by_rank)
        if clock is None:
            raise CheckpointError(
                f"rank {self.rank}: no checkpoint of this model and world size ({self.world}) in {directory} that every "
                f"rank has (complete clocks per rank: {by_rank})"
            )
        state = await self._loop.run_in_executor(self._compute, checkpoint.read, directory, clock, self.rank)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
        lossy.restore_state(self.feedback, self.compression, state.get("compression"), state.get("schemes") or {})
        self.clock = clock
        self.merge_info = json.loads(state["merge_info"])
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
            ConfigError: a batch ``loss_fn`` cannot take.
        """
        if not self._started:
            raise ConfigError("start the trainer first: `async with Trainer(...) as trainer:`")
        if self.loss_fn is not None and not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise ConfigError(
                f"step() got a batch of type {type(batch).__name__}: with loss_fn a batch is an (inputs, targets) "
                "pair; for dicts or several tensors give the Trainer batch_loss=lambda model, batch: <scalar loss>"
            )
        if not self._planned:
            await self._plan(batch)
        t = self.clock
        state = _Step(t, time.perf_counter())
        measuring = bool(self._runtimes) and any(r.measuring(t) for r in self._runtimes.values())
        loop_cpu = time.thread_time()  # this (the event loop's) thread
        loop_waited = _runqueue_wait() if measuring else 0.0  # a file read: warm-up steps only
        state.agg = self._aggregates(t)
        for layer in self.layers:
            captures = syncer_class(self.schemes[layer.index]).captures_factors
            self._ready[layer.index].reset(enabled=not captures)
            if layer.index in self._captures:
                self._captures[layer.index].reset(enabled=captures)
        self._state = state
        loss = await self._loop.run_in_executor(self._compute, self._forward_backward, batch)
        state.compute_end = time.perf_counter()
        state.compute_done = True
        for layer in [*state.deferred, *reversed(self.layers)]:  # the naive mode's, and unused layers
            self._launch(state, layer)
        self._inflight.append(state)
        if self.broadcast_buffers and self._buffers:
            # This step's forward updated them (BatchNorm statistics); the next forward reads them.
            await self._broadcast(self._buffers, clock=t)
        while self._inflight and self._inflight[0].clock <= t - self.ps_config.staleness:
            await self._apply(self._inflight.pop(0))
        done = state.done = time.perf_counter()
        self.clock += 1
        if measuring:
            self._step_times.append(done - state.started)
        elif self._trial_from is not None:
            self._trials[self._trial_at][2].append(done - state.started)
        if measuring:
            self._measure(state, time.thread_time() - loop_cpu, _runqueue_wait() - loop_waited)
            if any(r.due(t) for r in self._runtimes.values()):
                await self._replan()  # the new syncers (and parameter server) start at the next clock
        elif self._trial_from is not None and t == self._trial_from + self.merge.trial - 1:
            await self._next_trial()
        if state not in self._inflight:  # (a step still syncing, under SSP, is traced when applied)
            self.tracer.step(t, state.started, state.compute_end, state.spans, done, state.work)
        return StepStats(
            clock=t,
            loss=loss,
            compute_s=state.compute_end - state.started,
            stall_s=done - state.compute_end,
            overlap_s=sum(max(0.0, min(s.end, state.compute_end) - s.start) for s in state.spans if s.end),
            step_s=done - state.started,
            bytes=state.bytes,  # (the step's own: under SSP its syncs that are still moving add to it)
            dropped=sorted(state.dropped),
            schemes=dict(self._scheme_names),  # a copy: a caller may change a step's dict
        )

    def _aggregates(self, clock: int) -> dict:
        """Where clock ``clock``'s synchronized results land: one tensor per parameter, from a ring
        of ``staleness + 2`` sets reused clock after clock. Under SSP an older clock's results may
        still be landing while this one runs, and each set is handed to ``param.grad`` for one
        optimizer step; fresh tensors instead would cost a page fault (and the kernel zeroing a
        page) per 4 KiB of the model every step: 50 MB for a 12.6 M-parameter model.

        A set is one buffer per (device, dtype), the parameters back to back in model order:
        the keys of a merged message, consecutive slices of consecutive parameters, are then
        consecutive bytes, and its reply is received into them directly (``wire.spans``)."""
        slot = self._agg_slot(clock)
        agg = self._agg_ring.get(slot)
        if agg is None:
            agg = self._agg_ring[slot] = _back_to_back([p for _, p in self._named])
        return agg

    def _agg_slot(self, clock: int) -> int:
        return clock % (self.ps_config.staleness + 2)

    def _loss(self, batch) -> torch.Tensor:
        if self.batch_loss is not None:
            return self.batch_loss(self.model, batch)
        inputs, targets = batch
        return self.loss_fn(self.model(inputs), targets)

    def _forward_backward(self, batch) -> float:
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss = self._loss(batch)
        self._state.forward_end = time.perf_counter()
        loss.backward()
        return float(loss.detach())

    # -- hooks -> loop -> syncers -----------------------------------------------------------

    def _on_ready_threadsafe(self, layer: Layer) -> None:
        # On the compute thread. A staged layer's copies run later, off the loop: what they copy
        # is taken here, where the backward made it, with the point on its stream where it was
        # made. Read later on another thread, under SSP ``p.grad`` is being replaced by the next
        # step's backward (autograd writes it without the GIL: a worker crashed with SIGSEGV in
        # the staged copy beside a CPU hog) and the factor captures reset by its forward.
        if self._gpu:
            taken = self._state.taken
            cap = self._captures.get(layer.index)
            if cap is not None and syncer_class(self.schemes[layer.index]).captures_factors and cap.captured:
                u, v = cap.factors()
                taken[("factors", layer.index)] = (u, v, self.staging.ready_event(u))
            for i, (_, p) in zip(layer.param_ids, layer.params):
                g = p.grad
                if g is not None:
                    taken[i] = (g, self.staging.ready_event(g))
        now = time.perf_counter()
        group = self._wake_with.get(layer.index)
        if group is None:
            self._loop.call_soon_threadsafe(self._launch, self._state, layer, now)
            return
        # A merge group's message leaves once its last member is in (sync.merge.Merging): wake
        # the loop once for all of them, not once a layer. Each wake-up costs the loop a pass and
        # the backward the GIL for it (31 a step for the ResNet of bench train, 2 with its plan).
        # A member that never reports is launched with the rest of the layers after the backward.
        with self._held_lock:
            held = self._state.held.setdefault(group, [])
            held.append((layer, now))
            complete = len(held) == len(group)
        if complete:
            self._loop.call_soon_threadsafe(self._launch_held, self._state, held)

    def _launch_held(self, state: _Step, held: list) -> None:
        """A merge group whose layers are all in: one bucket, one sync, one span. Handed to
        ``Merging.start`` a layer at a time (a future and a callback each, settled one by one),
        the ResNet-20's 30-layer group cost the loop 1.45 ms of CPU a step; at once, 1.05 ms. A
        GPU's buckets are staged off the loop, one layer at a time."""
        scheme = self.schemes[held[0][0].index]
        syncer = self._syncers.get(scheme)
        if self._gpu or not isinstance(syncer, Merging) or any(layer.index in state.launched for layer, _ in held):
            for layer, ready_at in held:
                self._launch(state, layer, ready_at)
            return
        for layer, ready_at in held:
            state.launched.add(layer.index)
            state.ready_at[layer.index] = ready_at
        first, last = min(layer.index for layer, _ in held), max(layer.index for layer, _ in held)
        span = Span(f"{self.layers[last].name}..{self.layers[first].name}", scheme, max(r for _, r in held), time.perf_counter())
        ids = [i for layer, _ in held for i in layer.param_ids]
        self._start(state, scheme, span, lambda: syncer.start_group([self._bucket(state, layer, scheme) for layer, _ in held], state.clock), ids)

    def _launch(self, state: _Step, layer: Layer, ready_at: Optional[float] = None) -> None:
        if layer.index in state.launched:
            return
        if self.mode is Mode.NAIVE and not state.compute_done:
            state.deferred.append(layer)  # naive: nothing moves until the backward is over
            return
        state.launched.add(layer.index)
        state.ready_at[layer.index] = ready_at or time.perf_counter()
        scheme = self.schemes[layer.index]
        span = Span(layer.name, scheme, state.ready_at[layer.index], time.perf_counter())
        if self._gpu:  # the host copies wait on CUDA streams: off the loop
            self._start(state, scheme, span, lambda: asyncio.ensure_future(self._staged_sync(state, layer, scheme)), layer.param_ids)
        else:  # CPU tensors are their own host buffers: start at once, no task of our own
            self._start(state, scheme, span, lambda: self._syncers[scheme].start(self._bucket(state, layer, scheme), state.clock), layer.param_ids)

    def _start(self, state: _Step, scheme: Scheme, span: Span, start: Callable[[], asyncio.Future], ids: list) -> None:
        """Start one sync of ``state``'s step (``start()``: its syncer's call), traced by ``span``;
        it lands the parameters ``ids`` (manifest indices)."""
        state.spans.append(span)
        try:
            sync = start()
        except Exception as exc:  # noqa: BLE001 - it fails the step, as a failed sync does
            sync = self._loop.create_future()
            sync.set_exception(exc)
        sync.add_done_callback(lambda fut: self._synced(state, scheme, span, fut))
        state.syncs.append(sync)
        state.sync_ids.append(ids)

    async def _staged_sync(self, state: _Step, layer: Layer, scheme: Scheme):
        bucket = await self._loop.run_in_executor(self._reduce, self._bucket, state, layer, scheme)
        return await self._syncers[scheme].start(bucket, state.clock)

    def _synced(self, state: _Step, scheme: Scheme, span: Span, sync: asyncio.Future) -> None:
        span.end = time.perf_counter()
        if sync.cancelled() or sync.exception() is not None:
            return  # the step's apply raises it
        result = sync.result()
        state.bytes[scheme.value] = state.bytes.get(scheme.value, 0) + result.bytes_sent + result.bytes_received
        state.dropped.update(result.dropped)
        state.work.extend(result.work)

    def _bucket(self, state: _Step, layer: Layer, scheme: Scheme) -> Bucket:
        """The layer's buffers as its scheme moves them: host views on CPU, staged copies on a GPU
        (then this runs off the loop: the copies wait on a CUDA stream)."""
        params = [p for _, p in layer.params]
        priority = layer.index  # nearest the input first: it gates the next forward
        if syncer_class(scheme).host_outs:  # the wire writes host memory
            outs = [self._landing(state, i) for i in layer.param_ids]
        else:  # a kernel writes the (device) tensors itself
            outs = [state.agg[i] for i in layer.param_ids]
        if syncer_class(scheme).captures_factors:
            cap = self._captures[layer.index]
            m, n = layer.module.weight.shape
            u, v, event = state.taken.pop(("factors", layer.index), None) or (None, None, None)
            if u is None and cap.captured:
                u, v = cap.factors()
            elif u is None:  # unused here: K = 0
                u, v = torch.zeros(0, m), torch.zeros(0, n)
                state.unused.update(layer.param_ids)
            fu, fv = u.float(), v.float()
            if fu is not u or fv is not v:  # the event marks u and v, not a cast made here
                event = None
            u, v = self.staging.host(("u", layer.index), fu, event), self.staging.host(("v", layer.index), fv, event)
            return Bucket(layer.name, [layer.index], layer.param_ids, outs, factors=(u, v), shape=(m, n), priority=priority)
        grads = []
        for i, p in zip(layer.param_ids, params):
            g, event = state.taken.pop(i, None) or (p.grad, None)
            if g is None:  # an unused branch: zeros
                g = torch.zeros_like(p)
                state.unused.add(i)
            c = g.contiguous()
            # The event marks g; a copy of it made here is waited for on this thread's stream.
            grads.append(self.staging.host(("grad", i), c, event if c is g else None))
        return Bucket(layer.name, [layer.index], layer.param_ids, outs, grads=grads, priority=priority)

    def _landing(self, state: _Step, i: int) -> np.ndarray:
        """Where parameter ``i``'s synchronized result lands for ``state``'s clock: the host view
        of its aggregate, made once per slot of the aggregate ring (the tensors are reused)."""
        key = (self._agg_slot(state.clock), i)
        view = self._agg_views.get(key)
        if view is None:
            # One host buffer per slot of the ring, as on the device: under SSP two clocks land at once.
            view = self._agg_views[key] = self.staging.landing(("agg", *key), state.agg[i])
        return view

    async def _host(self, slot, tensor: torch.Tensor, event=None):
        if not self.staging.staged(tensor):
            return self.staging.host(slot, tensor)
        return await self._loop.run_in_executor(self._reduce, self.staging.host, slot, tensor, event)

    # -- apply ------------------------------------------------------------------------------

    async def _apply(self, state: _Step) -> None:
        try:
            if self._steps_early(state):
                await self._step_as_synced(state)
            else:
                await asyncio.gather(*state.syncs)
        except BaseException:
            for task in state.syncs:
                task.cancel()
            raise
        await self._stepper.run("optimizer", self._optimizer_step, state)
        self._finish(state)

    def _steps_early(self, state: _Step) -> bool:
        """Whether ``state``'s optimizer step may start on the parameters whose syncs are in while
        others are still moving (:meth:`_step_as_synced`): on the CPU, under BSP, with an optimizer
        that updates each parameter on its own and no step hooks (they would run once a part), and
        where some sync lands enough bytes to be worth a step of its own
        (``PSConfig.early_step_bytes``)."""
        least = self.ps_config.early_step_bytes
        if least is None or self._gpu or self.ps_config.staleness or type(self.optimizer) not in _PER_PARAMETER_OPTIMIZERS or len(state.syncs) < 2:
            return False
        hooks = (
            getattr(self.optimizer, "_optimizer_step_pre_hooks", None), getattr(self.optimizer, "_optimizer_step_post_hooks", None),
            getattr(torch_optimizer, "_global_optimizer_pre_hooks", None), getattr(torch_optimizer, "_global_optimizer_post_hooks", None),
        )
        if any(hooks):
            return False
        return any(self._bytes_of(ids) >= least for ids in state.sync_ids)

    def _bytes_of(self, ids) -> int:
        return sum(self._param_bytes[i] for i in ids)

    async def _step_as_synced(self, state: _Step) -> None:
        """Await ``state``'s syncs, stepping the optimizer on the parameters of those that have
        landed while the others are still moving, once they hold ``PSConfig.early_step_bytes``: SGD
        over an FC-heavy model's 50 MB took 5 ms after the last factors landed (bench train, fc,
        2 workers); stepped as the layers land, only the last ones' update is left after it. The
        rest, and any parameter of the optimizer outside the model, are stepped by ``_apply``.

        A sync that fails raises here, as ``gather`` does; layers already stepped stay stepped
        (the step fails either way, and a run resumes from its checkpoint)."""
        ids_of = {id(sync): ids for sync, ids in zip(state.syncs, state.sync_ids)}
        arrivals: asyncio.Queue = asyncio.Queue()  # holds at most the step's syncs
        for sync in state.syncs:
            sync.add_done_callback(arrivals.put_nowait)
        pending, landed = len(state.syncs), []
        while pending:
            sync = await arrivals.get()
            while True:  # every sync that has landed by now
                pending -= 1
                sync.result()  # the first failure ends the step
                landed.extend(ids_of[id(sync)])
                if arrivals.empty():
                    break
                sync = arrivals.get_nowait()
            if pending and self._bytes_of(landed) >= self.ps_config.early_step_bytes:
                # On the compute thread, never on the loop: the loop is receiving the rest.
                started = time.perf_counter()
                await self._loop.run_in_executor(self._compute, self._optimizer_step, state, landed)
                state.work.append((f"optimizer, {len(landed)} tensors", started, time.perf_counter(), "optimizer"))
                landed = []

    def _finish(self, state: _Step) -> None:
        """A step whose syncs are all in and applied: its bytes into the totals, and a step that
        returned before its syncs were in (SSP) into the trace, now that every sync has ended."""
        self._count_shard_bytes(state.bytes)
        for scheme, n in state.bytes.items():
            self.bytes_total[scheme] = self.bytes_total.get(scheme, 0) + n
        if state.done is not None:
            end = max([state.done, *(s.end or 0.0 for s in state.spans)])
            self.tracer.step(state.clock, state.started, state.compute_end, state.spans, end, state.work)

    def _optimizer_step(self, state: _Step, ids: Optional[list] = None) -> None:
        """Put ``state``'s aggregates in ``param.grad`` and step the optimizer: on the manifest
        indices ``ids`` only (their syncs have landed, see :meth:`_step_as_synced`), or on every
        parameter not stepped yet."""
        # A parameter no rank used keeps grad None so the optimizer skips it, as it would in one
        # process: one this rank did not use is checked for an exactly zero aggregate (every rank
        # sees the same aggregate, so every rank decides alike); scanning every aggregate would
        # cost a pass over the model's gradients per step. A parameter frozen for this step
        # (requires_grad off) gets no gradient either.
        chosen = ids if ids is not None else [i for i in range(len(self._named)) if i not in state.stepped]
        slot, wanted = self._agg_slot(state.clock), set(chosen)
        for layer in self.layers:
            if syncer_class(self.schemes[layer.index]).host_outs:
                for i in layer.param_ids:
                    if i in wanted:
                        self.staging.to_device(("agg", slot, i), state.agg[i])
        self.staging.wait()
        with torch.no_grad():
            for i in chosen:
                p = self._named[i][1]
                agg = state.agg[i]
                if i in self._server_owned:  # the shards' SGD sent the new values themselves
                    p.copy_(agg)
                    p.grad = None
                elif not p.requires_grad:
                    p.grad = None
                elif i in state.unused:  # unused here: a gradient only if some rank used it
                    p.grad = agg if bool(agg.any()) else None
                else:
                    p.grad = agg
        if ids is None and not state.stepped:
            self.optimizer.step()
        elif ids is not None:
            step_some(self.optimizer, {id(self._named[i][1]) for i in ids}, keep=True)
            state.stepped.update(ids)
        else:
            step_some(self.optimizer, {id(self._named[i][1]) for i in state.stepped}, keep=False)

    # -- plan and parameter server ----------------------------------------------------------

    async def _plan(self, batch) -> None:
        """Decide every layer's scheme (the same on every rank) and build the syncers."""
        restored = (self._restored or {}).get("schemes")
        if restored:
            if set(restored) != {layer.name for layer in self.layers}:
                raise CheckpointError(f"rank {self.rank}: the checkpoint's scheme plan names other layers than this model has")
            by_name = restored
        else:
            rows = await self._loop.run_in_executor(self._compute, self._measure_rows, batch)
            seen = await self._job.rendezvous.exchange("rows", json.dumps(rows), range(self.world))
            k = {name: max(json.loads(seen[r]).get(name, 0) for r in seen) for name in rows}
            plan_layers = [lossy.plan_layer(layer) for layer in self.layers]
            on_compute = lambda fn, *args: self._loop.run_in_executor(self._compute, fn, *args)  # noqa: E731
            planner = await lossy.agreed_planner(self.compression, self._job.rendezvous, self.rank, self.world, on_compute)
            stated = self.compression.link if self.compression is not None else None
            by_name = choose_schemes(
                plan_layers, k, mode=self.mode, workers=self.world, shards=self.ps_config.shards_for(self.world),
                overrides=self.overrides, link=stated or await self._agreed_link(), candidates=self.hybcomm,
                chunk_bytes=self.ps_config.chunk_bytes, compression=planner, report=self.compression_plan,
            )
            if self.compression_plan:
                log.info("rank %d: lossy plan\n%s", self.rank, lossy.describe(self.compression_plan))
        self.schemes = {layer.index: Scheme(by_name[layer.name]) for layer in self.layers}
        self._scheme_names = {layer.name: self.schemes[layer.index].value for layer in self.layers}
        plan = json.dumps(self._scheme_names)
        await self._job.rendezvous.check_digest("scheme plan", plan)
        groups = {}
        for scheme in self._mergeable():
            groups[scheme] = [[layer.index] for layer in self._layers_of(scheme)]
            if self.merge.kind is MergeKind.SINGLE:
                groups[scheme] = [[i for g in groups[scheme] for i in g]]
        saved = (self._restored or {}).get("groups") or {}
        for scheme in self._mergeable():  # the merge plans in force when the checkpoint was taken
            if saved.get(scheme.value):
                by_layer = {layer.name: layer.index for layer in self._layers_of(scheme)}
                if sorted(n for g in saved[scheme.value] for n in g) != sorted(by_layer):
                    raise CheckpointError(f"rank {self.rank}: the checkpoint's {scheme.value} merge plan names other layers than this model syncs by {scheme.value}")
                groups[scheme] = [[by_layer[n] for n in g] for g in saved[scheme.value]]
        if self.ps_config.server_sgd is not None:
            self._server_owned = {i for layer in self._layers_of(Scheme.PS) for i in layer.param_ids}
        await self._build_syncers(groups)
        if self.merge.planned and self.world > 1:
            shards = self.ps_config.shards_for(self.world)
            self._runtimes = {
                scheme: MergeRuntime(self.merge, self.rank, self.world, shards, scheme, self._calibration)
                for scheme in self._mergeable() if len(self._layers_of(scheme)) > 1 and not saved.get(scheme.value)
            }
        self._planned = True
        log.info("rank %d: schemes %s", self.rank, plan)

    async def _agreed_link(self) -> Link:
        """Rank 0's measured alpha and beta, on every rank: each rank measures its own, and one
        plan needs one link."""
        if self._link is None:
            if self.rank == 0:
                link = link_of(self._calibration, self._kernel_flop)
                await self._job.rendezvous.publish("hybcomm-link", json.dumps([link.alpha, link.beta, link.flop]))
            alpha, beta, flop = json.loads(await self._job.rendezvous.read("hybcomm-link", who="rank 0"))
            self._link = Link(alpha, beta, flop)
        return self._link

    @property
    def merge_groups(self) -> list:
        """The messages of mergeable schemes in force: lists of layer names, model order."""
        out = []
        for scheme in self._mergeable():
            syncer = self._syncers.get(scheme)
            if isinstance(syncer, Merging):
                out += [[self.layers[i].name for i in g] for g in syncer.groups]
            else:
                out += [[layer.name] for layer in self._layers_of(scheme)]
        return out

    def _layers_of(self, scheme: Scheme) -> list:
        return [layer for layer in self.layers if self.schemes[layer.index] is scheme]

    def _mergeable(self) -> list:
        """The mergeable schemes in use, in a fixed order (every rank the same)."""
        used = {self.schemes[layer.index] for layer in self.layers}
        return [s for s in Scheme if s in used and syncer_class(s).mergeable]

    async def _build_syncers(self, groups: dict) -> None:
        """One syncer per scheme in use, each mergeable one wrapped in :class:`Merging` with its
        groups; the parameter server (re)started with one message per PS group and shard when a
        scheme keeps layers there."""
        used = {self.schemes[layer.index] for layer in self.layers}
        on_ps = [layer for layer in self.layers if syncer_class(self.schemes[layer.index]).on_ps]
        # Plain-PS layers first, so any run of them a merge plan groups is consecutive in the manifest.
        on_ps.sort(key=lambda layer: (syncer_class(self.schemes[layer.index]).factored, layer.index))
        ps_index = {i: j for j, i in enumerate(i for layer in on_ps for i in layer.param_ids)}
        if on_ps:
            await self._start_ps(on_ps, ps_index, groups.get(Scheme.PS, []))
        ctx = SyncContext(
            self.rank, self.world, self._job.peers, self.ps_config.sync_timeout, node=self._node, ps_index=ps_index,
            reconstruct=kernels.reconstruct, executor=self._reduce, chunk_bytes=self.ps_config.chunk_bytes,
            allreduce=self.ps_config.allreduce,
            compression=self.compression, feedback=self.feedback,
        )
        self._syncers = {scheme: syncer_class(scheme).build(ctx) for scheme in used}
        wake_with = {}
        if self.merge.kind is not MergeKind.NONE:
            for scheme, scheme_groups in groups.items():
                self._syncers[scheme] = Merging(self._syncers[scheme], scheme_groups)
                wake_with.update((i, tuple(g)) for g in scheme_groups if len(g) > 1 for i in g)
        self._wake_with = wake_with  # read by the backward's hooks: replaced whole, never edited

    async def _start_ps(self, on_ps: list, ps_index: dict, groups: list) -> None:
        names = [[n for i in g for n, _ in self.layers[i].params] for g in groups if len(g) > 1]
        factored = [[n for n, _ in layer.params] for layer in on_ps if syncer_class(self.schemes[layer.index]).factored]
        manifest = Manifest.of_arrays(self._named[i] for i in sorted(ps_index, key=ps_index.get))
        saved = (self._restored or {}).get("shard") if self._generation == 0 else None
        config = self.ps_config
        if names and config.group_spread_bytes is None:  # one value on every rank: rank 0's link
            link = await self._agreed_link()
            config = replace(config, group_spread_bytes=spread_bytes_for(link.alpha, link.beta, config.shards_for(self.world)))
        self._node = await PSNode.start(
            manifest, config, net=self.net, groups=names or None, start_clock=self.clock,
            rendezvous=self._job.rendezvous.scoped(f"ps{self._generation}"), process_shaper=self._shaper,
            factored=factored or None, shard_state={k: v.numpy() for k, v in saved.items()} if saved else None,
        )
        self._shard_bytes_seen = 0
        if self.ps_config.server_sgd is not None and not self._node.resumed and self.rank == 0:
            # The shards start from rank 0's parameters (everyone's, after the start-up broadcast);
            # a rank's PARAMS frame reaches each shard before its first push on the same link.
            owned = sorted(self._server_owned)
            values = [self.staging.host(("param", i), self._named[i][1].detach()) for i in owned]
            await self._node.client.broadcast([ps_index[i] for i in owned], values, self.clock)

    async def _close_ps(self, failed: bool = False) -> None:
        if self._node is None:
            return
        if failed:
            await self._node.teardown()
        else:
            await self._node.close()
        self._node = None

    def _count_shard_bytes(self, into: dict) -> None:
        """Add the payload bytes this rank's shard moved over the network for the others."""
        shard = self._node.shard if self._node is not None else None
        if shard is None:
            return
        moved = shard.stats.remote_bytes_in + shard.stats.remote_bytes_out
        into["ps"] = into.get("ps", 0) + moved - self._shard_bytes_seen
        self._shard_bytes_seen = moved

    def _measure_rows(self, batch) -> dict:
        """K per layer in one forward of ``batch``: an FC layer's input rows, an embedding's
        distinct tokens (the rows its gradient can have)."""
        for cap in self._captures.values():
            cap.reset(enabled=False)
        tokens: dict = {}

        def count(layer, module, inputs):
            tokens.setdefault(layer.name, []).append(inputs[0].detach().reshape(-1))

        hooks = [layer.module.register_forward_pre_hook(functools.partial(count, layer)) for layer in self.layers if layer.row_sparse]
        was = self.model.training
        self.model.train(False)  # evaluation mode: no side effects on BatchNorm statistics
        try:
            with torch.no_grad():
                self._loss(batch)
        finally:
            self.model.train(was)
            for hook in hooks:
                hook.remove()
        rows = {cap.layer.name: sum(cap.rows) for cap in self._captures.values()}
        rows.update({name: int(torch.cat(seen).unique().numel()) for name, seen in tokens.items()})
        return rows

    # -- MG-WFBP ----------------------------------------------------------------------------

    def _measure(self, state: _Step, loop_cpu: float, loop_waited: float = 0.0) -> None:
        # What a message costs the host: the loop's CPU for it plus the time the loop, ready to
        # run it, waited for a core. Where the workers share fewer cores than they have busy
        # threads (4 workers on 2 cores: a ResNet-20's 31 messages each took ~0.45 ms of the
        # loop's CPU and as long again waiting), that time is taken from some rank's backward,
        # and merging is what gives it back.
        #
        # How much of it the backward loses: on such a host a message's CPU is the compute's,
        # and the wall time the step gains per message was ~2.5 x the loop's CPU (ResNet-20, 4
        # workers, 2 cores: 8 messages more, +21 ms a step, +8.6 ms of the loop's CPU), about its
        # CPU plus its wait. Where the loop has a core of its own it runs beside the backward and
        # hardly waits; the wait is the evidence, so the backward is charged at most twice it.
        #
        # Only what a message costs as a message counts: the loop's CPU for the step's bytes
        # (copies, the kernel's socket work; ``_loop_cpu_per_byte``, timed at start-up) is the
        # same however the layers are grouped, and the wait is shared in proportion.
        messages = max(1, len(state.spans))
        moved = sum(state.bytes.values())  # sent and received, every scheme
        fixed = max(0.0, loop_cpu - self._loop_cpu_per_byte * moved)
        waited = loop_waited * (fixed / loop_cpu if loop_cpu > 0 else 1.0)
        per_message = (fixed + waited) / messages
        serial = min(fixed + waited, 2.0 * waited) / messages
        for scheme, runtime in self._runtimes.items():
            layers = [layer.index for layer in self._layers_of(scheme)]
            spans = [(s.start, s.end) for s in state.spans if s.scheme is scheme and s.end]
            nbytes = sum(lossy.message_bytes(self.layers[i], scheme, self.compression) for i in layers)
            runtime.record(state.forward_end - state.started, state.forward_end, state.ready_at, layers, spans, nbytes, per_message, serial)

    async def _replan(self) -> None:
        """Adopt the merge plans every rank agreed on (with trials: the first plan to try): the
        syncers (and the parameter server) restart with them."""
        groups, infos = {}, {}
        for scheme in self._mergeable():
            layers = self._layers_of(scheme)
            runtime = self._runtimes.get(scheme)
            if runtime is None:
                syncer = self._syncers[scheme]
                groups[scheme] = syncer.groups if isinstance(syncer, Merging) else [[layer.index] for layer in layers]
                continue
            sizes = [lossy.message_bytes(layer, scheme, self.compression) for layer in layers]
            info = await runtime.agree(self._job.rendezvous, self._generation, [layer.index for layer in layers], [layer.name for layer in layers], sizes)
            by_name = {layer.name: layer.index for layer in layers}
            # Layers 1..L run from the input: group members are listed input side first; keep the
            # model's order inside each group.
            groups[scheme] = [sorted(by_name[n] for n in group) for group in info["groups"]]
            infos[scheme.value] = info
        self._runtimes = {}
        trials = self._trial_plans(groups, infos) if self.merge.trial else []
        await self._rebuild(trials[0][1] if trials else groups)
        self._set_merge_info(infos)
        log.info("rank %d: merge plans %s", self.rank, {k: [c["groups"] for c in v["candidates"]] for k, v in infos.items()})
        self._trials, self._trial_at, self._trial_from = trials, 0, (self.clock if trials else None)
        if not trials:
            self._step_times = []

    def _trial_plans(self, groups: dict, infos: dict) -> list:
        """The plans to try, ``[(planner, {Scheme: groups}, [])]``: one per planner (``best``:
        Algorithm 1's, then the exact one's and one message's where they differ), a scheme with
        fewer candidates keeping its first; only plans that merge."""
        planners = dict.fromkeys(c["planner"] for info in infos.values() for c in info["candidates"])
        by_name = {name: {layer.name: layer.index for layer in self._layers_of(Scheme(name))} for name in infos}
        trials = []
        for planner in planners:
            plan = dict(groups)
            for name, info in infos.items():
                chosen = next((c for c in info["candidates"] if c["planner"] == planner), info["candidates"][0])
                plan[Scheme(name)] = [sorted(by_name[name][n] for n in group) for group in chosen["groups"]]
            if any(len(g) > 1 for gs in plan.values() for g in gs) and all(plan != other for _, other, _ in trials):
                trials.append((planner, plan, []))
        return trials

    async def _next_trial(self) -> None:
        """End the running plan's trial: on to the next plan's, or after the last, the verdict."""
        if self._trial_at + 1 < len(self._trials):
            self._trial_at += 1
            await self._rebuild(self._trials[self._trial_at][1])
            self._trial_from = self.clock
        else:
            await self._judge()

    async def _judge(self) -> None:
        """End the merge plans' trials: every rank's step times go round, each rank reaches the
        same verdict (:func:`judge_trial`): the fastest plan if it made the step faster than the
        warm-up's one message per layer, otherwise one message per layer."""
        trials, self._trials, self._trial_from = self._trials, [], None
        mine = json.dumps({"warm": self._step_times, "trials": [times for _, _, times in trials]})
        self._step_times = []
        seen = await self._job.rendezvous.exchange(f"merge-trial/{self._generation}", mine, range(self.world))
        figures = {r: json.loads(text) for r, text in seen.items()}
        verdict = judge_trial(
            {r: f["warm"] for r, f in figures.items()},
            *({r: f["trials"][i] for r, f in figures.items()} for i in range(len(trials))),
        )
        planner, plan, _ = trials[verdict["best"]]
        verdict["planner"] = planner
        verdict["tried"] = {name: ms for (name, _, _), ms in zip(trials, verdict["trials_s"])}
        infos = self.merge_info.get("schemes", {})
        for name, info in infos.items():
            info["groups"], info["planner"] = [[self.layers[i].name for i in g] for g in plan[Scheme(name)]], planner
        if verdict["kept"]:
            if verdict["best"] != len(trials) - 1:  # the fastest is not the one running now
                await self._rebuild(plan)
            self._set_merge_info(infos, trial=verdict)
            log.info("rank %d: merge plan (%s) kept: %.1f ms a step against %.1f unmerged", self.rank, planner, verdict["planned_s"] * 1e3, verdict["unmerged_s"] * 1e3)
            return
        await self._rebuild({scheme: [[layer.index] for layer in self._layers_of(scheme)] for scheme in self._mergeable()})
        for name, info in infos.items():
            info["rejected_groups"], info["groups"] = info["groups"], [[layer.name] for layer in self._layers_of(Scheme(name))]
        self._set_merge_info(infos, trial=verdict)
        log.warning(
            "rank %d: the fastest merge plan (%s) ran %.1f ms a step against %.1f with one message per layer; back to one per layer",
            self.rank, planner, verdict["planned_s"] * 1e3, verdict["unmerged_s"] * 1e3,
        )

    def _set_merge_info(self, infos: dict, **extra) -> None:
        # The plan of the scheme with the most layers leads (``merge_info`` of a PS-only model is
        # the PS plan, as before); every scheme's is kept under its name.
        lead = max(infos, key=lambda name: len(infos[name]["groups"]), default=None)
        self.merge_info = {**(infos[lead] if lead else {}), "schemes": infos, **extra}

    async def _rebuild(self, groups: dict) -> None:
        """New syncers (and a new parameter server) with these groups, from the next clock."""
        await self._drain()
        self._count_shard_bytes(self.bytes_total)
        await self._close_ps()
        self._generation += 1
        await self._build_syncers(groups)

    # -- broadcast --------------------------------------------------------------------------

    async def _broadcast(self, tensors: list, clock: Optional[int] = None) -> None:
        """Make every rank's ``tensors`` equal rank 0's, through host buffers: the parameters and
        buffers at start (``clock`` None), the buffers at the end of step ``clock``."""
        if self.world == 1:
            return
        role = "params" if clock is None else "buffers"
        slots = [("bcast", role, i) for i in range(len(tensors))]
        data = [t.detach().view(torch.uint8) if t.dtype is torch.bool else t.detach() for t in tensors]
        if self.rank == 0:
            arrays = [await self._host(slot, d) for slot, d in zip(slots, data)]
        else:
            arrays = [self.staging.landing(slot, d) for slot, d in zip(slots, data)]
        peers, timeout = self._job.peers, self.ps_config.sync_timeout
        if clock is None:
            await broadcast.parameters(self.rank, peers, arrays, timeout)
        else:
            await broadcast.buffers(self.rank, peers, arrays, clock, timeout)
        if self.rank != 0:
            for slot, d in zip(slots, data):
                self.staging.to_device(slot, d)
            self.staging.wait()


def _runqueue_wait() -> float:
    """Seconds this thread has spent runnable but waiting for a core (Linux's schedstat; 0.0
    where there is none)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) * 1e-9
    except (OSError, ValueError, IndexError):
        return 0.0


def _time_reconstruction(world: int) -> float:
    """Seconds per FLOP of the sufficient-factor kernel on this device: the fastest of three
    rebuilds of a 1024 x 1024 layer from ``world`` ranks' 64 rows (~0.5 GFLOP at 4 ranks: long
    enough to time, ~13 ms on one CPU core; the kernel the trainer will call, so a replaced one
    is what is timed)."""
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
