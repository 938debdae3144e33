"""Bootstrap on PyTorch's ``torch.distributed.TCPStore``, at the address the launcher gave
(:class:`~poseidon_aio.cluster.launcher.ClusterEnv`).

Every rank publishes its listening address and its model manifest under a prefix of the store and
reads everyone else's. A manifest that differs fails every rank at once, naming the first
differing parameter and the ranks.

Every wait ends when it says. ``TCPStore`` calls block in C++ and do not reliably honour their own
timeout (a listener that accepts and never answers holds a client's constructor far past it), so
each one runs in a daemon thread under our own deadline: the event loop keeps
serving meanwhile, and a call stuck for good is abandoned without holding up interpreter exit.
Before dialling the store a plain TCP connect tells "nothing listening" (refused: retried until
the deadline, the master may start late) from "something accepts" (then it must answer like a
store).

A rank that fails during start-up publishes a one-line reason under the ``abort`` key
(:meth:`Rendezvous.abort`); every wait here polls that key, so the others stop with that reason
instead of timing out. Secrets never travel through the store: it holds addresses, manifests,
digests and those reasons, nothing that authenticates.

This is the one module below the trainer that imports torch (for the TCPStore only, lazily).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Optional

from ..errors import ConfigError, ConnectionLost, PeerTimeout, PoseidonError, StartupAborted, StoreUnavailable
from .manifest import Manifest, ManifestMismatch, first_difference
from .launcher import ClusterEnv
from .topology import Placement, Topology

PREFIX = "poseidon_aio"
ABORT_KEY = "abort"
# Waiting for a key polls ``check`` rather than blocking in ``TCPStore.wait``: a wait cannot watch
# the abort key at the same time, and each one that times out prints two C++ warning lines. The
# first poll comes after 5 ms, the pause doubles up to 250 ms: a key that is already there costs
# one round trip, a late key or an abort is seen within 0.25 s, and a rank waiting 60 s makes
# about 250 polls, each one round trip to the store.
_POLL_FIRST = 0.005
_POLL_MAX = 0.25
# One poll that the store has not answered after this long means the store is stuck, not that
# the key is late; it also lets the last poll before the deadline finish.
_CALL_GRACE = 2.0
# The preflight connect gives up on an address that neither accepts nor refuses after 1 s and
# tries again; after "connection refused" the next try comes 0.2 s later. A TCPStore constructor
# that failed is retried after 1 s, since each failure prints a C++ stack trace.
_PROBE_TIMEOUT = 1.0
_RETRY_PAUSE = 0.2
_STORE_RETRY_PAUSE = 1.0
# Publishing an abort is best effort: the store may be what failed.
_ABORT_TIMEOUT = 2.0
# An abort reason is one line for a person to read, not a traceback.
_REASON_MAX = 500


@dataclass
class StartupConfig:
    """How long start-up waits for the other ranks.

    Args:
        timeout: seconds for every rank to show up at the rendezvous, the manifest check and the
            worker mesh; past it the ranks still missing are named.
    """

    timeout: float = 60.0

    def __post_init__(self) -> None:
        if self.timeout <= 0:
            raise ConfigError(f"StartupConfig.timeout must be > 0 seconds, got {self.timeout}")


class _Overdue(Exception):
    """A blocking call passed our deadline; the thread running it was abandoned."""


async def _in_daemon_thread(fn: Callable, *args, timeout: Optional[float]):
    """Run the blocking ``fn(*args)`` in a new daemon thread; wait at most ``timeout`` s for it.

    A thread stuck in a C++ call cannot be stopped. ``asyncio.to_thread`` would run it on the
    default executor, whose threads are joined at interpreter exit, so a store that never
    answers would hang the process's exit too; a daemon thread is simply left behind.

    Raises:
        _Overdue: ``fn`` had not returned after ``timeout`` s (``None``: no limit).
        whatever ``fn`` raised.
    """
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def settle(ok: bool, value) -> None:
        if not fut.done():  # cancelled when we stopped waiting
            (fut.set_result if ok else fut.set_exception)(value)

    def body() -> None:
        try:
            outcome = (True, fn(*args))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting coroutine
            outcome = (False, exc)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:
            pass  # the loop is closed: nobody waits for this answer any more

    threading.Thread(target=body, name=f"poseidon-store-{getattr(fn, '__name__', 'call')}", daemon=True).start()
    try:
        done, _ = await asyncio.wait({fut}, timeout=timeout)
    finally:
        if not fut.done():
            fut.cancel()
    if not done:
        raise _Overdue
    return fut.result()


def _import_tcpstore():
    from torch.distributed import TCPStore

    return TCPStore


def _probe(host: str, port: int, timeout: float) -> tuple:
    """One plain TCP connect: ``("accepts", "")``, ``("refused", why)`` or ``("no answer", why)``."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return ("accepts", "")
    except ConnectionRefusedError as exc:
        return ("refused", str(exc))
    except (TimeoutError, OSError) as exc:  # a timeout, no route, a name that does not resolve
        return ("no answer", str(exc) or type(exc).__name__)


