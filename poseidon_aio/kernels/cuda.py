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


def _torch_stream(device):
    """torch's current stream on ``device`` as a CuPy stream: the kernels queue behind the
    backward's work and ahead of the optimizer's."""
    stream = torch.cuda.current_stream(device)
    from_external = getattr(cupy.cuda.Stream, "from_external", None)  # CuPy 14 (ExternalStream deprecated)
    if from_external is not None:
        try:
            return from_external(stream)  # torch's stream speaks the CUDA stream protocol
        except (TypeError, AttributeError, ValueError):
            pass  # an older torch: wrap its handle
    return cupy.cuda.ExternalStream(stream.cuda_stream)


def reconstruct(us: Sequence, vs: Sequence, scale: float, out_weight: torch.Tensor, out_bias=None) -> None:
    with _torch_stream(out_weight.device):
        # The scale on u before the GEMM, as the torch kernel does (same rounding on every replica).
        u = cupy.concatenate([_cp(x) for x in us], axis=0) * cupy.float32(scale)
        v = cupy.concatenate([_cp(x) for x in vs], axis=0)
        w = _cp(out_weight)
        cupy.matmul(u.T, v, out=w)
        if out_bias is not None:
            b = _cp(out_bias)
            cupy.sum(u, axis=0, out=b)
