"""What the simulator's tests (tests/test_simulate*.py) share: a run, a one-layer trace, a random
trace, and the one layer the hand cases work out."""

from __future__ import annotations

from hypothesis import strategies as st

from poseidon_aio.plan.cost import Link
from poseidon_aio.plan.models import trace_of
from poseidon_aio.plan.simulator import Simulator

K = 32
TEN_GBE = Link.of_bandwidth(10e9 / 8, alpha=45.26e-6)


def fc_trace(m: int, n: int, *, bias: bool = False, rows: int = K):
    shapes = [(m, n), (m,)] if bias else [(m, n)]
    return trace_of("fc", [("fc", shapes, 2 * rows * m * n)], batch=rows)


def run(tr, workers, **kw):
    merge = kw.pop("merge", None)
    return Simulator(tr, workers, **kw).run(merge)


# -- the hand cases' layer: one 1024 x 1024 weight -----------------------------------------------

M = N = 1024
RATE = 1e12
ALPHA, BETA = 50e-6, 1e-9
B = 4 * M * N  # the layer's bytes
T_F = 2 * K * M * N / RATE  # its forward


def _random_trace(draw):
    layers = []
    for i in range(draw(st.integers(1, 8))):
        if draw(st.booleans()):
            m, n = draw(st.sampled_from([16, 256, 1024, 4096])), draw(st.sampled_from([16, 256, 1024, 4096]))
            layers.append((f"fc{i}", [(m, n), (m,)], 2 * K * m * n))
        else:
            c, d, hw = (
                draw(st.sampled_from([16, 64, 256])),
                draw(st.sampled_from([16, 64, 256])),
                draw(st.sampled_from([7, 14, 56])),
            )
            layers.append((f"conv{i}", [(d, c, 3, 3), (d,)], 2 * K * c * d * 9 * hw * hw))
    return trace_of("random", layers, batch=K)
