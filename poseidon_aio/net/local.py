"""An in-process link: a worker and the parameter-server shard its own process hosts.

It offers what a :class:`~poseidon_aio.net.connection.Connection` offers the layers above, minus
the socket: a frame is handed over by reference and its payload copied once, straight into the
receiver's destination (the shard's receive slot, the worker's output tensor). Through loopback
TCP the same bytes would be copied twice and cost two system calls per 64 KiB; with one shard per
worker this is a quarter of every worker's parameter-server traffic.
"""

from __future__ import annotations

import asyncio
from typing import Optional

from ..errors import ConnectionLost
from ..wire import DType, Frame, Header, Kind, byte_view, encode_header, payload_views
from .endpoint import Endpoint

# Same default as NetConfig.inbox_high_water: in-process, nothing pauses, but keep the bound.
_INBOX_HIGH_WATER = 64 << 20


class LocalLink(Endpoint):
    """One end of an in-process link. Make both ends with :meth:`pair`.

    >>> # worker_end, shard_end = LocalLink.pair(rank, rank); shard.attach(shard_end)
    """

    is_local = True

    def __init__(self, rank: int, peer_rank: int) -> None:
        self._init_endpoint(asyncio.get_running_loop(), rank, _INBOX_HIGH_WATER)
        self.peer_rank = peer_rank
        self.peer: Optional["LocalLink"] = None
        self.bytes_sent = 0

    @classmethod
    def pair(cls, rank_a: int, rank_b: int) -> tuple:
        a, b = cls(rank_a, rank_b), cls(rank_b, rank_a)
        a.peer, b.peer = b, a
        return a, b

    def __repr__(self) -> str:
        return f"<LocalLink rank {self.rank} <-> rank {self.peer_rank} (in-process)>"

    @property
    def where(self) -> str:
        return f"rank {self.peer_rank} (in-process)"

    @property
    def is_open(self) -> bool:
        return self._exc is None

    async def send(
        self,
        kind: Kind,
        payload=b"",
        *,
        key: int = 0,
        clock: int = 0,
        dtype: DType = DType.BYTES,
        flags: int = 0,
        priority: int = 0,
    ) -> None:
        """Hand one frame to the peer; its payload is copied before this returns."""
        self.try_send(kind, payload, key=key, clock=clock, dtype=dtype, flags=flags, priority=priority)

    def try_send(
        self,
        kind: Kind,
        payload=b"",
        *,
        key: int = 0,
        clock: int = 0,
        dtype: DType = DType.BYTES,
        flags: int = 0,
        priority: int = 0,
    ) -> bool:
        """Hand one frame to the peer now (an in-process link never has to wait): ``True``."""
        if self._exc is not None:
            raise self._lost()
        views, length = payload_views(payload)
        encode_header(
            kind, rank=self.rank, key=key, clock=clock, length=length, dtype=dtype, flags=flags
        )  # range checks
        kind = kind if type(kind) is Kind else Kind(kind)  # the enum's call is dear on a hot path
        dtype = dtype if type(dtype) is DType else DType(dtype)
        header = Header(kind, self.rank, key, clock, length, dtype, flags)
        peer = self.peer
        try:
            dest = peer._allocate(header) if length else None
        except Exception as exc:  # noqa: BLE001 - the receiver refused the header, as a Connection would
            peer._fail(exc, "error")
            return True  # the frame went where a refused one goes; the sender hears it next
        target = byte_view(dest) if dest is not None else memoryview(bytearray(length))
        offset = 0
        for v in views:
            target[offset : offset + v.nbytes] = v
            offset += v.nbytes
        self.bytes_sent += length
        peer._dispatch(Frame(header, target))
        return True

    async def close(self) -> None:
        self._fail(ConnectionLost(f"link to {self.where} was closed by rank {self.rank}"), "close")

    def abort(self) -> None:
        self._fail(ConnectionLost(f"link to {self.where} was aborted by rank {self.rank}"), "abort")

    def _fail(self, exc: BaseException, how: str, cause: Optional[BaseException] = None) -> None:
        if self._exc is not None:
            return
        self._exc = exc
        if cause is not None:
            exc.__cause__ = cause
        self._fail_waiters()
        if not self._closed.done():
            self._closed.set_result(None)
        peer = self.peer
        if peer is not None and peer._exc is None:
            gone = ConnectionLost(f"rank {self.rank} (in-process) ended the link: {exc}")
            gone.__cause__ = exc
            peer._fail(gone, "none")
