"""The Poseidon trainer: ``await trainer.step(batch)`` with wait-free backprop and hybrid communication.

A facade: forward and backward run on the caller's thread (a CUDA model's on a compute thread of
ours) while the trainer's event loop, on a thread of its own, moves bytes; each job of a step
belongs to a helper of its own: :mod:`.dispatch` (hooks -> buckets -> syncers), :mod:`.apply`
(results -> ``param.grad`` -> the optimizer), :mod:`.planning` (schemes, link, syncers, parameter
server), :mod:`.merging` (MG-WFBP's warm-up, plans and trials), :mod:`.replicas` (rank 0's
tensors everywhere) and :mod:`.checkpoint`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Awaitable, Callable, Optional

import torch
from torch import nn

from ..cluster import ClusterEnv, Manifest, Rendezvous, StartupConfig
from ..cluster.departures import Departures
from ..cluster.job import Job
from ..errors import CheckpointError, ConfigError
from ..net import NetConfig, Shaper
from ..net.loop import LoopThread
from ..net.credentials import config_from_env
from ..ps import PSConfig
from ..plan import HYBCOMM_SCHEMES, CompressionConfig, MergeConfig, Mode
from ..sync import AllReduceConfig, Feedback
from ..sync import collective
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
        hosts: ``"launcher"`` (default): where the launcher puts several workers on a host
            (torchrun's ``--nproc-per-node``, SLURM's tasks per node), their all-reduce layers
            are summed inside the host first and cross the network once per host;
            ``"flat"``: every worker a peer of its own on the network, as for comparison.
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
        hosts: str = "launcher",
        env: Optional[ClusterEnv] = None,
        rendezvous: Optional[Rendezvous] = None,
    ) -> None:
        if loss_fn is not None and batch_loss is not None:
            raise ConfigError("give the Trainer loss_fn (for (inputs, targets) batches) or batch_loss, not both")
        self.settings = resolve(
            mode,
            ps,
            net,
            merge,
            compression,
            schemes,
            hybcomm,
            allreduce,
            optimizer_config,
            startup,
            broadcast_buffers,
            hosts,
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
        self._rank: Optional[int] = None
        self._world: Optional[int] = None
        self._collectives = 0  # the user's all-reduces and barriers so far (their frames' number)
        self._last_step = None  # the coroutine step() last returned: was it awaited?
        self._thread: Optional[LoopThread] = None  # the loop the trainer moves bytes on
        self._armed: Optional[StepState] = None  # the next step, its hooks ready for its backward

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
        if self._thread is not None:
            raise ConfigError("this trainer has already started")
        self._thread = LoopThread(init=_as_caller(torch.get_num_threads()))
        try:
            await self._thread.run(self._start())
        except BaseException:
            await self._thread.close()
            self._thread = None
            raise

    async def _start(self) -> None:
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
        init = _as_caller(torch.get_num_threads(), device)
        self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="poseidon-compute", initializer=init)
        self._reduce = ThreadPoolExecutor(max_workers=1, thread_name_prefix="poseidon-reconstruct", initializer=init)
        shaper = Shaper.from_config(s.net.bandwidth) if s.net.bandwidth is not None else None
        self._manifest = Manifest.of_arrays(self._named)
        timeout = s.startup.timeout
        self._job = await Job.join(
            self._manifest, s.net, timeout=timeout, env=self.env, rendezvous=self._given_rdzv, shaper=shaper
        )
        self._rank, self._world = self._job.rank, self._job.world
        self._departures = Departures(self._rank, self._job.peers)
        self.tracer.rank, self.tracer.world = self._rank, self._world
        await self.tracer.align(self._job.peers, timeout)
        self._replicas = Replicas(
            self._rank, self._world, self._job.peers, self.staging, self._reduce, s.ps.sync_timeout
        )
        # Every parameter, frozen ones too, and every buffer: replicas must start identical.
        await self._replicas.broadcast([*self.model.parameters(), *self._buffers])
        self._aggregates = Aggregates([p for _, p in self._named], s.ps.staleness, self.staging)
        self._dispatch = Dispatch(
            self.model, self.layers, self.settings.mode, self.staging, self._aggregates, self._reduce
        )
        self._applier = Applier(
            s, self.optimizer, self._named, self.staging, self._aggregates, self._compute, self._dispatch.gpu
        )
        self._planning = Planning(
            s, self.layers, self._named, self._job, self.staging, self._compute, self._reduce, shaper, self.feedback
        )
        await self._planning.calibrate()
        self._arm()
        self._started = True

    async def close(self, failed: bool = False) -> None:
        """Finish in-flight steps, write the trace, leave the job.

        Raises:
            ConfigError: the last ``step()`` was never awaited (the job is left all the same).
        """
        if self._thread is None:
            return
        unawaited = None
        if not failed:
            try:
                self._refuse_unawaited()
            except ConfigError as exc:
                unawaited, failed = exc, True
        try:
            await self._thread.run(self._close(failed))
        finally:
            await self._thread.close()
            self._thread = None
        if unawaited is not None:
            raise unawaited

    async def _close(self, failed: bool) -> None:
        if not self._started:
            return
        self._started = False
        try:
            if not failed:
                await self._drain()
                # Every rank's syncs are over before any rank closes a link (a rank whose last
                # step was done could otherwise reset a link a peer still reads that step from);
                # a peer still stepping learns at once that this rank has finished.
                await self._departures.finish(self.clock, self.settings.ps.sync_timeout)
                self._planning.count_shard_bytes(self.bytes_total)
        finally:
            if failed:  # why, to every peer, before the links close
                await self._departures.fail(self.settings.net.close_timeout)
            self._departures.close()
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
        self._refuse_unawaited()
        return await self._on_loop(self._save, directory, keep)

    async def _save(self, directory: str, keep: int) -> int:
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
            self._compute, checkpoint.write, directory, clock, self._rank, self._world, digest, state
        )
        await self._job.rendezvous.barrier(f"checkpoint/{clock}")
        await loop.run_in_executor(self._compute, checkpoint.prune, directory, self._rank, keep)
        log.info("rank %d: checkpoint at clock %d in %s", self._rank, clock, directory)
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
        if not self._started or self._merging is not None or self._armed.deferred:
            raise ConfigError("restore() goes after start() and before the first step")
        return await self._on_loop(self._restore, directory)

    async def _restore(self, directory: str) -> int:
        on_compute = functools.partial(asyncio.get_running_loop().run_in_executor, self._compute)
        digest, rdzv = self._manifest.digest(), self._job.rendezvous
        try:
            clock = await checkpoint.newest_everywhere(directory, rdzv, self._rank, self._world, digest, on_compute)
            saved_world, read_rank = self._world, self._rank
        except CheckpointError:
            clock, saved_world = await checkpoint.newest_of_rank_0(
                directory, rdzv, self._rank, self._world, digest, on_compute
            )
            read_rank = 0
        state = await on_compute(checkpoint.read, directory, clock, read_rank)
        if saved_world != self._world:
            state = checkpoint.for_world(state, saved_world, self._world, self._rank, clock)
        checkpoint.load(state, self.model, self.optimizer, rng=saved_world == self._world)
        schemes = state.get("schemes") or {}
        lossy.restore_state(self.feedback, self.settings.compression, state.get("compression"), schemes)
        self.clock = clock
        self._restored = state
        self._arm()  # the next step is this clock's
        log.info("rank %d: resumed from the checkpoint at clock %d in %s", self._rank, clock, directory)
        return clock

    # -- the step ---------------------------------------------------------------------------

    def step(self, batch, *, scaler: Optional[torch.amp.GradScaler] = None) -> Awaitable[StepStats]:
        """One iteration on this rank's ``batch``: ``(inputs, targets)`` with ``loss_fn``, anything
        with ``batch_loss``: zero the gradients, forward and backward (each layer's sync starting
        as the backward is done with it), the averages into ``.grad``, the optimizer.

        On the CPU the forward, the backward and the optimizer run here, on the calling thread, as
        in a DDP loop: the caller's event loop waits for them, while the trainer's own loop thread
        moves the bytes. With a CUDA model they run on the trainer's compute thread, where the
        host waits for the device, and the caller's loop stays free. Under SSP, and where a sync
        lands ``OptimizerConfig.early_step_bytes`` (early layers are then stepped as their syncs
        land), the trainer's threads step the optimizer.

        The caller's ``torch.autocast`` state (CPU and CUDA) holds for the forward. With a
        ``scaler``, the loss is scaled for the backward and the optimizer steps through
        ``scaler.step`` (skipped on every rank alike where a gradient is inf or NaN), then
        ``scaler.update()``.

        Returns:
            :class:`StepStats` (loss, timings, bytes per scheme, dropped ranks).
        Raises:
            SyncTimeout, ConnectionLost, WorkerLeft: a sync did not complete (the message names
                the layer, the clock and the peer or shard).
            ConfigError: called before :meth:`start`, without ``await`` the last time, with a
                batch ``loss_fn`` cannot take, or with neither ``loss_fn`` nor ``batch_loss``.
        """
        self._refuse_unawaited()
        self._check(batch)
        started = time.perf_counter()
        if self._dispatch.gpu:
            # torch.autocast is per thread: the forward runs on the compute thread.
            autocast = [(d, torch.get_autocast_dtype(d)) for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)]
            self._last_step = self._on_loop(self._step_on_compute, batch, started, autocast, scaler)
        else:
            self._last_step = self._step_here(batch, started, scaler)
        return self._last_step

    async def _step_here(self, batch, started: float, scaler) -> StepStats:
        # A step then wakes the loop for its gradients and bytes only, and the optimizer runs warm
        # on the thread that runs the next forward (bench/RESULTS.md, "Where a step's CPU goes").
        state = self._armed  # (armed on the loop before the last step returned)
        self._departures.check(state.clock)
        state.started, state.scaler = started, scaler
        loss = self._gradients(state, batch)  # the hooks start each layer's sync
        state.compute_end = time.perf_counter()
        stats, stepped = await self._on_loop(self._after_backward, state, loss, True)
        if not stepped:
            self._applier.step_optimizer(state)
            stats.step_s = time.perf_counter() - started
        return stats

    async def _step_on_compute(self, batch, started: float, autocast: list, scaler) -> StepStats:
        state = self._armed
        self._departures.check(state.clock)
        state.started, state.scaler = started, scaler
        loop = asyncio.get_running_loop()
        loss = await loop.run_in_executor(self._compute, self._gradients, state, batch, autocast)
        state.compute_end = time.perf_counter()
        stats, _ = await self._after_backward(state, loss, False)
        return stats

    async def _after_backward(self, state: StepState, loss: float, here: bool) -> tuple:
        """The step's syncs, on the loop: ``(stats, whether the optimizer has stepped)``. It has
        not where the caller steps it (``here``, BSP, no early steps): the averages are then in
        ``.grad``."""
        await self._backward_done(state)
        if here and not (self.settings.ps.staleness or self._applier.steps_early(state)):
            return await self._land(state, loss), False
        self._inflight.append(state)
        while self._inflight and self._inflight[0].clock <= state.clock - self.settings.ps.staleness:
            await self._apply(self._inflight.pop(0))
        return await self._step_done(state, loss, traced=state not in self._inflight), True

    async def _land(self, state: StepState, loss: float) -> StepStats:
        """The averages into ``.grad`` (the optimizer is the caller's), the step done."""
        await self._departures.guard(self._applier.land(state), state.clock)
        self._count(state)
        return await self._step_done(state, loss, traced=True)

    async def synchronize(self) -> StepStats:
        """In your own loop, after ``loss.backward()``: return once every gradient is averaged
        over the ranks into its ``.grad``; then clip, unscale and step the optimizer as you would
        with DDP. The syncs started during the backward, layer by layer, as in :meth:`step`.

        Returns:
            :class:`StepStats` of the iteration (``loss`` is NaN: the trainer did not see it).
        Raises:
            SyncTimeout, ConnectionLost, WorkerLeft: as :meth:`step`.
            ConfigError: inside :meth:`no_sync`, or with a setting only :meth:`step` carries out
                (SSP's ``staleness``, the shards' ``server_sgd``).
        """
        self._require_started("synchronize")
        self._refuse_unawaited()
        if self._dispatch.accumulating:
            raise ConfigError("synchronize() inside no_sync(): leave the no_sync() block for the backward that syncs")
        ps = self.settings.ps
        if ps.staleness or ps.server_sgd is not None:
            what = "staleness (SSP)" if ps.staleness else "server_sgd"
            raise ConfigError(
                f"PSConfig.{what} needs the trainer to step the optimizer: use `await trainer.step(batch)`, "
                "not your own loop with synchronize()"
            )
        return await self._on_loop(self._synchronize, time.perf_counter())

    async def _synchronize(self, compute_end: float) -> StepStats:
        state = self._armed
        state.compute_end = compute_end
        self._departures.check(state.clock)
        await self._backward_done(state)
        return await self._land(state, float("nan"))

    def no_sync(self) -> contextlib.AbstractContextManager:
        """A context for gradient accumulation in your own loop, as DDP's: the backward passes
        run inside add into ``.grad`` and start no sync; the first backward after it sends the
        sum, and :meth:`synchronize` then returns the average over ranks of every rank's sum.

        >>> # with trainer.no_sync():
        >>> #     (loss_fn(model(x1), y1) / 2).backward()
        >>> # (loss_fn(model(x2), y2) / 2).backward()
        >>> # await trainer.synchronize()
        """
        self._require_started("no_sync")
        return self._dispatch.accumulating_locally()

    def _arm(self) -> None:
        """The next iteration's state, its hooks ready for its backward (on the trainer's loop).
        Until the first backward is over there is no plan: that iteration is the planning step."""
        state = StepState(self.clock, time.perf_counter(), self._aggregates.of(self.clock))
        if self._merging is not None:
            self._merging.begin(state.clock)
        self._dispatch.arm(state)
        self._armed = state

    async def _backward_done(self, state: StepState) -> None:
        """After the backward: the plan (the planning step), every sync not started yet, and
        rank 0's buffers (BatchNorm statistics: the next forward reads them)."""
        if self._merging is None:
            await self._plan()
        self._dispatch.launch_rest(state)
        if self.settings.broadcast_buffers and self._buffers:
            await self._departures.guard(self._replicas.broadcast(self._buffers, clock=state.clock), state.clock)

    async def _step_done(self, state: StepState, loss: float, traced: bool) -> StepStats:
        """The clock moves on, MG-WFBP records the step (or re-plans), the next step is armed."""
        state.done = time.perf_counter()
        self.clock += 1
        await self._merging.end(state, self.clock)
        if traced:  # (a step still syncing, under SSP, is traced when applied)
            self.tracer.step(state.clock, state.started, state.compute_end, state.spans, state.done, state.work)
        self._arm()
        return state.stats(loss, self._planning.plan.names)

    async def _on_loop(self, fn, *args):
        """``await fn(*args)`` on the trainer's loop thread."""
        return await self._thread.run(fn(*args))

    def _check(self, batch) -> None:
        if not self._started:
            raise ConfigError("start the trainer first: `async with Trainer(...) as trainer:`")
        if self.loss_fn is None and self.batch_loss is None:
            raise ConfigError(
                "step() needs the Trainer's loss_fn or batch_loss; without one, run your own loop: "
                "loss.backward(), then `await trainer.synchronize()`, then optimizer.step()"
            )
        if self.loss_fn is None:
            return
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise ConfigError(
                f"step() got a batch of type {type(batch).__name__}: with loss_fn a batch is an (inputs, targets) "
                "pair of tensors; for dicts or several tensors give the Trainer batch_loss=lambda model, batch: "
                "<scalar loss>"
            )
        for what, x in zip(("inputs", "targets"), batch):
            # Targets may be None, for a loss_fn that takes none (a replayed or self-supervised loss).
            if not isinstance(x, torch.Tensor) and not (what == "targets" and x is None):
                raise ConfigError(
                    f"step() got {what} of type {type(x).__module__}.{type(x).__name__}: the model takes tensors; "
                    "convert them with torch.as_tensor(...) (a DataLoader does this for you)"
                )

    def _refuse_unawaited(self) -> None:
        """Raises ConfigError where the last ``step()`` was never awaited (it did nothing)."""
        last, self._last_step = self._last_step, None
        if last is not None and inspect.getcoroutinestate(last) == inspect.CORO_CREATED:
            last.close()  # (this error, not Python's "never awaited" warning as well)
            raise ConfigError(
                f"rank {self._rank}: trainer.step(batch) at clock {self.clock} was called without await, so it did "
                "nothing: write `stats = await trainer.step(batch)`"
            )

    async def _plan(self) -> None:
        """After the planning step's backward: every layer's scheme (the same on every rank) on
        the rows its forward saw, the syncers, and MG-WFBP's measurement from the next step."""
        p, saved = self._planning, self._restored.get("groups") or {}
        plan = await p.choose(self._dispatch.rows(), self._restored.get("schemes"))
        self._merging = MergeTuning(self.settings, p, self._rebuild, self.merge_info, first_clock=self.clock + 1)
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

    def _gradients(self, state: StepState, batch, autocast: tuple = ()) -> float:
        # The modules' modes are the caller's (a frozen BatchNorm stays frozen), as under DDP.
        self.optimizer.zero_grad(set_to_none=True)
        with contextlib.ExitStack() as casts:
            for device, dtype in autocast:
                casts.enter_context(torch.autocast(device, dtype=dtype))
            loss = self._loss(batch)
        state.forward_end = time.perf_counter()
        (loss if state.scaler is None else state.scaler.scale(loss)).backward()
        return float(loss.detach())

    async def _apply(self, state: StepState) -> None:
        await self._departures.guard(self._applier.apply(state), state.clock)
        self._count(state)
        # A step that returned before its syncs were in (SSP) into the trace, now that every
        # sync has ended.
        if state.done is not None:
            end = max([state.done, *(s.end or 0.0 for s in state.spans)])
            self.tracer.step(state.clock, state.started, state.compute_end, state.spans, end, state.work)

    def _count(self, state: StepState) -> None:
        """A landed step's bytes into the totals."""
        self._planning.count_shard_bytes(state.bytes)
        for scheme, n in state.bytes.items():
            self.bytes_total[scheme] = self.bytes_total.get(scheme, 0) + n

    async def _drain(self) -> None:
        """Apply every step still in flight (SSP leaves up to ``staleness`` of them)."""
        while self._inflight:
            await self._apply(self._inflight.pop(0))

    # -- the user's collectives --------------------------------------------------------------

    async def all_reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        """Reduce ``tensor`` over every rank, in place, for metrics and evaluation (a loss, a
        count of correct predictions); every rank gets the same bits. Every rank must call it
        (and :meth:`barrier`) the same number of times, in the same order, as with
        ``torch.distributed``.

        Args:
            tensor: any float or integer tensor, CPU or CUDA, the same shape and dtype on every rank.
            op: ``"mean"`` (float tensors), ``"sum"``, ``"max"`` or ``"min"``.
        Returns:
            ``tensor``, now holding the result.
        Raises:
            ConfigError: before :meth:`start`, an unknown op, or a mean of an integer tensor.
            SyncTimeout: some rank did not call it within ``PSConfig.sync_timeout`` (names them).
            RemoteProtocolError: a rank gave another shape or dtype (names it).
        """
        self._require_started("all_reduce")
        self._refuse_unawaited()
        host = tensor.detach().to("cpu", torch.float32 if tensor.dtype is torch.bfloat16 else tensor.dtype)
        if host.dtype is torch.bool or host.is_complex():
            raise ConfigError(f"all_reduce of a {tensor.dtype} tensor: give a float or integer tensor")
        array = host.contiguous().numpy()
        collective.check_op(op, array.dtype)
        seq, self._collectives = self._collectives, self._collectives + 1
        peers, timeout = self._job.peers, self.settings.ps.sync_timeout
        out = await self._on_loop(collective.all_reduce, self._rank, peers, array, op, seq, timeout, self._departures)
        with torch.no_grad():
            tensor.copy_(torch.from_numpy(out))
        return tensor

    async def barrier(self) -> None:
        """Return once every rank has called it (over the worker mesh; the same order rule as
        :meth:`all_reduce`).

        Raises:
            SyncTimeout: some rank did not reach it within ``PSConfig.sync_timeout`` (names them).
            WorkerLeft: a rank finished training instead.
        """
        self._require_started("barrier")
        self._refuse_unawaited()
        seq, self._collectives = self._collectives, self._collectives + 1
        empty = torch.zeros(0, dtype=torch.int32).numpy()
        timeout = self.settings.ps.sync_timeout
        await self._on_loop(
            collective.all_reduce, self._rank, self._job.peers, empty, "sum", seq, timeout, self._departures
        )

    def _require_started(self, what: str) -> None:
        if not self._started:
            raise ConfigError(f"{what}() needs a started trainer: call it inside `async with Trainer(...) as trainer:`")

    # -- what a caller may read -------------------------------------------------------------

    @property
    def loop_cpu_s(self) -> float:
        """CPU seconds the trainer's event loop thread has used so far (0.0 before start)."""
        return self._thread.cpu_s() if self._thread is not None else 0.0

    @property
    def rank(self) -> int:
        """This worker's rank, 0 .. ``world_size`` - 1 (a ``DistributedSampler``'s ``rank``)."""
        self._require_joined("rank")
        return self._rank

    @property
    def world_size(self) -> int:
        """How many workers the job has (a ``DistributedSampler``'s ``num_replicas``)."""
        self._require_joined("world_size")
        return self._world

    @property
    def topology(self):
        """The job's hosts as the launcher placed the workers, checked at start-up
        (:class:`~poseidon_aio.cluster.topology.Topology`: ``hosts``, ``local_size``, ``host_of``)."""
        self._require_joined("topology")
        return self._job.topology

    def _require_joined(self, what: str) -> None:
        if self._rank is None:
            raise ConfigError(
                f"trainer.{what} is known once the trainer has started (`async with Trainer(...) as trainer:`); "
                "before that, read RANK and WORLD_SIZE from the environment the launcher set"
            )

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


def _as_caller(threads: int, device: Optional[torch.device] = None) -> Callable[[], None]:
    """What a thread of ours sets before its first kernel: the caller's intra-op threads (OpenMP
    keeps them per thread: a new one would run each GEMM on every core, spinning beside the other
    workers; bench/RESULTS.md, "Training step against DDP"), and the model's CUDA device (a new
    thread has none)."""

    def init() -> None:
        torch.set_num_threads(threads)
        if device is not None:
            torch.cuda.set_device(device)

    return init
