"""A merge group's gradients in one buffer, its results landing in one: DDP's flat bucket.

An MG-WFBP group is many small layers sent as one message. Handed over as one array per
parameter, every step pays a pass of Python per parameter at each layer it crosses (views, checks,
slices, byte views): on a ResNet-20 that was most of the loop's CPU a step. Here the group's
gradients are copied into one buffer by one torch call, and the syncer is given that buffer and
the one its results land in (the group's parameters are back to back in the step's aggregates).
Everything per parameter is made once, per group and slot of the aggregates' ring, on the loop;
once made, the backward's hook fills the buffer itself (:meth:`FlatGroups.made`).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..sync import Bucket
from ..wire.spans import spanning
from .layers import Layer
from .step import Aggregates, StepState, carved


class _Group:
    """One group's buffers for one slot of the ring (what never changes from step to step)."""

    __slots__ = ("params", "ids", "views", "grads", "outs", "flat", "members", "label", "layers")

    def __init__(self, layers: Sequence[Layer], send: torch.Tensor, outs: list, out_flat) -> None:
        self.params = [p for layer in layers for _, p in layer.params]
        self.ids = [i for layer in layers for i in layer.param_ids]
        self.views = carved(send, self.params)
        self.grads = [v.numpy() for v in self.views]
        self.outs = outs
        self.flat = (send.numpy(), out_flat)
        self.members = tuple((layer.name, len(layer.param_ids)) for layer in layers)
        self.label = f"{layers[-1].name}..{layers[0].name}"
        self.layers = tuple(layer.index for layer in layers)


class FlatGroups:
    """Buckets of CPU merge groups, each over one gradient buffer and one landing buffer.

    Args:
        aggregates: where the step's results land (its ring of slots: a buffer each here too, so
            a clock still sending under SSP never sees the next one's copy).
    """

    def __init__(self, aggregates: Aggregates) -> None:
        self.aggregates = aggregates
        self._groups: dict = {}  # (layer indices, slot) -> _Group, or None: cannot go flat

    def clear(self) -> None:
        """Forget every buffer (the plan's groups changed)."""
        self._groups.clear()

    def bucket(self, state: StepState, layers: Sequence[Layer]) -> Optional[Bucket]:
        """The bucket of the group ``layers`` (model order) for ``state``'s step, its gradients
        copied into the group's buffer; ``None`` where the group cannot be one buffer (mixed
        dtypes, a gradient that is not dense, results not back to back): send it layer by layer."""
        key = (tuple(layer.index for layer in layers), self.aggregates.slot(state.clock))
        group = self._groups.get(key, False)
        if group is False:
            group = self._groups[key] = self._make(state, layers)
        if group is None:
            return None
        return self._filled(state, group)

    def made(self, state: StepState, layers: Sequence[Layer]) -> Optional[Bucket]:
        """:meth:`bucket`, from any thread, where the group's buffers for ``state``'s slot are
        made already; ``None`` where they are not (nothing is made here) or cannot be."""
        group = self._groups.get((tuple(layer.index for layer in layers), self.aggregates.slot(state.clock)))
        return self._filled(state, group) if group else None

    def _filled(self, state: StepState, group: _Group) -> Optional[Bucket]:
        grads = [p.grad for p in group.params]
        if any(g is None or g.layout is not torch.strided for g in grads):
            return self._with_gaps(state, group, grads)
        torch._foreach_copy_(group.views, grads)
        return self._bucket_of(group)

    def _with_gaps(self, state: StepState, group: _Group, grads: list) -> Optional[Bucket]:
        """A parameter with no gradient (an unused branch) sends zeros, as one process would add none."""
        if any(g is not None and g.layout is not torch.strided for g in grads):
            return None
        for i, view, g in zip(group.ids, group.views, grads):
            if g is None:
                view.zero_()
                state.unused.add(i)
            else:
                view.copy_(g)
        return self._bucket_of(group)

    @staticmethod
    def _bucket_of(group: _Group) -> Bucket:
        return Bucket(
            group.label,
            group.layers,
            group.ids,
            group.outs,
            grads=group.grads,
            priority=group.layers[0],
            members=group.members,
            flat=group.flat,
        )

    def _make(self, state: StepState, layers: Sequence[Layer]) -> Optional[_Group]:
        params = [p for layer in layers for _, p in layer.params]
        dtype = params[0].dtype
        if any(p.dtype != dtype or p.is_cuda or p.layout is not torch.strided for p in params):
            return None
        outs = [self.aggregates.landing(state, i) for layer in layers for i in layer.param_ids]
        out_flat = spanning(outs)
        if out_flat is None or out_flat.size != sum(p.numel() for p in params):
            return None
        send = torch.empty(out_flat.size, dtype=dtype)
        return _Group(layers, send, outs, out_flat)
