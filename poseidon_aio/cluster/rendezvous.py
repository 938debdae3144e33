"""Bootstrap on PyTorch's machinery: the torchrun / SLURM / Kubernetes environment variables and
``torch.distributed.TCPStore``.

Every rank publishes its listening address and its model manifest under a prefix of the store and
reads everyone else's. A manifest that differs fails every rank at once, naming the first
differing parameter and the ranks. All store calls block, so they run in a thread: the event loop
keeps serving while a rank waits for a slow peer, and every wait has a deadline.

This is the one module below the trainer that imports torch (for the TCPStore only, lazily).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Mapping, Optional

from ..errors import ConfigError, PeerTimeout
from .manifest import Manifest, ManifestMismatch, first_difference

PREFIX = "poseidon_aio"


@dataclass(frozen=True)
class ClusterEnv:
    """Where this process is in the job, from the launcher's environment variables."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int

    @classmethod
    def from_env(cls, env: Optional[Mapping[str, str]] = None) -> "ClusterEnv":
        """Read ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``.

        Raises:
            ConfigError: a variable is missing or malformed (the message names it).
        """
        env = os.environ if env is None else env
        missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in env]
        if missing:
            raise ConfigError(
                f"{', '.join(missing)} not set: start workers with torchrun, SLURM or "
                "`poseidon-aio run -n N script.py`, which set RANK, WORLD_SIZE, LOCAL_RANK, "
                "MASTER_ADDR and MASTER_PORT"
            )
        try:
            out = cls(
                rank=int(env["RANK"]),
                world_size=int(env["WORLD_SIZE"]),
                local_rank=int(env.get("LOCAL_RANK", env["RANK"])),
                master_addr=env["MASTER_ADDR"],
                master_port=int(env["MASTER_PORT"]),
            )
        except ValueError as exc:
            raise ConfigError(f"malformed launcher environment: {exc}") from None
        if not 0 <= out.rank < out.world_size:
            raise ConfigError(f"RANK={out.rank} is outside 0..WORLD_SIZE-1 ({out.world_size - 1})")
        return out


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


