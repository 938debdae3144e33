"""Landing a step: its synchronized results into ``param.grad``, then the user's optimizer, on the
parameters whose syncs are in while others are still moving where that gives the same bits."""

from __future__ import annotations

import asyncio
import time
from typing import Optional

import torch
from torch.optim import optimizer as torch_optimizer

from ..net.loop import INLINE_BUDGET_S, Offload
from .dispatch import SchemePlan
from .settings import Settings
from .staging import Staging
from .step import Aggregates, StepState

# Optimizers whose update of a parameter reads only that parameter, its gradient, its own state
# and its group's settings: stepping them on some parameters, then on the rest, gives every
# parameter the bits one step over all of them gives (exact types: a subclass may couple them).
PER_PARAMETER_OPTIMIZERS = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.RMSprop,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Adadelta,
)


def step_some(optimizer: torch.optim.Optimizer, params: set, keep: bool) -> None:
    """One ``optimizer`` step on the parameters whose ``id`` is in ``params`` (``keep``) or not
    in it: every group cut to them for the step, with its own settings (read afresh: a scheduler
    may have changed them since the last step). For the optimizers of
    ``PER_PARAMETER_OPTIMIZERS``, steps on the parts of a partition give every parameter and its
    state the bits one step on all of them gives (tests/test_step_parts.py)."""
    groups = optimizer.param_groups
    cut = [{**g, "params": [p for p in g["params"] if (id(p) in params) == keep]} for g in groups]
    optimizer.param_groups = [g for g in cut if g["params"]]
    try:
        optimizer.step()
    finally:
        optimizer.param_groups = groups


