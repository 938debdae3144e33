"""The torch kernels: the reference the CuPy ones are held to."""

from __future__ import annotations

from typing import Sequence

import torch


def reconstruct(us: Sequence[torch.Tensor], vs: Sequence[torch.Tensor], scale: float, out_weight: torch.Tensor, out_bias=None) -> None:
    u = torch.cat(list(us), dim=0) if len(us) > 1 else us[0]
    v = torch.cat(list(vs), dim=0) if len(vs) > 1 else vs[0]
    # One GEMM over all workers' rows: (sum K) x M transposed times (sum K) x N.
    torch.mm(u.t(), v, out=out_weight)
    if scale != 1.0:
        out_weight.mul_(scale)
    if out_bias is not None:
        torch.sum(u, dim=0, out=out_bias)
        if scale != 1.0:
            out_bias.mul_(scale)
