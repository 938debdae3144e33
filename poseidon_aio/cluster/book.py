"""The information book: which key-value pair holds which slice of which parameter, on which shard.

Computed deterministically on every rank from the manifest and the cluster shape, so no rank has
to ask another; its digest is compared at start-up.

Partitioning (ATC'17 §4): each parameter is flattened and cut into ``ceil(nbytes / chunk)``
key-value pairs of nearly equal size (at most ``chunk_bytes``, 2 MiB by default). Placement:
longest-processing-time greedy — pairs in decreasing size, each to the shard with the fewest bytes
so far (ties: lower shard id) — and where a pair would take that shard past 1.05 x the mean, the
pair is split so the shard gets exactly its share and the rest goes on: every model's shards are
within 5 % of each other in bytes, small models (all tensors far under a chunk) included, for at
most P2 - 1 more pairs. Stock TensorFlow's one-tensor-per-shard round robin
(``placement="tensor"``) is kept for comparison: it puts a 400 MB FC weight on one shard.

Messages: what travels in one frame. A message carries keys of one shard, packed in key order up
to ``chunk_bytes``; by default every parameter is its own group, so a message is one key. Groups
of several parameters (the MG-WFBP merge plan) pack their small keys into fewer messages: those
keys are placed on one shard together (up to a chunk per shard), so merging really saves frames.
"""

from __future__ import annotations

import hashlib
import heapq
import json
from dataclasses import dataclass
from typing import Iterable, Mapping, Optional, Sequence

from ..errors import ConfigError
from .manifest import Manifest

DEFAULT_CHUNK_BYTES = 2 << 20
# The most a shard may hold over the mean before a key-value pair is split to even it out.
BALANCE = 1.05


@dataclass(frozen=True)
class KVPair:
    """One key-value pair: elements ``[offset, offset + numel)`` of parameter ``param``."""

    key: int
    param: int
    offset: int
    numel: int
    nbytes: int
    shard: int


@dataclass(frozen=True)
class Message:
    """Keys that travel together in one frame to (and back from) ``shard``."""

    id: int
    shard: int
    keys: tuple
    nbytes: int
    dtype: str
    group: int


# Answers of messages_of_params kept: a trainer asks about each layer or bucket (far fewer).
_LOOKUPS_KEPT = 4096


