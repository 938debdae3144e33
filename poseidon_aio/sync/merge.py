"""MG-WFBP merging as a wrapper around a syncer: the buckets of one merge group travel as one.

The trainer starts every layer's bucket the moment it is ready. :class:`Merging` holds the
buckets of a group until the last of them (the one nearest the input: backward runs from the
output) is there, then starts the wrapped syncer once on their concatenation; every member's
awaitable resolves with that one sync.
"""

from __future__ import annotations

import asyncio
from typing import Sequence

from ..errors import ConfigError
from .bucket import Bucket
from .syncer import Syncer, SyncResult


class Merging(Syncer):
    """Args:
    inner: the syncer a merged bucket goes to (a ``mergeable`` one: the PS, all-reduce).
    groups: layer indices that travel together, each group in model order; a layer in no
        group (or alone in one) goes on its own.
    """

    def __init__(self, inner: Syncer, groups: Sequence[Sequence[int]]) -> None:
        self.inner = inner
        self.scheme = inner.scheme
        self.mergeable = True
        self.groups = [tuple(g) for g in groups]
        self._group_of = {layer: g for g, members in enumerate(self.groups) if len(members) > 1 for layer in members}
        self._waiting: dict = {}  # (group, clock) -> {layer: (bucket, future)}

    @classmethod
    def build(cls, ctx) -> "Merging":  # pragma: no cover - made around a built syncer
        raise ConfigError("Merging wraps a built syncer: Merging(inner, groups)")

    def start(self, bucket: Bucket, clock: int):
        (layer,) = bucket.layers
        g = self._group_of.get(layer)
        if g is None:
            return self.inner.start(bucket, clock)
        fut = asyncio.get_running_loop().create_future()
        entry = self._waiting.setdefault((g, clock), {})
        entry[layer] = (bucket, fut)
        members = self.groups[g]
        if len(entry) == len(members):
            del self._waiting[(g, clock)]
            merged = Bucket.merged([entry[m][0] for m in members])
            task = asyncio.ensure_future(self.inner.start(merged, clock))
            futures = [entry[m][1] for m in members]
            task.add_done_callback(lambda t: _settle(t, futures))
            for f in futures:  # a member given up on (the step failed) gives the message up
                f.add_done_callback(lambda f: f.cancelled() and task.cancel())
        return fut

    def start_group(self, buckets: Sequence[Bucket], clock: int) -> asyncio.Future:
        """A whole group's buckets at once, any order: one message, no future per member (the
        trainer holds a group's layers until the last is in, then hands them over together).

        Raises:
            ConfigError: the buckets are not exactly one group's layers.
        """
        by_layer = {b.layers[0]: b for b in buckets}
        g = self._group_of.get(buckets[0].layers[0]) if buckets else None
        if g is None or set(by_layer) != set(self.groups[g]) or len(by_layer) != len(buckets):
            raise ConfigError(
                f"a merged message takes one whole merge group; got layers {sorted(by_layer)} (groups {self.groups})"
            )
        return asyncio.ensure_future(self.inner.start(Bucket.merged([by_layer[m] for m in self.groups[g]]), clock))

    def start_merged(self, bucket: Bucket, clock: int) -> asyncio.Future:
        """A whole group's bucket, made as one (``Bucket.flat``): one message.

        Raises:
            ConfigError: the bucket's layers are not one merge group's.
        """
        g = self._group_of.get(bucket.layers[0]) if bucket.layers else None
        if g is None or bucket.layers != self.groups[g]:
            raise ConfigError(
                f"a merged message takes one whole merge group; got layers {list(bucket.layers)} (groups {self.groups})"
            )
        return asyncio.ensure_future(self.inner.start(bucket, clock))


def _settle(task: asyncio.Task, futures: list) -> None:
    for fut in futures:
        if fut.done():
            continue
        if task.cancelled():
            fut.cancel()
        elif task.exception() is not None:
            fut.set_exception(task.exception())
            fut.exception()  # the trainer awaits every member; no "never retrieved" report for the rest
        else:
            # The group's bytes count once: on the first member, the others report none.
            fut.set_result(task.result() if fut is futures[0] else SyncResult(dropped=task.result().dropped))
