"""SF reconstruction: the CPU kernel against autograd, and the CuPy kernel against the CPU one."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from poseidon_aio import kernels
from poseidon_aio.kernels import cpu


@settings(max_examples=30, deadline=None)
@given(
    workers=st.integers(1, 4),
    rows=st.integers(1, 9),
    m=st.integers(1, 20),
    n=st.integers(1, 20),
    seed=st.integers(0, 99),
)
def test_reconstruction_equals_the_mean_of_autograd_gradients(workers, rows, m, n, seed):
    g = torch.Generator().manual_seed(seed)
    layer = torch.nn.Linear(n, m)
    grads_w, grads_b, us, vs = [], [], [], []
    for _ in range(workers):
        x = torch.randn(rows, n, generator=g)
        layer.zero_grad()
        out = layer(x)
        gout = torch.randn(rows, m, generator=g)
        out.backward(gout)
        grads_w.append(layer.weight.grad.clone())
        grads_b.append(layer.bias.grad.clone())
        us.append(gout)
        vs.append(x)
    w, b = torch.empty(m, n), torch.empty(m)
    cpu.reconstruct(us, vs, 1.0 / workers, w, b)
    torch.testing.assert_close(w, torch.stack(grads_w).mean(0), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b, torch.stack(grads_b).mean(0), rtol=1e-5, atol=1e-5)


def test_reconstruction_is_deterministic():
    us = [torch.randn(7, 30) for _ in range(3)]
    vs = [torch.randn(7, 40) for _ in range(3)]
    outs = []
    for _ in range(2):
        w = torch.empty(30, 40)
        kernels.reconstruct(us, vs, 1 / 3, w)
        outs.append(w)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.skipif(
    not kernels.cuda_available(), reason="no CUDA GPU (or CuPy) on this machine: the CuPy kernels cannot run"
)
def test_cupy_kernel_matches_the_cpu_reference():
    us = [torch.randn(16, 300) for _ in range(4)]
    vs = [torch.randn(16, 200) for _ in range(4)]
    w_cpu, b_cpu = torch.empty(300, 200), torch.empty(300)
    cpu.reconstruct(us, vs, 0.25, w_cpu, b_cpu)
    dev = torch.device("cuda")
    w_gpu, b_gpu = torch.empty(300, 200, device=dev), torch.empty(300, device=dev)
    kernels.reconstruct([u.to(dev) for u in us], [v.to(dev) for v in vs], 0.25, w_gpu, b_gpu)
    torch.testing.assert_close(w_gpu.cpu(), w_cpu, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b_gpu.cpu(), b_cpu, rtol=1e-5, atol=1e-5)
