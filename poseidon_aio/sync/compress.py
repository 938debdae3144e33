"""Gradient compression: the error-feedback state, the pure arithmetic, and what it costs here.

Three lossy schemes sit beside the exact ones (PS, SFB, all-reduce) and the planner weighs them
per layer (``plan/lossy.py``, which holds their settings, ``CompressionConfig``):

* ``fp16``: an all-reduce whose payloads are scaled float16 (``wire/half.py``), summed in float32
  in rank order. No state.
* ``powersgd``: rank-r PowerSGD (Vogels et al., NeurIPS 2019, Algorithm 1) on every matrix
  parameter, a convolution's kernel read as out_channels x (in_channels kh kw): ``P = M Q``,
  all-reduced and orthonormalized, then ``Q = M^T P_hat``, all-reduced; the result is
  ``P_hat Q_mean^T``. ``M`` is the gradient plus the error left over from the last step (error
  feedback) and ``Q`` starts from the last step's (warm start). 1-D parameters ride exact in
  ``P``'s all-reduce.
* ``topk``: each rank sends the ``k`` largest magnitudes of gradient + error, as (index, value)
  pairs, to every peer (``wire/sparse.py``); every rank adds all ranks' pairs in rank order. The
  error keeps what was not sent. 1-D parameters travel dense and exact.

Determinism: every sum is taken in rank order by the same NumPy kernel, so each replica holds
the same bits (:func:`rank_order_mean`); PowerSGD's orthonormalization and final GEMM run on
every rank on bitwise-equal inputs, like SFB's reconstruction (same machine type, same BLAS).

This module is pure: arrays in, arrays out, no I/O (:func:`measure_compute` only times it). The
syncers (``sync/half.py``, ``sync/powersgd.py``, ``sync/topk.py``) put the mesh's collectives
between its steps, and the property tests run the same steps with :func:`rank_order_mean`
standing in for the mesh.
"""

from __future__ import annotations

import math
import time
import zlib
from typing import Mapping, Optional, Sequence

import numpy as np

from ..errors import CheckpointError, ConfigError
from ..plan.cost import LOSSY_SCHEMES, Scheme
from ..plan.lossy import CompressionConfig, ComputeCosts, matrix_of, topk_count
from ..wire import half


# -- the shared arithmetic --------------------------------------------------------------------


def rank_order_mean(parts: Sequence[np.ndarray]) -> np.ndarray:
    """The mean of every rank's array, summed in rank order (a new float32 array).

    The mesh's reductions compute exactly this, element by element, so a test that stands this
    in for the mesh gets the syncers' bits.

    >>> rank_order_mean([np.float32([1, 2]), np.float32([3, 4])]).tolist()
    [2.0, 3.0]
    """
    total = np.array(parts[0], dtype=np.float32, copy=True)
    for x in parts[1:]:
        np.add(total, x, out=total)
    np.divide(total, np.float32(len(parts)), out=total)
    return total


def orthonormalize(p: np.ndarray) -> np.ndarray:
    """Orthonormal columns spanning ``p``'s (m x r): modified Gram-Schmidt, twice.

    A second pass restores orthogonality that one pass loses in float32 when columns are close
    to dependent ("twice is enough", Giraud et al. 2005). A column that is (numerically) in the
    span of the ones before it — its norm after projection at most 1e-5 of its norm before, a
    hundred float32 ulps — becomes zero: the result is then still a projection basis, of fewer
    directions, never a column of amplified rounding noise.

    >>> q = orthonormalize(np.float32([[3, 1], [4, 1]]))
    >>> bool(np.allclose(q.T @ q, np.eye(2), atol=1e-6))
    True
    """
    q = np.array(p, dtype=np.float32).T.copy()  # r x m: each column a contiguous row
    for _ in range(2):
        for j in range(q.shape[0]):
            col = q[j]
            before = float(np.sqrt(np.dot(col, col)))
            for i in range(j):
                col -= np.dot(q[i], col) * q[i]
            norm = float(np.sqrt(np.dot(col, col)))
            if norm > 0.0 and norm > 1e-5 * before:
                col /= np.float32(norm)
            elif math.isfinite(norm):
                col[:] = 0.0
            # (a non-finite column — a diverged step — stays as it is and reaches the result)
    return np.ascontiguousarray(q.T)


