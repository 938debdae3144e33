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
to ``chunk_bytes``; by default every parameter is its own group, so a message is one key. A layer
whose parameters together fit in a chunk (``layers``: a weight and its bias, a norm's scale and
shift) is placed as one unit, so it travels as one message (two where balancing the shards splits
it): every message is a frame each way and a sum on the shard, whatever its size. A group
of several parameters (the MG-WFBP merge plan) is cut into one run of keys per shard, of nearly
equal bytes, before anything else is placed: it travels as one message per shard (a reduce-
scatter's shape), so merging saves the frames of its small layers and its bytes still use every
link both ways at once (a group of under two runs of ``spread_bytes`` stays on one shard). Over
fewer than ``GROUP_RUNS`` shards a large group still goes in that many runs, so that each shard's
sums follow the pushes instead of waiting for the whole group; a run past one a shard is a message
more on every rank, so only where each run would hold ``pipeline_bytes`` (:func:`pipeline_bytes_for`
a link: what it carries in ``PIPELINE_RUN_S``).

Hosts (the topology): where each runs L workers, a message's gradient is summed inside every host
and pushed once per host, by the host's local rank ``message id mod L`` (its speaker: the
messages' pushes share the host's link among its workers); the shard waits for the P_h speakers
and replies to them, each pushing the sum of L workers. A factored layer's factors still come
from every worker.
"""

from __future__ import annotations

import hashlib
import heapq
import json
from dataclasses import dataclass
from typing import Iterable, Mapping, Optional, Sequence

from ..errors import ConfigError
from .manifest import Manifest
from .topology import Topology

DEFAULT_CHUNK_BYTES = 2 << 20
# The most a shard may hold over the mean before a key-value pair is split to even it out.
BALANCE = 1.05
# The least bytes of a merge group a shard gets when the group is spread over the shards, where
# no link says more (spread_bytes_for): under a run of this, the event loop's work for one more
# message costs more than the run's bytes take on a 1 Gbit link.
SPREAD_MIN_BYTES = 64 << 10
# A merge group of several workers goes in at least this many runs, as many on every shard (fewer
# only where a run would be under ``spread_bytes``); over more shards, in one run a shard. A shard
# replies to a run once every worker's push of it is in and summed. In one run a shard, the last
# worker to push waits for the sum of its whole run before its reply starts, and so it is the last
# to start the next step too (bench/RESULTS.md, "Merge groups in runs the shards can sum as they
# come; ..."). In runs of a quarter, the sums follow the pushes.
GROUP_RUNS = 4
# Runs past one a shard buy only that overlap, and each costs every rank a message's CPU a step (a
# frame each way, a sum, their futures; dearer where the loop wakes cold): a group goes in them only
# where each run takes this long on the link (250 kB at 1 Gbit, where that CPU is the step) and
# holds PIPELINE_MIN_BYTES: at 100 Mbit the CNN's runs of 66 kB bought no time and cost its loop
# a fifth of its CPU, where runs of 250 kB and more are worth it (bench/RESULTS.md, "A merge
# group's runs").
PIPELINE_RUN_S = 2e-3
PIPELINE_MIN_BYTES = 128 << 10


def spread_bytes_for(alpha: float, beta: float, shards: int) -> int:
    """The least run of a merge group worth spreading over ``shards`` shards on a link of
    ``alpha`` seconds a message and ``beta`` seconds a byte: the bytes of ``shards`` start-ups,
    at least ``SPREAD_MIN_BYTES``.

    Spread over ``s`` shards, every worker sends ``s`` messages a group where one shard takes
    one, and what it saves is at most the group's bytes' time (the push and the reply no longer
    one after the other). A run of ``shards x alpha / beta`` bytes or more keeps the added
    start-ups under ``1 / shards`` of that. Where workers are many, a group stays on one shard
    and the groups share the shards out among them: spread over a thousand shards in small runs,
    a group's start-ups cost more than its bytes (bench/RESULTS.md, "Merge groups spread over the
    shards; issue 11's rows on another VM").

    >>> spread_bytes_for(150e-6, 8e-9, 2), spread_bytes_for(45e-6, 0.8e-9, 1024)
    (65536, 57600000)
    """
    if alpha <= 0 or beta <= 0:
        return SPREAD_MIN_BYTES
    return max(SPREAD_MIN_BYTES, int(round(shards * alpha / beta)))


def pipeline_bytes_for(beta: float, spread_bytes: int) -> int:
    """The least run of a merge group worth a run past one a shard on a link of ``beta`` seconds
    a byte: its bytes in ``PIPELINE_RUN_S``, at least ``PIPELINE_MIN_BYTES`` and ``spread_bytes``
    (a link not measured, ``beta`` 0: ``spread_bytes``).

    >>> pipeline_bytes_for(8e-9, 65536), pipeline_bytes_for(80e-9, 65536)
    (250000, 131072)
    """
    if beta <= 0:
        return spread_bytes
    return max(spread_bytes, PIPELINE_MIN_BYTES, int(round(PIPELINE_RUN_S / beta)))


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
        layers: parameters of one layer (names, consecutive in the manifest) that travel in one
            message: placed together, never spread; a layer of over ``chunk_bytes`` in all is
            placed key by key, as a parameter of its own is.
        factored: fully-connected layers synced by the Project-Adam scheme, ``[weight, bias]``
            names each: their keys all live on one shard, which rebuilds the matrix from the
            workers' sufficient factors (a FACTORS frame keyed by the layer's first message).
        spread_bytes: the least bytes of a merge group a shard gets when the group is spread
            over the shards (:func:`spread_bytes_for` a link); 0 keeps every group on one shard.
        pipeline_bytes: the least bytes of a run past one a shard (:func:`pipeline_bytes_for` a
            link); by default ``spread_bytes``.
        topology: the workers' hosts (:class:`~poseidon_aio.cluster.topology.Topology`, as the
            rendezvous checked them); by default every worker a host of its own.

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
        layers: Optional[Sequence[Sequence[str]]] = None,
        placement: str = "balanced",
        factored: Optional[Sequence[Sequence[str]]] = None,
        spread_bytes: int = SPREAD_MIN_BYTES,
        pipeline_bytes: Optional[int] = None,
        topology: Optional[Topology] = None,
    ) -> None:
        if workers < 1 or shards < 1:
            raise ConfigError(f"need at least one worker and one shard, got {workers} and {shards}")
        if topology is not None and topology.world != workers:
            raise ConfigError(f"the topology's hosts hold {topology.world} workers, the book {workers}")
        self.topology = topology or Topology.flat(workers)
        if placement not in ("balanced", "tensor"):
            raise ConfigError(f"placement must be 'balanced' or 'tensor', got {placement!r}")
        if chunk_bytes < 64:
            raise ConfigError(f"chunk_bytes must be at least 64, got {chunk_bytes}")
        if spread_bytes < 0:
            raise ConfigError(f"spread_bytes must be >= 0 (0: every merge group on one shard), got {spread_bytes}")
        self.spread_bytes = spread_bytes
        if pipeline_bytes is not None and pipeline_bytes < 1:
            raise ConfigError(f"pipeline_bytes must be >= 1 byte, got {pipeline_bytes}")
        self.pipeline_bytes = max(spread_bytes, pipeline_bytes or 0) or 1
        self.manifest = manifest
        self.workers = workers
        self.shards = shards
        self.chunk_bytes = chunk_bytes
        self.placement = placement
        self.factored = tuple(tuple(self.manifest.index(n) for n in layer) for layer in (factored or ()))
        for layer in self.factored:
            w = self.manifest[layer[0]]
            if (
                len(w.shape) != 2
                or w.dtype != "float32"
                or (len(layer) == 2 and self.manifest[layer[1]].shape != (w.shape[0],))
            ):
                raise ConfigError(
                    f"factored layer {[self.manifest[i].name for i in layer]} "
                    "must be a float32 MxN weight and an M bias"
                )
        self._run_starts: set = set()  # (param, offset) where a run of a spread merge group begins
        factored_names = [[self.manifest[i].name for i in layer] for layer in self.factored]
        grouped = {n for group in [*(groups or ()), *factored_names] for n in group}
        self.layers = self._small_layers(layers, grouped)
        self.groups = self._groups(list(groups or ()) + factored_names + list(self.layers))
        self._group_index = {p: g for g, params in enumerate(self.groups) if len(params) > 1 for p in params}
        self._whole = {p for layer in self.factored for p in layer}
        # Placed as one unit, keys together: factored layers (never split) and small layers.
        self._together = self._whole | {self.manifest.index(n) for layer in self.layers for n in layer}
        self.pairs = self._partition()
        self._by_param: dict = {}
        for pair in self.pairs:
            self._by_param.setdefault(pair.param, []).append(pair)
        self.messages = self._messages()
        self._message_of_key = {k: m for m in self.messages for k in m.keys}
        # Looked up for every layer of every step: the book never changes once built, so each
        # answer is computed once (bounded by the layers and buckets the trainer asks about).
        self._messages_of: dict = {}
        self._slice_plan = {
            m.id: tuple(
                (self.pairs[k].param, self.pairs[k].offset, self.pairs[k].offset + self.pairs[k].numel) for k in m.keys
            )
            for m in self.messages
        }
        self._pushers: dict = {}  # message id -> the ranks that push it (pushers())
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
            return tuple(KVPair(k, p, o, n, b, shard_of[k]) for k, (p, o, n, b) in enumerate(cuts))
        # A merge group is spread first, evenly over the shards (see _spread); the other keys are
        # then placed around it: the small keys of a factored layer go to one shard together (one
        # shard rebuilds it), every other key is a unit of its own. LPT over the units.
        merged = {p for p in self._group_index if p not in self._together}
        placed, load = self._spread([c for c in cuts if c[0] in merged])
        rest = [c for c in cuts if c[0] not in merged]
        units, current, size, owner = [], [], 0, None
        for key, (param, _, _, nbytes) in enumerate(rest):
            group = self._group_index.get(param, ("solo", param))
            if param in self._together and current and group == owner:
                current.append(key)
                size += nbytes
                continue
            if current:
                units.append((current, size))
                current, size = [], 0
            if param not in self._together:
                units.append(([key], nbytes))
                continue
            current.append(key)
            size += nbytes
            owner = group
        if current:
            units.append((current, size))
        rest, shard_of = self._place(rest, units, load)
        every = sorted([*placed, *((*cut, shard) for cut, shard in zip(rest, shard_of))])
        return tuple(KVPair(k, p, o, n, b, shard) for k, (p, o, n, b, shard) in enumerate(every))

    def _spread(self, cuts: list) -> tuple:
        """Each merge group's keys cut into ``s`` runs of nearly equal bytes, one per shard, the
        least-loaded shards first: ``([(param, offset, numel, nbytes, shard)], load per shard)``.

        ``s`` is P2 (where there are several workers and each run would hold ``pipeline_bytes``,
        up to ``GROUP_RUNS``, a whole number a shard), or fewer where a run would be under
        ``spread_bytes``, and never fewer than the group's chunks; runs past P2 take the shards in
        turn, each a message of its own. A merged message on one shard is pushed whole over one
        link and then replied whole over the other direction, one after the other; spread, every
        worker's pushes and every shard's replies use all links both ways at once, and its bytes
        cross the busiest link (P1 + P2 - 2) / P2 times each way, as Table 1 and the merge planner count them
        (bench/RESULTS.md, "Merge groups spread over the shards; issue 11's rows on another VM").
        """
        load = [0] * self.shards
        placed = []
        by_group: dict = {}
        for cut in cuts:
            by_group.setdefault(self._group_index[cut[0]], []).append(cut)
        for group in sorted(by_group):
            group_cuts = by_group[group]
            total = sum(c[3] for c in group_cuts)
            # Never fewer runs than chunks (a chunk is the largest message), more where P2 allows;
            # past P2, as many on every shard (a shard with one more run would hold more bytes).
            fit = total // self.spread_bytes if self.spread_bytes else 1
            if fit > self.shards:
                wide = self.shards * -(-GROUP_RUNS // self.shards) if self.workers > 1 else self.shards
                deep = total // self.pipeline_bytes // self.shards * self.shards
                fit = min(wide, max(self.shards, deep))
            runs = max(-(-total // self.chunk_bytes), fit)
            used: set = set()

            def next_shard() -> int:  # the least-loaded shard this group has no run on yet
                if len(used) == self.shards:
                    used.clear()
                shard = min((s for s in range(self.shards) if s not in used), key=lambda s: (load[s], s))
                used.add(shard)
                return shard

            opened = -1  # the last run whose first key is marked (runs only go up)
            run, done, shard = 0, 0, next_shard()  # the run being filled; the group's bytes placed so far
            for param, offset, numel, nbytes in group_cuts:
                itemsize = nbytes // numel if numel else 1
                while numel:
                    # Run r ends within an item of byte total (r + 1) / s of the group.
                    want = total * (run + 1) // runs - done
                    take = numel if run == runs - 1 else min(numel, max(0, want) // itemsize)
                    if take:
                        if run != opened:  # a run is one message of its own (see _messages)
                            opened = run
                            self._run_starts.add((param, offset))
                        placed.append((param, offset, take, take * itemsize, shard))
                        load[shard] += take * itemsize
                        offset, numel, done = offset + take, numel - take, done + take * itemsize
                    if numel:
                        run, shard = run + 1, next_shard()
        return placed, load

    def _place(self, cuts: list, units: list, held: list) -> tuple:
        """LPT over the units, splitting the one that would push the least-loaded shard past
        ``BALANCE`` x the mean: it fills that shard and the rest goes back in the queue. Every
        split fills a shard, so there are at most P2 - 1 of them: a model whose tensors are all
        far smaller than a chunk (a 67 k-parameter CNN over 4 shards) gets each shard its share
        for at most 3 more key-value pairs. Factored layers are never split. ``held``: the bytes
        each shard holds already (the merge groups'). Returns the cuts (split ones in two, in
        (param, offset) order) and their shards."""
        total = sum(nbytes for _, nbytes in units) + sum(held)
        cap = BALANCE * total / self.shards
        pieces = [list(cuts[k]) for k in range(len(cuts))]  # mutable: a split shortens one
        shard_of: dict = {}
        load = [(used, s) for s, used in enumerate(held)]
        heapq.heapify(load)
        queue = [(-nbytes, keys[0], keys) for keys, nbytes in units]
        heapq.heapify(queue)
        while queue:
            size, _, keys = heapq.heappop(queue)
            size = -size
            used, shard = heapq.heappop(load)
            room = cap - used
            # Never split a factored layer: one shard rebuilds it.
            whole = used + size <= cap or any(pieces[k][0] in self._whole for k in keys)
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

    def _small_layers(self, layers: Optional[Sequence[Sequence[str]]], grouped: set) -> tuple:
        """The ``layers`` of several parameters and at most ``chunk_bytes`` in all (one message's
        worth); those in a merge group or factored are left out (their group places them)."""
        out = []
        for names in layers or ():
            names = tuple(names)
            if len(names) < 2 or grouped.intersection(names):
                continue
            if sum(self.manifest[self.manifest.index(n)].nbytes for n in names) <= self.chunk_bytes:
                out.append(names)
        return tuple(out)

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
                    new_run = (pair.param, pair.offset) in self._run_starts
                    if batch and (size + pair.nbytes > self.chunk_bytes or pdtype != dtype or new_run):
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
        # The hosts count where they are not flat: a flat job's digest (and its shard
        # checkpoints, which carry it) stays what it was before the book recorded hosts.
        hosts = {"hosts": self.topology.to_json()} if self.topology.by_host else {}
        return json.dumps(
            {
                **hosts,
                "manifest": self.manifest.to_json(),
                "workers": self.workers,
                "shards": self.shards,
                "chunk_bytes": self.chunk_bytes,
                "placement": self.placement,
                "spread_bytes": self.spread_bytes,
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

    @property
    def by_host(self) -> bool:
        """Whether a message's gradient is pushed once per host (hosts run several workers)."""
        return self.topology.by_host

    def speaker(self, message_id: int) -> int:
        """The local rank that pushes ``message_id`` for its host (0 where every worker is a host)."""
        return message_id % self.topology.local_size

    def pushers(self, message_id: int) -> tuple:
        """The ranks whose pushes make message ``message_id``'s sum: every host's speaker, or every
        worker (a flat job; a factored layer's factors)."""
        found = self._pushers.get(message_id)
        if found is None:
            rebuilt = any(message_id in {m.id for m in self.messages_of_params(layer)} for layer in self.factored)
            if self.by_host and not rebuilt:
                found = tuple(h[self.speaker(message_id)] for h in self.topology.hosts)
            else:
                found = tuple(range(self.workers))
            self._pushers[message_id] = found
        return found

    def shard_bytes(self) -> list:
        load = [0] * self.shards
        for pair in self.pairs:
            load[pair.shard] += pair.nbytes
        return load

    def max_over_mean(self) -> float:
        load = self.shard_bytes()
        mean = sum(load) / len(load)
        return max(load) / mean if mean else 1.0
