"""Joining a training job: the rendezvous, the model check, the worker mesh."""

from __future__ import annotations

from typing import Optional

from ..net import NetConfig
from .manifest import Manifest
from .mesh import Mesh
from .launcher import ClusterEnv
from .rendezvous import Rendezvous
from .topology import Topology


class Job:
    """This process's place in a job. Build it with :meth:`join`.

    Attributes:
        rendezvous: the store view the job meets through.
        mesh: authenticated connections to every other worker (``mesh.peers``).
        rank, world: this worker and how many there are.
        topology: the job's hosts, checked at the rendezvous (:class:`Topology`).
    """

    def __init__(self, rendezvous: Rendezvous, mesh: Mesh, owned: bool, topology: Topology) -> None:
        self.rendezvous = rendezvous
        self.mesh = mesh
        self.topology = topology
        self.rank = rendezvous.env.rank
        self.world = rendezvous.env.world_size
        self._owned = owned

    @classmethod
    async def join(
        cls,
        manifest: Manifest,
        net: NetConfig,
        *,
        timeout: float,
        env: Optional[ClusterEnv] = None,
        rendezvous: Optional[Rendezvous] = None,
        shaper=None,
    ) -> "Job":
        """Meet the other ranks, check that they build the same model, connect to every one.

        Args:
            manifest: this rank's model.
            rendezvous: an already started view of a store (several trainers one after another);
                by default one is opened at ``MASTER_ADDR:MASTER_PORT``.
            timeout: seconds every rank may take to show up.
        Raises:
            StoreUnavailable, PeerTimeout, ManifestMismatch, TopologyMismatch, AuthenticationError:
                the job could not form here; this rank publishes why (:meth:`Rendezvous.abort`) so the others stop
                waiting at once.
            StartupAborted: another rank failed during start-up (its reason is in the message).
        """
        owned = rendezvous is None
        if owned:
            rendezvous = Rendezvous(env or ClusterEnv.from_env(), timeout=timeout)
            await rendezvous.start()
        try:
            await rendezvous.check_manifest(manifest)
            topology = await rendezvous.check_topology()
            mesh = await Mesh.start(
                rendezvous.scoped("mesh"), net, timeout=timeout, process_shaper=shaper, topology=topology
            )
        except BaseException as exc:
            await rendezvous.abort(exc)
            if owned:
                # The rank hosting the store keeps it up (at most 5 s) until the others have read
                # the reason and left.
                await rendezvous.leave(5.0)
            raise
        return cls(rendezvous, mesh, owned, topology)

    @property
    def peers(self) -> dict:
        return self.mesh.peers

    async def leave(self, failed: bool = False) -> None:
        """Close the mesh and, when this job opened the store, leave it."""
        await self.mesh.close()
        if self._owned:
            await self.rendezvous.leave(5.0 if failed else None)
