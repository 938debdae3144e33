"""Gradient compression: its settings, the error-feedback state, and the pure arithmetic.

Three lossy schemes sit beside the exact ones (PS, SFB, all-reduce) and the planner weighs them
per layer (``sync/lossyplan.py``):

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

This module is pure: arrays in, arrays out, no I/O. The syncers (``sync/half.py``,
``sync/powersgd.py``, ``sync/topk.py``) put the mesh's collectives between its steps, and the
property tests run the same steps with :func:`rank_order_mean` standing in for the mesh.
"""

from __future__ import annotations

import enum
import json
import math
import zlib
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import numpy as np

from ..errors import CheckpointError, ConfigError
from .cost import LOSSY_SCHEMES, Link


class Compression(str, enum.Enum):
    """What ``Trainer(compression=...)`` asks for."""

    AUTO = "auto"  # the planner weighs every lossy scheme beside the exact ones, per layer
    FP16 = "fp16"
    POWERSGD = "powersgd"
    TOPK = "topk"


# 16384 elements (64 KiB of float32). Below it a layer stays exact, for accuracy, not for time:
# such layers are the ones that move a model most per element (the first convolution, small
# heads; biases and norms have no matrix at all), and top-k at 1 % would keep fewer than 164 of
# their values a step. The time given up is not nothing on a slow link: a 64 KiB layer's exact
# ring all-reduce moves 2(P - 1)/P x 64 KiB each way, 7.9 ms at 100 Mbit and 0.8 ms at 1 Gbit
# with 4 workers, of which a lossy scheme could save most; ``min_elements`` lowers the bar. A
# bias inside a larger layer stays exact too (it rides uncompressed in PowerSGD's and top-k's
# messages).
MIN_ELEMENTS = 16384


@dataclass
class CompressionConfig:
    """Lossy gradient compression, chosen per layer (opt-in; ``None`` keeps every layer exact).

    Args:
        method: ``"auto"`` (the planner weighs fp16, PowerSGD and top-k beside the exact schemes
            by predicted time, per layer), or one method, used on every layer it suits (at least
            ``min_elements`` elements of matrices, float32; PowerSGD only where its rank-r factors
            are fewer floats than the matrix) and the exact schemes elsewhere.
        rank: PowerSGD's rank r (Vogels et al. reach full accuracy at r = 2-4 on CIFAR-10
            ResNet-18 and LSTMs; 4 leaves a margin).
        ratio: top-k's density, k = ceil(ratio x elements) (1 %: Aji & Heafield 2017 and Stich
            et al. 2018 train to full accuracy with error feedback at 1 % and below).
        min_elements: matrix elements under which a layer stays exact (see ``MIN_ELEMENTS``).
        link: plan as if each worker's link were this (``Link.of_bandwidth(12.5e6, 1e-4)``: 100
            Mbit, 100 us per round) instead of the one measured at start-up: to study or test a
            slow network from a fast one.
        compute: plan with these compression compute costs, ``{"fp16" | "powersgd" | "topk":
            (a seconds, b seconds per element)}``, instead of measuring them at start-up. The
            measurement depends on the machine's load, so an ``"auto"`` plan is repeatable bit
            for bit only with ``link`` and ``compute`` both given (the log prints the measured
            ones to copy).

    Raises:
        ConfigError: an unknown method or a value out of range.

    >>> CompressionConfig("powersgd", rank=2).method
    <Compression.POWERSGD: 'powersgd'>
    """

    method: Compression | str = Compression.AUTO
    rank: int = 4
    ratio: float = 0.01
    min_elements: int = MIN_ELEMENTS
    link: Optional[Link] = None
    compute: Optional[Mapping[str, tuple]] = None

    def __post_init__(self) -> None:
        try:
            self.method = Compression(self.method)
        except ValueError:
            raise ConfigError(f"compression must be one of {[c.value for c in Compression]} or None, got {self.method!r}") from None
        if not (isinstance(self.rank, int) and self.rank >= 1):
            raise ConfigError(f"CompressionConfig.rank (PowerSGD's rank) must be an integer >= 1, got {self.rank!r}")
        if not (0.0 < self.ratio <= 1.0):
            raise ConfigError(f"CompressionConfig.ratio (top-k's density) must be in (0, 1], got {self.ratio!r}")
        if self.min_elements < 1:
            raise ConfigError(f"CompressionConfig.min_elements must be >= 1, got {self.min_elements!r}")
        if self.link is not None and not (self.link.beta > 0 and self.link.alpha >= 0):
            raise ConfigError(f"CompressionConfig.link needs beta > 0 and alpha >= 0, got {self.link}")
        if self.compute is not None:
            known = {s.value for s in LOSSY_SCHEMES}
            if not set(self.compute) <= known or not all(len(ab) == 2 and min(ab) >= 0 for ab in self.compute.values()):
                raise ConfigError(f"CompressionConfig.compute maps {sorted(known)} to (a >= 0, b >= 0) seconds, got {self.compute!r}")
            self.compute = {k: (float(a), float(b)) for k, (a, b) in self.compute.items()}

    @classmethod
    def of(cls, value) -> Optional["CompressionConfig"]:
        """``None``, a method name or a config, as ``Trainer(compression=...)`` takes it."""
        if value is None or isinstance(value, CompressionConfig):
            return value
        if isinstance(value, (str, Compression)):
            return cls(value)
        raise ConfigError(f"compression must be None, a method name or a CompressionConfig, got {type(value).__name__}")

    @property
    def schemes(self) -> tuple:
        """The lossy schemes this setting lets the planner use."""
        from .cost import Scheme

        if self.method is Compression.AUTO:
            return (Scheme.FP16, Scheme.POWERSGD, Scheme.TOPK)
        return (Scheme(self.method.value),)

    def settings(self) -> str:
        """What every rank must agree on, as JSON (its digest is checked at start-up)."""
        link = None if self.link is None else [self.link.alpha, self.link.beta]
        compute = None if self.compute is None else {k: list(v) for k, v in self.compute.items()}
        return json.dumps({"method": self.method.value, "rank": self.rank, "ratio": self.ratio, "min_elements": self.min_elements, "link": link, "compute": compute}, sort_keys=True)