def initial_q(label: str, index: int, n: int, rank: int) -> np.ndarray:
    """PowerSGD's first Q for matrix ``index`` of layer ``label`` (n x r): standard normal from a
    seed every rank derives alike from the name, so every replica starts from the same Q.

    >>> bool((initial_q("fc1", 0, 5, 2) == initial_q("fc1", 0, 5, 2)).all())
    True
    """
    seed = zlib.crc32(f"{label}/{index}".encode())
    return np.random.default_rng(seed).standard_normal((n, rank), dtype=np.float32)


def topk_select(x: np.ndarray, k: int) -> tuple:
    """``(indices uint32 ascending, values float32)`` of the ``k`` largest ``|x|`` (1-D).

    NaN counts as the largest (a diverged step's values travel, as an exact scheme would carry
    them). Among equal magnitudes at the boundary the choice is NumPy's introselect's: the same
    for the same input, so a run repeats bit for bit.

    >>> idx, values = topk_select(np.float32([0.1, -3.0, 2.0, 0.5]), 2)
    >>> idx.tolist(), values.tolist()
    ([1, 2], [-3.0, 2.0])
    """
    if k >= x.size:
        idx = np.arange(x.size, dtype=np.uint32)
        return idx, x.astype(np.float32, copy=True)
    magnitude = np.abs(x)
    magnitude[np.isnan(magnitude)] = np.inf
    idx = np.argpartition(magnitude, x.size - k)[x.size - k :]
    idx.sort()
    idx = idx.astype(np.uint32)
    return idx, x[idx]


# -- error feedback ---------------------------------------------------------------------------


class Feedback:
    """Per-layer state of the lossy schemes on this worker: ``{layer label: {name: array}}``.

    It outlives the syncers (the trainer rebuilds those when MG-WFBP replans) and is part of
    ``Trainer.save``/``restore``, so a resumed run continues with the same errors and the same
    warm-started Q and stays bitwise equal to an uninterrupted one.

    >>> fb = Feedback(); fb.entry("fc1")["error"] = np.zeros(3, np.float32)
    >>> sorted(fb.state())
    ['fc1/error']
    """

    def __init__(self) -> None:
        self._layers: dict = {}

    def entry(self, label: str) -> dict:
        return self._layers.setdefault(label, {})

    def state(self) -> dict:
        """Copies of every array, ``{"<layer>/<name>": array}`` (layer names hold no ``/``)."""
        return {
            f"{label}/{name}": np.array(a, copy=True)
            for label, arrays in sorted(self._layers.items())
            for name, a in sorted(arrays.items())
        }

    def load(self, state: Mapping[str, np.ndarray]) -> None:
        """Replace the state with ``state`` (as :meth:`state` gave it)."""
        layers: dict = {}
        for key, array in state.items():
            label, sep, name = key.rpartition("/")
            if not sep:
                raise CheckpointError(f"error-feedback state key {key!r} is not '<layer>/<name>'")
            layers.setdefault(label, {})[name] = np.array(array, dtype=np.float32, copy=True)
        self._layers = layers

    def __len__(self) -> int:
        return len(self._layers)


def _stored(entry: dict, name: str, shape: tuple, label: str, make) -> np.ndarray:
    a = entry.get(name)
    if a is None:
        a = entry[name] = make()
    elif a.shape != shape:
        raise CheckpointError(
            f"layer {label}: the error-feedback state {name} has shape {a.shape}, this model needs {shape}: "
            "the checkpoint is of another model or setting"
        )
    return a


