"""Server-side SGD: the shard owns the parameters of its messages and applies the update (ATC'17's
KV store does), sending parameters instead of gradients; and the checkpoints of that state."""

from __future__ import annotations

from typing import Mapping, Optional

import numpy as np

from ..errors import CheckpointError, RemoteProtocolError
from .config import ServerSGD


class ServerOptimizer:
    """Parameters and momentum per message of one shard.

    Args:
        sgd: the update rule (``torch.optim.SGD``'s).
        shard: the shard's index, for messages.
        dtypes: message id -> its dtype.
        checkpoint_every: take a snapshot every this many versions (0: never).
    """

    def __init__(self, sgd: ServerSGD, shard: int, dtypes: dict, checkpoint_every: int = 0) -> None:
        self.sgd = sgd
        self.shard = shard
        self._dtypes = dtypes
        self._every = checkpoint_every
        self._params: dict = {}
        self._momentum: dict = {}
        self._snapshots: dict = {}  # version -> arrays taken so far

    def init(self, mid: int, values: np.ndarray) -> None:
        """Start message ``mid`` from ``values`` (rank 0's start-up broadcast)."""
        self._params[mid] = values.copy()
        self._momentum[mid] = np.zeros_like(values)

    def has(self, mid: int) -> bool:
        return mid in self._params

    def values(self, mid: int) -> np.ndarray:
        """A copy of message ``mid``'s parameters (a send keeps reading it)."""
        return self._params[mid].copy()

    def apply(self, mid: int, grad: np.ndarray) -> np.ndarray:
        """``v = momentum v + (g + weight_decay w); w -= lr v``; return a copy of the new ``w``.

        Raises:
            RemoteProtocolError: the message has no parameters: rank 0 never broadcast them.
        """
        w = self._params.get(mid)
        if w is None:
            raise RemoteProtocolError(
                f"shard {self.shard} has no parameters for message {mid}: with server-side SGD, rank 0 must broadcast "
                "the initial parameters (PSClient.broadcast) before the first push"
            )
        sgd, v = self.sgd, self._momentum[mid]
        if sgd.weight_decay:
            grad = grad + w.dtype.type(sgd.weight_decay) * w
        if sgd.momentum:
            np.multiply(v, v.dtype.type(sgd.momentum), out=v)
            np.add(v, grad, out=v)
            step = v
        else:
            step = grad
        np.subtract(w, w.dtype.type(sgd.lr) * step, out=w)
        return w.copy()

    def state(self) -> dict:
        """Copies of every array: ``w<message>`` and ``v<message>``."""
        out = {}
        for mid in self._params:
            out[f"w{mid}"] = self._params[mid].copy()
            out[f"v{mid}"] = self._momentum[mid].copy()
        return out

    def load(self, state: dict, needed: Mapping[int, int]) -> None:
        """Take a checkpoint's arrays; ``needed``: message id -> its elements.

        Raises:
            CheckpointError: a message in ``needed`` has none, or another size (the state was taken
                with another model, merge plan, cluster shape or information book).
        """
        missing = sorted(mid for mid in needed if f"w{mid}" not in state)
        wrong = sorted(
            mid for mid, numel in needed.items() if mid not in missing and np.asarray(state[f"w{mid}"]).size != numel
        )
        if missing or wrong:
            which = f"no parameters for messages {missing[:8]}" if missing else f"other sizes for messages {wrong[:8]}"
            raise CheckpointError(
                f"shard {self.shard}: the saved state has {which}: it was taken with another model, merge plan, "
                "cluster shape or poseidon_aio release"
            )
        for name, array in state.items():
            mid = int(name[1:])
            if mid in self._dtypes:
                (self._params if name[0] == "w" else self._momentum)[mid] = array.astype(self._dtypes[mid], copy=True)

    def snapshot(self, mid: int, version: int, messages: int) -> Optional[dict]:
        """Note message ``mid`` at ``version``; return the whole snapshot once all ``messages`` of
        the shard are in (then write it), else ``None``."""
        if not self._every or version % self._every:
            return None
        snap = self._snapshots.setdefault(version, {})
        snap[f"w{mid}"] = self._params[mid].copy()
        snap[f"v{mid}"] = self._momentum[mid].copy()
        if len(snap) < 2 * messages:
            return None
        return self._snapshots.pop(version)
