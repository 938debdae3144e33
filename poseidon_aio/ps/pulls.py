"""Parameters served to workers that pull them: rank 0's start-up values, and with server-side SGD
each new version, to the ranks that asked for that message at that clock."""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from ..wire import Kind


class Pulls:
    """Who waits for which message's parameters at which clock.

    Args:
        send: ``send(rank, frames)`` queues frames for a worker.
        dtypes: ``{message id: wire DType}``.
    """

    def __init__(self, send: Callable[[int, list], None], dtypes: dict) -> None:
        self._send = send
        self._dtypes = dtypes
        self._init: dict = {}  # message -> (clock, rank 0's start-up values) until every worker has them
        self._waiting: dict = {}  # (message, clock) -> ranks

    def initial(self, mid: int, clock: int, values: np.ndarray) -> None:
        """Rank 0's start-up values of message ``mid`` (one per message: a peer cannot grow it)."""
        self._init[mid] = (clock, values)

    def started(self, mid: int) -> None:
        """Every worker has the start-up values (it pushed): forget them."""
        self._init.pop(mid, None)

    def ask(self, rank: int, mid: int, clock: int) -> None:
        self._waiting.setdefault((mid, clock), set()).add(rank)

    def answer(self, mid: int, clock: int, version: Callable[[], Optional[np.ndarray]]) -> None:
        """Send message ``mid``'s values at ``clock`` to the ranks that asked, where they exist: the
        start-up values, else ``version()`` (``None``: not yet)."""
        ranks = self._waiting.get((mid, clock))
        if not ranks:
            return
        init = self._init.get(mid)
        values = init[1] if init is not None and init[0] == clock else None
        if values is None:
            values = version()
        if values is None:
            return
        for r in sorted(ranks):
            self._send(r, [(Kind.PARAMS, values, mid, clock, self._dtypes[mid])])
        del self._waiting[(mid, clock)]


__all__ = ["Pulls"]
