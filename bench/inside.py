"""``python -m bench inside``: what link between two workers on one host moves frames fastest.

Two fresh processes a run exchange frames of each size, one way (A to B) and both ways at once,
through:

* ``tcp``: our :class:`~poseidon_aio.net.Connection` over loopback TCP (what hosts used first);
* ``unix``: the same Connection on asyncio's transport of an abstract AF_UNIX stream socket;
* ``shm``: the same Connection on shared-memory rings (``net.shm``: a ring per direction in a
  memfd passed over a Unix socket with SCM_RIGHTS, doorbells and credits on that socket), the
  link hosts use now.

Every receiver lands payloads in a registered destination buffer, as a training step does. The
figure is GB/s (10^9 bytes a second) delivered, both directions counted where both send, from
the parent's "go" to the last frame in; each run is timed on the host's monotonic clock, the
options interleaved run by run so drift hits them alike; median and min-max over ``--repeats``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import socket
import statistics
import time

KiB, MiB = 1 << 10, 1 << 20
SIZES = [64 * KiB, 1 * MiB, 16 * MiB]
OPTIONS = ["tcp", "unix", "shm"]
TOKEN = b"bench-inside-token-0123456789abc"


# -- one process of a pair ----------------------------------------------------------------------


def _child(option: str, side: str, pipe, frame: int, count: int, both: bool) -> None:
    from poseidon_aio.net import run

    run(_pair_main(option, side, pipe, frame, count, both))


async def _pair_main(option, side, pipe, frame, count, both) -> None:
    import numpy as np

    from poseidon_aio.wire import Kind

    sends = side == "a" or both
    receives = side == "b" or both
    link = await _open(option, side, pipe)
    sink = np.empty(frame, np.uint8)
    payload = np.ones(frame, np.uint8)
    done = asyncio.get_running_loop().create_future()
    left = [count if receives else 0]

    def on_frame(_f) -> None:
        left[0] -= 1
        if left[0] == 0 and not done.done():
            done.set_result(time.perf_counter())

    link.set_handler(on_frame, allocate=lambda h: sink if h.length == frame else None, kinds=[Kind.DATA])
    pipe.send("ready")
    await asyncio.to_thread(pipe.recv)  # "go"
    if sends:
        for clock in range(count):
            await link.send(Kind.DATA, payload, clock=clock)
    async with asyncio.timeout(300):
        end = await done if receives else time.perf_counter()
    pipe.send(end)
    await asyncio.to_thread(pipe.recv)  # both sides done: close
    await link.close()


async def _open(option: str, side: str, pipe):
    from poseidon_aio.net import NetConfig, connect, connect_unix, listen

    config = NetConfig(token=TOKEN)
    if option == "unix":
        return await _plain_unix(side, pipe, config)
    if side == "a":
        got = asyncio.get_running_loop().create_future()
        listener = await listen(
            "127.0.0.1", 0, rank=0, config=config, on_connection=got.set_result, same_host=option == "shm"
        )
        pipe.send(listener.unix_name if option == "shm" else listener.address[1])
        conn = await asyncio.wait_for(got, 60)
        conn._bench_listener = listener
        return conn
    where = await asyncio.to_thread(pipe.recv)
    if option == "shm":
        conn = await connect_unix(where, rank=1, config=config)
    else:
        conn = await connect("127.0.0.1", where, rank=1, config=config)
    if conn.via != option:
        raise RuntimeError(f"asked for {option}, got a link via {conn.via}")
    return conn


async def _plain_unix(side: str, pipe, config):
    """Our Connection straight on an AF_UNIX stream socket (asyncio's own transport)."""
    from poseidon_aio.net import Connection, Role
    from poseidon_aio.net.unix import bind, new_name

    loop = asyncio.get_running_loop()
    if side == "a":
        name = new_name(0)
        lsock = bind(name, 0)
        pipe.send(name)
        sock, _ = await asyncio.wait_for(loop.sock_accept(lsock), 60)
        lsock.close()
        conn = Connection(Role.SERVER, 0, config)
        await loop.connect_accepted_socket(lambda: conn, sock)
    else:
        name = await asyncio.to_thread(pipe.recv)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        await loop.sock_connect(sock, "\0" + name)
        conn = Connection(Role.CLIENT, 1, config)
        await loop.create_unix_connection(lambda: conn, sock=sock)
    return await conn.wait_ready()


# -- harness ------------------------------------------------------------------------------------


def measure(option: str, frame: int, volume: int, both: bool) -> float:
    """One run: GB/s delivered (both directions together when ``both``)."""
    ctx = multiprocessing.get_context("fork")
    count = max(4, volume // frame)
    ends = [ctx.Pipe() for _ in "ab"]
    procs = [
        ctx.Process(target=_child, args=(option, side, ends[i][1], frame, count, both)) for i, side in enumerate("ab")
    ]
    for p in procs:
        p.start()
    a, b = ends[0][0], ends[1][0]
    b.send(a.recv())  # A's address to B
    for end in (a, b):
        if not end.poll(120) or end.recv() != "ready":
            raise RuntimeError(f"{option}: a process of the pair did not get ready")
    go = time.perf_counter()
    for end in (a, b):
        end.send("go")
    ends_at = []
    for end in (a, b):
        if not end.poll(600):
            raise TimeoutError(f"{option} run of {frame} B frames did not finish")
        ends_at.append(end.recv())
    for end in (a, b):
        end.send("close")
    for p in procs:
        p.join(60)
        if p.exitcode != 0:
            raise RuntimeError(f"a {option} bench process exited with {p.exitcode}")
    return (2 if both else 1) * count * frame / (max(ends_at) - go) / 1e9


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench inside", description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--volume-mib", type=int, default=256, help="MiB each direction moves a run")
    parser.add_argument("--sizes", default=",".join(str(s // KiB) for s in SIZES), help="frame sizes in KiB")
    parser.add_argument("--options", default=",".join(OPTIONS))
    args = parser.parse_args(argv)
    options = args.options.split(",")
    sizes = [int(s) * KiB for s in args.sizes.split(",")]
    runs: dict = {}
    for both in (False, True):
        for frame in sizes:
            for r in range(args.repeats):
                for option in options[r % len(options) :] + options[: r % len(options)]:
                    runs.setdefault((both, frame, option), []).append(
                        measure(option, frame, args.volume_mib * MiB, both)
                    )
    lines = [
        f"Inside one host: GB/s delivered between two processes, median (min-max) of {args.repeats} "
        f"runs; {args.volume_mib} MiB each way a run",
        "",
        "| direction | frame | " + " | ".join(options) + " |",
        "|---|---|" + "---|" * len(options),
    ]
    out: dict = {"bench": "inside", "cores": os.cpu_count()}
    for both in (False, True):
        for frame in sizes:
            cells = []
            for option in options:
                v = runs[(both, frame, option)]
                cells.append(f"{statistics.median(v):.2f} ({min(v):.2f}–{max(v):.2f})")
                out[f"{'both' if both else 'one'}_{_size(frame)}_{option}"] = round(statistics.median(v), 3)
            lines.append(f"| {'both ways' if both else 'one way'} | {_size(frame)} | " + " | ".join(cells) + " |")
    print("\n".join(lines))
    print(json.dumps(out))
    return out


def _size(n: int) -> str:
    return f"{n // MiB}MiB" if n >= MiB else f"{n // KiB}KiB"