class Rendezvous:
    """Key exchange through ``torch.distributed.TCPStore``.

    Args:
        env: this process's :class:`ClusterEnv`.
        timeout: seconds any rank may take to publish what the others wait for.
        namespace: key prefix, so several jobs (or a torchrun agent's own keys) share a store.

    >>> # rdzv = Rendezvous(ClusterEnv.from_env()); await rdzv.start()
    """

    def __init__(self, env: ClusterEnv, *, timeout: float = 60.0, namespace: str = PREFIX) -> None:
        self.env = env
        self.timeout = timeout
        self.namespace = namespace
        self._store = None
        self._owner = True  # False for scoped views: leaving is their parent's business

    async def start(self) -> None:
        """Connect to (on rank 0: host) the store at MASTER_ADDR:MASTER_PORT."""
        self._store = await asyncio.to_thread(self._open)

    def _open(self):
        from torch.distributed import TCPStore

        # Under torchrun the elastic agent already hosts a store on MASTER_PORT.
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        try:
            return TCPStore(
                self.env.master_addr,
                self.env.master_port,
                self.env.world_size,
                is_master=self.env.rank == 0 and not agent,
                timeout=timedelta(seconds=self.timeout),
                wait_for_workers=False,
            )
        except (RuntimeError, OSError) as exc:
            raise PeerTimeout(
                f"rank {self.env.rank} could not reach the rendezvous store at "
                f"{self.env.master_addr}:{self.env.master_port} within {self.timeout} s: {exc}"
            ) from None

    @property
    def store(self):
        """The underlying ``TCPStore`` (e.g. for ``torch.distributed.init_process_group``)."""
        return self._store

    def scoped(self, namespace: str) -> "Rendezvous":
        """A view of the same store under another key prefix (several jobs on one store)."""
        other = Rendezvous(self.env, timeout=self.timeout, namespace=f"{self.namespace}/{namespace}")
        other._store = self._store
        other._owner = False
        return other

    def _key(self, name: str) -> str:
        return f"{self.namespace}/{name}"

    async def publish(self, name: str, value: str) -> None:
        await asyncio.to_thread(self._store.set, self._key(name), value)

    async def read(self, name: str, *, who: str, deadline: Optional[float] = None) -> str:
        """Wait (bounded) for ``name`` and return it; ``who`` names the publisher in errors."""
        deadline = time.monotonic() + self.timeout if deadline is None else deadline

        def wait():
            left = max(0.001, deadline - time.monotonic())
            try:
                self._store.wait([self._key(name)], timedelta(seconds=left))
            except (RuntimeError, OSError):
                return None
            return self._store.get(self._key(name)).decode()

        value = await asyncio.to_thread(wait)
        if value is None:
            raise PeerTimeout(
                f"rank {self.env.rank}: {who} did not publish {name!r} within {self.timeout} s: "
                f"is it running, with the same MASTER_ADDR:MASTER_PORT "
                f"({self.env.master_addr}:{self.env.master_port})?"
            )
        return value

    async def exchange(self, name: str, value: str, ranks: range) -> dict:
        """Publish ``value`` as ``{name}/{rank}`` and return everyone's, keyed by rank."""
        await self.publish(f"{name}/{self.env.rank}", value)
        deadline = time.monotonic() + self.timeout
        out = {}
        for r in ranks:
            out[r] = await self.read(f"{name}/{r}", who=f"rank {r}", deadline=deadline)
        return out

    async def barrier(self, name: str) -> None:
        await self.exchange(f"barrier/{name}", "1", range(self.env.world_size))

    async def check_manifest(self, manifest: Manifest) -> None:
        """Fail on every rank if any rank's manifest differs, naming the parameter and ranks.

        Raises:
            ManifestMismatch
        """
        texts = await self.exchange("manifest", manifest.to_json(), range(self.env.world_size))
        reference = Manifest.from_json(texts[0])
        for r in range(1, self.env.world_size):
            if texts[r] == texts[0]:
                continue
            diff = first_difference(reference, Manifest.from_json(texts[r]))
            raise ManifestMismatch(
                f"rank {r}'s model differs from rank 0's at {diff}: every rank must build the "
                f"same model (seen from rank {self.env.rank})"
            )

    async def check_digest(self, what: str, digest: str) -> None:
        """Fail on every rank unless all ranks computed the same ``digest`` of ``what``."""
        seen = await self.exchange(f"digest/{what}", digest, range(self.env.world_size))
        odd = sorted(r for r, d in seen.items() if d != seen[0])
        if odd:
            raise ManifestMismatch(
                f"ranks {odd} computed a different {what} than rank 0 "
                f"({seen[odd[0]][:12]} vs {seen[0][:12]}): same model, world size and settings everywhere?"
            )

    async def addresses(self, role: str, host: str, port: int, ranks: range) -> dict:
        """Exchange ``(host, port)`` of ``role`` endpoints; returns ``{rank: (host, port)}``."""
        got = await self.exchange(f"addr/{role}", json.dumps([host, port]), ranks)
        return {r: tuple(json.loads(v)) for r, v in got.items()}

    async def leave(self, linger: Optional[float] = None) -> None:
        """Say this rank is done with the store; the rank hosting it waits (bounded) for everyone
        else to say so too, since ending its process ends the store under their feet."""
        if self._store is None or not self._owner:
            return
        try:
            await self.publish(f"left/{self.env.rank}", "1")
            agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
            if self.env.rank == 0 and not agent:
                linger = self.timeout if linger is None else linger
                deadline = time.monotonic() + linger
                for r in range(1, self.env.world_size):
                    try:
                        await self.read(f"left/{r}", who=f"rank {r}", deadline=deadline)
                    except PeerTimeout:
                        break
        except (RuntimeError, OSError):
            pass  # the store is already gone: nothing left to coordinate
        finally:
            self._store = None
