"""Where this process runs, from its launcher's environment: torchrun's variables (single- or
multi-node), SLURM's, or none (a host of its own), and the address the other ranks reach it at."""

from __future__ import annotations

import ipaddress
import os
import random
import socket
from dataclasses import dataclass
from typing import Mapping, Optional

from ..errors import ConfigError
from .topology import Placement, tasks_per_node


@dataclass(frozen=True)
class ClusterEnv:
    """Where this process is in the job, from the launcher's environment variables.

    ``node``, ``local_world_size`` and ``nnodes`` say which host it runs on (torchrun's
    ``GROUP_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_WORLD_SIZE``; SLURM's ``SLURM_NODEID``,
    ``SLURM_TASKS_PER_NODE``, ``SLURM_NNODES``). ``node=None``: no launcher said, the process is
    a host of its own.
    """

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    node: Optional[int] = None
    local_world_size: int = 1
    nnodes: Optional[int] = None
    launcher: str = "env"

    @classmethod
    def from_env(cls, env: Optional[Mapping[str, str]] = None) -> "ClusterEnv":
        """Read torchrun's variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``GROUP_RANK``,
        ``LOCAL_WORLD_SIZE``, ``GROUP_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), or SLURM's
        where ``RANK`` is not set (``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``,
        ``SLURM_NODEID``, ``SLURM_NNODES``, ``SLURM_TASKS_PER_NODE``; the batch script exports
        ``MASTER_ADDR`` and ``MASTER_PORT``).

        Raises:
            ConfigError: a variable is missing or malformed (the message names it).
        """
        env = os.environ if env is None else env
        slurm = "RANK" not in env and "SLURM_PROCID" in env
        needed = ("SLURM_PROCID", "SLURM_NTASKS") if slurm else ("RANK", "WORLD_SIZE")
        missing = [v for v in (*needed, "MASTER_ADDR", "MASTER_PORT") if v not in env]
        if missing:
            how = (
                "under SLURM, export MASTER_ADDR (the first host of $SLURM_JOB_NODELIST) and a free "
                "MASTER_PORT in the batch script, or start the workers with srun torchrun"
                if slurm
                else "start workers with torchrun, SLURM or `poseidon-aio run -n N script.py`, which set "
                "RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT"
            )
            raise ConfigError(f"{', '.join(missing)} not set: {how}")
        try:
            out = cls._from_slurm(env) if slurm else cls._from_torchrun(env)
        except (ValueError, IndexError) as exc:
            raise ConfigError(f"malformed launcher environment: {exc}") from None
        if not 0 <= out.rank < out.world_size:
            raise ConfigError(f"RANK={out.rank} is outside 0..WORLD_SIZE-1 ({out.world_size - 1})")
        if out.node is not None and not 0 <= out.local_rank < out.local_world_size:
            raise ConfigError(
                f"rank {out.rank}: local rank {out.local_rank} is outside 0..{out.local_world_size - 1} "
                f"(the {out.launcher} launcher's local world size)"
            )
        return out

    @classmethod
    def _from_torchrun(cls, env: Mapping[str, str]) -> "ClusterEnv":
        rank = int(env["RANK"])
        common = dict(
            rank=rank,
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", rank)),
            master_addr=env["MASTER_ADDR"],
            master_port=int(env["MASTER_PORT"]),
        )
        if "GROUP_RANK" not in env:
            return cls(**common)
        missing = [v for v in ("LOCAL_RANK", "LOCAL_WORLD_SIZE") if v not in env]
        if missing:
            raise ValueError(f"GROUP_RANK is set but {', '.join(missing)} is not (torchrun sets all three)")
        nnodes = env.get("GROUP_WORLD_SIZE")
        return cls(
            **common,
            node=int(env["GROUP_RANK"]),
            local_world_size=int(env["LOCAL_WORLD_SIZE"]),
            nnodes=None if nnodes is None else int(nnodes),
            launcher="torchrun",
        )

    @classmethod
    def _from_slurm(cls, env: Mapping[str, str]) -> "ClusterEnv":
        world, nnodes = int(env["SLURM_NTASKS"]), int(env.get("SLURM_NNODES", "1"))
        node = int(env.get("SLURM_NODEID", "0"))
        if "SLURM_TASKS_PER_NODE" in env:
            local_world_size = tasks_per_node(env["SLURM_TASKS_PER_NODE"])[node]
        else:
            local_world_size = world // max(nnodes, 1)
        return cls(
            rank=int(env["SLURM_PROCID"]),
            world_size=world,
            local_rank=int(env.get("SLURM_LOCALID", "0")),
            master_addr=env["MASTER_ADDR"],
            master_port=int(env["MASTER_PORT"]),
            node=node,
            local_world_size=local_world_size,
            nnodes=nnodes,
            launcher="slurm",
        )

    def placement(self) -> Placement:
        """What this process publishes of where it runs (a host of its own where no launcher said)."""
        if self.node is None:
            return Placement(node=None, local_rank=0, local_world_size=1, hostname=socket.gethostname())
        return Placement(
            node=self.node,
            local_rank=self.local_rank,
            local_world_size=self.local_world_size,
            nnodes=self.nnodes,
            hostname=socket.gethostname(),
            launcher=self.launcher,
        )


def advertise_host(master_addr: str) -> str:
    """The address of the interface that routes to the master (no packet is sent)."""
    try:
        if ipaddress.ip_address(socket.gethostbyname(master_addr)).is_loopback:
            return "127.0.0.1"
    except (OSError, ValueError):
        pass
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((master_addr, 9))
            return probe.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())


# Its own source: a user's seeding of the random module must not make two jobs draw alike.
_PORTS = random.SystemRandom()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now, for the rendezvous store a launcher binds a moment later:
    drawn below the kernel's ephemeral range, where no connection opened meanwhile on this host
    takes it as its source port (``bind(0)`` draws from that range, and on a busy host lost that
    race: the store's bind failed, or its clients reached another socket)."""
    low = _ephemeral_low()
    for _ in range(64):
        port = _PORTS.randrange(10000, low)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # that range is full: the kernel's choice
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):  # not Linux: IANA's range starts here
        low = 49152
    return max(low, 10001)
