"""The MG-WFBP runtime: calibrate the link, measure warm-up steps, plan once, agree.

At start-up the ranks time push/reply round trips of several sizes around a ring
(:func:`calibrate`; HybComm's link, ``plan.merging.link_of``, is fit from them).
For ``MergeConfig.after`` steps the trainer reports, per mergeable scheme (PS, all-reduce,
PowerSGD, top-k), each step's forward time, when each of its layers' gradient was ready, and the
intervals its syncs ran; then rank 0 plans (``plan.merging.MergePlanner``: the per-byte cost refit
from those syncs, then ``mgwfbp.merge_plan``, ``mgwfbp.optimal_plan`` or, for ``best``, every
planner of ``BEST_PLANNERS``), publishes the plans, and every rank checks their hash before
adopting them. Each plan that merges then runs for ``MergeConfig.trial`` steps, one after the
other, and the fastest is kept only if the job's step got faster than in the warm-up
(``sync.trial``); otherwise every layer goes back to its own message.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Mapping, Optional, Sequence

import numpy as np

from ..errors import SyncTimeout
from ..plan.cost import Scheme
from ..plan.merging import MergeConfig, MergePlanner
from ..plan.mgwfbp import fit
from ..wire import Kind

# Mesh frames of the calibration: keys no layer reaches, clocks far past any training clock.
_CALIBRATION_KEY = 7
_CALIBRATION_CLOCK = 1 << 61


async def calibrate(
    rank: int,
    world: int,
    peers: Mapping[int, object],
    sizes: Sequence[int],
    timeout: float,
    cpu: Optional[list] = None,
    ring: Optional[Sequence[int]] = None,
) -> list:
    """Round trips around the ring of ranks shaped like a PS sync (a PUSH out, an AGGREGATE of
    the same size back), three per size, while the links are idle: ``[(bytes, seconds)]``.

    ``cpu``: where given, gets ``(bytes, seconds)`` of this thread's (the event loop's) CPU for
    each round trip, which moves its size through this loop four times (out, in, out, in).
    ``ring``: the ranks in ring order, this one among them (default: every rank): one rank of
    each host measures the links between hosts, a host's ranks the link inside it."""
    ring = list(ring) if ring is not None else list(range(world))
    at = ring.index(rank)
    nxt, prv = peers[ring[(at + 1) % len(ring)]], peers[ring[(at - 1) % len(ring)]]
    samples = []
    for i, size in enumerate(sizes):
        payload = np.zeros(size, dtype=np.uint8)
        # The ranks leave the start-up broadcast at different times, so the very first round trip
        # waits for a neighbour: it lines the ring up and is not timed (bench/RESULTS.md, "Training
        # step time vs DDP: a message's cost to the backward, and the 2-worker rows").
        for rep in range(4 if i == 0 else 3):
            clock = _CALIBRATION_CLOCK + 10 * i + rep
            back = nxt.expect(Kind.AGGREGATE, _CALIBRATION_KEY, clock)
            incoming = prv.expect(Kind.PUSH, _CALIBRATION_KEY, clock)
            started, cpu_started = time.perf_counter(), time.thread_time()
            await nxt.send(Kind.PUSH, payload, key=_CALIBRATION_KEY, clock=clock)
            try:
                await asyncio.wait_for(incoming, timeout)
                await prv.send(Kind.AGGREGATE, payload, key=_CALIBRATION_KEY, clock=clock)
                await asyncio.wait_for(back, timeout)
            except TimeoutError:
                raise SyncTimeout(
                    f"rank {rank}: a calibration message of {size} bytes did not come back "
                    f"from rank {nxt.peer_rank} within {timeout} s"
                ) from None
            if i == 0 and rep == 0:
                continue
            samples.append((size, time.perf_counter() - started))
            if cpu is not None:
                cpu.append((size, time.thread_time() - cpu_started))
    return samples


def loop_cpu_per_byte(cpu: Sequence[tuple]) -> float:
    """The event loop's CPU seconds per byte it sends or receives, from :func:`calibrate`'s
    ``cpu`` samples (0 without two sizes)."""
    if len({size for size, _ in cpu}) < 2:
        return 0.0
    return fit(*zip(*cpu)).b / 4


class MergeRuntime(MergePlanner):
    """Measures, plans and agrees on the merging of one scheme's layers: a
    :class:`~poseidon_aio.plan.merging.MergePlanner` that knows the step clock and its rank.

    Args:
        config: :class:`~poseidon_aio.plan.merging.MergeConfig` (a planned kind).
        rank, world, shards: this worker, P1 and P2.
        scheme: the mergeable scheme whose layers it merges (PS, all-reduce, PowerSGD, top-k).
        calibration: the start-up round trips (:func:`calibrate`), shared by every scheme.
    """

    def __init__(
        self,
        config: MergeConfig,
        rank: int,
        world: int,
        shards: int,
        scheme: Scheme = Scheme.PS,
        calibration: Sequence[tuple] = (),
        first: int = 0,
    ) -> None:
        super().__init__(config, world, shards, scheme, calibration)
        self.rank = rank
        self.first = first  # the first measured clock

    def measuring(self, clock: int) -> bool:
        return self.first <= clock < self.first + self.config.after

    def due(self, clock: int) -> bool:
        """Whether the plan is made after the step of ``clock``."""
        return clock == self.first + self.config.after - 1

    async def agree(
        self, rdzv, generation: int, layers: Sequence[int], names: Sequence[str], sizes: Sequence[int]
    ) -> dict:
        """Rank 0 plans and publishes; every rank reads the plan and checks its hash.

        Raises:
            ManifestMismatch: a rank computed another plan (different code or settings).
            PeerTimeout: rank 0 did not publish one.
        """
        key = f"merge-plan/{self.scheme.value}/{generation}"
        if self.rank == 0:
            await rdzv.publish(key, json.dumps(self.plan(layers, names, sizes)))
        text = await rdzv.read(key, who="rank 0")
        await rdzv.check_digest(f"{self.scheme.value} merge plan {generation}", text)
        return json.loads(text)
