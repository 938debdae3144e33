"""bench's CPU a step: every rank's CPU over its timed steps ÷ steps, summed over the ranks."""

import pytest

from bench import job_cpu


def test_a_lump_in_one_step_counts_in_full():
    # Another thread's CPU, charged late, lands in one step's delta: 6 ms spent over 10 steps.
    lumpy = {"cpu": [0.001] * 9 + [0.007]}
    even = {"cpu": [0.002] * 10}
    assert job_cpu([lumpy, even]) == pytest.approx(0.0016 + 0.002)
    assert job_cpu([lumpy]) > sorted(lumpy["cpu"])[5]  # where the median of the steps would be
