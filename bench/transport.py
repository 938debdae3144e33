"""``python -m bench transport``: our framed transport against plain blocking sockets.

Same run, same machine, same frames: one sender to one receiver and four senders to one receiver,
frames of 64 KiB to 8 MiB, each codec. Every measurement is a fresh set of processes on
127.0.0.1; the receiver times from the moment it releases the senders to the last payload byte,
and the figure is the median over ``--repeats`` runs, taken interleaved (plain, python, cython,
plain, ...) so drift on a shared machine hits every column alike.

Both sides do the same work per frame: a 44-byte header then the payload, received into a reused
buffer (ours through the BufferedProtocol destination hook, plain sockets through ``recv_into``).

``--checksum`` measures the cost of the payload CRC32C instead: the compiled codec with
``NetConfig(payload_checksum=True)`` (the default) and ``False``, interleaved with plain sockets
in one run, and prints on/off throughput ratios.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import socket
import statistics
import struct
import threading
import time

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
SIZES = [64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB, 8 * MiB]
IMPLS = ["plain", "python", "cython"]
# --checksum: the compiled codec with payload CRC32Cs on and off ("-nocrc").
CHECKSUM_IMPLS = ["plain", "cython", "cython-nocrc"]
_LEN = struct.Struct("<Q")
TOKEN = b"bench-transport-token-0123456789"


# -- plain blocking sockets ---------------------------------------------------------------------


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if not n:
            raise ConnectionError("sender closed early")
        got += n


def _plain_receiver(pipe, senders: int, frame: int, frames_each: int) -> None:
    srv = socket.create_server(("127.0.0.1", 0), backlog=senders)
    pipe.send(srv.getsockname()[1])
    conns = [srv.accept()[0] for _ in range(senders)]
    for c in conns:
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def drain(sock):
        header = memoryview(bytearray(40))
        payload = memoryview(bytearray(frame))
        for _ in range(frames_each):
            _recv_exact(sock, header)
            (length,) = _LEN.unpack_from(header, 24)
            _recv_exact(sock, payload[:length])

    threads = [threading.Thread(target=drain, args=(c,)) for c in conns]
    pipe.recv()  # all senders connected
    start = time.perf_counter()
    for c in conns:
        c.sendall(b"g")
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    pipe.send(time.perf_counter() - start)


def _plain_sender(port: int, frame: int, frames_each: int) -> None:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    header = bytearray(40)
    header[0:4] = b"PSDN"
    _LEN.pack_into(header, 24, frame)
    payload = bytearray(frame)
    sock.recv(1)
    for _ in range(frames_each):
        sock.sendall(header)
        sock.sendall(payload)
    sock.recv(1)  # wait for the receiver to close


# -- poseidon_aio -------------------------------------------------------------------------------


def _ours_receiver(pipe, senders: int, frame: int, frames_each: int, checksum: bool = True) -> None:
    import asyncio

    from poseidon_aio.net import NetConfig, listen, run
    from poseidon_aio.wire import CODEC, Kind

    async def main():
        sink = bytearray(frame)
        conns, done = [], asyncio.Event()
        remaining = [senders * frames_each]

        def on_frame(f):
            remaining[0] -= 1
            if remaining[0] == 0:
                done.set()

        def accept(conn):
            conn.set_handler(on_frame, allocate=lambda h: sink if h.length == frame else None)
            conns.append(conn)

        config = NetConfig(token=TOKEN, payload_checksum=checksum)
        listener = await listen("127.0.0.1", 0, rank=0, config=config, on_connection=accept)
        pipe.send(listener.address[1])
        await asyncio.to_thread(pipe.recv)
        while len(conns) < senders:
            await asyncio.sleep(0.001)
        start = time.perf_counter()
        for c in conns:
            await c.send(Kind.CONTROL, b"go")
        async with asyncio.timeout(600):
            await done.wait()
        elapsed = time.perf_counter() - start
        if any(c.payload_checksum != checksum for c in conns):
            raise RuntimeError(f"asked for payload_checksum={checksum}, a connection settled otherwise")
        await listener.close()
        pipe.send((elapsed, CODEC))

    run(main())


def _ours_sender(port: int, frame: int, frames_each: int, checksum: bool = True) -> None:

    import numpy as np

    from poseidon_aio.errors import ConnectionLost
    from poseidon_aio.net import NetConfig, connect, run
    from poseidon_aio.wire import Kind

    async def main():
        conn = await connect("127.0.0.1", port, rank=1, config=NetConfig(token=TOKEN, payload_checksum=checksum))
        payload = np.zeros(frame, dtype=np.uint8)
        await conn.recv(timeout=600)
        for clock in range(frames_each):
            await conn.send(Kind.DATA, payload, clock=clock)
        try:
            await conn.recv(timeout=600)  # the receiver's GOODBYE ends this
        except ConnectionLost:
            pass

    run(main())


# -- harness ------------------------------------------------------------------------------------


def measure(impl: str, senders: int, frame: int, volume: int) -> float:
    """One run: GiB/s received, ``volume`` bytes in all, ``senders`` processes."""
    ctx = multiprocessing.get_context("spawn")
    frames_each = max(4, volume // senders // frame)
    receiver, sender = (_plain_receiver, _plain_sender) if impl == "plain" else (_ours_receiver, _ours_sender)
    codec, _, variant = impl.partition("-")
    extra = () if impl == "plain" else (variant != "nocrc",)
    parent, child = ctx.Pipe()
    saved = os.environ.get("POSEIDON_NO_EXTENSIONS")
    os.environ["POSEIDON_NO_EXTENSIONS"] = "1" if codec == "python" else "0"
    try:
        recv_proc = ctx.Process(target=receiver, args=(child, senders, frame, frames_each, *extra))
        recv_proc.start()
        port = parent.recv()
        procs = [ctx.Process(target=sender, args=(port, frame, frames_each, *extra)) for _ in range(senders)]
        for p in procs:
            p.start()
    finally:
        if saved is None:
            os.environ.pop("POSEIDON_NO_EXTENSIONS", None)
        else:
            os.environ["POSEIDON_NO_EXTENSIONS"] = saved
    if impl == "plain":
        time.sleep(0.5)  # the plain receiver accepts in its own time; give the senders a moment
    parent.send("go")
    if not parent.poll(900):
        raise TimeoutError(f"{impl} run with {senders} senders of {frame} B frames did not finish")
    result = parent.recv()
    elapsed = result if impl == "plain" else result[0]
    if impl != "plain" and result[1] != codec:
        raise RuntimeError(f"asked for the {impl} codec, the receiver ran {result[1]}")
    for p in [recv_proc, *procs]:
        p.join(60)
        if p.exitcode != 0:
            raise RuntimeError(f"a {impl} benchmark process exited with {p.exitcode}")
    return senders * frames_each * frame / elapsed / GiB


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench transport", description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--volume-mib", type=int, default=1024, help="MiB moved per run")
    parser.add_argument("--sizes", default=",".join(str(s // KiB) for s in SIZES), help="frame sizes in KiB")
    parser.add_argument("--quick", action="store_true", help="1 repeat, 128 MiB per run")
    parser.add_argument(
        "--checksum", action="store_true", help="payload CRC32C on against off (compiled codec), with plain sockets"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.volume_mib = 1, 128
    from poseidon_aio.wire import CODECS

    if args.checksum:
        if "cython" not in CODECS:
            raise SystemExit("--checksum measures the compiled codec, which is not built here")
        impls = CHECKSUM_IMPLS
    else:
        impls = [i for i in IMPLS if i == "plain" or i in CODECS]
    sizes = [int(s) * KiB for s in args.sizes.split(",")]
    results: dict = {}
    for senders in (1, 4):
        for frame in sizes:
            runs = {impl: [] for impl in impls}
            for r in range(args.repeats):
                order = impls[r % len(impls) :] + impls[: r % len(impls)]
                for impl in order:
                    runs[impl].append(measure(impl, senders, frame, args.volume_mib * MiB))
            results[(senders, frame)] = runs
    if args.checksum:
        return _checksum_report(results, args)

    lines = [
        f"Transport throughput, GiB/s received (median of {args.repeats}; {args.volume_mib} MiB per run); "
        "ratio: of the medians, with the min-max of the runs' own ratios (each run beside plain's in its turn)",
        "",
        "| senders | frame | plain sockets | ours, python codec | ratio | ours, cython codec | ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    summary: dict = {}
    for (senders, frame), runs in results.items():
        r = {impl: statistics.median(v) for impl, v in runs.items()}
        plain = r["plain"]
        cells = []
        for impl in ("python", "cython"):
            if impl in r:
                each = [o / p for o, p in zip(runs[impl], runs["plain"])]
                cells += [f"{r[impl]:.2f}", f"{r[impl] / plain:.2f} ({min(each):.2f}–{max(each):.2f})"]
                summary[f"ratio_{senders}to1_{_size(frame)}_{impl}"] = round(r[impl] / plain, 3)
            else:
                cells += ["n/a", "n/a"]
        lines.append(f"| {senders}→1 | {_size(frame)} | {plain:.2f} | " + " | ".join(cells) + " |")
    print("\n".join(lines))
    best = "cython" if "cython" in impls else "python"
    out = {
        "bench": "transport",
        "ratio_1to1_1MiB": summary.get(f"ratio_1to1_1MiB_{best}"),
        "ratio_4to1_1MiB": summary.get(f"ratio_4to1_1MiB_{best}"),
        "codec": best,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        **summary,
    }
    print(json.dumps(out))
    return out


def _size(n: int) -> str:
    return f"{n // MiB}MiB" if n >= MiB else f"{n // KiB}KiB"


def _checksum_report(results: dict, args) -> dict:
    lines = [
        f"Payload CRC32C on vs off, compiled codec, GiB/s received (median of {args.repeats}; "
        f"{args.volume_mib} MiB per run); on/off: ratio of the medians, with the min-max of each "
        "repeat's own on/off ratio",
        "",
        "| senders | frame | plain sockets | checksum off | checksum on | on / off |",
        "|---|---|---|---|---|---|",
    ]
    summary: dict = {}
    for (senders, frame), runs in results.items():
        med = {impl: statistics.median(v) for impl, v in runs.items()}
        each = [on / off for on, off in zip(runs["cython"], runs["cython-nocrc"])]
        ratio = med["cython"] / med["cython-nocrc"]
        lines.append(
            f"| {senders}→1 | {_size(frame)} | {med['plain']:.2f} | {med['cython-nocrc']:.2f} | "
            f"{med['cython']:.2f} | {ratio:.3f} ({min(each):.3f}–{max(each):.3f}) |"
        )
        summary[f"crc_on_off_{senders}to1_{_size(frame)}"] = round(ratio, 3)
        summary[f"crc_on_off_{senders}to1_{_size(frame)}_range"] = [round(min(each), 3), round(max(each), 3)]
    print("\n".join(lines))
    out = {
        "bench": "transport --checksum",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        **summary,
    }
    print(json.dumps(out))
    return out
