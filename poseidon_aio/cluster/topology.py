"""Which worker runs on which host: the launcher's word, checked by every rank at the rendezvous.

Poseidon keeps one KV store per host (ATC'17 §4), and NCCL, Horovod and BytePS all sum inside a
host before anything crosses the network: a host's link then carries its bytes once, not once per
local worker. That needs the host layer explicit. The launcher says where a process runs
(torchrun's ``GROUP_RANK``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``; SLURM's ``SLURM_NODEID``,
``SLURM_LOCALID``, ``SLURM_TASKS_PER_NODE``); every rank publishes what it was told
(:class:`Placement`) and every rank builds the same :class:`Topology` from all of them, or the
same one-line error naming the host that differs.

A process its launcher gave no host (``RANK`` and ``WORLD_SIZE`` set by hand, as the tests and the
namespace benches do) is a host of its own: the flat job every rank a peer, as before.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Mapping, Optional

from ..errors import ConfigError, TopologyMismatch

# The most nodes a SLURM_TASKS_PER_NODE may spell out: a bound on the list it makes.
MAX_NODES = 1 << 16


@dataclass(frozen=True)
class Placement:
    """What one process's launcher said of where it runs.

    Attributes:
        node: the host's index among the job's (``GROUP_RANK``, ``SLURM_NODEID``); ``None`` when
            the launcher named none: the process is then a host of its own.
        local_rank: its index among the host's workers (``LOCAL_RANK``, ``SLURM_LOCALID``).
        local_world_size: how many workers its host runs (``LOCAL_WORLD_SIZE``, from
            ``SLURM_TASKS_PER_NODE``).
        nnodes: how many hosts the launcher says the job has (``GROUP_WORLD_SIZE``,
            ``SLURM_NNODES``), or ``None``.
        hostname: the machine's name, for messages only.
        launcher: ``"torchrun"``, ``"slurm"`` or ``"env"`` (variables set by hand), for messages.
    """

    node: Optional[int]
    local_rank: int
    local_world_size: int
    nnodes: Optional[int] = None
    hostname: str = ""
    launcher: str = "env"

    def to_json(self) -> str:
        return json.dumps(
            {
                "node": self.node,
                "local_rank": self.local_rank,
                "local_world_size": self.local_world_size,
                "nnodes": self.nnodes,
                "hostname": self.hostname,
                "launcher": self.launcher,
            }
        )

    @classmethod
    def from_json(cls, text: str, rank: int) -> "Placement":
        """Parse rank ``rank``'s published placement (types checked: it came over the store).

        Raises:
            ConfigError: the text is not a placement this release writes.
        """
        try:
            d = json.loads(text)
            node, nnodes = d["node"], d["nnodes"]
            out = cls(
                node=None if node is None else _whole(node),
                local_rank=_whole(d["local_rank"]),
                local_world_size=_whole(d["local_world_size"]),
                nnodes=None if nnodes is None else _whole(nnodes),
                hostname=str(d["hostname"])[:255],
                launcher=str(d["launcher"])[:16],
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(
                f"rank {rank} published a placement this release cannot read ({exc}): "
                "is every rank running the same poseidon_aio release?"
            ) from None
        return out


def _whole(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{value!r} is not a whole number")
    return value


@dataclass(frozen=True)
class Topology:
    """The job's hosts, each a tuple of its workers' ranks in local-rank order.

    Every host runs the same number of workers, L (``local_size``); P_h = ``len(hosts)``. The
    first rank of a host (local rank 0) speaks for it on the network.

    >>> t = Topology(((0, 1), (2, 3)))
    >>> t.local_size, t.host_of(3), t.local_rank_of(3), t.leader(1)
    (2, 1, 1, 2)
    """

    hosts: tuple
    names: tuple = ()

    def __post_init__(self) -> None:
        hosts = tuple(tuple(h) for h in self.hosts)
        object.__setattr__(self, "hosts", hosts)
        ranks = sorted(r for h in hosts for r in h)
        if not hosts or ranks != list(range(len(ranks))):
            raise ConfigError(f"a topology's hosts must hold every rank 0..P-1 once, got {hosts}")
        if len({len(h) for h in hosts}) != 1:
            raise ConfigError(f"every host must run the same number of workers, got {hosts}")
        if self.names and len(self.names) != len(hosts):
            raise ConfigError(f"{len(self.names)} host names for {len(hosts)} hosts")
        object.__setattr__(
            self, "_where", {r: (h, i) for h, members in enumerate(hosts) for i, r in enumerate(members)}
        )

    @classmethod
    def flat(cls, world: int) -> "Topology":
        """Every worker a host of its own."""
        return cls(tuple((r,) for r in range(world)))

    @property
    def world(self) -> int:
        return len(self._where)

    @property
    def local_size(self) -> int:
        """L, the workers a host runs."""
        return len(self.hosts[0])

    @property
    def by_host(self) -> bool:
        """Whether the hosts run several workers each (L > 1): the schemes then go by host and a
        host's workers talk over shared memory. With L = 1 every worker is a host of its own."""
        return self.local_size > 1

    def same_host(self, a: int, b: int) -> bool:
        """Whether ranks ``a`` and ``b`` are two workers of one host."""
        return a != b and self.host_of(a) == self.host_of(b)

    def host_of(self, rank: int) -> int:
        return self._where[rank][0]

    def local_rank_of(self, rank: int) -> int:
        return self._where[rank][1]

    def leader(self, host: int) -> int:
        """The rank that speaks for ``host`` on the network (its local rank 0)."""
        return self.hosts[host][0]

    def local_peers(self, rank: int) -> tuple:
        """The ranks on ``rank``'s host, itself included, in local-rank order."""
        return self.hosts[self.host_of(rank)]

    def routes(self, rank: int) -> tuple:
        """How a host's bundle (its L ranks' payloads together) reaches every other host, seen
        from ``rank``: host ``h`` sends it to host ``g`` from its local rank ``g mod L`` to ``g``'s
        local rank ``h mod L``, which forwards it to its local peers; so the host pairs are shared
        out among the local ranks.

        Returns:
            ``(sends_to, comes_from, crossing)``: ``{host: rank}`` this rank sends its host's
            bundle to, ``{host: rank}`` each other host's bundle comes from (over the network,
            or forwarded by a local peer), and the hosts whose bundles reach this rank over the
            network (it forwards them).

        >>> Topology(((0, 1), (2, 3), (4, 5))).routes(1)  # host 0's local rank 1
        ({1: 2}, {1: 2, 2: 0}, {1})
        """
        host, me, L = self.host_of(rank), self.local_rank_of(rank), self.local_size
        local = self.hosts[host]
        others = [h for h in range(len(self.hosts)) if h != host]
        sends_to = {g: self.hosts[g][host % L] for g in others if g % L == me}
        crossing = {h for h in others if h % L == me}
        comes_from = {h: self.hosts[h][host % L] if h in crossing else local[h % L] for h in others}
        return sends_to, comes_from, crossing

    def describe(self, host: int) -> str:
        """``"host 1 'node-b'"``, for messages."""
        name = self.names[host] if self.names else ""
        return f"host {host} {name!r}" if name else f"host {host}"

    def locate(self, rank: int) -> str:
        """``"host 1 'node-b', local rank 1"``: where ``rank`` runs, for messages."""
        return f"{self.describe(self.host_of(rank))}, local rank {self.local_rank_of(rank)}"

    def to_json(self) -> list:
        return [list(h) for h in self.hosts]

    @classmethod
    def from_placements(cls, placements: Mapping[int, Placement]) -> "Topology":
        """The job's topology from every rank's placement, the same on every rank.

        Hosts are ordered by the launcher's node index, ranks in a host by local rank.

        Raises:
            TopologyMismatch: the placements do not make a job of equal hosts: some ranks were
                given a host and others not, two ranks claim one local rank, a host runs another
                number of workers than it says or than host 0 does, or the launcher's host count
                differs from the hosts seen. The message names the host and what to change.
        """
        world = len(placements)
        told = [r for r in range(world) if placements[r].node is not None]
        if not told:
            return cls.flat(world)
        if len(told) != world:
            bare = min(set(range(world)) - set(told))
            raise TopologyMismatch(
                f"rank {bare} was given no host (no GROUP_RANK or SLURM_NODEID) while rank {told[0]}'s "
                f"launcher ({placements[told[0]].launcher}) named one: start every rank with the same launcher"
            )
        by_node: dict = {}
        for r in range(world):
            by_node.setdefault(placements[r].node, []).append(r)
        hosts, names = [], []
        for node in sorted(by_node):
            ranks = by_node[node]
            first = placements[ranks[0]]
            where = f"host {node} ({first.hostname!r})" if first.hostname else f"host {node}"
            said = {placements[r].local_world_size for r in ranks}
            if len(said) > 1:
                raise TopologyMismatch(
                    f"the ranks on {where} disagree on its local world size ({sorted(said)}): "
                    "start each host's workers with one launcher"
                )
            if first.local_world_size != len(ranks):
                raise TopologyMismatch(
                    f"{where} says it runs {first.local_world_size} workers but ranks {ranks} are on it: "
                    "give each host its own node rank (torchrun --node-rank, SLURM_NODEID)"
                )
            by_local: dict = {}
            for r in ranks:
                other = by_local.setdefault(placements[r].local_rank, r)
                if other != r:
                    raise TopologyMismatch(
                        f"ranks {other} and {r} both say they are local rank {placements[r].local_rank} on "
                        f"{where}: give each host its own node rank (torchrun --node-rank, SLURM_NODEID)"
                    )
            if sorted(by_local) != list(range(len(ranks))):
                raise TopologyMismatch(
                    f"{where}'s local ranks are {sorted(by_local)}, not 0..{len(ranks) - 1}: "
                    "its launcher's LOCAL_RANK and LOCAL_WORLD_SIZE disagree"
                )
            hosts.append(tuple(by_local[i] for i in range(len(ranks))))
            names.append(first.hostname)
        sizes = [len(h) for h in hosts]
        for h, size in enumerate(sizes):
            if size != sizes[0]:
                node = sorted(by_node)[h]
                raise TopologyMismatch(
                    f"host {node} ({names[h]!r}) runs {size} workers where host {sorted(by_node)[0]} "
                    f"({names[0]!r}) runs {sizes[0]}: every host must run the same number "
                    "(torchrun --nproc-per-node, srun --ntasks-per-node)"
                )
        claimed = {placements[r].nnodes for r in range(world)} - {None}
        if claimed and claimed != {len(hosts)}:
            raise TopologyMismatch(
                f"the launcher says the job has {sorted(claimed)} hosts but its {world} ranks are on "
                f"{len(hosts)} (node ranks {sorted(by_node)}): give every host the same --nnodes and "
                "its own --node-rank"
            )
        return cls(tuple(hosts), tuple(names))


def tasks_per_node(text: str) -> list:
    """SLURM's ``SLURM_TASKS_PER_NODE`` spelled out, a count per node.

    >>> tasks_per_node("2(x3),1")
    [2, 2, 2, 1]

    Raises:
        ValueError: not in SLURM's format.
    """
    counts: list = []
    for part in text.split(","):
        count, sep, repeat = part.partition("(x")
        if sep and not repeat.endswith(")"):
            raise ValueError(f"{part!r}")
        times = int(repeat[:-1]) if sep else 1
        if not 0 < times or len(counts) + times > MAX_NODES:
            raise ValueError(f"{part!r}")
        counts.extend([int(count)] * times)
    return counts


__all__ = ["Placement", "Topology", "tasks_per_node"]
