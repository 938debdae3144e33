"""Where a tensor's bytes meet the wire: its own memory on CPU, a pinned host buffer on a GPU.

The network layers below read and write host memory (NumPy arrays). A CPU tensor is its own host
buffer: ``tensor.numpy()`` shares its memory, nothing is copied. A CUDA tensor gets a page-locked
(pinned) host buffer of its size, kept from step to step (pinning is slow, so it is done once);
device-to-host copies run on a side CUDA stream that first waits for the event recorded when the
gradient was produced, so they overlap the backward of lower layers; host-to-device copies of
the aggregates run on the same stream and are waited for before the optimizer reads them.

``Staging(force=True)`` stages CPU tensors the same way (separate host buffers, explicit copies,
no streams): the CPU tests exercise the GPU path's logic with it.
"""

from __future__ import annotations

import threading
from typing import Optional

import numpy as np
import torch


def on_gpu(tensor: torch.Tensor) -> bool:
    return tensor.is_cuda  # an attribute read; ``tensor.device`` builds an object per call


class Staging:
    """Host buffers per ``slot`` (any hashable naming a tensor's role: ``("grad", i)``, ...).

    Args:
        force: stage CPU tensors too (tests).
    """

    def __init__(self, *, force: bool = False) -> None:
        self.force = force
        self.copies_to_host = 0
        self.copies_to_device = 0
        self._buffers: dict = {}
        self._lock = threading.Lock()
        self._stream = None

    def staged(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` goes through a host buffer (else it is its own)."""
        return self.force or on_gpu(tensor)

    def buffer(self, slot, tensor: torch.Tensor) -> torch.Tensor:
        """The host tensor for ``slot``, shaped like ``tensor`` (made once per shape, pinned for a GPU)."""
        key = (slot, tuple(tensor.shape), tensor.dtype)
        with self._lock:
            buf = self._buffers.get(key)
            if buf is None:
                buf = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=on_gpu(tensor))
                self._buffers[key] = buf
        return buf

    def ready_event(self, tensor: torch.Tensor):
        """Mark the point on the producing stream after which ``tensor`` holds its values (call it
        where the value is produced, e.g. in a backward hook); ``None`` on CPU."""
        if not on_gpu(tensor):
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(tensor.device))
        return event

    def host(self, slot, tensor: torch.Tensor, event=None) -> np.ndarray:
        """``tensor``'s values in host memory, as a NumPy array: the tensor itself on CPU, else
        a copy into ``slot``'s buffer, complete when this returns (run it off the event loop).

        ``event``: recorded where ``tensor`` was produced (:meth:`ready_event`); the copy waits
        for it alone. Without one the copy waits for everything queued so far on the calling
        thread's current stream: a tensor made after the event (a ``cat`` of factors, a cast)
        would otherwise be copied before a kernel has written it."""
        if not self.staged(tensor):  # a gradient needs no detach (a call saved per parameter per step)
            return (tensor.detach() if tensor.requires_grad else tensor).numpy()
        buf = self.buffer(slot, tensor)
        if on_gpu(tensor):
            stream = self._copy_stream(tensor.device)
            with torch.cuda.stream(stream):
                if event is not None:
                    stream.wait_event(event)
                else:  # made by work this thread queued (a cat, a cast): wait for all of it
                    stream.wait_stream(torch.cuda.current_stream(tensor.device))
                buf.copy_(tensor.detach(), non_blocking=True)
            stream.synchronize()
        else:
            buf.copy_(tensor.detach())
        self.copies_to_host += 1
        return buf.numpy()

    def landing(self, slot, tensor: torch.Tensor) -> np.ndarray:
        """Where the wire writes ``tensor``'s new values: the tensor itself on CPU, else ``slot``'s
        host buffer (then :meth:`to_device`)."""
        if not self.staged(tensor):
            return tensor.detach().numpy()
        return self.buffer(slot, tensor).numpy()

    def to_device(self, slot, tensor: torch.Tensor) -> None:
        """Copy ``slot``'s host buffer into ``tensor`` (asynchronously on a GPU: :meth:`wait`)."""
        if not self.staged(tensor):
            return
        buf = self.buffer(slot, tensor)
        if on_gpu(tensor):
            with torch.cuda.stream(self._copy_stream(tensor.device)):
                tensor.copy_(buf, non_blocking=True)
        else:
            tensor.copy_(buf)
        self.copies_to_device += 1

    def wait(self, device: Optional[torch.device] = None) -> None:
        """Make the current stream wait for every host-to-device copy (before the optimizer)."""
        if self._stream is not None:
            torch.cuda.current_stream(device).wait_stream(self._stream)

    def _copy_stream(self, device):
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream
