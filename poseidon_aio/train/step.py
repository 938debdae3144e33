"""One iteration's state, what a step reports, and where its synchronized results land."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from .staging import Staging


@dataclass
class StepStats:
    """What one step did.

    Attributes:
        clock: the step's iteration clock.
        loss: this rank's loss on its batch.
        compute_s: forward + backward wall time.
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


class StepState:
    """One iteration in flight: its layer syncs and where their results land."""

    __slots__ = (
        "clock",
        "syncs",
        "launched",
        "deferred",
        "agg",
        "compute_done",
        "started",
        "forward_end",
        "compute_end",
        "spans",
        "work",
        "ready_at",
        "bytes",
        "dropped",
        "unused",
        "held",
        "done",
        "taken",
        "sync_ids",
        "stepped",
        "holding",
        "scaler",
    )

    def __init__(self, clock: int, started: float, agg: dict) -> None:
        self.clock = clock
        self.syncs: list = []  # awaitables of SyncResult
        self.sync_ids: list = []  # the manifest indices each of ``syncs`` lands, in the same order
        self.stepped: set = set()  # manifest indices the optimizer has stepped
        self.holding = False  # the planning step: every sync waits for the plan, made after the backward
        self.scaler = None  # the caller's GradScaler (step(batch, scaler=...))
        self.launched: set = set()
        self.deferred: list = []
        self.agg = agg  # manifest index -> tensor receiving the synchronized result
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

    def stats(self, loss: float, schemes: dict) -> StepStats:
        """What the step did, once ``step()`` returns (``done`` set)."""
        return StepStats(
            clock=self.clock,
            loss=loss,
            compute_s=self.compute_end - self.started,
            stall_s=self.done - self.compute_end,
            overlap_s=sum(max(0.0, min(s.end, self.compute_end) - s.start) for s in self.spans if s.end),
            step_s=self.done - self.started,
            bytes=self.bytes,  # (the step's own: under SSP its syncs that are still moving add to it)
            dropped=sorted(self.dropped),
            schemes=dict(schemes),  # a copy: a caller may change a step's dict
        )


class Aggregates:
    """Where each clock's synchronized results land: one tensor per parameter, from a ring of
    ``staleness + 2`` sets reused clock after clock.

    Under SSP an older clock's results may still be landing while this one runs, and each set is
    handed to ``param.grad`` for one optimizer step; fresh tensors every step would cost a page
    fault (and the kernel zeroing a page) per 4 KiB of the model.

    A set is one buffer per (device, dtype), the parameters back to back in model order: the keys
    of a merged message, consecutive slices of consecutive parameters, are then consecutive
    bytes, and its reply is received into them directly (``wire.spans``).
    """

    def __init__(self, params: list, staleness: int, staging: Staging) -> None:
        self.params = params
        self.slots = staleness + 2
        self.staging = staging
        self._ring: dict = {}
        self._views: dict = {}  # (ring slot, parameter) -> host view of that aggregate

    def slot(self, clock: int) -> int:
        return clock % self.slots

    def of(self, clock: int) -> dict:
        """``{manifest index: tensor}`` for clock ``clock``'s results."""
        slot = self.slot(clock)
        agg = self._ring.get(slot)
        if agg is None:
            agg = self._ring[slot] = back_to_back(self.params)
        return agg

    def landing(self, state: StepState, i: int) -> np.ndarray:
        """Where parameter ``i``'s synchronized result lands for ``state``'s clock: the host view
        of its aggregate, made once per slot of the ring (the tensors are reused)."""
        key = (self.slot(state.clock), i)
        view = self._views.get(key)
        if view is None:
            # One host buffer per slot of the ring, as on the device: under SSP two clocks land at once.
            view = self._views[key] = self.staging.landing(("agg", *key), state.agg[i])
        return view

    def to_device(self, state: StepState, i: int) -> None:
        """Copy parameter ``i``'s host landing back to its (device) aggregate, where staged."""
        self.staging.to_device(("agg", self.slot(state.clock), i), state.agg[i])


def carved(flat: torch.Tensor, tensors: list) -> list:
    """Views of the 1-D ``flat``, back to back from its start, each shaped like one of ``tensors``."""
    views, at = [], 0
    for t in tensors:
        views.append(flat[at : at + t.numel()].view(t.shape))
        at += t.numel()
    return views


def back_to_back(params: list) -> dict:
    """``{i: tensor}`` shaped like ``params[i]``: views of one contiguous buffer per (device,
    dtype), in the given order."""
    by_kind: dict = {}
    for i, p in enumerate(params):
        by_kind.setdefault((p.device, p.dtype), []).append(i)
    views = {}
    for (device, dtype), ids in by_kind.items():
        members = [params[i] for i in ids]
        flat = torch.empty(sum(p.numel() for p in members), dtype=dtype, device=device)
        views.update(zip(ids, carved(flat, members)))
    return dict(sorted(views.items()))