class InformationBook:
    """Partition and placement of a model over the parameter-server shards.

    Args:
        manifest: the model's :class:`Manifest`.
        workers: P1, the number of workers.
        shards: P2, the number of KV shards.
        chunk_bytes: largest key-value pair, in bytes.
        groups: parameters that sync together (lists of names, consecutive in the manifest);
            parameters in no group form a group of their own.
        placement: ``"balanced"`` (LPT over ~2 MiB pairs, the default) or ``"tensor"`` (one
            whole tensor per shard, round robin: stock TensorFlow's placement, for comparison).
        factored: fully-connected layers synced by the Project-Adam scheme, ``[weight, bias]``
            names each: their keys all live on one shard, which rebuilds the matrix from the
            workers' sufficient factors (a FACTORS frame keyed by the layer's first message).

    >>> from poseidon_aio.cluster.manifest import ParamSpec
    >>> book = InformationBook(Manifest([ParamSpec("w", (1024, 1024))]), workers=2, shards=2)
    >>> [(p.key, p.numel, p.shard) for p in book.keys_of("w")]
    [(0, 524288, 0), (1, 524288, 1)]
    """

    def __init__(
        self,
        manifest: Manifest,
        *,
        workers: int,
        shards: int,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        groups: Optional[Sequence[Sequence[str]]] = None,
        placement: str = "balanced",
        factored: Optional[Sequence[Sequence[str]]] = None,
    ) -> None:
        if workers < 1 or shards < 1:
            raise ConfigError(f"need at least one worker and one shard, got {workers} and {shards}")
        if placement not in ("balanced", "tensor"):
            raise ConfigError(f"placement must be 'balanced' or 'tensor', got {placement!r}")
        if chunk_bytes < 64:
            raise ConfigError(f"chunk_bytes must be at least 64, got {chunk_bytes}")
        self.manifest = manifest
        self.workers = workers
        self.shards = shards
        self.chunk_bytes = chunk_bytes
        self.placement = placement
        self.factored = tuple(tuple(self.manifest.index(n) for n in layer) for layer in (factored or ()))
        for layer in self.factored:
            w = self.manifest[layer[0]]
            if len(w.shape) != 2 or w.dtype != "float32" or (len(layer) == 2 and self.manifest[layer[1]].shape != (w.shape[0],)):
                raise ConfigError(f"factored layer {[self.manifest[i].name for i in layer]} must be a float32 MxN weight and an M bias")
        self.groups = self._groups(list(groups or ()) + [[self.manifest[i].name for i in layer] for layer in self.factored])
        self._group_index = {p: g for g, params in enumerate(self.groups) if len(params) > 1 for p in params}
        self._whole = {p for layer in self.factored for p in layer}
        self.pairs = self._partition()
        self._by_param: dict = {}
        for pair in self.pairs:
            self._by_param.setdefault(pair.param, []).append(pair)
        self.messages = self._messages()
        self._message_of_key = {k: m for m in self.messages for k in m.keys}
        # Looked up for every layer of every step: the book never changes once built, so each
        # answer is computed once (bounded by the layers and buckets the trainer asks about).
        self._messages_of: dict = {}
        self._slice_plan = {m.id: tuple((self.pairs[k].param, self.pairs[k].offset, self.pairs[k].offset + self.pairs[k].numel) for k in m.keys) for m in self.messages}
        self._digest = hashlib.sha256(self._canonical().encode()).hexdigest()

    # -- construction ---------------------------------------------------------------------------

    def _partition(self) -> tuple:
        cuts = []  # (param, offset, numel, nbytes)
        for index, spec in enumerate(self.manifest):
            if self.placement == "tensor" or spec.nbytes <= self.chunk_bytes:
                cuts.append((index, 0, spec.numel, spec.nbytes))
                continue
            pieces = -(-spec.nbytes // self.chunk_bytes)
            base, extra = divmod(spec.numel, pieces)
            offset = 0
            for i in range(pieces):
                numel = base + (1 if i < extra else 0)
                cuts.append((index, offset, numel, numel * spec.itemsize))
                offset += numel
        if self.placement == "tensor":
            shard_of = [i % self.shards for i in range(len(cuts))]
        else:
            # Placement units: the small keys of a merge group, packed in key order up to a chunk,
            # go to one shard together, so a merged group of small layers is one message, not one
            # per shard; every other key is a unit of its own. LPT over the units.
            units, current, size, owner = [], [], 0, None
            for key, (param, _, _, nbytes) in enumerate(cuts):
                group = self._group_index.get(param, ("solo", param))
                # A factored layer is one unit, whatever its size: one shard rebuilds it.
                small = nbytes < self.chunk_bytes or param in self._whole
                if param in self._whole and current and group == owner:
                    current.append(key)
                    size += nbytes
                    continue
                if current and (not small or group != owner or size + nbytes > self.chunk_bytes):
                    units.append((current, size))
                    current, size = [], 0
                if not small:
                    units.append(([key], nbytes))
                    continue
                current.append(key)
                size += nbytes
                owner = group
            if current:
                units.append((current, size))
            cuts, shard_of = self._place(cuts, units)
        return tuple(KVPair(k, p, o, n, b, shard_of[k]) for k, (p, o, n, b) in enumerate(cuts))

    def _place(self, cuts: list, units: list) -> tuple:
        """LPT over the units, splitting the one that would push the least-loaded shard past
        ``BALANCE`` x the mean: it fills that shard and the rest goes back in the queue. Every
        split fills a shard, so there are at most P2 - 1 of them: a model whose tensors are all
        far smaller than a chunk (a 67 k-parameter CNN over 4 shards) gets each shard its share
        for at most 3 more key-value pairs. Factored layers and merge groups are never split.
        Returns the cuts (split ones in two, in (param, offset) order) and their shards."""
        total = sum(nbytes for _, nbytes in units)
        cap = BALANCE * total / self.shards
        pieces = [list(cuts[k]) for k in range(len(cuts))]  # mutable: a split shortens one
        shard_of: dict = {}
        load = [(0, s) for s in range(self.shards)]
        queue = [(-nbytes, keys[0], keys) for keys, nbytes in units]
        heapq.heapify(queue)
        while queue:
            size, _, keys = heapq.heappop(queue)
            size = -size
            used, shard = heapq.heappop(load)
            room = cap - used
            # Never split: a factored layer (one shard rebuilds it) or a merge group (MG-WFBP chose
            # one message over the bytes it saves; splitting would add the start-up it saved).
            whole = used + size <= cap or any(pieces[k][0] in self._whole or pieces[k][0] in self._group_index for k in keys)
            if not whole:
                taken, rest = self._take(pieces, keys, room)
                if taken:
                    for k in taken:
                        shard_of[k] = shard
                    placed = sum(pieces[k][3] for k in taken)
                    heapq.heappush(load, (used + placed, shard))
                    remaining = sum(pieces[k][3] for k in rest)
                    heapq.heappush(queue, (-remaining, min(rest), rest))
                    continue
            for k in keys:
                shard_of[k] = shard
            heapq.heappush(load, (used + size, shard))
        order = sorted(range(len(pieces)), key=lambda k: (pieces[k][0], pieces[k][1]))
        return [tuple(pieces[k]) for k in order], [shard_of[k] for k in order]

    def _take(self, pieces: list, keys: list, room: float) -> tuple:
        """Take at most ``room`` bytes off the front of unit ``keys``, whole pieces first, then
        part of the next (a new piece). Returns ``(taken keys, remaining keys)``."""
        taken, left = [], room
        for i, k in enumerate(keys):
            param, offset, numel, nbytes = pieces[k]
            if nbytes <= left:
                taken.append(k)
                left -= nbytes
                continue
            itemsize = self.manifest[param].itemsize
            head = int(left // itemsize)
            if head:
                pieces[k] = [param, offset, head, head * itemsize]
                pieces.append([param, offset + head, numel - head, (numel - head) * itemsize])
                taken.append(k)
                return taken, [len(pieces) - 1, *keys[i + 1 :]]
            return taken, list(keys[i:])
        return taken, []

    def _groups(self, groups: Optional[Sequence[Sequence[str]]]) -> tuple:
        assigned: dict = {}
        for g, names in enumerate(groups or ()):
            indices = sorted(self.manifest.index(n) for n in names)
            if indices != list(range(indices[0], indices[0] + len(indices))):
                raise ConfigError(f"merge group {list(names)} is not consecutive in the manifest")
            for i in indices:
                if i in assigned:
                    raise ConfigError(f"parameter {self.manifest[i].name!r} is in two merge groups")
                assigned[i] = g
        out, current, last = [], [], None
        for i in range(len(self.manifest)):
            g = assigned.get(i, ("solo", i))
            if current and g != last:
                out.append(tuple(current))
                current = []
            current.append(i)
            last = g
        if current:
            out.append(tuple(current))
        return tuple(out)

    def _messages(self) -> tuple:
        messages = []
        for g, params in enumerate(self.groups):
            per_shard: dict = {}
            for p in params:
                for pair in self._pairs_of(p):
                    per_shard.setdefault(pair.shard, []).append(pair)
            for shard in sorted(per_shard):
                batch, size, dtype = [], 0, None
                for pair in per_shard[shard]:
                    pdtype = self.manifest[pair.param].dtype
                    if batch and (size + pair.nbytes > self.chunk_bytes or pdtype != dtype):
                        messages.append((shard, tuple(batch), size, dtype, g))
                        batch, size = [], 0
                    batch.append(pair.key)
                    size += pair.nbytes
                    dtype = pdtype
                if batch:
                    messages.append((shard, tuple(batch), size, dtype, g))
        return tuple(Message(i, s, k, b, d, g) for i, (s, k, b, d, g) in enumerate(messages))

    def _pairs_of(self, param: int) -> Iterable[KVPair]:
        return self._by_param.get(param, ())

    def _canonical(self) -> str:
        return json.dumps(
            {
                "manifest": self.manifest.to_json(),
                "workers": self.workers,
                "shards": self.shards,
                "chunk_bytes": self.chunk_bytes,
                "placement": self.placement,
                "pairs": [[p.key, p.param, p.offset, p.numel, p.shard] for p in self.pairs],
                "messages": [[m.id, m.shard, list(m.keys)] for m in self.messages],
            },
            separators=(",", ":"),
        )

    # -- queries --------------------------------------------------------------------------------

    def digest(self) -> str:
        """SHA-256 of everything that defines the book; equal on every rank or start-up fails."""
        return self._digest

    def shard_of(self, key: int) -> int:
        return self.pairs[key].shard

    def keys_of(self, name: str) -> tuple:
        """The key-value pairs of parameter ``name``, in offset order."""
        return tuple(self._by_param.get(self.manifest.index(name), ()))

    def message_of(self, key: int) -> Message:
        return self._message_of_key[key]

    def messages_of_shard(self, shard: int) -> tuple:
        return tuple(m for m in self.messages if m.shard == shard)

    def messages_of_params(self, indices: Iterable[int]) -> tuple:
        """Messages that carry any key of the given parameters (a layer or a bucket)."""
        indices = tuple(indices)
        found = self._messages_of.get(indices)
        if found is None:
            wanted = set(indices)
            found = tuple(m for m in self.messages if any(self.pairs[k].param in wanted for k in m.keys))
            if len(self._messages_of) < _LOOKUPS_KEPT:
                self._messages_of[indices] = found
        return found

    def slices(self, message: Message, flat: Mapping) -> list:
        """Views of ``message``'s key-value pairs in ``flat`` (manifest index -> flattened array)."""
        return [flat[param][start:stop] for param, start, stop in self._slice_plan[message.id]]

    def factored_layer(self, message_id: int) -> Optional[tuple]:
        """``(param indices, messages)`` of the factored layer whose first message is ``message_id``."""
        for layer in self.factored:
            messages = self.messages_of_params(layer)
            if messages and messages[0].id == message_id:
                return layer, messages
        return None

    def shard_bytes(self) -> list:
        load = [0] * self.shards
        for pair in self.pairs:
            load[pair.shard] += pair.nbytes
        return load

    def max_over_mean(self) -> float:
        load = self.shard_bytes()
        mean = sum(load) / len(load)
        return max(load) / mean if mean else 1.0
