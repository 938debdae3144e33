"""The trainer's threads run the caller's intra-op threads: OpenMP keeps the count per thread."""

from __future__ import annotations

import ctypes
import glob
import os
import threading

import pytest
import torch

from poseidon_aio.train.trainer import _as_caller


def openmp():
    """torch's libgomp, or skip (a build without OpenMP has no per-thread count to check)."""
    found = glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp*"))
    if not found:
        pytest.skip("this torch has no libgomp")
    return ctypes.CDLL(found[0])


def in_a_new_thread(fn):
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def test_a_thread_of_ours_runs_as_many_intra_op_threads_as_its_caller():
    omp = openmp()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        init = _as_caller(torch.get_num_threads())
        assert in_a_new_thread(lambda: (init(), omp.omp_get_max_threads())[1]) == 1
    finally:
        torch.set_num_threads(before)
