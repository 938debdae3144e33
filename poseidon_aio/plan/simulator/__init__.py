"""A discrete-event simulator of one training iteration, on the trainer's own plans.

Three jobs, one module each: ``iteration`` works out what the trainer would decide (schemes, the
calibrated link, merge plans) and returns an :class:`Iteration`; ``events`` runs that iteration's
compute and messages in time order; ``network`` is the NICs' FIFO links and what fan-in costs
them. How close it comes to the emulated cluster is in bench/RESULTS.md ("Simulator, 1 to 1024
workers" and the sections after it that compare the two).

    >>> from poseidon_aio.plan.models import trace
    >>> from poseidon_aio.plan import Link
    >>> it = simulate(trace("resnet50"), 8, rate=6e12, link=Link.of_bandwidth(10e9 / 8, 45e-6), mode="wfbp")
    >>> it.time > it.compute
    True
"""

from .events import DDP_BUCKET_BYTES, DDP_FIRST_BUCKET_BYTES
from .iteration import DDP, MODES, Iteration, Simulator, simulate
from .network import FlowEfficiency

__all__ = [
    "DDP",
    "DDP_BUCKET_BYTES",
    "DDP_FIRST_BUCKET_BYTES",
    "FlowEfficiency",
    "Iteration",
    "MODES",
    "Simulator",
    "simulate",
]
