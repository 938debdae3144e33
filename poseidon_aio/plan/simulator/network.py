"""The simulator's network: every worker's NIC as two FIFO links, and what fan-in costs them.

``P`` workers, each with a full-duplex NIC: an up-link and a down-link, each a FIFO server. A
message of ``n`` bytes takes ``alpha + n * beta`` of its sender's up-link (``alpha``: the
per-message start-up, what the shaper's ``message_cost`` emulates) and ``n * beta`` of its
receiver's down-link; it is delivered when both are done. What one event sends at once is one
batch per link: a payload to every peer (a shard's reply, a worker's factors, an owner's reduced
chunk), the P - 1 pushes of one message arriving at a shard; a batch's messages share the link and
finish together (fair sharing, as concurrent TCP streams do). Anything a node sends itself costs
nothing (the trainer's in-process link).

Latency (``latency``, 0 by default) is time in flight that occupies no link, added to every
delivery: messages sent together overlap it, a chain of them (a ring's steps) pays it each step.
By default all of a message's start-up is ``alpha``, which occupies its sender's up-link (what
``bench mgwfbp``'s shaper emulates): pessimistic for fan-outs, whose latencies really overlap.

Fan-in (``efficiency``, ideal by default). A down-link fed by ``n`` senders at once may deliver
less than its rate: TCP streams converging on one capped link overflow its queue and back off
(incast). :class:`FlowEfficiency` is that loss as measured (``bench patterns``: a ring's one flow
each way, an all-to-all's P - 1), the fraction of its rate a down-link delivers with ``n``
senders; a delivery then takes ``bytes * beta / efficiency(n)`` of its down-link. Which ``n`` each
traffic pattern feeds a down-link with is the events' to say (``simulator.events``).

A down-link serves messages in the order they were sent, so when one sender's up-link lags the
others' it may count that sender's bytes as received before they were sent: optimistic by at most
that message's ``n * beta``; exact when the senders are in step, as identical workers mostly are.

Workers are identical, so every operation is one vector operation over the P nodes: a PS message
costs O(P), an all-to-all (SFB, reduce-scatter) O(P) — the O(P^2) messages it stands for are
accounted per link exactly (bytes, messages, busy time), not one by one.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from ...errors import ConfigError
from ...wire import Kind
from ..cost import Link


class FlowEfficiency:
    """The fraction of its rate a down-link delivers when ``n`` senders feed it at once.

    Built from measured points ``{n: fraction}`` (``bench patterns``: a ring's one sender, an
    all-to-all's P - 1); linear between them, the nearest point's value outside them (beyond the
    largest fan-in measured the loss stays what it was there: measure the fan-in you plan for).
    ``FlowEfficiency()`` is the ideal link: 1 for every ``n``.

    Raises:
        ConfigError: a fan-in below 1 or a fraction outside (0, 1].

    >>> eff = FlowEfficiency({1: 0.95, 15: 0.65})
    >>> eff(1), round(eff(8), 3), eff(31)
    (0.95, 0.8, 0.65)
    """

    def __init__(self, points: Optional[dict] = None) -> None:
        points = dict(points or {1: 1.0})
        for n, fraction in points.items():
            if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
                raise ConfigError(f"efficiency: a fan-in is a whole number of senders >= 1, got {n!r}")
            if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
                raise ConfigError(
                    f"efficiency: the fraction of the rate delivered with {n} senders "
                    f"must be in (0, 1], got {fraction!r}"
                )
        self.points = {int(n): float(f) for n, f in sorted(points.items())}
        self._n = np.array(list(self.points), dtype=float)
        self._f = np.array(list(self.points.values()))
        self.ideal = bool((self._f == 1.0).all())

    @classmethod
    def parse(cls, text: str) -> "FlowEfficiency":
        """``"1:0.95,15:0.66"`` (senders:fraction, comma-separated) as a :class:`FlowEfficiency`."""
        try:
            points = {int(n): float(f) for n, f in (item.split(":") for item in text.split(",") if item.strip())}
        except ValueError:
            raise ConfigError(
                f"efficiency: expected 'senders:fraction,...' (e.g. '1:0.95,15:0.66'), got {text!r}"
            ) from None
        return cls(points)

    def __call__(self, senders):
        """The fraction for ``senders`` (a number, or an array of them: an array back)."""
        out = np.interp(np.maximum(senders, 1), self._n, self._f)
        return float(out) if np.ndim(out) == 0 else out

    def __repr__(self) -> str:
        return f"FlowEfficiency({self.points})"


class Links:
    """The P nodes' up- and down-links as FIFO servers, one vector each (see the module doc).

    Each operation takes the time its messages are enqueued (never earlier than the previous
    operation's: the event loop runs in time order) and returns when they are delivered.
    """

    def __init__(
        self,
        nodes: int,
        link: Link,
        costed: Optional[frozenset],
        ingress: bool = True,
        latency: float = 0.0,
        efficiency: Optional[FlowEfficiency] = None,
    ) -> None:
        self.nodes = nodes
        self.alpha, self.beta = link.alpha, link.beta
        self.latency = latency  # in flight, occupying no link: added to every delivery
        # Without ingress, a down-link never limits (an egress-only shaper, as bench mgwfbp has).
        self.beta_in = link.beta if ingress else 0.0
        self.efficiency = efficiency if efficiency is not None else FlowEfficiency()
        self.costed = costed
        self.up = np.zeros(nodes)
        self.down = np.zeros(nodes)
        self.up_bytes = np.zeros(nodes)
        self.down_bytes = np.zeros(nodes)
        self.sent = np.zeros(nodes, dtype=np.int64)

    def startup(self, kind: Kind) -> float:
        return self.alpha if self.costed is None or kind in self.costed else 0.0

    def beta_down(self, senders):
        """Seconds a byte takes a down-link that ``senders`` feed at once (a number or an array)."""
        return self.beta_in if self.efficiency.ideal else self.beta_in / self.efficiency(senders)

    def gather(self, t: float, dest: int, nbytes: int, kind: Kind, senders: Optional[float] = None) -> float:
        """Every node but ``dest`` sends it one message of ``nbytes``: when the last is in.
        ``senders``: the fan-in its down-link sees (default P - 1; see the module doc)."""
        if self.nodes < 2:
            return t
        keep = self.up[dest]
        np.maximum(self.up, t, out=self.up)
        self.up += self.startup(kind) + nbytes * self.beta
        self.up[dest] = -math.inf
        last = float(self.up.max())
        self.up[dest] = keep
        self.down[dest] = max(t, self.down[dest]) + (self.nodes - 1) * nbytes * self.beta_down(
            self.nodes - 1 if senders is None else senders
        )
        self.up_bytes += nbytes
        self.up_bytes[dest] -= nbytes
        self.sent += 1
        self.sent[dest] -= 1
        self.down_bytes[dest] += (self.nodes - 1) * nbytes
        return max(last, float(self.down[dest])) + self.latency

    def fan_out(self, t: float, src: int, nbytes: int, kind: Kind, senders: int = 1) -> np.ndarray:
        """``src`` sends one message of ``nbytes`` to every other node (a shard's reply), while
        ``senders`` nodes in all do the same (the shards one PS message spans).

        Returns when each node has it (``src`` itself: ``t``).
        """
        if self.nodes < 2:
            return np.full(self.nodes, t)
        end = max(t, float(self.up[src])) + (self.nodes - 1) * (self.startup(kind) + nbytes * self.beta)
        self.up[src] = end
        self.up_bytes[src] += (self.nodes - 1) * nbytes
        self.sent[src] += self.nodes - 1
        keep = self.down[src]
        np.maximum(self.down, t, out=self.down)
        self.down += nbytes * self.beta_down(senders)
        self.down[src] = keep
        self.down_bytes += nbytes
        self.down_bytes[src] -= nbytes
        out = np.maximum(self.down, end) + self.latency
        out[src] = t
        return out

    def scatter(self, t: float, srcs: np.ndarray, nbytes: np.ndarray, count: np.ndarray, kind: Kind) -> np.ndarray:
        """Each node in ``srcs`` sends ``nbytes[i]`` (``count[i]`` messages) to every other node.

        Returns when each node has all of it (a source does not wait for its own).
        """
        out = np.full(self.nodes, t)
        if self.nodes < 2 or len(srcs) == 0:
            return out
        per_peer = count * self.startup(kind) + nbytes * self.beta
        ends = np.maximum(self.up[srcs], t) + (self.nodes - 1) * per_peer
        self.up[srcs] = ends
        self.up_bytes[srcs] += (self.nodes - 1) * nbytes
        self.sent[srcs] += (self.nodes - 1) * count
        incoming = np.full(self.nodes, float(nbytes.sum()))
        incoming[srcs] -= nbytes
        receiving = incoming > 0
        senders = np.full(self.nodes, len(srcs))
        senders[srcs] -= 1  # a source does not feed its own down-link
        self.down[receiving] = np.maximum(self.down[receiving], t) + incoming[receiving] * self.beta_down(
            senders[receiving]
        )
        self.down_bytes += incoming
        out[receiving] = (
            np.maximum(self.down[receiving], _max_of_others(ends, srcs, self.nodes)[receiving]) + self.latency
        )
        return out

    def ring(self, t: float, nbytes: float, count: int, kind: Kind) -> float:
        """Every node sends ``nbytes`` (``count`` messages) to the next: when all have theirs."""
        np.maximum(self.up, t, out=self.up)
        self.up += count * self.startup(kind) + nbytes * self.beta
        np.maximum(self.down, t, out=self.down)
        self.down += nbytes * self.beta_down(1)
        self.up_bytes += nbytes
        self.down_bytes += nbytes
        self.sent += count
        return max(float(self.up.max()), float(self.down.max())) + self.latency

    def exchange(self, t: float, nbytes: np.ndarray, count: np.ndarray, kind: Kind) -> np.ndarray:
        """Every node sends ``nbytes[o]`` (``count[o]`` messages) to every other node ``o``.

        Returns when each node has all its P - 1 parts.
        """
        out = np.full(self.nodes, t)
        if self.nodes < 2:
            return out
        to = count * self.startup(kind) + nbytes * self.beta
        busy = float(to.sum()) - to  # a node sends to everyone but itself
        sending = busy > 0
        self.up[sending] = np.maximum(self.up[sending], t) + busy[sending]
        self.up_bytes += float(nbytes.sum()) - nbytes
        self.sent += int(count.sum()) - count
        incoming = (self.nodes - 1) * nbytes
        receiving = incoming > 0
        feeding = int(sending.sum()) - sending  # every sender but the node itself
        self.down[receiving] = np.maximum(self.down[receiving], t) + incoming[receiving] * self.beta_down(
            feeding[receiving]
        )
        self.down_bytes += incoming
        senders = np.flatnonzero(sending)
        if len(senders):
            out[receiving] = (
                np.maximum(self.down[receiving], _max_of_others(self.up[senders], senders, self.nodes)[receiving])
                + self.latency
            )
        return out

    def busiest(self) -> tuple:
        """``(bytes, "up-link of worker 3")`` of the link direction that carried the most."""
        if self.nodes < 2:
            return 0.0, "none"
        up, down = int(np.argmax(self.up_bytes)), int(np.argmax(self.down_bytes))
        if self.up_bytes[up] >= self.down_bytes[down]:
            return float(self.up_bytes[up]), f"up-link of worker {up}"
        return float(self.down_bytes[down]), f"down-link of worker {down}"


def _max_of_others(values: np.ndarray, at: np.ndarray, nodes: int) -> np.ndarray:
    """For every node ``y``: the largest of ``values`` (indexed by nodes ``at``) not at ``y``."""
    first = int(np.argmax(values))
    top = float(values[first])
    values[first] = -math.inf
    second = float(values.max()) if len(values) > 1 else -math.inf
    values[first] = top
    out = np.full(nodes, top)
    out[at[first]] = second
    return out