class Applier:
    """Awaits a step's syncs and steps the optimizer on their results.

    Args:
        settings: the trainer's (``optimizer.early_step_bytes``; the SSP bound: early steps are
            for BSP only).
        optimizer: the user's optimizer.
        named: ``[(name, parameter)]`` in manifest order.
        staging, aggregates: host buffers and where results land.
        compute: the compute thread's executor (early steps run there: the loop is receiving).
        gpu: whether the model's tensors are staged through host buffers.
    """

    def __init__(
        self,
        settings: Settings,
        optimizer: torch.optim.Optimizer,
        named: list,
        staging: Staging,
        aggregates: Aggregates,
        compute,
        gpu: bool,
    ) -> None:
        self.optimizer = optimizer
        self.named = named
        self.param_bytes = [p.numel() * p.element_size() for _, p in named]
        self.staging = staging
        self.aggregates = aggregates
        self.compute = compute
        # A small model's optimizer step costs less than the hop to the compute thread and back:
        # it runs on the loop (the compute thread is idle by then). A GPU's waits on its streams.
        self.stepper = Offload(compute, budget_s=0.0 if gpu else INLINE_BUDGET_S)
        self.early_step_bytes = settings.optimizer.early_step_bytes
        self.clip_grad_norm = settings.optimizer.clip_grad_norm
        self.staleness = settings.ps.staleness
        self.gpu = gpu
        self.plan: Optional[SchemePlan] = None
        self.server_owned: set = set()  # manifest indices whose values the shards' SGD sends

    async def apply(self, state: StepState) -> None:
        """Await ``state``'s syncs and step the optimizer on every parameter.

        Raises:
            the first failed sync's error (the others are cancelled).
        """
        await self._synced(state, self._step_as_synced(state) if self.steps_early(state) else None)
        if state.scaler is not None or self.clip_grad_norm is not None:
            await self.stepper.run("optimizer", self.scaled_step, state)
        else:
            await self.stepper.run("optimizer", self.optimizer_step, state)

    def scaled_step(self, state: StepState) -> None:
        """:meth:`step_optimizer` with ``state``'s aggregates put in ``param.grad`` first."""
        self.put_grads(state, list(range(len(self.named))))
        self.step_optimizer(state)

    def step_optimizer(self, state: StepState) -> None:
        """One optimizer step over every parameter, its gradients in, through the caller's
        GradScaler (unscaled, clipped, skipped where a gradient is inf or NaN) and the clipping of
        the settings. Every rank holds the same averaged bits, so every rank skips or steps alike."""
        scaler = state.scaler
        if self.clip_grad_norm is not None:
            if scaler is not None:
                scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_([p for _, p in self.named if p.grad is not None], self.clip_grad_norm)
        if scaler is None:
            self.optimizer.step()
        else:
            scaler.step(self.optimizer)
            scaler.update()

    @staticmethod
    async def _synced(state: StepState, waiting=None) -> None:
        """``await waiting`` (default: every sync of ``state``); on a failure the others are
        cancelled and the first error raised."""
        try:
            if waiting is not None:
                await waiting
            elif len(state.syncs) == 1:  # (a merged model's one message: no gathering future)
                await state.syncs[0]
            else:
                await asyncio.gather(*state.syncs)
        except BaseException:
            for task in state.syncs:
                task.cancel()
            raise

    def steps_early(self, state: StepState) -> bool:
        """Whether ``state``'s optimizer step may start on the parameters whose syncs are in while
        others are still moving: on the CPU, under BSP, with an optimizer that updates each
        parameter on its own and no step hooks (they would run once a part), and where some sync
        lands enough bytes to be worth a step of its own."""
        least = self.early_step_bytes
        if (
            least is None
            or state.scaler is not None  # (one decision over every gradient: inf anywhere skips the step)
            or self.clip_grad_norm is not None  # (the norm is over every gradient)
            or self.gpu
            or self.staleness
            or type(self.optimizer) not in PER_PARAMETER_OPTIMIZERS
            or len(state.syncs) < 2
        ):
            return False
        hooks = (
            getattr(self.optimizer, "_optimizer_step_pre_hooks", None),
            getattr(self.optimizer, "_optimizer_step_post_hooks", None),
            getattr(torch_optimizer, "_global_optimizer_pre_hooks", None),
            getattr(torch_optimizer, "_global_optimizer_post_hooks", None),
        )
        if any(hooks):
            return False
        return any(self._bytes_of(ids) >= least for ids in state.sync_ids)

    def _bytes_of(self, ids) -> int:
        return sum(map(self.param_bytes.__getitem__, ids))  # (no generator: this runs on the loop every step)

    async def _step_as_synced(self, state: StepState) -> None:
        """Await ``state``'s syncs, stepping the optimizer on the parameters of those that have
        landed while the others are still moving, once they hold ``early_step_bytes``: only the
        last layers' update is then left after the last sync. The rest, and any parameter of the
        optimizer outside the model, are stepped by :meth:`apply`.

        A sync that fails raises here, as ``gather`` does; layers already stepped stay stepped
        (the step fails either way, and a run resumes from its checkpoint)."""
        loop = asyncio.get_running_loop()
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
            if pending and self._bytes_of(landed) >= self.early_step_bytes:
                # On the compute thread, never on the loop: the loop is receiving the rest.
                started = time.perf_counter()
                await loop.run_in_executor(self.compute, self.optimizer_step, state, landed)
                state.work.append((f"optimizer, {len(landed)} tensors", started, time.perf_counter(), "optimizer"))
                landed = []

    async def land(self, state: StepState) -> None:
        """Await ``state``'s syncs and put their results in ``param.grad``, without stepping the
        optimizer: the user's loop clips, unscales and steps it (``Trainer.synchronize``).

        Raises:
            the first failed sync's error (the others are cancelled).
        """
        await self._synced(state)
        await self.stepper.run("land", self.put_grads, state, list(range(len(self.named))))

    def optimizer_step(self, state: StepState, ids: Optional[list] = None) -> None:
        """Put ``state``'s aggregates in ``param.grad`` and step the optimizer: on the manifest
        indices ``ids`` only (their syncs have landed), or on every parameter not stepped yet."""
        chosen = ids if ids is not None else [i for i in range(len(self.named)) if i not in state.stepped]
        self.put_grads(state, chosen)
        if ids is None and not state.stepped:
            self.optimizer.step()
        elif ids is not None:
            step_some(self.optimizer, {id(self.named[i][1]) for i in ids}, keep=True)
            state.stepped.update(ids)
        else:
            step_some(self.optimizer, {id(self.named[i][1]) for i in state.stepped}, keep=False)

    def put_grads(self, state: StepState, chosen: list) -> None:
        """``state``'s aggregates of the manifest indices ``chosen`` into ``param.grad``."""
        # A parameter no rank used keeps grad None so the optimizer skips it, as it would in one
        # process: one this rank did not use is checked for an exactly zero aggregate (every rank
        # sees the same aggregate, so every rank decides alike); scanning every aggregate would
        # cost a pass over the model's gradients per step. A parameter frozen for this step
        # (requires_grad off) gets no gradient either.
        if self.gpu:  # (on the CPU the wire wrote the aggregates themselves: nothing to copy)
            wanted = set(chosen)
            for layer in self.plan.layers:
                if self.plan.host_outs(layer):
                    for i in layer.param_ids:
                        if i in wanted:
                            self.aggregates.to_device(state, i)
            self.staging.wait()
        for i in chosen:
            p = self.named[i][1]
            agg = state.agg[i]
            if i in self.server_owned:  # the shards' SGD sent the new values themselves
                with torch.no_grad():
                    p.copy_(agg)
                p.grad = None
            elif not p.requires_grad:
                p.grad = None
            elif i in state.unused:  # unused here: a gradient only if some rank used it
                p.grad = agg if bool(agg.any()) else None
            else:
                p.grad = agg
