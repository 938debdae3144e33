"""Who has finished training, told over the worker mesh: a rank that runs out of data (or leaves
the trainer) says so to every peer, and a peer still stepping fails at once with ``WorkerLeft``
instead of waiting out the sync timeout for gradients that will never come.

The same message ends the job cleanly: each rank sends it after its last step's syncs are over and
closes its links once every peer has sent it too (or is gone), so no rank closes a link a peer
still reads a step from.

A rank whose step failed says why before it closes its links (``FAILED_KEY``): a peer whose sync
then breaks on that closed link fails with that reason, the root cause (a worker killed on
another host, its host and local rank named), not with "closed the connection". A link carries
frames in order, so the reason is in before the close is seen; a parameter server's links are
not the mesh's, so a sync that breaks there waits a moment (``REASON_GRACE_S``) for the peers'
reasons before it fails.
"""

from __future__ import annotations

import asyncio
import json
from typing import Awaitable, Callable, Mapping, Optional, TypeVar

from ..errors import ConnectionLost, WorkerLeft
from ..net.endpoint import silence
from ..net.loop import stopped_by
from ..wire import DType, Kind

T = TypeVar("T")

FINISHED_KEY = 1  # the CONTROL frame key of "I have finished" (clock 0)
FAILED_KEY = 2  # the CONTROL frame key of "my step failed, and why" (clock 0)
# A reason is one line for a person to read; a peer's longer one is cut.
_REASON_MAX = 600
_SIGNALS = ("SIGTERM", "SIGINT")  # the signals a peer may say it was stopped by
# How long a sync broken on a link other than the mesh's (a shard's) waits for a peer's reason
# on the mesh: that peer sent it before closing its links, so it is at most a moment behind.
REASON_GRACE_S = 1.0


