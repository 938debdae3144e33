"""``python -m bench hosts``: hosts of several workers, each crossing its link once, against the same
library flat and DDP.

Every emulated host is a network namespace whose link tc tbf caps in both directions (nothing is
capped inside a host: its workers reach each other over the namespace's own addresses, which the
kernel delivers without the link); each host's L workers are started by one torchrun per host
(``--nnodes H --node-rank h``, static rendezvous on host 0). Implementations, interleaved:
``poseidon`` (by host), ``poseidon:hosts=flat`` (every worker a peer of its own) and ``ddp``
(gloo, its defaults), on bench train's models with replayed or real compute (bench/train.py).

Reported per row: the step (the slowest rank's, median over the timed steps, median over the
repeats), and the bytes each host's link carried a step, each way, read from the host's interface
counters (``/sys/class/net/eth0/statistics``) by its local rank 0 over the timed steps, not
counted by us. ``--device cuda`` puts every worker's model and batch on the machine's one GPU (real
compute only). ``--links loopback`` starts the torchruns on this host's loopback without namespaces
(nothing capped, no link of a host's own to count: step times only), where namespaces or tc are
missing. The CPU a step is the job's, every thread of every rank (bench train's); the JSON rows
also carry the TCP segments the hosts' links retransmitted a step (the most over the repeats:
whether a row's time went to loss). The last line is one JSON object: ``max_bytes_vs_flat`` (the
largest ratio of a row's bytes by host to flat), ``min_speedup_vs_ddp``, ``max_cpu_vs_ddp`` and
the rows.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

from bench import BENCH_TOKEN, MERGE_WARMUP, free_port, job_cpu

RATES = {"1gbit": 1e9 / 8, "100mbit": 100e6 / 8}


def worker(cfg: dict) -> None:
    """One rank under torchrun: bench train's worker, its place from torchrun's environment."""
    from bench.train import worker as train_worker

    rank = int(os.environ["RANK"])
    train_worker({**cfg, "rank": rank, "world": int(os.environ["WORLD_SIZE"]), "out": cfg["out"] % rank})


def run(impl: str, model: str, compute: str, link: str, hosts: int, local: int, args) -> dict:
    """One run of ``impl``: H namespaces, one torchrun each; the ranks' results and bytes."""
    from bench import netns

    cfg = dict(
        impl=impl,
        model=model,
        compute=compute,
        tflops=args.device_tflops,
        warmup=args.warmup,
        steps=args.steps,
        allreduce="auto",
        merge=None,
        group_spread_bytes=None,
        iface=None if link == "loopback" else "eth0",
        device=args.device,
        link=f"{link}-{hosts}x{local}",
        profile=args.profile and os.path.abspath(args.profile),
        native=not os.environ.get("BENCH_PROFILE_NONBLOCKING"),
    )
    world = hosts * local
    spaces = contextlib.nullcontext([None] * hosts) if link == "loopback" else netns.hosts(hosts, link)
    with tempfile.TemporaryDirectory(prefix="bench-hosts-") as tmp, spaces as names:
        cfg["out"] = os.path.join(tmp, "rank%d.json")
        port = free_port()
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "GLOO_SOCKET_IFNAME": "lo" if link == "loopback" else "eth0",
            "PYTHONPATH": os.getcwd(),
            "POSEIDON_TOKEN": BENCH_TOKEN,
        }
        procs, errs = [], []
        for h, ns in enumerate(names):
            command = ["ip", "netns", "exec", ns] if ns else []
            command += [sys.executable, "-m", "torch.distributed.run"]
            command += ["--nnodes", str(hosts), "--node-rank", str(h), "--nproc-per-node", str(local)]
            command += ["--master-addr", netns.address(0) if ns else "127.0.0.1", "--master-port", str(port)]
            command += ["-m", "bench.hosts", "--worker", json.dumps(cfg)]
            errs.append(open(os.path.join(tmp, f"host{h}.err"), "w+"))
            procs.append(subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=errs[-1]))
        deadline = time.monotonic() + args.timeout
        try:
            for p in procs:
                p.wait(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{impl} {model} {hosts}x{local} on {link} did not finish in {args.timeout} s") from None
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        failed = [h for h, p in enumerate(procs) if p.returncode != 0]
        if failed:
            errs[failed[0]].seek(0)
            tail = errs[failed[0]].read()[-2000:]
            raise RuntimeError(f"{impl} {model} {hosts}x{local} on {link}: host {failed[0]} failed:\n...{tail}")
        for f in errs:
            f.close()
        ranks = []
        for r in range(world):
            with open(cfg["out"] % r) as f:
                ranks.append(json.load(f))
    steps = [max(r["times"][i] for r in ranks) for i in range(len(ranks[0]["times"]))]
    leaders = [ranks[h * local] for h in range(hosts)]  # torchrun's static ranks: host h's first is h * L
    per_step = [max(r["iface"]["tx"], r["iface"]["rx"]) / args.steps for r in leaders if "iface" in r]
    host_bytes = max(per_step) if per_step else None  # loopback: no link of a host's own to read
    retrans = [r["tcp"]["retrans_segs"] / args.steps for r in leaders if "tcp" in r]
    return {
        "step_s": statistics.median(steps),
        "steps_s": steps,
        "retrans_segs": sum(retrans) if retrans else None,  # every host's, a step
        "cpu_s": job_cpu(ranks),
        "host_bytes": host_bytes,
        "schemes": ranks[0].get("schemes"),
        "groups": ranks[0].get("groups"),
        "plan": ranks[0].get("plan"),
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench hosts", description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--links", default="100mbit,1gbit")
    parser.add_argument("--compute", default="replayed,real")
    parser.add_argument("--models", default="cnn,resnet,transformer,fc")
    parser.add_argument("--layouts", default="2x2", help="hosts x workers a host, e.g. 2x2,2x3,3x2")
    parser.add_argument("--impls", default="ddp,poseidon,poseidon:hosts=flat")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=MERGE_WARMUP)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device-tflops", type=float, default=6.0)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: every worker's model on the one GPU")
    parser.add_argument(
        "--profile", default=None, help="folder: py-spy samples every rank over its timed steps (bench/profile.py)"
    )
    args = parser.parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return {}
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    from bench import netns

    if args.device != "cpu" and "replayed" in args.compute.split(","):
        raise SystemExit("bench hosts: --device cuda computes for real; give --compute real")
    capped, why = netns.available()
    if not capped and set(args.links.split(",")) - {"loopback"}:
        raise SystemExit(
            f"bench hosts needs network namespaces and tc for capped links ({why}); --links loopback runs without"
        )
    impls = args.impls.split(",")
    rows = []
    for link in args.links.split(","):
        for compute in args.compute.split(","):
            for model in args.models.split(","):
                for layout in args.layouts.split(","):
                    hosts, local = (int(x) for x in layout.split("x"))
                    runs = {impl: [] for impl in impls}
                    for _ in range(args.repeats):
                        for impl in impls:
                            runs[impl].append(run(impl, model, compute, link, hosts, local, args))
                    rows.append(_row(link, compute, model, layout, runs))
                    print(_line(rows[-1]), flush=True)
    summary = {
        "bench": "hosts",
        "max_bytes_vs_flat": max((r["bytes_vs_flat"] for r in rows if r.get("bytes_vs_flat")), default=None),
        "min_speedup_vs_ddp": min((r["vs_ddp"] for r in rows if r.get("vs_ddp")), default=None),
        "max_cpu_vs_ddp": max((r["cpu_vs_ddp"] for r in rows if r.get("cpu_vs_ddp")), default=None),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "device": args.device,
        "rows": rows,
    }
    print(json.dumps(summary))
    return summary


