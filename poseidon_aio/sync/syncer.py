"""The Syncer interface: one class per scheme, ``start(bucket, clock) -> awaitable SyncResult``.

In the spirit of DDP's communication hooks: the trainer hands a syncer a :class:`Bucket` the
moment its gradient (or factors) exist and awaits the result before the optimizer steps. A scheme
says, as class attributes, what it needs of the layers above and below it:

* ``on_ps``: its layers' parameters are key-value pairs of the parameter server;
* ``factored``: the parameter server rebuilds them from sufficient factors (Project Adam);
* ``host_outs``: the results arrive over the wire into host buffers (the trainer copies them to
  a GPU tensor afterwards); a scheme that computes them (SFB's reconstruction) gets the tensors.

What the planners also need to know, ``captures_factors`` (the backward hooks keep the layer's
``(u, v)``, not its weight gradient), ``mergeable`` (MG-WFBP may merge consecutive layers'
buckets into one, :class:`Merging`) and ``rounds`` (the rounds of messages a bucket's sync runs
one after the other), each syncer class takes from its :class:`~poseidon_aio.plan.cost.Scheme`.

A scheme is added by writing its class and listing it in :data:`SYNCERS`; the trainer, the
information book and the cost model's explain read these attributes.
"""

from __future__ import annotations

import abc
import asyncio
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Awaitable, Callable, ClassVar, Mapping, Optional

from ..errors import ConfigError, SyncTimeout
from ..net.endpoint import silence
from ..plan.cost import Scheme
from .bucket import Bucket


@dataclass(slots=True)
class SyncResult:
    """What one sync cost: payload bytes this rank put on and took off a network (an in-process
    link not counted), the ranks a shard dropped from the aggregate (straggler policy), and the
    compute the sync did itself (``(what, start, end)``, ``time.perf_counter`` seconds: SFB's
    rebuild), for the trace."""

    bytes_sent: int = 0
    bytes_received: int = 0
    dropped: tuple = ()
    work: tuple = ()


@dataclass
class SyncContext:
    """What syncers are built from.

    Attributes:
        rank, world: this worker and how many there are.
        peers: ``{rank: link}`` of the worker mesh.
        timeout: seconds any one sync may take (``PSConfig.sync_timeout``).
        node: the parameter-server node, when a scheme in use keeps layers there.
        ps_index: model manifest index -> the parameter server's manifest index.
        reconstruct: the sufficient-factor kernel, ``reconstruct(us, vs, scale, out_w, out_b)``
            (the trainer passes torch's or CuPy's; ``sync`` itself stays torch-free).
        executor: the thread reconstructions run on.
        chunk_bytes: the largest message a scheme sends at once (``PSConfig.chunk_bytes``).
        allreduce: how all-reduce buckets move, ``"auto"``, ``"ring"`` or ``"direct"`` (``AllReduceConfig.algorithm``).
        compression: the lossy schemes' settings (``plan.lossy.CompressionConfig``).
        feedback: this worker's error-feedback state (``sync.compress.Feedback``), kept by the
            trainer across syncer rebuilds and in its checkpoints.
        topology: the job's hosts (``cluster.topology.Topology``); ``None``, or one worker a
            host: every worker a peer of its own on the network.
    """

    rank: int
    world: int
    peers: Mapping[int, object]
    timeout: float
    node: object = None
    ps_index: Mapping[int, int] = field(default_factory=dict)
    reconstruct: Optional[Callable] = None
    executor: Optional[Executor] = None
    chunk_bytes: int = 2 << 20
    allreduce: str = "auto"
    compression: object = None
    feedback: object = None
    topology: object = None

    @property
    def by_host(self):
        """``topology`` where its hosts run several workers each (the schemes by host), else ``None``."""
        topology = self.topology
        return topology if topology is not None and topology.by_host else None


class Syncer(abc.ABC):
    """Synchronizes buckets of one scheme."""

    scheme: ClassVar[Scheme]
    on_ps: ClassVar[bool] = False
    factored: ClassVar[bool] = False
    captures_factors: ClassVar[bool] = False
    mergeable: ClassVar[bool] = False
    rounds: ClassVar[int] = 1
    host_outs: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        scheme = cls.__dict__.get("scheme")
        if scheme is not None:  # the planners read these of the scheme: one place for both
            cls.captures_factors = scheme.captures_factors
            cls.mergeable = scheme.mergeable
            cls.rounds = scheme.rounds

    @classmethod
    @abc.abstractmethod
    def build(cls, ctx: SyncContext) -> "Syncer":
        """A syncer for this job."""

    @abc.abstractmethod
    def start(self, bucket: Bucket, clock: int) -> Awaitable[SyncResult]:
        """Start synchronizing ``bucket`` for ``clock``; the awaitable resolves once every
        ``bucket.outs`` holds its result.

        Raises (from the awaitable):
            SyncTimeout, ConnectionLost, WorkerLeft, RemoteProtocolError: the message names the
                layer, the clock and the peer or shard.
        """


async def within(aw, timeout: float, waits, what: Callable[[list], str]):
    """``await aw`` within ``timeout`` seconds.

    Raises:
        SyncTimeout: ``what(late)``, ``late`` the ranks of ``waits`` (``(rank, future)`` pairs)
            never heard from (a wait the timeout cancelled did not arrive).
    """
    fut = asyncio.ensure_future(aw)
    # Cancelled with the sync (a sibling failed, SIGTERM), a gather ends holding a CancelledError
    # that nobody awaits any more: read it here, or the loop reports it as never retrieved.
    fut.add_done_callback(silence)
    try:
        return await asyncio.wait_for(fut, timeout)
    except TimeoutError:
        late = sorted({q for q, f in waits if f.cancelled() or not f.done()})
        raise SyncTimeout(what(late)) from None


SYNCERS: dict = {}


def register(cls: type) -> type:
    """Class decorator: make ``cls`` the syncer of ``cls.scheme``."""
    SYNCERS[cls.scheme] = cls
    return cls


def syncer_class(scheme: Scheme) -> type:
    cls = SYNCERS.get(scheme)  # a Scheme: the hot path (several calls a layer a step); Scheme() costs more
    if cls is not None:
        return cls
    try:
        return SYNCERS[Scheme(scheme)]
    except (KeyError, ValueError):
        raise ConfigError(f"no syncer for scheme {scheme!r}; known: {sorted(s.value for s in SYNCERS)}") from None
