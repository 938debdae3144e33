"""The PowerSGD scheme (Vogels et al., NeurIPS 2019): rank-r power iteration with error feedback.

Per layer and step, around two all-reduces over the worker mesh (``MeshExchange``, exact float32
sums in rank order, payloads in ``wire/lowrank.py``): ``P = M Q`` with ``M`` the gradient plus
the last step's error (the bias appended, exact), all-reduced, orthonormalized on every rank;
``Q = M^T P_hat``, all-reduced; the result is ``P_hat Q_mean^T``. The arithmetic is
:class:`~poseidon_aio.sync.compress.PowerSGDStep`'s. For an m x n matrix that moves r (m + n)
floats instead of mn: a 512 x 4608 convolution at r = 4 sends 20 480 floats, not 2.4 million.

Such messages are small, so their start-up (two rounds of the mesh, three hops to the compute
thread) weighs: MG-WFBP merges consecutive PowerSGD layers like exact ones, its message size a
layer's factor bytes (``plan.lossy.message_bytes``), its start-up two rounds'.
"""

from __future__ import annotations

from ..plan.cost import Scheme
from ..wire import lowrank
from .compress import PowerSGDStep
from .exchange import LossySyncer
from .syncer import Syncer, SyncResult, register

PHASE_P, PHASE_Q = 0, 1


@register
class PowerSGDSyncer(LossySyncer, Syncer):
    """Args:
    mesh: the worker's :class:`~poseidon_aio.sync.exchange.MeshExchange`.
    config: the job's :class:`~poseidon_aio.plan.lossy.CompressionConfig` (its ``rank``).
    feedback: the worker's error-feedback state (errors and warm-started Q per layer).
    """

    # MG-WFBP may merge consecutive PowerSGD layers (``Scheme.mergeable``): one P and one Q
    # all-reduce for the group (as DDP's hook does per bucket), the state still per layer
    # (``PowerSGDStep``'s members). P, then Q from it: a message starts up twice (``Scheme.rounds``).
    scheme = Scheme.POWERSGD

    async def _sync(self, bucket, clock: int) -> SyncResult:
        step = PowerSGDStep(bucket.label, bucket.grads, self.config.rank, self.feedback, bucket.members)
        layer, what = bucket.layers[0], f"layer {bucket.label}"
        p = await self._mesh.run((layer, "begin"), step.begin)
        p_mean, sent_p, received_p = await self._mesh.allreduce(
            p,
            lowrank,
            layer=layer,
            phase=PHASE_P,
            clock=clock,
            what=f"PowerSGD's P of {what}",
            priority=bucket.priority,
        )
        q = await self._mesh.run((layer, "middle"), step.middle, p_mean)
        q_mean, sent_q, received_q = await self._mesh.allreduce(
            q,
            lowrank,
            layer=layer,
            phase=PHASE_Q,
            clock=clock,
            what=f"PowerSGD's Q of {what}",
            priority=bucket.priority,
        )
        arrays = await self._mesh.run((layer, "finish"), step.finish, q_mean)
        self._land(bucket, arrays)
        return SyncResult(sent_p + sent_q, received_p + received_q)