# -- shapes -----------------------------------------------------------------------------------


def matrix_of(shape: Sequence[int]) -> tuple:
    """A parameter of >= 2 dimensions as a matrix: a Linear's (out, in), a convolution's
    (out_channels, in_channels x kh x kw), an embedding's (rows, dim)."""
    return int(shape[0]), int(math.prod(shape[1:]))


def split_shapes(shapes: Sequence[Sequence[int]]) -> tuple:
    """``(matrices [(m, n)], vector elements)``: what a layer's parameters are to the lossy schemes."""
    mats = [matrix_of(s) for s in shapes if len(s) >= 2]
    vec = sum(int(math.prod(s)) for s in shapes if len(s) < 2)
    return mats, vec


def topk_count(size: int, ratio: float) -> int:
    """k for ``size`` matrix elements: at least one, at most all.

    >>> topk_count(65536, 0.01), topk_count(50, 0.01)
    (656, 1)
    """
    return max(1, min(size, math.ceil(ratio * size)))


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
        return {f"{label}/{name}": np.array(a, copy=True) for label, arrays in sorted(self._layers.items()) for name, a in sorted(arrays.items())}

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
        raise CheckpointError(f"layer {label}: the error-feedback state {name} has shape {a.shape}, this model needs {shape}: the checkpoint is of another model or setting")
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

    def __init__(self, label: str, grads: Sequence[np.ndarray], rank: int, feedback: Feedback, members: Optional[Sequence[tuple]] = None) -> None:
        self.label = label
        self.shapes = [g.shape for g in grads]
        self.rank = rank
        self._grads = grads
        members = members or ((label, len(grads)),)
        if sum(count for _, count in members) != len(grads):
            raise ConfigError(f"bucket {label}: its members name {sum(c for _, c in members)} arrays, it holds {len(grads)}")
        # each matrix: (its index in grads, its layer, that layer's state, its index in the layer)
        self._mats: list = []
        first = 0
        for owner, count in members:
            mats = [i for i in range(first, first + count) if grads[i].ndim >= 2]
            if not mats:
                raise ConfigError(f"layer {owner} has no matrix parameter: PowerSGD compresses matrices (Linear, convolution, embedding weights)")
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
            raise ConfigError(f"layer {label} has no matrix parameter: top-k sparsifies matrices (Linear, convolution, embedding weights)")
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
