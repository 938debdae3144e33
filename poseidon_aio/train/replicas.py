"""Rank 0's tensors on every rank, through host buffers: the parameters and buffers at start, the
buffers (BatchNorm statistics) after every step, so replicas stay identical."""

from __future__ import annotations

import asyncio
from typing import Optional

import torch

from ..sync import broadcast
from ..wire import Kind
from .staging import Staging
from .step import carved


class Replicas:
    """Makes every rank's tensors equal rank 0's.

    Args:
        rank, world: this worker and how many there are.
        peers: ``{rank: link}`` of the worker mesh.
        staging: host buffers for a GPU model's tensors.
        reduce: the executor a GPU tensor's copy to the host waits on.
        timeout: seconds any one broadcast may take.
    """

    def __init__(self, rank: int, world: int, peers, staging: Staging, reduce, timeout: float) -> None:
        self.rank, self.world, self.peers = rank, world, peers
        self.staging = staging
        self.reduce = reduce
        self.timeout = timeout
        self._flats: Optional[tuple] = None  # (the buffers, their groups by dtype): _buffers_flat

    async def broadcast(self, tensors: list, clock: Optional[int] = None) -> None:
        """Rank 0's ``tensors`` everywhere: the parameters and buffers at start (``clock`` None),
        the buffers at the end of step ``clock``."""
        if self.world == 1:
            return
        if clock is not None and self._groups_for(tensors) is not None:
            await self._buffers_flat(clock)
            return
        role = "params" if clock is None else "buffers"
        slots = [("bcast", role, i) for i in range(len(tensors))]
        data = [t.detach().view(torch.uint8) if t.dtype is torch.bool else t.detach() for t in tensors]
        if self.rank == 0:
            arrays = [await self._host(slot, d) for slot, d in zip(slots, data)]
        else:
            arrays = [self.staging.landing(slot, d) for slot, d in zip(slots, data)]
        if clock is None:
            await broadcast.parameters(self.rank, self.peers, arrays, self.timeout)
        else:
            await broadcast.buffers(self.rank, self.peers, arrays, clock, self.timeout)
        if self.rank != 0:
            for slot, d in zip(slots, data):
                self.staging.to_device(slot, d)
            self.staging.wait()

    def _groups_for(self, tensors: list) -> Optional[list]:
        """The groups of :func:`_flat_groups` for ``tensors``, made once for the same tensors;
        ``None`` where some are staged (a GPU's)."""
        flats = self._flats
        if flats is None or len(flats[0]) != len(tensors) or any(a is not b for a, b in zip(flats[0], tensors)):
            staged = any(self.staging.staged(t) for t in tensors)
            flats = self._flats = (list(tensors), None if staged else _flat_groups(tensors))
        return flats[1]

    async def _buffers_flat(self, clock: int) -> None:
        """The step's buffers, host tensors, as :func:`broadcast.buffers` sends them (one array per
        dtype, in order) but through one flat buffer per dtype kept from step to step, filled and
        emptied by one torch call each: no pass of Python per buffer (a ResNet-20 has 45)."""
        groups = self._flats[1]
        if self.rank == 0:
            for members, views, _ in groups:
                torch._foreach_copy_(views, members)
        await broadcast.broadcast(
            self.rank, self.peers, [flat for _, _, flat in groups], Kind.DATA, clock, self.timeout, what="buffers"
        )
        if self.rank != 0:
            with torch.no_grad():
                for members, views, _ in groups:
                    torch._foreach_copy_(members, views)

    async def _host(self, slot, tensor: torch.Tensor):
        if not self.staging.staged(tensor):
            return self.staging.host(slot, tensor)
        return await asyncio.get_running_loop().run_in_executor(self.reduce, self.staging.host, slot, tensor)


def _flat_groups(tensors: list) -> list:
    """``[(tensors, views, flat array)]`` per dtype in order of first use: each group's tensors
    (booleans as bytes) and views of one buffer shaped like them, back to back."""
    by_dtype: dict = {}
    for t in tensors:
        t = t.detach().view(torch.uint8) if t.dtype is torch.bool else t.detach()
        by_dtype.setdefault(t.dtype, []).append(t)
    groups = []
    for dtype, members in by_dtype.items():
        flat = torch.empty(sum(t.numel() for t in members), dtype=dtype)
        groups.append((members, carved(flat, members), flat.numpy()))
    return groups
