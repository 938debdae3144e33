"""Token-bucket bandwidth limiter with priorities among waiting frames.

The bench caps bandwidth with it where network namespaces and ``tc`` are not available, and the
bandwidth manager (MG-WFBP issue) builds its per-process budget on it. One :class:`TokenBucket`
can be shared by all connections of a process (a per-process cap) or owned by one connection.

Tokens are bytes. A frame larger than the burst may drive the bucket into debt: it is sent at once
and the frames after it wait until the debt is repaid, so the long-run rate is exact without
splitting frames. Waiters are served lowest ``priority`` value first, FIFO within a priority.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from dataclasses import dataclass
from typing import Callable, Optional

from ..errors import ConfigError


class TokenBucket:
    """A token bucket refilled at ``rate`` bytes/s up to ``burst`` bytes.

    Args:
        rate: bytes per second (> 0).
        burst: bucket depth in bytes; at 1 Gbit/s a 256 KiB burst is 2 ms of line rate.
        clock: monotonic time source (tests inject a fake one).

    >>> bucket = TokenBucket(rate=1e6, burst=1000, clock=lambda: 0.0)
    >>> bucket.reserve(1500)   # 500 bytes of debt: wait 0.5 ms before the next frame
    0.0005
    """

    def __init__(
        self,
        rate: float,
        burst: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        message_cost: float = 0.0,
        costed_kinds=None,
    ) -> None:
        if rate <= 0:
            raise ConfigError(f"shaper rate must be > 0 bytes/s, got {rate}")
        if burst < 1:
            raise ConfigError(f"shaper burst must be >= 1 byte, got {burst}")
        if message_cost < 0:
            raise ConfigError(f"message start-up cost must be >= 0 seconds, got {message_cost}")
        self.rate = float(rate)
        self.burst = int(burst)
        #: seconds of link time every (costed) message pays on top of its bytes: the alpha of
        #: ``alpha + beta p``, serialized with the bytes as on a real link
        self.message_cost = message_cost
        self.costed_kinds = frozenset(costed_kinds) if costed_kinds is not None else None
        self._clock = clock
        self._tokens = float(burst)
        self._stamp = clock()
        self._waiters: list = []
        self._seq = itertools.count()
        self._timer: Optional[asyncio.TimerHandle] = None

    def cost_of(self, nbytes: int, kind=None) -> float:
        """Tokens a frame of ``nbytes`` (of ``kind``) takes: its bytes plus its start-up as link time."""
        if self.message_cost and (self.costed_kinds is None or kind in self.costed_kinds):
            return nbytes + self.message_cost * self.rate
        return nbytes

    def _refill(self) -> float:
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
        self._stamp = now
        return self._tokens

    def reserve(self, nbytes: int) -> float:
        """Take ``nbytes`` now; return how long the caller should wait before sending more.

        Non-blocking; used for ingress, where the bytes have already arrived and the reply is to
        pause reading for the returned number of seconds.
        """
        self._refill()
        self._tokens -= nbytes
        return max(0.0, -self._tokens / self.rate)

    async def acquire(self, nbytes: int, priority: int = 0) -> None:
        """Wait until the bucket is out of debt and it is this caller's turn, then take ``nbytes``."""
        if not self._waiters and self._refill() >= 0:
            self._tokens -= nbytes
            return
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        heapq.heappush(self._waiters, (priority, next(self._seq), fut, nbytes))
        self._arm(loop)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                # Granted just as we were cancelled: give the tokens back.
                self._tokens += nbytes
            raise

    def _arm(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._timer is not None or not self._waiters:
            return
        delay = max(0.0, -self._refill() / self.rate)
        self._timer = loop.call_later(delay, self._wake, loop)

    def _wake(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        while self._waiters and self._refill() >= 0:
            _, _, fut, nbytes = heapq.heappop(self._waiters)
            if fut.done():
                continue
            self._tokens -= nbytes
            fut.set_result(None)
        self._arm(loop)


@dataclass
class ShaperConfig:
    """Rates in bytes per second; ``None`` means unlimited. Burst defaults to 256 KiB.

    ``message_cost``: seconds of link time every data frame pays before its bytes (needs
    ``egress_rate``): a network's per-message start-up, emulated in user space.
    ``costed_kinds``: the frame kinds that pay it (default: every data frame).

    As the trainer's ``bandwidth`` it is the bandwidth manager: one budget for all of a process's
    connections, frames of layers nearest the input first.
    """

    egress_rate: Optional[float] = None
    ingress_rate: Optional[float] = None
    burst: int = 256 * 1024
    message_cost: float = 0.0
    costed_kinds: Optional[frozenset] = None

    def __post_init__(self) -> None:
        for name in ("egress_rate", "ingress_rate"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"ShaperConfig.{name} must be > 0 bytes/s or None, got {value}")
        if self.burst < 1:
            raise ConfigError(f"ShaperConfig.burst must be >= 1, got {self.burst}")
        if self.message_cost and not self.egress_rate:
            raise ConfigError("ShaperConfig.message_cost is link time: it needs egress_rate")


class Shaper:
    """The egress and ingress buckets of one scope (a process or a connection).

    >>> Shaper.from_config(ShaperConfig(egress_rate=125e6)).egress.rate   # 1 Gbit/s
    125000000.0
    """

    def __init__(self, egress: Optional[TokenBucket] = None, ingress: Optional[TokenBucket] = None) -> None:
        self.egress = egress
        self.ingress = ingress

    @classmethod
    def from_config(cls, config: ShaperConfig) -> "Shaper":
        def bucket(rate):
            return TokenBucket(rate, config.burst) if rate else None

        egress = (
            TokenBucket(
                config.egress_rate, config.burst, message_cost=config.message_cost, costed_kinds=config.costed_kinds
            )
            if config.egress_rate
            else None
        )
        return cls(egress, bucket(config.ingress_rate))
