"""Settings of the parameter server: one dataclass per concern, validated, with working defaults."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Optional

from ..cluster.book import DEFAULT_CHUNK_BYTES, SPREAD_MIN_BYTES
from ..errors import ConfigError


@dataclass
class StragglerPolicy:
    """When a shard stops waiting for slow workers.

    Off by default (``deadline=None``): every key waits for every worker, as BSP and SSP define.
    With a deadline, a key whose first push arrived ``deadline`` seconds ago finalizes with the
    workers present if at least ``quorum`` of them are; the aggregate is then the mean over those
    contributors, the missing ranks are reported to every worker and late pushes are discarded.

    Args:
        deadline: seconds after a key's first push, or ``"adaptive"``: ``factor`` times the 90th
            percentile of the arrival spread of the last 64 keys this shard finalized with
            everyone, clamped to ``[min_deadline, max_deadline]``.
        quorum: least contributors for a dropping finalization (default: a majority of workers).
    """

    deadline: Optional[float | str] = None
    quorum: Optional[int] = None
    factor: float = 3.0
    min_deadline: float = 0.05
    max_deadline: float = 30.0

    def __post_init__(self) -> None:
        if isinstance(self.deadline, str) and self.deadline != "adaptive":
            raise ConfigError(f"StragglerPolicy.deadline must be seconds, 'adaptive' or None, got {self.deadline!r}")
        if isinstance(self.deadline, (int, float)) and self.deadline <= 0:
            raise ConfigError(f"StragglerPolicy.deadline must be > 0 seconds, got {self.deadline}")
        if self.quorum is not None and self.quorum < 1:
            raise ConfigError(f"StragglerPolicy.quorum must be >= 1, got {self.quorum}")
        if not 0 < self.min_deadline <= self.max_deadline:
            raise ConfigError("StragglerPolicy needs 0 < min_deadline <= max_deadline")

    @property
    def enabled(self) -> bool:
        return self.deadline is not None

    def quorum_of(self, workers: int) -> int:
        return min(workers, self.quorum if self.quorum is not None else workers // 2 + 1)


@dataclass
class ServerSGD:
    """Apply SGD on the shards (ATC'17's KV store does); workers then receive parameters.

    ``v = momentum * v + (g + weight_decay * w); w -= lr * v`` — ``torch.optim.SGD``'s rule.
    """

    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        if self.lr <= 0 or self.momentum < 0 or self.weight_decay < 0:
            raise ConfigError(f"ServerSGD needs lr > 0, momentum >= 0, weight_decay >= 0: {self}")


@dataclass
class PSConfig:
    """How the parameter server is laid out and behaves.

    Args:
        shards: P2; shards are hosted by worker ranks ``0..P2-1`` (default: every worker hosts
            one, the paper's co-located layout).
        chunk_bytes: largest key-value pair (2 MiB: ATC'17's granularity).
        staleness: the SSP bound ``s``; 0 is BSP. A worker at clock ``t`` proceeds once every
            aggregate up to clock ``t - s - 1`` is in.
        stragglers: see :class:`StragglerPolicy`.
        server_sgd: apply SGD on the shards and return parameters instead of gradients.
        checkpoint_dir, checkpoint_every: every N clocks each shard writes its state atomically
            (server-side SGD, where shards own the model); 0 disables.
        sync_timeout: seconds a worker waits for any one aggregate before :class:`SyncTimeout`.
        placement: ``"balanced"`` or ``"tensor"`` (see :class:`InformationBook`).
        standalone_shards: the ``shards`` shards run in their own processes
            (``poseidon-aio shard --index S``) instead of inside workers.
        outbox_bytes: the most reply bytes a shard queues for one worker that is slow, gone or
            not yet connected; past it the worker is ejected (with a straggler policy) or the
            job fails naming it. Default: what a healthy worker can be owed, ``(staleness + 2)``
            clocks of the shard's replies plus 1 MiB.
        group_spread_bytes: a merge group's keys are spread over the shards in runs of at
            least this many bytes (one message per shard: every link busy both ways at once);
            0 keeps every group on one shard. ``None``: the trainer takes the bytes of P2
            message start-ups on its measured link (``cluster.book.spread_bytes_for``), at
            least 64 KiB.
        group_pipeline_bytes: over fewer shards than ``cluster.book.GROUP_RUNS``, a merge group
            goes in more runs than shards (so that a shard's sums follow the pushes) only where
            each would hold this many bytes. ``None``: what the trainer's measured link carries in
            ``cluster.book.PIPELINE_RUN_S`` (``pipeline_bytes_for``), at least 128 KiB and the
            spread bytes.
    """

    shards: Optional[int] = None
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    staleness: int = 0
    stragglers: StragglerPolicy = field(default_factory=StragglerPolicy)
    server_sgd: Optional[ServerSGD] = None
    checkpoint_dir: Optional[str] = None
    checkpoint_every: int = 0
    sync_timeout: float = 120.0
    placement: str = "balanced"
    standalone_shards: bool = False
    outbox_bytes: Optional[int] = None
    group_spread_bytes: Optional[int] = None
    group_pipeline_bytes: Optional[int] = None

    def __post_init__(self) -> None:
        if self.shards is not None and self.shards < 1:
            raise ConfigError(f"PSConfig.shards must be >= 1, got {self.shards}")
        if self.staleness < 0:
            raise ConfigError(f"PSConfig.staleness must be >= 0, got {self.staleness}")
        if self.checkpoint_every < 0:
            raise ConfigError("PSConfig.checkpoint_every must be >= 0")
        if self.checkpoint_every and not self.checkpoint_dir:
            raise ConfigError("PSConfig.checkpoint_every needs checkpoint_dir")
        if self.sync_timeout <= 0:
            raise ConfigError(f"PSConfig.sync_timeout must be > 0 seconds, got {self.sync_timeout}")
        if self.group_spread_bytes is not None and self.group_spread_bytes < 0:
            raise ConfigError(
                "PSConfig.group_spread_bytes must be >= 0 (0: every merge group on one shard), "
                f"got {self.group_spread_bytes}"
            )
        if self.group_pipeline_bytes is not None and self.group_pipeline_bytes < 1:
            raise ConfigError(f"PSConfig.group_pipeline_bytes must be >= 1 byte, got {self.group_pipeline_bytes}")
        if self.outbox_bytes is not None and self.outbox_bytes < 1:
            raise ConfigError(f"PSConfig.outbox_bytes must be >= 1 byte, got {self.outbox_bytes}")

    def shards_for(self, workers: int) -> int:
        shards = self.shards or workers
        if self.standalone_shards:
            if self.shards is None:
                raise ConfigError("PSConfig.standalone_shards needs shards= (how many shard processes run)")
            return shards
        if shards > workers:
            raise ConfigError(f"PSConfig.shards={shards} but only {workers} workers host shards")
        return shards

    def spread_bytes(self) -> int:
        """``group_spread_bytes``, or the book's default where no link has set it."""
        return SPREAD_MIN_BYTES if self.group_spread_bytes is None else self.group_spread_bytes

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "PSConfig":
        raw = json.loads(text)
        raw["stragglers"] = StragglerPolicy(**raw["stragglers"])
        if raw.get("server_sgd") is not None:
            raw["server_sgd"] = ServerSGD(**raw["server_sgd"])
        return cls(**raw)
