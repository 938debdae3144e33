"""What test_lossy.py and test_lossy_syncers.py share: seeded gradients, a lossy scheme's
pure steps run on every worker with the mesh replaced by its arithmetic, and layer shapes to draw."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from poseidon_aio.sync import Feedback
from poseidon_aio.sync.compress import TopKStep, rank_order_mean


def _gradients(seed: int, world: int, steps: int, shapes, scale: float = 1.0) -> list:
    rng = np.random.default_rng(seed)
    return [
        [[(scale * rng.standard_normal(s)).astype(np.float32) for s in shapes] for _ in range(world)]
        for _ in range(steps)
    ]


def _simulate(make_step, grads_by_step, world: int):
    """Run a lossy scheme's pure steps on ``world`` workers, the mesh replaced by its arithmetic
    (rank_order_mean); return each step's result (asserting every replica's is the same bits)
    and the workers' Feedback."""
    feedback = [Feedback() for _ in range(world)]
    results = []
    for grads in grads_by_step:
        steps = [make_step(grads[w], feedback[w]) for w in range(world)]
        if isinstance(steps[0], TopKStep):
            parts = [s.begin() for s in steps]
            outs = [s.finish(parts) for s in steps]
        else:
            p = rank_order_mean([s.begin() for s in steps])
            q = rank_order_mean([s.middle(p) for s in steps])
            outs = [s.finish(q) for s in steps]
        for w in range(1, world):
            assert all(a.tobytes() == b.tobytes() for a, b in zip(outs[0], outs[w])), "replicas differ"
        results.append(outs[0])
    return results, feedback


layer_shapes = st.lists(
    st.tuples(st.integers(2, 12), st.integers(2, 12), st.booleans()).map(
        lambda d: [(d[0], d[1]), (d[0],)] if d[2] else [(d[0], d[1])]
    ),
    min_size=2,
    max_size=4,
)