def _agent_hosts_store() -> bool:
    # Under torchrun the elastic agent already hosts a store on MASTER_PORT.
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"


class Rendezvous:
    """Key exchange through ``torch.distributed.TCPStore``.

    Args:
        env: this process's :class:`ClusterEnv`.
        timeout: seconds any rank may take to publish what the others wait for; also the bound
            on reaching the store at :meth:`start`.
        namespace: key prefix, so several jobs (or a torchrun agent's own keys) share a store.

    Every wait raises :class:`~poseidon_aio.errors.StartupAborted` as soon as another rank has
    published why it failed (:meth:`abort`); scoped views share that one abort key.

    >>> # rdzv = Rendezvous(ClusterEnv.from_env()); await rdzv.start()
    """

    def __init__(self, env: ClusterEnv, *, timeout: float = 60.0, namespace: str = PREFIX) -> None:
        self.env = env
        self.timeout = timeout
        self.namespace = namespace
        self._store = None
        self._owner = True  # False for scoped views: leaving is their parent's business
        # A torchrun agent's store outlives a failed attempt: each restart gets its own abort key,
        # or one failed start-up would abort every restart at once.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self._abort_key = f"{namespace}/{ABORT_KEY}/{attempt}"

    @property
    def address(self) -> str:
        """``MASTER_ADDR:MASTER_PORT``, for messages."""
        return f"{self.env.master_addr}:{self.env.master_port}"

    async def start(self) -> None:
        """Connect to (on rank 0: host) the store at MASTER_ADDR:MASTER_PORT, within ``timeout`` s.

        Rank 0 hosts the store unless a torchrun agent does (``TORCHELASTIC_USE_AGENT_STORE=true``).
        Every other rank retries refused connections until the deadline: the master may start late.
        The deadline starts once ``torch.distributed`` is imported (seconds, once per process; a
        trainer has imported it already).

        Raises:
            StoreUnavailable: no store answered in time; ``reason`` says whether nothing was
                listening, something that is not a rendezvous store was, or the address did not
                answer at all.
            ConfigError: rank 0 could not host the store (MASTER_PORT is taken, or not allowed).
        """
        tcpstore = await _in_daemon_thread(_import_tcpstore, timeout=None)
        deadline = time.monotonic() + self.timeout
        if self.env.rank == 0 and not _agent_hosts_store():
            store = await self._host(tcpstore, deadline)
        else:
            store = await self._dial(tcpstore, deadline)
        # Construction ran on the time left; later calls get the whole timeout again.
        store.set_timeout(timedelta(seconds=self.timeout))
        self._store = store

    async def _host(self, tcpstore, deadline: float):
        env = self.env

        def make():
            return tcpstore(
                env.master_addr,
                env.master_port,
                env.world_size,
                is_master=True,
                timeout=timedelta(seconds=max(0.001, deadline - time.monotonic())),
                wait_for_workers=False,
            )

        try:
            return await _in_daemon_thread(make, timeout=max(0.0, deadline - time.monotonic()))
        except _Overdue:
            raise StoreUnavailable(
                f"rank 0 could not start the rendezvous store on port {env.master_port} within "
                f"{self.timeout} s: is this machine overloaded?",
                address=self.address,
                reason="no answer",
            ) from None
        except (RuntimeError, OSError) as exc:
            raise ConfigError(
                f"rank 0 could not host the rendezvous store on port {env.master_port}: {exc}. "
                "Pick a free MASTER_PORT, or set TORCHELASTIC_USE_AGENT_STORE=true where a torchrun "
                "agent already hosts the store there"
            ) from None

    async def _dial(self, tcpstore, deadline: float):
        env = self.env
        host, port = env.master_addr, env.master_port
        last = None  # (reason, detail) of the latest attempt that says something about the address
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._unavailable(*(last or ("no answer", "no connect attempt finished in time")))
            probe_timeout = min(left, _PROBE_TIMEOUT)
            try:
                state, detail = await _in_daemon_thread(_probe, host, port, probe_timeout, timeout=left)
            except _Overdue:
                state, detail = "no answer", f"connecting (resolving {host!r}) took over {left:.1f} s"
            if state == "no answer" and probe_timeout < _PROBE_TIMEOUT and last is not None:
                # Cut short by the deadline (on a loaded machine even a refusal can take that
                # long): it says nothing new about the address.
                continue
            if state == "accepts":

                def make():
                    return tcpstore(
                        host,
                        port,
                        env.world_size,
                        is_master=False,
                        timeout=timedelta(seconds=max(0.001, deadline - time.monotonic())),
                        wait_for_workers=False,
                    )

                try:
                    return await _in_daemon_thread(make, timeout=max(0.0, deadline - time.monotonic()))
                except _Overdue:
                    raise self._unavailable(
                        "not a rendezvous store", "it accepted the connection but never answered"
                    ) from None
                except (RuntimeError, OSError) as exc:
                    last = ("not a rendezvous store", str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
                pause = _STORE_RETRY_PAUSE
            else:
                last = ("nothing listening" if state == "refused" else "no answer", detail)
                pause = _RETRY_PAUSE
            await asyncio.sleep(max(0.0, min(pause, deadline - time.monotonic())))

    def _unavailable(self, reason: str, detail: str) -> StoreUnavailable:
        where = f"rank {self.env.rank}: no rendezvous store at {self.address} after {self.timeout} s"
        if reason == "nothing listening":
            what = (
                "nothing listening there (every connect was refused). Start rank 0, which hosts the "
                "store (or the torchrun agent), and give every rank the same MASTER_ADDR and MASTER_PORT"
            )
        elif reason == "not a rendezvous store":
            what = (
                f"not a rendezvous store: something accepts TCP connections there but did not answer "
                f"like a TCPStore ({detail}). MASTER_PORT must be the port rank 0's store (or the "
                "torchrun agent's) listens on, not another service's"
            )
        else:
            what = (
                f"no answer: connects were neither accepted nor refused ({detail}). Check that "
                "MASTER_ADDR names rank 0's machine and that a firewall lets MASTER_PORT through"
            )
        return StoreUnavailable(f"{where}: {what}", address=self.address, reason=reason)

    @property
    def store(self):
        """The underlying ``TCPStore`` (e.g. for ``torch.distributed.init_process_group``)."""
        return self._store

    def scoped(self, namespace: str) -> "Rendezvous":
        """A view of the same store under another key prefix, for a part of this job (its mesh,
        its parameter server).

        The view shares this rendezvous's abort key: a start-up failure in any part stops every
        wait of the job.
        """
        other = Rendezvous(self.env, timeout=self.timeout, namespace=f"{self.namespace}/{namespace}")
        other._store = self._store
        other._owner = False
        other._abort_key = self._abort_key
        return other

    def job(self, namespace: str) -> "Rendezvous":
        """A view of the same store for another job (several trainers one after another over one
        store): its own key prefix and its own abort key, so one job's failed start does not
        abort the next."""
        other = self.scoped(namespace)
        other._abort_key = f"{other.namespace}/{ABORT_KEY}/{self._abort_key.rsplit('/', 1)[1]}"
        return other

    def _key(self, name: str) -> str:
        return f"{self.namespace}/{name}"

    async def _call(self, what: str, fn: Callable, *args, timeout: Optional[float] = None):
        """``fn(*args)`` on the store, bounded by ``timeout`` (default: the rendezvous timeout).

        Raises:
            PeerTimeout: the store did not answer in time.
            ConnectionLost: the store's connection broke (its host exited).
        """
        timeout = self.timeout if timeout is None else timeout
        try:
            return await _in_daemon_thread(fn, *args, timeout=timeout)
        except _Overdue:
            raise PeerTimeout(
                f"rank {self.env.rank}: the rendezvous store at {self.address} did not answer within "
                f"{timeout:.1f} s ({what}): is the process hosting it (rank 0, or the torchrun agent) "
                "alive and not swapping?"
            ) from None
        except (RuntimeError, OSError) as exc:
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise ConnectionLost(
                f"rank {self.env.rank} lost the rendezvous store at {self.address} ({what}): {first}. "
                "The process hosting it (rank 0, or the torchrun agent) has probably exited: its log "
                "says why"
            ) from None

    async def publish(self, name: str, value: str) -> None:
        """Set ``name`` to ``value`` for every rank to read.

        Raises:
            PeerTimeout, ConnectionLost: the store did not answer, or is gone.
        """
        await self._call(f"publishing {name!r}", self._store.set, self._key(name), value)

    async def read(self, name: str, *, who: str, deadline: Optional[float] = None) -> str:
        """Wait (bounded) for ``name`` and return it.

        Args:
            name: the key, under this view's namespace.
            who: names the publisher in errors (``"rank 3"``).
            deadline: ``time.monotonic()`` value to give up at (default: ``timeout`` from now).
        Returns:
            The value, decoded.
        Raises:
            PeerTimeout: nobody published ``name`` by the deadline (the message names ``who``).
            StartupAborted: another rank failed during start-up (the message gives its reason).
            ConnectionLost: the store is gone.
        """
        return await self._await_key(name, who, deadline, abortable=True)

    async def _await_key(self, name: str, who: str, deadline: Optional[float], *, abortable: bool) -> str:
        deadline = time.monotonic() + self.timeout if deadline is None else deadline
        key = self._key(name)
        store, abort_key = self._store, self._abort_key

        def poll():
            if store.check([key]):
                return key, store.get(key).decode()
            if abortable and store.check([abort_key]):
                return abort_key, store.get(abort_key).decode()
            return None

        what = f"waiting for {who}'s {name!r}"
        pause = _POLL_FIRST
        while True:
            left = deadline - time.monotonic()
            found = await self._call(what, poll, timeout=max(left, 0.0) + _CALL_GRACE)
            if found is not None:
                if found[0] == abort_key:
                    raise self._aborted(found[1], what)
                return found[1]
            left = deadline - time.monotonic()
            if left <= 0:
                raise PeerTimeout(
                    f"rank {self.env.rank}: {who} did not publish {name!r} (key {key!r}) within "
                    f"{self.timeout} s: is it running, with the same MASTER_ADDR:MASTER_PORT "
                    f"({self.address})?"
                )
            await asyncio.sleep(min(pause, left))
            pause = min(pause * 2, _POLL_MAX)

    async def check_aborted(self, waiting_for: str) -> None:
        """Raise if any rank has published a start-up failure (one store round trip).

        Args:
            waiting_for: what this rank is waiting for, for the message.
        Raises:
            StartupAborted: naming the rank that failed and its reason.
        """
        store, abort_key = self._store, self._abort_key

        def poll():
            return store.get(abort_key).decode() if store.check([abort_key]) else None

        text = await self._call(f"checking for an abort while {waiting_for}", poll, timeout=_CALL_GRACE)
        if text is not None:
            raise self._aborted(text, waiting_for)

    def _aborted(self, text: str, waiting_for: str) -> StartupAborted:
        try:
            info = json.loads(text)
            rank, reason = int(info["rank"]), str(info["reason"])
            during = str(info.get("during", "start-up"))
        except (ValueError, KeyError, TypeError):
            rank, reason, during = -1, text, "start-up"
        return StartupAborted(
            f"rank {self.env.rank} stopped {waiting_for}: rank {rank} failed during {during}: {reason}",
            rank=rank,
            reason=reason,
        )

    async def abort(self, error: BaseException, during: str = "start-up") -> None:
        """Tell every rank waiting on this store that this rank failed during start-up, and why.

        Only the first abort on a store is kept (the root cause; later ones are mostly its echoes),
        a :class:`StartupAborted` (an echo) and a cancellation are not published, and publishing
        is best effort within 2 s: the store itself may be what failed. Never raises.

        Args:
            error: the failure; its type and the first 500 characters of its message are
                published, so a message must never hold a secret (none of this library's do).
            during: what the rank was doing, for the message ("training": a rank that failed
                a step, so that ranks waiting to leave hear why at once).
        """
        if self._store is None or isinstance(error, (StartupAborted, asyncio.CancelledError)):
            return
        if not isinstance(error, Exception):
            return
        reason = f"{type(error).__name__}: {error}"
        if len(reason) > _REASON_MAX:
            reason = reason[: _REASON_MAX - 3] + "..."
        text = json.dumps({"rank": self.env.rank, "reason": reason, "during": during})
        try:
            await self._call(
                "publishing an abort", self._store.compare_set, self._abort_key, "", text, timeout=_ABORT_TIMEOUT
            )
        except PoseidonError:
            pass  # nobody can hear it; every other rank still has its own deadline

    async def exchange(self, name: str, value: str, ranks: range) -> dict:
        """Publish ``value`` as ``{name}/{rank}`` and return everyone's, keyed by rank.

        Raises:
            PeerTimeout, StartupAborted, ConnectionLost: as :meth:`read`.
        """
        await self.publish(f"{name}/{self.env.rank}", value)
        deadline = time.monotonic() + self.timeout
        out = {}
        for r in ranks:
            out[r] = await self.read(f"{name}/{r}", who=f"rank {r}", deadline=deadline)
        return out

    async def barrier(self, name: str) -> None:
        """Return once every rank has reached the barrier ``name``.

        Raises:
            PeerTimeout, StartupAborted, ConnectionLost: as :meth:`read`.
        """
        await self.exchange(_barrier(name), "1", range(self.env.world_size))

    async def arrive(self, name: str) -> None:
        """Count this rank at the barrier ``name`` without waiting there: a rank leaving early (its
        step failed) that will never wait, so the ranks waiting there need not wait for it. Best
        effort, never raises: the store may be what failed."""
        if self._store is None:
            return
        try:
            await self.publish(f"{_barrier(name)}/{self.env.rank}", "1")  # as exchange() publishes it
        except PoseidonError:
            pass

    async def check_manifest(self, manifest: Manifest) -> None:
        """Fail on every rank if any rank's manifest differs, naming the parameter and ranks.

        Raises:
            ManifestMismatch
        """
        texts = await self.exchange("manifest", manifest.to_json(), range(self.env.world_size))
        reference = Manifest.from_json(texts[0])
        for r in range(1, self.env.world_size):
            if texts[r] == texts[0]:
                continue
            diff = first_difference(reference, Manifest.from_json(texts[r]))
            raise ManifestMismatch(
                f"rank {r}'s model differs from rank 0's at {diff}: every rank must build the "
                f"same model (seen from rank {self.env.rank})"
            )

    async def check_topology(self) -> Topology:
        """Every rank's placement, exchanged and checked: the job's hosts, the same on every rank.

        Raises:
            TopologyMismatch: the launcher's hosts are not equal (the message names the host).
            ConfigError: a rank published a placement this release cannot read.
            PeerTimeout, StartupAborted, ConnectionLost: as :meth:`read`.
        """
        texts = await self.exchange("placement", self.env.placement().to_json(), range(self.env.world_size))
        return Topology.from_placements({r: Placement.from_json(t, r) for r, t in texts.items()})

    async def check_digest(self, what: str, digest: str) -> None:
        """Fail on every rank unless all ranks computed the same ``digest`` of ``what``."""
        seen = await self.exchange(f"digest/{what}", digest, range(self.env.world_size))
        odd = sorted(r for r, d in seen.items() if d != seen[0])
        if odd:
            raise ManifestMismatch(
                f"ranks {odd} computed a different {what} than rank 0 "
                f"({seen[odd[0]][:12]} vs {seen[0][:12]}): same model, world size and settings everywhere?"
            )

    async def addresses(self, role: str, host: str, port: int, ranks: range) -> dict:
        """Exchange ``(host, port)`` of ``role`` endpoints; returns ``{rank: (host, port)}``."""
        got = await self.exchange(f"addr/{role}", json.dumps([host, port]), ranks)
        return {r: tuple(json.loads(v)) for r, v in got.items()}

    async def leave(self, linger: Optional[float] = None) -> None:
        """Say this rank is done with the store; the rank hosting it waits (bounded) for everyone
        else to say so too, since ending its process ends the store under their feet."""
        if self._store is None or not self._owner:
            return
        try:
            await self.publish(f"left/{self.env.rank}", "1")
            if self.env.rank == 0 and not _agent_hosts_store():
                linger = self.timeout if linger is None else linger
                deadline = time.monotonic() + linger
                for r in range(1, self.env.world_size):
                    # Not abortable: after a failed start-up, rank 0 must keep the store up
                    # until the others have read the reason and left.
                    await self._await_key(f"left/{r}", f"rank {r}", deadline, abortable=False)
        except PoseidonError:
            pass  # a rank that does not leave in time, or a store already gone: nothing to wait for
        finally:
            self._store = None


def _barrier(name: str) -> str:
    """The store name of barrier ``name``: each rank's arrival is ``{it}/{rank}``."""
    return f"barrier/{name}"
