"""The Project-Adam scheme on the shard: the mean gradient of a fully-connected layer rebuilt from
the contributing workers' sufficient factors with one GEMM, in rank order."""

from __future__ import annotations

import numpy as np

from ..cluster.book import InformationBook


def rebuild(book: InformationBook, params: tuple, messages: tuple, factors: dict, contributors: list) -> list:
    """``[(message, payload)]`` of a layer's messages from ``factors`` (rank -> ``(u, v)``).

    ``(sum u_r^T v_r) / len(contributors)`` for the weight and ``(sum_r sum_k u_r) / len(...)``
    for the bias, ranks in the given (sorted) order, so every shard computes the same bits.
    """
    us = np.concatenate([factors[r][0] for r in contributors])
    vs = np.concatenate([factors[r][1] for r in contributors])
    scale = np.float32(1.0 / len(contributors))
    flat = [((us.T @ vs) * scale).reshape(-1), us.sum(axis=0) * scale]
    values = {params[i]: flat[i] for i in range(len(params))}
    out = []
    for msg in messages:
        parts = book.slices(msg, values)
        out.append((msg, np.concatenate(parts) if len(parts) > 1 else parts[0]))
    return out
