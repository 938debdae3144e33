"""The Poseidon trainer: ``await trainer.step(batch)`` with wait-free backprop and hybrid communication.

Threads and loops (../shared/DESIGN.md): forward and backward run on one dedicated compute thread;
the event loop keeps moving bytes meanwhile (PyTorch releases the GIL inside its kernels). Backward
hooks hand each finished layer to the loop with ``call_soon_threadsafe``; the loop starts that
layer's sync at once — a parameter-server push, or a sufficient-factor broadcast to the peers —
so upper layers' syncs overlap the backward of lower layers (WFBP). Each layer has one future per
iteration; the step awaits them (under SSP only those older than the staleness bound), puts the
averaged gradients in ``param.grad`` and steps the user's optimizer.

Modes:

* ``naive``: every layer by PS, all syncs started after the whole backward;
* ``wfbp``: every layer by PS, each started the moment its gradient exists;
* ``mgwfbp``: WFBP by PS with MG-WFBP merging: after ``merge_after`` measured steps, consecutive
  layers whose separate messages would each pay the start-up cost travel as one message;
* ``poseidon``: WFBP + HybComm: fully-connected layers by SFB where the cost model says it moves
  fewer bytes (ATC'17 Algorithm 1), the rest by PS, merged as in ``mgwfbp``.

Merging (../shared/papers/mg-wfbp.md): at start-up the ranks time push/reply round trips of 4 KiB
to 4 MiB around a ring and fit ``T(p) = a + b p``; the first ``merge_after`` steps measure every layer's
backward time on the compute thread and every PS sync; rank 0 then plans (Algorithm 1, or the
exact dynamic program with ``merge="optimal"``), publishes the plan, every rank checks its hash,
and the parameter server is rebuilt with one message per merged group and shard.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import torch
from torch import nn

from .. import kernels
from ..cluster import ClusterEnv, Manifest, Rendezvous
from ..cluster.mesh import Mesh
from ..errors import ConfigError, RemoteProtocolError, SyncTimeout
from ..net import NetConfig
from ..ps import PSConfig, PSNode
from ..net import Shaper, TokenBucket
from ..sync.cost import Scheme, best_scheme
from ..sync.mgwfbp import CommModel, fit, merge_plan, optimal_plan
from ..wire import DType, Kind
from .layers import FactorCapture, GradReady, Layer, discover, grad_or_zeros

log = logging.getLogger("poseidon_aio.train")

MODES = ("naive", "wfbp", "mgwfbp", "poseidon")
MERGES = ("none", "algorithm1", "optimal", "single")
CALIBRATION_SIZES = (4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20)
_TORCH_WIRE = {torch.float32: DType.FLOAT32, torch.float64: DType.FLOAT64, torch.float16: DType.FLOAT16, torch.int64: DType.INT64, torch.int32: DType.INT32, torch.uint8: DType.UINT8, torch.bool: DType.UINT8}


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
            in-process link to its own shard not counted).
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

    def __init__(self, clock: int) -> None:
        self.clock = clock
        self.tasks: dict = {}
        self.launched: set = set()
        self.deferred: list = []
        self.agg: dict = {}  # manifest index -> tensor receiving the averaged gradient
        self.compute_done = False
        self.t_start = self.t_compute_end = 0.0
        self.spans: list = []  # [label, scheme, ready, start, end]
        self.ready_at: dict = {}  # layer index -> when its gradient (or factors) were ready
        self.t_forward_end = 0.0
        self.groups_launched: set = set()
        self.bytes = {"ps": 0, "sfb": 0}
        self.dropped: set = set()


class Trainer:
    """Data-parallel training of ``model`` across the job's worker processes.

    Args:
        model: the module every rank builds identically (parameters are broadcast from rank 0).
        optimizer: any ``torch.optim`` optimizer over the model's parameters; it steps on the
            averaged gradients. Step your LR scheduler yourself, as usual.
        loss_fn: ``loss_fn(model(inputs), targets)`` -> scalar tensor.
        mode: ``"naive"``, ``"wfbp"`` or ``"poseidon"`` (see the module docstring).
        ps: parameter-server settings (shards, chunk size, staleness, stragglers).
        net: connection settings; by default rank 0 draws a cluster token and shares it through
            the rendezvous store (see :class:`PSNode`).
        schemes: per-layer overrides, ``{"head.fc1": "ps" | "sfb" | "adam"}`` (``adam``: Project
            Adam's scheme, factors pushed to the PS and full matrices pulled back, for comparison).
        broadcast_buffers: send rank 0's buffers (BatchNorm statistics) before every forward,
            as ``DistributedDataParallel`` does, so replicas stay identical.
        trace: write a Chrome trace (JSON) of every step's compute and layer syncs there on close.
        env: the launcher environment (default: ``RANK``, ``WORLD_SIZE``, ... from the environment).
        rendezvous: an already started :class:`Rendezvous` (a ``scoped`` view), to run several
            trainers one after another over one store.
        merge: ``"algorithm1"`` (MG-WFBP's, the default in ``mgwfbp``/``poseidon``), ``"optimal"``
            (an exact dynamic program over the same model), ``"single"`` (every PS layer in one
            message after the backward: SyncEASGD) or ``"none"``.
        merge_after: measured steps before the merge plan is made.
        bandwidth: the bandwidth manager's per-process budget, bytes/s of outbound data on all
            connections together; frames of layers nearest the input go first.
        shaper: a process-wide :class:`~poseidon_aio.net.Shaper` to use instead (e.g. with a
            per-message start-up cost, to emulate a network's alpha).
        calibration_sizes: message sizes timed at start-up to fit alpha and beta.

    >>> # async with Trainer(model, torch.optim.SGD(model.parameters(), 0.1), F.cross_entropy) as trainer:
    >>> #     for batch in loader:
    >>> #         stats = await trainer.step(batch)
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable,
        *,
        mode: str = "poseidon",
        ps: Optional[PSConfig] = None,
        net: Optional[NetConfig] = None,
        schemes: Optional[dict] = None,
        broadcast_buffers: bool = True,
        trace: Optional[str] = None,
        env: Optional[ClusterEnv] = None,
        rendezvous: Optional[Rendezvous] = None,
        merge: Optional[str] = None,
        merge_after: int = 3,
        bandwidth: Optional[float] = None,
        shaper: Optional[Shaper] = None,
        calibration_sizes=CALIBRATION_SIZES,
    ) -> None:
        if mode not in MODES:
            raise ConfigError(f"mode must be one of {MODES}, got {mode!r}")
        merge = merge or ("algorithm1" if mode in ("mgwfbp", "poseidon") else "none")
        if merge not in MERGES:
            raise ConfigError(f"merge must be one of {MERGES}, got {merge!r}")
        if merge != "none" and mode in ("naive", "wfbp"):
            raise ConfigError(f"mode {mode!r} sends every layer on its own; merging is mode 'mgwfbp' or 'poseidon'")
        if merge_after < 1:
            raise ConfigError("merge_after must be >= 1 measured step")
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.mode = mode
        self.ps_config = ps or PSConfig()
        self.net = net
        self.overrides = dict(schemes or {})
        self.broadcast_buffers = broadcast_buffers
        self.trace_path = trace
        self.env = env
        self._given_rdzv = rendezvous
        self.merge = merge
        self.merge_after = merge_after
        self.calibration_sizes = tuple(calibration_sizes)
        self._shaper = shaper or (Shaper(egress=TokenBucket(bandwidth, 256 * 1024)) if bandwidth else None)
        #: The merge plan in force: groups of layer names, the fitted model, the predicted times.
        self.merge_info: dict = {}
        self.clock = 0
        self.layers = discover(model)
        self.schemes: dict = {}
        self.trace_events: list = []
        self._named = [(n, p) for layer in self.layers for n, p in layer.params]
        index = {id(p): i for i, (_, p) in enumerate(self._named)}
        for layer in self.layers:
            layer.param_ids = [index[id(p)] for _, p in layer.params]
        self._buffers = [b for b in model.buffers()]
        self._started = False
        self._planned = False
        self._inflight: list = []
        self._state: Optional[_Step] = None
        self._node: Optional[PSNode] = None
        self._mesh: Optional[Mesh] = None
        self._rdzv: Optional[Rendezvous] = None
        self._captures: dict = {}
        self._ready: dict = {}
        self._ps_index: dict = {}
        self._groups: list = []  # PS layers, grouped: one message per group and shard
        self._factored: list = []  # [weight, bias] names of the layers synced by Project Adam
        self._group_of: dict = {}
        self._samples = {"tf": [], "tb": {}, "ps": []}
        self._calibration: list = []
        self._generation = 0
        self._shard_bytes_seen = 0
        #: Payload bytes on the network per scheme since start (the shard's replies included).
        self.bytes_total: dict = {}
        self._t0 = time.perf_counter()

    # -- life -------------------------------------------------------------------------------

    async def __aenter__(self) -> "Trainer":
        await self.start()
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        await self.close(failed=exc_type is not None)

    async def start(self) -> None:
        """Join the job: rendezvous, manifest check, worker mesh, rank 0's parameters everywhere.

        Raises:
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
        if self._rdzv is not None:
            await self._rdzv.abort(exc)
        for hook in [*self._ready.values(), *self._captures.values()]:
            hook.remove()
        self._ready.clear()
        self._captures.clear()
        if self._mesh is not None:
            await self._mesh.close()
        if self._rdzv is not None:
            # The rank hosting the store keeps it up (at most 5 s) until the others have read
            # the reason and left.
            await self._rdzv.leave(5.0)
        self._compute.shutdown(wait=False)
        self._reduce.shutdown(wait=False)

    async def _join(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="poseidon-compute")
        self._reduce = ThreadPoolExecutor(max_workers=1, thread_name_prefix="poseidon-reconstruct")
        if self._given_rdzv is not None:
            self._rdzv = self._given_rdzv
            env = self._rdzv.env
        else:
            env = self.env or ClusterEnv.from_env()
            self._rdzv = Rendezvous(env, timeout=self.ps_config.rendezvous_timeout)
            await self._rdzv.start()
        self.env = env
        self.rank, self.world = env.rank, env.world_size
        if self.net is None:
            if env.rank == 0:
                await self._rdzv.publish("trainer-token", os.urandom(32).hex())
            self.net = NetConfig(token=bytes.fromhex(await self._rdzv.read("trainer-token", who="rank 0")))
        manifest = Manifest.of_arrays(self._named)
        await self._rdzv.check_manifest(manifest)
        self._mesh = await Mesh.start(
            self._rdzv.scoped("mesh"), self.net, timeout=self.ps_config.rendezvous_timeout, process_shaper=self._shaper
        )
        # Every parameter, frozen ones too: replicas must start identical.
        await self._broadcast(list(self.model.parameters()), Kind.PARAMS, 0)
        for layer in self.layers:
            self._ready[layer.index] = GradReady(layer, self._on_ready_threadsafe)
            if layer.sfb_capable:
                self._captures[layer.index] = FactorCapture(layer, self._on_ready_threadsafe)
        if self.merge in ("algorithm1", "optimal") and self.world > 1:
            self._calibration = await self._calibrate()  # before the plan, while the links are idle
        self._started = True

    async def close(self, failed: bool = False) -> None:
        """Finish in-flight steps, write the trace, leave the job."""
        if not self._started:
            return
        self._started = False
        try:
            if not failed:
                while self._inflight:
                    await self._apply(self._inflight.pop(0))
                if self._node is not None:
                    await self._node._rdzv.barrier("trainer-done")  # every rank's syncs are over
                    self.bytes_total["ps"] = self.bytes_total.get("ps", 0) + self._shard_bytes_delta()
        finally:
            for hook in [*self._ready.values(), *self._captures.values()]:
                hook.remove()
            if self.trace_path:
                with open(self.trace_path, "w") as f:
                    json.dump({"traceEvents": self.trace_events, "displayTimeUnit": "ms"}, f)
            if self._node is not None:
                if failed:
                    await self._node._teardown()
                else:
                    await self._node.close()
            if self._mesh is not None:
                await self._mesh.close()
            await self._rdzv.leave(5.0 if failed else None)
            self._compute.shutdown(wait=True)
            self._reduce.shutdown(wait=True)

    # -- the step ---------------------------------------------------------------------------

    async def step(self, batch) -> StepStats:
        """One iteration on this rank's ``batch`` = ``(inputs, targets)``.

        Returns:
            :class:`StepStats` (loss, timings, bytes per scheme, dropped ranks).
        Raises:
            SyncTimeout, ConnectionLost, WorkerLeft: a sync did not complete (the message names
                the layer, the clock and the peer or shard).
        """
        if not self._started:
            raise ConfigError("start the trainer first: `async with Trainer(...) as trainer:`")
        if not self._planned:
            await self._plan(batch)
        t = self.clock
        started = time.perf_counter()
        if self.broadcast_buffers and self._buffers:
            await self._broadcast(self._buffers, Kind.DATA, t)
        state = _Step(t)
        state.t_start = started
        for i, (_, p) in enumerate(self._named):
            state.agg[i] = torch.empty_like(p)
        for hook in self._ready.values():
            hook.reset()
            hook.enabled = self.schemes[hook.layer.index] is Scheme.PS
        for cap in self._captures.values():
            cap.reset()
            cap.enabled = self.schemes[cap.layer.index] in (Scheme.SFB, Scheme.ADAM)
        self._state = state
        loss = await self._loop.run_in_executor(self._compute, self._forward_backward, batch)
        state.t_compute_end = time.perf_counter()
        state.compute_done = True
        for layer in [*state.deferred, *reversed(self.layers)]:
            self._launch(state, layer, force=True)
        self._inflight.append(state)
        staleness = self.ps_config.staleness
        while self._inflight and self._inflight[0].clock <= t - staleness:
            await self._apply(self._inflight.pop(0))
        done = time.perf_counter()
        replan = self.merge in ("algorithm1", "optimal") and self.world > 1 and t < self.merge_after and len(self._groups) > 1
        if replan:
            self._measure(state)
        state.bytes["ps"] += self._shard_bytes_delta()
        for scheme, n in state.bytes.items():
            self.bytes_total[scheme] = self.bytes_total.get(scheme, 0) + n
        self.clock += 1
        if replan and t == self.merge_after - 1:
            await self._replan()  # the new parameter server starts at the next clock
        stats = StepStats(
            clock=t,
            loss=loss,
            compute_s=state.t_compute_end - started,
            stall_s=done - state.t_compute_end,
            overlap_s=sum(max(0.0, min(end, state.t_compute_end) - start) for *_, start, end in state.spans if end),
            step_s=done - started,
            bytes=dict(state.bytes),
            dropped=sorted(state.dropped),
            schemes={layer.name: self.schemes[layer.index].value for layer in self.layers},
        )
        self._trace(state, done)
        return stats

    def _shard_bytes_delta(self) -> int:
        """Payload bytes this rank's shard moved over the network for the others since last asked."""
        shard = self._node.shard if self._node is not None else None
        if shard is None:
            return 0
        moved = shard.stats.remote_bytes_in + shard.stats.remote_bytes_out
        delta, self._shard_bytes_seen = moved - self._shard_bytes_seen, moved
        return delta

    def _forward_backward(self, batch) -> float:
        inputs, targets = batch
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        out = self.model(inputs)
        loss = self.loss_fn(out, targets)
        self._state.t_forward_end = time.perf_counter()
        loss.backward()
        return float(loss.detach())

    # -- hooks -> loop ----------------------------------------------------------------------

    def _on_ready_threadsafe(self, layer: Layer) -> None:
        state = self._state
        self._loop.call_soon_threadsafe(self._launch, state, layer, False, time.perf_counter())

    def _launch(self, state: _Step, layer: Layer, force: bool = False, ready_at: Optional[float] = None) -> None:
        if layer.index in state.launched:
            return
        if self.mode == "naive" and not state.compute_done:
            state.deferred.append(layer)  # naive: nothing moves until the backward is over
            return
        state.launched.add(layer.index)
        state.ready_at[layer.index] = ready_at or time.perf_counter()
        if self.schemes[layer.index] is Scheme.SFB:
            self._start(state, layer.name, [layer], Scheme.SFB, self._sfb(state, layer))
            return
        if self.schemes[layer.index] is Scheme.ADAM:
            self._start(state, layer.name, [layer], Scheme.ADAM, self._adam(state, layer))
            return
        g = self._group_of[layer.index]
        group = self._groups[g]
        if g not in state.groups_launched and all(member.index in state.launched for member in group):
            state.groups_launched.add(g)  # a merged group goes once its last layer is ready
            label = group[0].name if len(group) == 1 else f"{group[-1].name}..{group[0].name}"
            self._start(state, label, group, Scheme.PS, self._ps_push(state, group))

    def _start(self, state: _Step, label: str, layers: list, scheme: Scheme, coro) -> None:
        span = [label, scheme, max(state.ready_at[x.index] for x in layers), time.perf_counter(), 0.0]
        task = asyncio.ensure_future(coro)
        task.add_done_callback(lambda _: span.__setitem__(4, time.perf_counter()))
        state.spans.append(span)
        state.tasks[(scheme.value, layers[0].index)] = task

    # -- schemes ----------------------------------------------------------------------------

    async def _ps_push(self, state: _Step, group: list) -> None:
        grads = [grad_or_zeros(p).detach().numpy() for layer in group for _, p in layer.params]
        outs = [state.agg[i].numpy() for layer in group for i in layer.param_ids]
        ids = [self._ps_index[i] for layer in group for i in layer.param_ids]
        priority = min(layer.index for layer in group)  # nearest the input first
        result = await self._node.client.push(ids, grads, outs, state.clock, priority)
        state.bytes["ps"] += result.remote_bytes_sent + result.remote_bytes_received
        state.dropped.update(result.dropped)

    async def _adam(self, state: _Step, layer: Layer) -> None:
        """Project Adam: factors to the shard holding the layer, the rebuilt full matrices back."""
        cap = self._captures[layer.index]
        m, n = layer.module.weight.shape
        u, v = cap.factors() if cap.captured else (torch.zeros(0, m), torch.zeros(0, n))
        outs = [state.agg[i].numpy() for i in layer.param_ids]
        ids = [self._ps_index[i] for i in layer.param_ids]
        result = await self._node.client.push_factors(ids, u.numpy(), v.numpy(), outs, state.clock, layer.index)
        state.bytes["adam"] = state.bytes.get("adam", 0) + result.remote_bytes_sent + result.remote_bytes_received

    async def _sfb(self, state: _Step, layer: Layer) -> None:
        cap = self._captures[layer.index]
        m, n = layer.module.weight.shape
        if cap.captured:
            u, v = cap.factors()
        else:  # not used on this rank this step: it contributes no rows
            u, v = torch.zeros(0, m), torch.zeros(0, n)
        peers = self._mesh.peers
        t = state.clock
        waits = {r: conn.expect(Kind.FACTORS, layer.index, t) for r, conn in peers.items()}
        parts = [u.numpy(), v.numpy()]
        await asyncio.gather(
            *(conn.send(Kind.FACTORS, parts, key=layer.index, clock=t, dtype=DType.FLOAT32, priority=layer.index) for conn in peers.values())
        )
        try:
            frames = await asyncio.wait_for(asyncio.gather(*waits.values()), self.ps_config.sync_timeout)
        except asyncio.CancelledError:
            for w in waits.values():
                w.cancel()
            raise
        except TimeoutError:
            missing = sorted(r for r, w in waits.items() if not w.done())
            raise SyncTimeout(
                f"rank {self.rank}: sufficient factors of layer {layer.name} at clock {t} did not arrive from "
                f"ranks {missing} within {self.ps_config.sync_timeout} s"
            ) from None
        us, vs = [None] * self.world, [None] * self.world
        us[self.rank], vs[self.rank] = u, v
        for r, frame in zip(waits, frames):
            floats = frame.header.length // 4
            if frame.header.dtype is not DType.FLOAT32 or floats % (m + n):
                raise RemoteProtocolError(
                    f"rank {r} sent {frame.header.length} bytes of factors for layer {layer.name} ({m}x{n}) at "
                    f"clock {t}: not K rows of {m}+{n} float32 — do the ranks build the same model?"
                )
            k = floats // (m + n)
            arr = torch.from_numpy(np.frombuffer(frame.payload, dtype=np.float32))
            us[r], vs[r] = arr[: k * m].view(k, m), arr[k * m :].view(k, n)
        out_w = state.agg[layer.param_ids[0]]
        out_b = state.agg[layer.param_ids[1]] if len(layer.param_ids) > 1 else None
        await self._loop.run_in_executor(self._reduce, kernels.reconstruct, us, vs, 1.0 / self.world, out_w, out_b)
        sent = u.numel() * 4 + v.numel() * 4
        state.bytes["sfb"] += sent * len(peers) + sum(f.header.length for f in frames)

    # -- apply ------------------------------------------------------------------------------

    async def _apply(self, state: _Step) -> None:
        try:
            await asyncio.gather(*state.tasks.values())
        except BaseException:
            for task in state.tasks.values():
                task.cancel()
            raise
        await self._loop.run_in_executor(self._compute, self._optimizer_step, state)

    def _optimizer_step(self, state: _Step) -> None:
        # A fresh tensor per clock: under SSP an older clock's gradient may still be on its way
        # out of the previous .grad while this one is applied. A parameter whose averaged gradient
        # is exactly zero (unused on every rank) keeps grad None so the optimizer skips it, as it
        # would in one process; every rank sees the same aggregate, so every rank decides alike.
        for i, (_, p) in enumerate(self._named):
            agg = state.agg[i]
            p.grad = agg if bool(agg.any()) else None
        self.optimizer.step()

    # -- start-up pieces --------------------------------------------------------------------

    async def _broadcast(self, tensors: list, kind: Kind, clock: int) -> None:
        """Make every rank's ``tensors`` equal rank 0's, over the mesh."""
        if self.world == 1:
            return
        if self.rank == 0:
            sends = []
            for i, tensor in enumerate(tensors):
                data = tensor.detach()
                payload = data.view(torch.uint8).numpy() if data.dtype is torch.bool else data.numpy()
                for conn in self._mesh.peers.values():
                    sends.append(conn.send(kind, payload, key=i, clock=clock, dtype=_TORCH_WIRE.get(data.dtype, DType.BYTES)))
            await asyncio.gather(*sends)
            return
        conn = self._mesh.peers[0]
        waits = []
        for i, tensor in enumerate(tensors):
            data = tensor.detach()
            target = data.view(torch.uint8).numpy() if data.dtype is torch.bool else data.numpy()
            waits.append(conn.expect(kind, i, clock, into=target))
        try:
            await asyncio.wait_for(asyncio.gather(*waits), self.ps_config.sync_timeout)
        except TimeoutError:
            raise SyncTimeout(f"rank {self.rank}: rank 0's {'parameters' if kind is Kind.PARAMS else 'buffers'} for clock {clock} did not arrive") from None

    async def _plan(self, batch) -> None:
        """Decide every layer's scheme (the same on every rank) and start the parameter server."""
        rows = await self._loop.run_in_executor(self._compute, self._measure_rows, batch)
        seen = await self._rdzv.exchange("rows", json.dumps(rows), range(self.world))
        k = {name: max(json.loads(seen[r]).get(name, 0) for r in seen) for name in rows}
        shards = self.ps_config.shards_for(self.world)
        for layer in self.layers:
            want = self.overrides.get(layer.name)
            if want is not None:
                scheme = Scheme(want)
                if scheme in (Scheme.SFB, Scheme.ADAM) and not (layer.sfb_capable and layer.module.weight.dtype is torch.float32):
                    raise ConfigError(
                        f"layer {layer.name} ({type(layer.module).__name__}) cannot go by {scheme.value}: "
                        "only an unshared float32 nn.Linear has sufficient factors"
                    )
            elif self.mode == "poseidon" and layer.sfb_capable and layer.module.weight.dtype is torch.float32 and k.get(layer.name):
                # (a layer the planning forward never called has no K to judge by: PS)
                scheme = best_scheme(layer.shape(k[layer.name]), self.world, shards)
            else:
                scheme = Scheme.PS
            if self.mode != "poseidon" and scheme is not Scheme.PS:
                raise ConfigError(f"mode {self.mode!r} syncs every layer by PS; use mode='poseidon' for {scheme.value} overrides")
            self.schemes[layer.index] = scheme
        plan = json.dumps({layer.name: self.schemes[layer.index].value for layer in self.layers})
        await self._rdzv.check_digest("scheme plan", plan)
        ps_layers = [layer for layer in self.layers if self.schemes[layer.index] is Scheme.PS]
        adam_layers = [layer for layer in self.layers if self.schemes[layer.index] is Scheme.ADAM]
        # Plain-PS layers first, so any run of them a merge plan groups is consecutive in the manifest.
        on_ps = ps_layers + adam_layers
        self._ps_index = {i: j for j, i in enumerate(i for layer in on_ps for i in layer.param_ids)}
        self._factored = [[n for n, _ in layer.params] for layer in adam_layers]
        self._set_groups([[layer] for layer in ps_layers] if self.merge != "single" or not ps_layers else [ps_layers])
        if on_ps:
            await self._start_ps()
        self._planned = True
        log.info("rank %d: schemes %s", self.rank, plan)

    # -- MG-WFBP ---------------------------------------------------------------------------

    def _set_groups(self, groups: list) -> None:
        self._groups = groups
        self._group_of = {layer.index: g for g, members in enumerate(groups) for layer in members}

    async def _start_ps(self) -> None:
        """(Re)start the parameter server with one message per merge group and shard."""
        names = [[n for layer in group for n, _ in layer.params] for group in self._groups if len(group) > 1]
        manifest = Manifest.of_arrays(self._named[i] for i in sorted(self._ps_index, key=self._ps_index.get))
        self._node = await PSNode.start(
            manifest, self.ps_config, net=self.net, groups=names or None, start_clock=self.clock,
            rendezvous=self._rdzv.scoped(f"ps{self._generation}"), process_shaper=self._shaper,
            factored=self._factored or None,
        )
        self._shard_bytes_seen = 0

    async def _calibrate(self) -> list:
        """Round trips around the ring of ranks, shaped like a parameter-server sync (a PUSH out,
        an AGGREGATE of the same size back): ``[(bytes, seconds)]`` per calibration size."""
        peers = self._mesh.peers
        nxt, prv = peers[(self.rank + 1) % self.world], peers[(self.rank - 1) % self.world]
        samples = []
        for i, size in enumerate(self.calibration_sizes):
            payload = np.zeros(size, dtype=np.uint8)
            for rep in range(3):
                clock = 1_000_000 + 10 * i + rep
                back = nxt.expect(Kind.AGGREGATE, 7, clock)
                incoming = prv.expect(Kind.PUSH, 7, clock)
                started = time.perf_counter()
                await nxt.send(Kind.PUSH, payload, key=7, clock=clock)
                try:
                    await asyncio.wait_for(incoming, self.ps_config.sync_timeout)
                    await prv.send(Kind.AGGREGATE, payload, key=7, clock=clock)
                    await asyncio.wait_for(back, self.ps_config.sync_timeout)
                except TimeoutError:
                    raise SyncTimeout(f"rank {self.rank}: a calibration message of {size} bytes did not come back from rank {nxt.peer_rank}") from None
                samples.append((size, time.perf_counter() - started))
        return samples

    def _measure(self, state: _Step) -> None:
        """Record a warm-up step's forward time, per-layer backward times and PS sync times."""
        self._samples["tf"].append(state.t_forward_end - state.t_start)
        previous = state.t_forward_end
        for layer in reversed([g for group in self._groups for g in group]):
            ready = state.ready_at.get(layer.index, previous)
            self._samples["tb"].setdefault(layer.index, []).append(max(0.0, ready - previous))
            previous = max(previous, ready)
        # The PS link's busy time: the union of this step's sync intervals (syncs overlap and queue
        # behind one another, so their own durations would count the same second several times).
        spans = sorted((start, end) for _, scheme, _, start, end in state.spans if scheme is Scheme.PS and end)
        busy, reach = 0.0, float("-inf")
        for start, end in spans:
            busy += max(0.0, end - max(start, reach))
            reach = max(reach, end)
        nbytes = sum(p.numel() * p.element_size() for group in self._groups for layer in group for _, p in layer.params)
        self._samples["ps"].append((len(spans), nbytes, busy))

    def _comm_model(self) -> CommModel:
        """PS message time: start-up from the ring calibration, per-byte cost refit from observed syncs."""
        shards = self.ps_config.shards_for(self.world)
        round_trip = fit(*zip(*self._calibration)) if len(self._calibration) >= 2 else CommModel(0.0, 0.0)
        # A PS sync is a push and a reply, like the calibration's round trip: its start-up is the
        # round trip's; its bytes cross the busiest link (P1 + P2 - 2) / P2 times over in each
        # direction (ATC'17 Table 1, per node), the round trip's once.
        a = round_trip.a
        b = round_trip.b / 2 * (self.world + shards - 2) / shards
        # Refit the per-byte cost from training's own transfers: under the model, a step's busy
        # time is n * a + b * bytes.
        steps = [(n, nbytes, busy) for n, nbytes, busy in self._samples["ps"] if nbytes]
        if steps:
            b = max(0.0, sum(busy - n * a for n, _, busy in steps) / sum(nbytes for _, nbytes, _ in steps))
        return CommModel(a, b)

    async def _replan(self) -> None:
        """Rank 0 plans from its measurements; every rank adopts the plan after checking its hash."""
        ps_layers = [g for group in self._groups for g in group]
        if self.rank == 0:
            median = lambda xs: float(np.median(xs)) if xs else 0.0  # noqa: E731
            model = self._comm_model()
            t_b = [median(self._samples["tb"].get(layer.index, [])) for layer in ps_layers]
            sizes = [sum(p.numel() * p.element_size() for _, p in layer.params) for layer in ps_layers]
            planner = optimal_plan if self.merge == "optimal" else merge_plan
            plan = planner(median(self._samples["tf"]), t_b, sizes, model)
            info = {
                "groups": [[ps_layers[i - 1].name for i in group] for group in plan.groups],
                "alpha_s": model.a, "beta_s_per_byte": model.b, "planner": self.merge,
                "predicted_s": {"plan": plan.t_iter, "wfbp": plan.t_iter_wfbp, "single": plan.t_iter_single},
            }
            await self._rdzv.publish(f"merge-plan/{self._generation}", json.dumps(info))
        text = await self._rdzv.read(f"merge-plan/{self._generation}", who="rank 0")
        await self._rdzv.check_digest(f"merge plan {self._generation}", text)
        info = json.loads(text)
        by_name = {layer.name: layer for layer in ps_layers}
        # Layers 1..L run from the input: group members are listed input side first; keep the
        # manifest's (model) order inside each group.
        groups = [sorted((by_name[n] for n in group), key=lambda x: x.index) for group in info["groups"]]
        while self._inflight:
            await self._apply(self._inflight.pop(0))
        if self._node is not None:
            self.bytes_total["ps"] = self.bytes_total.get("ps", 0) + self._shard_bytes_delta()
            await self._node.close()
        self._generation += 1
        self._set_groups(groups)
        await self._start_ps()
        self.merge_info = info
        log.info("rank %d: merge plan %s", self.rank, info["groups"])

    def _measure_rows(self, batch) -> dict:
        for cap in self._captures.values():
            cap.reset()
            cap.enabled = False
        was = self.model.training
        self.model.train(False)  # evaluation mode: no side effects on BatchNorm statistics
        try:
            with torch.no_grad():
                self.model(batch[0])
        finally:
            self.model.train(was)
        return {cap.layer.name: sum(cap.rows) for cap in self._captures.values()}

    # -- timeline ---------------------------------------------------------------------------

    def _trace(self, state: _Step, done: float) -> None:
        us = lambda t: round((t - self._t0) * 1e6, 1)  # noqa: E731
        pid = self.rank
        ev = self.trace_events
        ev.append({"name": f"forward+backward {state.clock}", "ph": "X", "pid": pid, "tid": "compute", "ts": us(state.t_start), "dur": us(state.t_compute_end) - us(state.t_start)})
        for label, scheme, ready, start, end in state.spans:
            ev.append({"name": f"{label} ready", "ph": "i", "s": "t", "pid": pid, "tid": "compute", "ts": us(ready)})
            ev.append({"name": f"sync {label} ({scheme.value})", "ph": "X", "pid": pid, "tid": f"sync {scheme.value}", "ts": us(start), "dur": us(end or done) - us(start), "args": {"clock": state.clock}})