class Departures:
    """This rank's view of which peers have finished, and after how many steps.

    Args:
        rank: this worker.
        peers: ``{rank: link}`` of the worker mesh; every link's "finished" frame is expected
            from here on (one small frame per peer).
    """

    def __init__(self, rank: int, peers: Mapping[int, object]) -> None:
        self.rank = rank
        self.peers = dict(peers)
        self.finished: dict = {}  # rank -> the steps it took
        self.gone: set = set()  # ranks whose link ended without saying
        self._listeners: list = []
        self.stopped: dict = {}  # rank -> why its step failed, as it said
        self.signalled: dict = {}  # rank -> the signal that stopped it, as it said
        self.failure: Optional[BaseException] = None  # this rank's first failed sync
        self._heard = {q: conn.expect(Kind.CONTROL, FINISHED_KEY, 0) for q, conn in self.peers.items()}
        for q, fut in self._heard.items():
            fut.add_done_callback(lambda f, q=q: self._on_heard(q, f))
        self._reasons = {q: conn.expect(Kind.CONTROL, FAILED_KEY, 0) for q, conn in self.peers.items()}
        for q, fut in self._reasons.items():
            fut.add_done_callback(lambda f, q=q: self._on_reason(q, f))

    def _on_heard(self, q: int, fut: asyncio.Future) -> None:
        if fut.cancelled():
            return
        if fut.exception() is not None:  # the link ended: the syncs on it fail on their own
            self.gone.add(q)
            return
        try:
            steps = json.loads(bytes(fut.result().payload))["steps"]
            if not isinstance(steps, int) or steps < 0:
                raise ValueError(steps)
        except (ValueError, KeyError, TypeError):
            # A malformed notice is the peer's fault: it ends nothing here but its own standing.
            self.gone.add(q)
            return
        self.finished[q] = steps
        for listener in list(self._listeners):
            listener(q)

    def _on_reason(self, q: int, fut: asyncio.Future) -> None:
        if fut.cancelled() or fut.exception() is not None:
            return
        try:
            said = json.loads(bytes(fut.result().payload))
            text = said["error"]
            if not isinstance(text, str):
                raise ValueError(text)
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            said, text = {}, "its step failed (it sent an unreadable reason)"
        self.stopped[q] = text[:_REASON_MAX].replace("\n", " ")
        if said.get("signal") in _SIGNALS:
            self.signalled[q] = said["signal"]

    def listen(self, listener: Callable[[int], None]) -> Callable[[], None]:
        """Call ``listener(rank)`` for every peer that has finished and every one that will;
        returns what stops it."""
        self._listeners.append(listener)
        for q in list(self.finished):
            listener(q)
        return lambda: self._listeners.remove(listener) if listener in self._listeners else None

    def error(self, step: int) -> Optional[WorkerLeft]:
        """The error of a sync of step ``step`` (0-based) once a peer has finished before it (a
        peer that took more steps than that still takes part in it), else None."""
        # A snapshot: step() reads this from the caller's thread while the loop's may add to it.
        early = {q: n for q, n in list(self.finished.items()) if n <= step}
        if not early:
            return None
        q = min(early)
        return WorkerLeft(
            f"rank {q} finished after {early[q]} steps; rank {self.rank} is at step {step + 1}: give every rank the "
            "same number of batches (a DistributedSampler does), or stop every rank at the shortest one's end"
        )

    def check(self, step: int) -> None:
        """Raises WorkerLeft where a peer finished before step ``step`` (it would wait for it)."""
        exc = self.error(step)
        if exc is not None:
            raise exc

    async def guard(self, aw: Awaitable[T], step: int) -> T:
        """``await aw`` (a sync of step ``step``), or raise WorkerLeft, ``aw`` cancelled, the
        moment a peer that finished before that step says so."""
        if not self.peers:
            return await aw
        left = self.error(step)
        if left is not None:
            if asyncio.iscoroutine(aw):
                aw.close()
            raise left
        # A departure cancels this task where it waits, as asyncio.timeout() does: no task for
        # ``aw`` and no wait on two futures, every step.
        task = asyncio.current_task()
        said: list = []

        def departed(_q: int) -> None:
            exc = self.error(step)
            if exc is not None and not said:
                said.append(exc)
                task.cancel()

        stop = self.listen(departed)
        try:
            return await aw
        except asyncio.CancelledError:
            if said and task.uncancel() == 0:  # (cancelled by the departure alone)
                raise said[0] from None
            raise
        except (ConnectionLost, WorkerLeft) as lost:  # (WorkerLeft: a shard lost a peer's link)
            await self._hear_reasons(REASON_GRACE_S)
            exc = self._root_cause(lost)
            if self.failure is None:
                self.failure = exc
            if exc is lost:
                raise
            raise exc from lost
        except Exception as error:
            if self.failure is None:
                self.failure = error
            raise
        finally:
            stop()

    async def _hear_reasons(self, grace: float) -> None:
        """Wait, ``grace`` seconds at most, until some peer has said why it stopped or every mesh
        link has said or ended (a peer killed outright says nothing)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        while not self.stopped:
            waiting = [fut for fut in self._reasons.values() if not fut.done()]
            left = deadline - loop.time()
            if not waiting or left <= 0:
                return
            await asyncio.wait(waiting, timeout=left, return_when=asyncio.FIRST_COMPLETED)

    def _root_cause(self, lost):
        """``lost`` (ConnectionLost or WorkerLeft), or where a peer said its step had failed
        first, that peer's reason."""
        if not self.stopped:
            return lost
        q = min(self.stopped)
        who = f"rank {q}{getattr(self.peers[q], 'peer_host', '')}"
        # (peer_signal: net.loop.run then waits a moment for this rank's own)
        return ConnectionLost(f"rank {self.rank}: {who} stopped: {self.stopped[q]}", peer_signal=self.signalled.get(q))

    async def fail(self, timeout: float) -> None:
        """Tell every peer why this rank's step failed (:attr:`failure`), or that a signal is
        stopping it, before its links close; best effort, at most ``timeout`` seconds."""
        signal = stopped_by()
        if signal is not None:
            said = {"error": f"stopped by {signal}", "signal": signal}
        elif self.failure is not None:
            said = {"error": f"{type(self.failure).__name__}: {self.failure}"[:_REASON_MAX]}
        else:
            return
        body = json.dumps(said).encode()
        sends = [
            conn.send(Kind.CONTROL, body, key=FAILED_KEY, clock=0, dtype=DType.JSON)
            for q, conn in self.peers.items()
            if q not in self.gone and conn.is_open
        ]
        if sends:
            tasks = [asyncio.ensure_future(s) for s in sends]
            for task in tasks:  # (a peer that left meanwhile: nobody to tell, nothing to report)
                task.add_done_callback(silence)
            await asyncio.wait(tasks, timeout=timeout)

    async def finish(self, steps: int, timeout: float) -> None:
        """Tell every peer this rank has finished after ``steps`` steps, and return once every
        peer has said the same or is gone (at most ``timeout`` seconds)."""
        body = json.dumps({"steps": steps}).encode()
        sends = []
        for q, conn in self.peers.items():
            if q not in self.gone and conn.is_open:
                sends.append(conn.send(Kind.CONTROL, body, key=FINISHED_KEY, clock=0, dtype=DType.JSON))
        await asyncio.gather(*sends, return_exceptions=True)  # (a peer gone meanwhile: nothing to tell)
        waits = [fut for fut in self._heard.values() if not fut.done()]
        if waits:
            await asyncio.wait(waits, timeout=timeout)

    def close(self) -> None:
        for fut in (*self._heard.values(), *self._reasons.values()):
            fut.cancel()
