"""Sufficient factor broadcasting (Poseidon 2015 §4.3, ATC'17 §3.2), for fully-connected layers.

The batch gradient of an M×N weight is ``sum_k u_k^T v_k``: each worker sends its K rows of ``u``
(the output's gradient) and ``v`` (the input) to every peer over the worker mesh, and every worker
rebuilds the mean gradient with one GEMM over all ranks' rows in rank order — the same inputs in
the same order through the same kernel, so every replica gets the same bits. The bias gradient is
the mean of ``sum_k u_k``.
"""

from __future__ import annotations

import asyncio
import time

from ..net.endpoint import silence
from ..errors import SyncTimeout
from ..wire import Kind
from ..plan.cost import Scheme
from ..wire import factors
from .bucket import Bucket
from .syncer import SyncContext, Syncer, SyncResult


class SFBSyncer(Syncer):
    """The SFB scheme between workers that are each a peer of their own (the scheme's registered
    syncer, :class:`~poseidon_aio.sync.hierarchical_sfb.HierarchicalSFB`, builds it where every
    host runs one worker).

    Args:
    rank, world: this worker and how many there are.
    peers: ``{rank: link}`` to every other worker.
    reconstruct: ``reconstruct(us, vs, scale, out_w, out_b)``, the kernel (torch or CuPy).
    executor: the thread it runs on (the GEMM releases the GIL; the loop keeps moving bytes).
    timeout: seconds to wait for every peer's factors.
    """

    scheme = Scheme.SFB
    host_outs = False  # the reconstruction kernel writes the (device) tensors

    def __init__(self, rank: int, world: int, peers, reconstruct, executor, timeout: float) -> None:
        self.rank = rank
        self.world = world
        self._peers = dict(peers)
        self._reconstruct = reconstruct
        self._executor = executor
        self._timeout = timeout

    @classmethod
    def build(cls, ctx: SyncContext) -> "SFBSyncer":
        return cls(ctx.rank, ctx.world, ctx.peers, ctx.reconstruct, ctx.executor, ctx.timeout)

    def start(self, bucket: Bucket, clock: int) -> asyncio.Task:
        return asyncio.ensure_future(self._sync(bucket, clock))

    async def _sync(self, bucket: Bucket, clock: int) -> SyncResult:
        key = bucket.layers[0]
        m, n = bucket.shape
        u, v = bucket.factors
        waits = {r: conn.expect(Kind.FACTORS, key, clock) for r, conn in self._peers.items()}
        parts = factors.encode(u, v)
        arrived = asyncio.gather(*waits.values())
        arrived.add_done_callback(silence)  # (cancelled with the sync: its outcome is no news)
        try:
            await asyncio.gather(
                *(
                    conn.send(Kind.FACTORS, parts, key=key, clock=clock, dtype=factors.DTYPE, priority=bucket.priority)
                    for conn in self._peers.values()
                )
            )
            frames = await asyncio.wait_for(arrived, self._timeout)
        except asyncio.CancelledError:
            for w in waits.values():
                w.cancel()
            raise
        except TimeoutError:
            # (The timeout cancelled the waits still open: those are the ranks that never sent.)
            missing = sorted(r for r, w in waits.items() if w.cancelled() or not w.done())
            raise SyncTimeout(
                f"rank {self.rank}: sufficient factors of layer {bucket.label} at clock {clock} did not arrive from "
                f"ranks {missing} within {self._timeout} s"
            ) from None
        us, vs = [None] * self.world, [None] * self.world
        us[self.rank], vs[self.rank] = u, v
        for r, frame in zip(waits, frames):
            us[r], vs[r] = factors.decode(frame, m, n, what=f"layer {bucket.label} at clock {clock}")
        out_w = bucket.outs[0]
        out_b = bucket.outs[1] if len(bucket.outs) > 1 else None
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        await loop.run_in_executor(self._executor, self._reconstruct, us, vs, 1.0 / self.world, out_w, out_b)
        rebuilt = ((f"rebuild {bucket.label}", started, time.perf_counter()),)
        return SyncResult(
            factors.nbytes(u.shape[0], m, n) * len(self._peers), sum(f.header.length for f in frames), work=rebuilt
        )