class PowerSGDStep:
    """One PowerSGD step of one layer, or of an MG-WFBP group of layers, on one worker, in three
    pure stages around two all-reduces.

    Args:
        label: the layer's name, or the group's (errors name it).
        grads: the gradient arrays, in parameter order (a group's: each layer's in model order).
        rank: r.
        feedback: the worker's :class:`Feedback`; the state is committed by :meth:`finish` only.
        members: ``(layer name, number of arrays)`` of each layer in ``grads`` (default: one layer,
            ``label``). The state is kept, and the first Q seeded, per layer and matrix, so a
            layer's factors, errors and results are the same bits merged or alone: merging only
            concatenates the all-reduced vectors, whose every element is summed in rank order
            either way.

    >>> # p = step.begin(); q = step.middle(mean(p)); outs = step.finish(mean(q))
    """

    def __init__(
        self,
        label: str,
        grads: Sequence[np.ndarray],
        rank: int,
        feedback: Feedback,
        members: Optional[Sequence[tuple]] = None,
    ) -> None:
        self.label = label
        self.shapes = [g.shape for g in grads]
        self.rank = rank
        self._grads = grads
        members = members or ((label, len(grads)),)
        if sum(count for _, count in members) != len(grads):
            raise ConfigError(
                f"bucket {label}: its members name {sum(c for _, c in members)} arrays, it holds {len(grads)}"
            )
        # each matrix: (its index in grads, its layer, that layer's state, its index in the layer)
        self._mats: list = []
        first = 0
        for owner, count in members:
            mats = [i for i in range(first, first + count) if grads[i].ndim >= 2]
            if not mats:
                raise ConfigError(
                    f"layer {owner} has no matrix parameter: "
                    "PowerSGD compresses matrices (Linear, convolution, embedding weights)"
                )
            entry = feedback.entry(owner)
            self._mats += [(i, owner, entry, j) for j, i in enumerate(mats)]
            first += count
        self._vecs = [i for i, g in enumerate(grads) if g.ndim < 2]

    def begin(self) -> np.ndarray:
        """``M = G + E``; the flat ``[P_1 .. P_j, biases]`` to all-reduce, ``P = M Q``."""
        self._m, self._q = [], []
        out = []
        for i, owner, entry, j in self._mats:
            m, n = matrix_of(self.shapes[i])
            r = min(self.rank, m, n)
            error = _stored(entry, f"error.{j}", (m, n), owner, lambda: np.zeros((m, n), np.float32))
            q = _stored(entry, f"q.{j}", (n, r), owner, lambda: initial_q(owner, j, n, r))
            mat = self._grads[i].reshape(m, n) + error
            self._m.append(mat)
            self._q.append(q)
            out.append((mat @ q).reshape(-1))
        out += [self._grads[i].reshape(-1).astype(np.float32) for i in self._vecs]
        return np.concatenate(out) if len(out) > 1 else out[0]

    def middle(self, p_mean: np.ndarray) -> np.ndarray:
        """From the all-reduced ``P``: ``P_hat`` (orthonormal), the 1-D parameters' means, and the
        flat ``[Q_1 .. Q_j]`` to all-reduce, ``Q = M^T P_hat``."""
        self._p_hat, self._q_local = [], []
        offset = 0
        out = []
        for mat, q in zip(self._m, self._q):
            size = mat.shape[0] * q.shape[1]
            p_hat = orthonormalize(p_mean[offset : offset + size].reshape(mat.shape[0], q.shape[1]))
            offset += size
            q_local = mat.T @ p_hat
            self._p_hat.append(p_hat)
            self._q_local.append(q_local)
            out.append(q_local.reshape(-1))
        self._vec_means = p_mean[offset:]
        return np.concatenate(out) if len(out) > 1 else out[0]

    def finish(self, q_mean: np.ndarray) -> list:
        """The layer's synchronized gradient (one array per parameter, its shape); commits the
        new errors ``E = M - P_hat Q_local^T`` and the warm start ``Q = Q_mean``."""
        outs: list = [None] * len(self.shapes)
        offset = 0
        for (i, _, entry, j), mat, p_hat, q_local in zip(self._mats, self._m, self._p_hat, self._q_local):
            size = q_local.size
            q_bar = np.array(q_mean[offset : offset + size].reshape(q_local.shape), dtype=np.float32, copy=True)
            offset += size
            outs[i] = (p_hat @ q_bar.T).reshape(self.shapes[i])
            entry[f"error.{j}"] = mat - p_hat @ q_local.T
            entry[f"q.{j}"] = q_bar
        offset = 0
        for i in self._vecs:
            n = self._grads[i].size
            outs[i] = np.array(self._vec_means[offset : offset + n], dtype=np.float32).reshape(self.shapes[i])
            offset += n
        return outs


