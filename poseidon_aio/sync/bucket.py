"""A bucket: what one synchronization moves (a layer, or an MG-WFBP group of layers).

The record a :class:`~poseidon_aio.sync.syncer.Syncer` is given, in the spirit of DDP's
``GradBucket``: host buffers in, host (or device) buffers out, nothing of torch.nn.
"""

from __future__ import annotations

from typing import Optional, Sequence


class Bucket:
    """One sync's buffers.

    Attributes:
        label: names the bucket in errors and the trace (a layer name, or ``"last..first"``).
        layers: the layer indices it covers, in model order.
        params: the manifest indices of their parameters, in order.
        grads: the local gradient of each parameter (C-contiguous host arrays), for schemes that
            move gradients.
        outs: where each parameter's synchronized result lands, same order.
        factors: ``(u, v)``, this rank's sufficient factors (K×M and K×N float32), for schemes
            that move factors.
        shape: ``(M, N)`` of the layer's weight (factor schemes).
        priority: lower goes first on the link (layers nearest the input gate the next forward).
        members: ``(layer label, number of parameters)`` of each layer it covers, in model order:
            a scheme that keeps state per layer (PowerSGD's error feedback) keys it by these, so
            the state is the same however MG-WFBP groups the layers.
        flat: ``(grads, outs)``, each one 1-D array over all the parameters back to back, of
            which ``grads`` and ``outs`` are views; ``None`` where they are not one buffer. A
            syncer that moves bytes, not tensors, takes these and skips a pass per parameter.
    """

    __slots__ = ("label", "layers", "params", "grads", "outs", "factors", "shape", "priority", "members", "flat")

    def __init__(
        self,
        label: str,
        layers: Sequence[int],
        params: Sequence[int],
        outs: list,
        *,
        grads: Optional[list] = None,
        factors: Optional[tuple] = None,
        shape: Optional[tuple] = None,
        priority: int = 0,
        members: Optional[Sequence[tuple]] = None,
        flat: Optional[tuple] = None,
    ) -> None:
        self.label = label
        self.layers = tuple(layers)
        self.params = tuple(params)
        self.grads = grads
        self.outs = outs
        self.factors = factors
        self.shape = shape
        self.priority = priority
        self.members = tuple(members) if members is not None else ((label, len(self.params)),)
        self.flat = flat

    def __repr__(self) -> str:
        return f"<Bucket {self.label} layers {list(self.layers)} params {list(self.params)}>"

    @classmethod
    def merged(cls, buckets: Sequence["Bucket"]) -> "Bucket":
        """One bucket of gradient buckets given in model order (an MG-WFBP group)."""
        if len(buckets) == 1:
            return buckets[0]
        label = f"{buckets[-1].label}..{buckets[0].label}"
        return cls(
            label,
            [layer for b in buckets for layer in b.layers],
            [p for b in buckets for p in b.params],
            [o for b in buckets for o in b.outs],
            grads=[g for b in buckets for g in b.grads],
            priority=min(b.priority for b in buckets),
            members=[m for b in buckets for m in b.members],
        )
