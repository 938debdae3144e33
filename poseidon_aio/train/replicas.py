"""Rank 0's tensors on every rank, through host buffers: the parameters and buffers at start, the
buffers (BatchNorm statistics) after every step, so replicas stay identical."""

from __future__ import annotations

import asyncio
from typing import Optional

import torch

from ..sync import broadcast
from .staging import Staging


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

    async def broadcast(self, tensors: list, clock: Optional[int] = None) -> None:
        """Rank 0's ``tensors`` everywhere: the parameters and buffers at start (``clock`` None),
        the buffers at the end of step ``clock``."""
        if self.world == 1:
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

    async def _host(self, slot, tensor: torch.Tensor):
        if not self.staging.staged(tensor):
            return self.staging.host(slot, tensor)
        return await asyncio.get_running_loop().run_in_executor(self.reduce, self.staging.host, slot, tensor)