class TopKStep:
    """One top-k step of one layer on one worker, in two pure stages around an all-gather.

    Args:
        label: the layer's name (keys the state).
        grads: the layer's gradient arrays, in parameter order.
        ratio: top-k's density.
        feedback: the worker's :class:`Feedback`; the state is committed by :meth:`finish` only.

    >>> # mine = step.begin(); outs = step.finish([every rank's (dense, indices, values)])
    """

    def __init__(self, label: str, grads: Sequence[np.ndarray], ratio: float, feedback: Feedback) -> None:
        self.label = label
        self.shapes = [g.shape for g in grads]
        self._entry = feedback.entry(label)
        self._grads = grads
        self._mats = [i for i, g in enumerate(grads) if g.ndim >= 2]
        self._vecs = [i for i, g in enumerate(grads) if g.ndim < 2]
        self.size = sum(grads[i].size for i in self._mats)
        self.dense = sum(grads[i].size for i in self._vecs)
        if not self.size:
            raise ConfigError(
                f"layer {label} has no matrix parameter: "
                "top-k sparsifies matrices (Linear, convolution, embedding weights)"
            )
        self.k = topk_count(self.size, ratio)

    def begin(self) -> tuple:
        """``(dense, indices, values)``: this rank's part, from ``M = G + E``."""
        error = _stored(self._entry, "error", (self.size,), self.label, lambda: np.zeros(self.size, np.float32))
        flat = [self._grads[i].reshape(-1) for i in self._mats]
        self._m = (np.concatenate(flat) if len(flat) > 1 else flat[0]) + error
        self._idx, values = topk_select(self._m, self.k)
        vecs = [self._grads[i].reshape(-1) for i in self._vecs]
        dense = np.concatenate(vecs).astype(np.float32) if vecs else np.zeros(0, np.float32)
        return dense, self._idx, values

    def finish(self, parts: Sequence[tuple]) -> list:
        """The layer's synchronized gradient from every rank's ``(dense, indices, values)`` in
        rank order; commits the new error (``M`` where nothing was sent, 0 where it was)."""
        world = len(parts)
        total = np.zeros(self.size, np.float32)
        for _, idx, values in parts:  # rank order: the same float32 additions on every replica
            total[idx] += values  # indices are distinct within a part (checked off the wire)
        np.divide(total, np.float32(world), out=total)
        dense = rank_order_mean([p[0] for p in parts]) if self.dense else None
        self._m[self._idx] = 0.0
        self._entry["error"] = self._m
        outs: list = [None] * len(self.shapes)
        offset = 0
        for i in self._mats:
            n = self._grads[i].size
            outs[i] = total[offset : offset + n].reshape(self.shapes[i])
            offset += n
        offset = 0
        for i in self._vecs:
            n = self._grads[i].size
            outs[i] = dense[offset : offset + n].reshape(self.shapes[i])
            offset += n
        return outs


# -- the start-up measurement ----------------------------------------------------------------

# Elements of the start-up measurement: a 64 x 64 and a 256 x 256 matrix. Large enough that the
# per-element slope is not lost in call overhead, small enough that all three schemes at both
# sizes, best of 3, take tens of milliseconds.
CALIBRATION_ELEMENTS = (4096, 65536)


def measure_compute(config: CompressionConfig, sizes=CALIBRATION_ELEMENTS, repeats: int = 3) -> ComputeCosts:
    """Time each lossy scheme's arithmetic on this machine at ``sizes`` elements (square
    matrices), best of ``repeats``, and fit ``a + b x elements`` through the two smallest.

    What is timed is the code the syncers run for one layer: fp16's encode and decode twice (its
    contribution and the mean), PowerSGD's three stages with a rank-order mean standing in for
    each all-reduce, top-k's selection and its rank-order sum of two ranks' parts.

    Returns:
        :class:`~poseidon_aio.plan.lossy.ComputeCosts` with a fit per lossy scheme (times vary run to run: the trainer
        uses rank 0's on every rank).

    >>> sorted(measure_compute(CompressionConfig(), sizes=(64, 256), repeats=1).fits)
    ['fp16', 'powersgd', 'topk']
    """
    rng = np.random.default_rng(0)
    samples: dict = {s.value: [] for s in LOSSY_SCHEMES}
    for size in sorted(sizes)[:2]:
        side = max(1, int(round(size**0.5)))
        grads = [rng.standard_normal((side, side), dtype=np.float32), rng.standard_normal(side, dtype=np.float32)]
        flat = np.concatenate([g.reshape(-1) for g in grads])
        elements = side * side

        def fp16() -> None:
            for _ in range(2):
                half.expand(half.encode(flat))

        def powersgd() -> None:
            step = PowerSGDStep("calibration", grads, config.rank, Feedback())
            q = step.middle(rank_order_mean([step.begin()]))
            step.finish(rank_order_mean([q]))

        def topk() -> None:
            step = TopKStep("calibration", grads, config.ratio, Feedback())
            mine = step.begin()
            step.finish([mine, mine])

        for scheme, fn in ((Scheme.FP16, fp16), (Scheme.POWERSGD, powersgd), (Scheme.TOPK, topk)):
            best = float("inf")
            for _ in range(repeats):
                started = time.perf_counter()
                fn()
                best = min(best, time.perf_counter() - started)
            samples[scheme.value].append((elements, best))
    fits = {}
    for scheme, points in samples.items():
        (x1, t1), (x2, t2) = points[0], points[-1]
        b = max(0.0, (t2 - t1) / (x2 - x1)) if x2 > x1 else 0.0
        fits[scheme] = (max(0.0, t1 - b * x1), b)
    return ComputeCosts(fits)
