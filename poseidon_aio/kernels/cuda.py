"""The CuPy kernels, for layers that live on a GPU. Imported only when ``cupy.cuda.is_available()``."""

from __future__ import annotations

from typing import Sequence

import cupy
import numpy as np
import torch


def _cp(t):
    if isinstance(t, np.ndarray):  # a peer's factors, received in host memory: upload them
        return cupy.asarray(t)
    return cupy.from_dlpack(torch.utils.dlpack.to_dlpack(t.contiguous()))


def reconstruct(us: Sequence, vs: Sequence, scale: float, out_weight: torch.Tensor, out_bias=None) -> None:
    with cupy.cuda.ExternalStream(torch.cuda.current_stream(out_weight.device).cuda_stream):
        # The scale on u before the GEMM, as the torch kernel does (same rounding on every replica).
        u = cupy.concatenate([_cp(x) for x in us], axis=0) * cupy.float32(scale)
        v = cupy.concatenate([_cp(x) for x in vs], axis=0)
        w = _cp(out_weight)
        cupy.matmul(u.T, v, out=w)
        if out_bias is not None:
            b = _cp(out_bias)
            cupy.sum(u, axis=0, out=b)
