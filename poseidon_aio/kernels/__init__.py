"""Sufficient-factor reconstruction and gradient application: torch on CPU, CuPy on CUDA.

For an ``nn.Linear`` (weight M×N) the batch gradient is ``sum_k u_k^T v_k`` with ``u`` the rows of
the output's gradient (K×M) and ``v`` the rows of the input (K×N). Every worker concatenates all
workers' factors in rank order and rebuilds the (mean) gradient with one GEMM; the same inputs in
the same order through the same kernel give every replica the same bits.

``reconstruct`` dispatches on where the result goes (:func:`kernel_for`): a CUDA tensor to the
CuPy kernel when ``cupy.cuda.is_available()``, everything else to the torch kernel, which is the
tested reference (and also runs on a GPU without CuPy). Factors may be host arrays (a peer's,
as received) or tensors; the kernel moves them to the result's device.
"""

from __future__ import annotations

from typing import Sequence

import torch

from . import cpu

_cuda_kernels = None


def cuda_available() -> bool:
    """Whether the CuPy kernels can run here (CuPy importable and a GPU present)."""
    try:
        import cupy
    except ImportError:
        return False
    try:
        return bool(cupy.cuda.is_available())
    except Exception:  # noqa: BLE001 - a broken CUDA install means "no GPU" to us
        return False


def _cuda():
    global _cuda_kernels
    if _cuda_kernels is None:
        from . import cuda as _cuda_kernels_module

        _cuda_kernels = _cuda_kernels_module
    return _cuda_kernels


def kernel_for(out: torch.Tensor) -> str:
    """``"cupy"`` or ``"torch"``: the kernel :func:`reconstruct` runs for a result in ``out``."""
    return "cupy" if out.device.type == "cuda" and cuda_available() else "torch"


def reconstruct(us: Sequence, vs: Sequence, scale: float, out_weight: torch.Tensor, out_bias=None) -> None:
    """Write ``scale * sum_p u_p^T v_p`` into ``out_weight`` and ``scale * sum_p sum_k u_p`` into
    ``out_bias`` (if given), factors taken in the given (rank) order."""
    if kernel_for(out_weight) == "cupy":
        _cuda().reconstruct(us, vs, scale, out_weight, out_bias)
    else:
        cpu.reconstruct(us, vs, scale, out_weight, out_bias)


__all__ = ["reconstruct", "kernel_for", "cuda_available", "cpu"]
