"""Entry points of the child processes the integration tests start (from the fork server of
``tests.support.cluster.mp_context``, never a fork of the test process).

Each child runs its own event loop (uvloop through ``poseidon_aio.net.run``), reports its bound
port through a ``multiprocessing`` pipe (a test harness channel, never the data path), and reports
what it saw back the same way when the parent says "stop".
"""

from __future__ import annotations

import asyncio
import os
from contextlib import contextmanager
from pathlib import Path

from poseidon_aio.net import NetConfig, TLSConfig, listen, run
from poseidon_aio.wire import Kind

from .cluster import mp_context

DATA = Path(__file__).parent.parent / "data"
TOKEN = b"poseidon-test-token-0123456789ab"


def tls_config() -> TLSConfig:
    cert = str(DATA / "test-cert.pem")
    return TLSConfig(certfile=cert, keyfile=str(DATA / "test-key.pem"), cafile=cert)


def net_config(token: bytes = TOKEN, tls: bool = False, **overrides) -> NetConfig:
    return NetConfig(token=token, tls=tls_config() if tls else None, **overrides)


@contextmanager
def child(target, *args, timeout: float = 30.0):
    """Start ``target(pipe, *args)`` in a child process; yield ``(process, pipe, port)``."""
    ctx = mp_context()
    parent_end, child_end = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child_end, *args), daemon=True)
    proc.start()
    try:
        if not parent_end.poll(timeout):
            raise TimeoutError(f"child {target.__name__} did not report its port within {timeout} s")
        port = parent_end.recv()
        yield proc, parent_end, port
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(10)


def report(pipe, timeout: float = 30.0):
    """Tell the child to stop and return what it reports."""
    pipe.send("stop")
    if not pipe.poll(timeout):
        raise TimeoutError(f"child did not report within {timeout} s")
    return pipe.recv()


async def _wait_stop(pipe, listener=None) -> None:
    await asyncio.to_thread(pipe.recv)
    # Let handshakes already under way end, so the report includes their outcome.
    async with asyncio.timeout(10):
        while listener is not None and listener.pending_handshakes:
            await asyncio.sleep(0.01)


def _describe(errors) -> list:
    return [(type(e).__name__, str(e)) for e in errors]


def echo_server(pipe, token: bytes, tls: bool, overrides: dict) -> None:
    """Echo every frame back as AGGREGATE with the same key and clock."""

    async def main():
        async def serve(conn):
            while True:
                frame = await conn.recv()
                await conn.send(
                    Kind.AGGREGATE, frame.payload, key=frame.key, clock=frame.clock, dtype=frame.header.dtype
                )

        listener = await listen("127.0.0.1", 0, rank=1, config=net_config(token, tls, **overrides), on_connection=serve)
        pipe.send(listener.address[1])
        await _wait_stop(pipe, listener)
        refused = _describe(listener.refused)
        await listener.close()
        pipe.send({"refused": refused, "pid": os.getpid()})

    run(main())


def unix_echo_server(pipe, token: bytes, overrides: dict) -> None:
    """``echo_server`` taking same-host peers on its Unix socket: reports that socket's name
    instead of a port, and what carried each connection it served."""

    async def main():
        vias = []

        async def serve(conn):
            vias.append(conn.via)
            while True:
                frame = await conn.recv()
                await conn.send(
                    Kind.AGGREGATE, frame.payload, key=frame.key, clock=frame.clock, dtype=frame.header.dtype
                )

        listener = await listen(
            "127.0.0.1", 0, rank=1, config=net_config(token, **overrides), on_connection=serve, same_host=True
        )
        pipe.send(listener.unix_name)
        await _wait_stop(pipe, listener)
        refused = _describe(listener.refused)
        await listener.close()
        pipe.send({"refused": refused, "pid": os.getpid(), "vias": vias})

    run(main())


def slow_reader(pipe, delay: float, overrides: dict, same_host: bool = False) -> None:
    """Take one frame every ``delay`` seconds; report the largest inbox it ever held. With
    ``same_host`` it reports its Unix socket's name, not its port."""

    async def main():
        done = asyncio.Event()
        seen = {}

        async def serve(conn):
            count = 0
            while True:
                frame = await conn.recv(timeout=30)
                count += 1
                if frame.kind is Kind.CONTROL:
                    break
                await asyncio.sleep(delay)
            seen.update(frames=count, max_inbox=conn.max_inbox_bytes)
            await conn.send(Kind.CONTROL, b"done")
            done.set()

        listener = await listen(
            "127.0.0.1", 0, rank=1, config=net_config(**overrides), on_connection=serve, same_host=same_host
        )
        pipe.send(listener.unix_name if same_host else listener.address[1])
        await done.wait()
        await _wait_stop(pipe)
        await listener.close()
        pipe.send(seen)

    run(main())


def connector(pipe, port: int, token: bytes, protocol: int) -> None:
    """Dial ``port`` and report how the handshake ended."""
    from poseidon_aio.net import connect

    async def main():
        pipe.send(0)
        try:
            conn = await connect("127.0.0.1", port, rank=7, config=net_config(token), protocol=protocol)
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            return (type(exc).__name__, str(exc))
        await conn.close()
        return ("ok", "")

    pipe.send(run(main()))