def _row(link, compute, model, layout, runs) -> dict:
    row = {"link": link, "compute": compute, "model": model, "layout": layout}
    for impl, got in runs.items():
        counted = [g["host_bytes"] for g in got if g["host_bytes"] is not None]
        row[impl] = {
            "step_s": statistics.median(g["step_s"] for g in got),
            "cpu_s": statistics.median(g["cpu_s"] for g in got),
            "retrans_segs": max((g["retrans_segs"] or 0 for g in got), default=0),
            "host_bytes": statistics.median(counted) if counted else None,
        }
    ours, flat, ddp = runs.get("poseidon"), runs.get("poseidon:hosts=flat"), runs.get("ddp")
    if ours and flat and row["poseidon"]["host_bytes"]:
        row["bytes_vs_flat"] = row["poseidon"]["host_bytes"] / row["poseidon:hosts=flat"]["host_bytes"]
    if ours and ddp:  # the median of the repeats' ratios, and their range
        ratios = sorted(d["step_s"] / o["step_s"] for o, d in zip(ours, ddp))
        row["vs_ddp"] = statistics.median(ratios)
        row["vs_ddp_range"] = [ratios[0], ratios[-1]]
        row["cpu_vs_ddp"] = statistics.median(o["cpu_s"] / d["cpu_s"] for o, d in zip(ours, ddp))
    return row


def _line(row: dict) -> str:
    cells = [row["link"], row["compute"], row["model"], row["layout"]]
    for impl, got in ((k, v) for k, v in row.items() if isinstance(v, dict)):  # every implementation, in order
        sent = got["host_bytes"]
        cells.append(
            f"{impl} {got['step_s'] * 1e3:.1f} ms, CPU {got['cpu_s'] * 1e3:.1f} ms"
            + (f", {sent / 1e6:.2f} MB/host/step" if sent else "")
        )
    if "bytes_vs_flat" in row:
        cells.append(f"bytes by host / flat {row['bytes_vs_flat']:.2f}")
    if "vs_ddp" in row:
        lo, hi = row["vs_ddp_range"]
        cells.append(f"vs DDP {row['vs_ddp']:.2f} ({lo:.2f}-{hi:.2f})")
    if "cpu_vs_ddp" in row:
        cells.append(f"CPU / DDP's {row['cpu_vs_ddp']:.2f}")
    return "| " + " | ".join(cells) + " |"


if __name__ == "__main__":
    main()
