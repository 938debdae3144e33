"""``python -m bench compress``: lossy compression against DDP and its compression hooks.

Models (bench/models.py): ``cnn`` (a small CNN), ``resnet`` (a ResNet-20-style CNN with batch
norm) and ``transformer`` (a two-block encoder: Linear layers over batch x sequence rows, where
SFB never pays). 4 workers, each process in its own network namespace whose link tc tbf caps in
both directions at 100 Mbit and 1 Gbit (bench/netns.py, as ``bench train``), compute **replayed**
per layer at ``--device-tflops`` (bench/models.py ``replay``); parameters, gradients and every
byte on the wire are real, and so is the compression arithmetic, on this machine's CPU, for
every implementation alike (DDP's hooks compress on the CPU too).

Implementations, side by side in one run:

* ``ddp``: ``DistributedDataParallel`` (gloo), exact;
* ``ddp_powersgd``: DDP with its PowerSGD comm hook, the same rank as ours (``--rank``), error
  feedback and warm start on, PowerSGD from the second step (``start_powerSGD_iter=2``: the
  earliest DDP allows with error feedback), its default minimum compression rate of 2, DDP's
  default buckets and overlap, each bucket's all-reduces on a process group of its own (see ``worker``);
* ``ddp_powersgd_1bucket``: the same with the whole model in one bucket (no overlap, fewer
  all-reduces and callbacks: on a host whose CPU bounds the step, the faster of the two);
* ``ddp_fp16``: DDP with its fp16 comm hook;
* ``exact``: poseidon (mode ``poseidon``: HybComm over PS, SFB and all-reduce, MG-WFBP), no
  compression;
* ``auto``: poseidon with ``compression="auto"``: per layer the least predicted time among the
  exact schemes, fp16, PowerSGD (the same rank) and top-k, on the link measured at start-up.

Beside each step time the report gives the CPU a step took, all threads of all ranks together:
with 4 workers on a 2-core host a step cannot be shorter than half of it.

A step's time is the median over the timed steps of the slowest rank, every implementation's steps
run back to back (DDP's too: no barrier between them since 2026-11-25); with ``--repeats R`` every
implementation runs R times, interleaved (a slow minute of the shared host lands on all of them),
a cell is the median repeat and a ratio the median of the repeats' ratios, min-max shown. Without root (no
namespaces) our processes are capped by the library's shaper and DDP runs uncapped; the report
says so and its speed-ups then mean nothing.

The last line is one JSON object: ``min_speedup_auto_vs_ddp_100mbit`` and
``min_speedup_auto_vs_ddp_powersgd_100mbit`` (the worst model at 100 Mbit; goals >= 2 and
>= 1.0), the same at 1 Gbit, ``max_cpu_vs_ddp`` (the largest ratio of our CPU a step, ``auto`` or
``exact``, to exact DDP's over the rows; median of the repeats), and every row's ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

from bench import MERGE_WARMUP, job_cpu, launch, median_run
from poseidon_aio.units import parse_rate

IMPLS = ["ddp", "ddp_powersgd", "ddp_powersgd_1bucket", "ddp_fp16", "exact", "auto"]
RATES = {link: (link, parse_rate(link) / 8) for link in ("1gbit", "100mbit")}  # tc rate, bytes/s
LOSSY = ("fp16", "powersgd", "topk")


# -- one worker process ---------------------------------------------------------------------------


def worker(cfg: dict) -> None:
    import torch

    from bench.models import build, replay, skip_weight_grad

    torch.set_num_threads(1)
    model, batch, _ = build(cfg["model"], seed=0)
    _, mine, _ = build(cfg["model"], seed=1 + cfg["rank"])  # this rank's own data
    replay(model, batch, cfg["tflops"])
    loss_fn = lambda out, _: out.float().mean()  # noqa: E731 - the replayed outputs are zeros
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    total = cfg["warmup"] + cfg["steps"]
    times, cpu, extra = [], [], {}
    if cfg["impl"].startswith("ddp"):
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        dist.init_process_group("gloo", rank=cfg["rank"], world_size=cfg["world"])
        ddp = DistributedDataParallel(model, **({"bucket_cap_mb": 1024} if cfg["impl"].endswith("_1bucket") else {}))
        if cfg["impl"].startswith("ddp_powersgd"):
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

            # The hook issues a bucket's P and Q all-reduces from gloo's callback thread while the
            # backward issues the next bucket's from the main one, so ranks can order them differently
            # (gloo's "collective mismatch"): each bucket gets a process group of its own, one state.
            from poseidon_aio.plan.simulator import DDP_BUCKET_BYTES

            most = 2 + sum(p.numel() * p.element_size() for p in model.parameters()) // DDP_BUCKET_BYTES
            groups = [dist.new_group(backend="gloo") for _ in range(most)]  # a bound on DDP's bucket count
            state = powerSGD_hook.PowerSGDState(
                process_group=None, matrix_approximation_rank=cfg["rank_r"], start_powerSGD_iter=2
            )

            def per_bucket_group(state, bucket):
                state.process_group = groups[bucket.index()]  # read once, at the hook's start
                return powerSGD_hook.powerSGD_hook(state, bucket)

            ddp.register_comm_hook(state, per_bucket_group)
        elif cfg["impl"] == "ddp_fp16":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        # One barrier, then the steps back to back, as a user's loop runs them and as ours are
        # timed: a barrier before every step would leave out of DDP's step the time a rank waits
        # for a slower one (3-4 ms of the transformer's 46 at 4 workers, 1 Gbit).
        dist.barrier()
        for _ in range(total):
            started, cpu0 = time.perf_counter(), time.process_time()
            opt.zero_grad()
            loss_fn(ddp(mine[0]), mine[1]).backward()
            opt.step()
            times.append(time.perf_counter() - started)
            cpu.append(time.process_time() - cpu0)
        dist.barrier()
    else:
        import poseidon_aio
        from poseidon_aio import kernels
        from poseidon_aio.net import NetConfig, ShaperConfig
        from poseidon_aio.net.credentials import token_from_env
        from poseidon_aio.plan import CompressionConfig

        rate = cfg["tflops"] * 1e12

        def replayed_reconstruct(us, vs, scale, out_w, out_b=None):
            time.sleep(2 * sum(u.shape[0] for u in us) * out_w.numel() / rate)

        kernels.reconstruct = replayed_reconstruct
        net = None
        if cfg.get("shaper_rate"):
            shaper = ShaperConfig(egress_rate=cfg["shaper_rate"], ingress_rate=cfg["shaper_rate"])
            net = NetConfig(token=token_from_env(), shaper=shaper)
        compression = CompressionConfig("auto", rank=cfg["rank_r"]) if cfg["impl"] == "auto" else None

        async def main():
            stats = []
            async with poseidon_aio.Trainer(
                model, opt, loss_fn, mode="poseidon", net=net, compression=compression
            ) as trainer:
                for t in range(total):
                    started, cpu0 = time.perf_counter(), time.process_time()
                    stats.append(await trainer.step(mine))
                    times.append(time.perf_counter() - started)
                    cpu.append(time.process_time() - cpu0)
                    if t == 0:  # the layers synced by factors compute no weight gradient
                        skip_weight_grad(model, [n for n, s in stats[0].schemes.items() if s in ("sfb", "adam")])
            return stats, {name: w.why for name, w in trainer.compression_plan.items()}, trainer.merge_groups

        stats, why, groups = poseidon_aio.run(main())
        stats = stats[cfg["warmup"] :]
        extra = {
            "schemes": stats[-1].schemes,
            "why": why,
            "groups": [g for g in groups if len(g) > 1],  # MG-WFBP's merged messages
            "compute_s": statistics.median(s.compute_s for s in stats),
            "bytes": statistics.median(sum(s.bytes.values()) for s in stats),
        }
    with open(cfg["out"], "w") as f:
        json.dump({"times": times[cfg["warmup"] :], "cpu": cpu[cfg["warmup"] :], **extra}, f)
    # gloo's teardown can hang once peers are gone; the result is written, leave at once.
    sys.stdout.flush()
    os._exit(0)


# -- the harness ----------------------------------------------------------------------------------


def run_config(impl: str, model: str, world: int, link: str, args, namespaces) -> dict:
    shaper_rate = RATES[link][1] if not namespaces and not impl.startswith("ddp") else None
    cfg = dict(
        impl=impl,
        model=model,
        tflops=args.device_tflops,
        rank_r=args.rank,
        warmup=args.warmup,
        steps=args.steps,
        shaper_rate=shaper_rate,
    )
    ranks = launch(
        "bench.compress",
        world,
        cfg,
        namespaces=namespaces,
        timeout=args.timeout,
        what=f"{impl} {model} x{world} on {link}",
    )
    steps = [
        max(r["times"][i] for r in ranks) for i in range(len(ranks[0]["times"]))
    ]  # the job's step: its slowest rank's
    # On a host with fewer cores than ranks the job's CPU a step bounds a step once the link no longer does.
    return {"step_s": statistics.median(steps), "cpu_s": job_cpu(ranks), "rank0": ranks[0]}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench compress", description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--models", default="cnn,resnet,transformer")
    parser.add_argument("--links", default="100mbit,1gbit")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--rank", type=int, default=4, help="PowerSGD's rank, ours and DDP's hook's")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs of every implementation per row, interleaved; a cell is their median, "
        "a ratio the median of the repeats' ratios (min-max shown)",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=MERGE_WARMUP,
        help="untimed steps (bench.MERGE_WARMUP: the merge plan and its trials; DDP's PowerSGD starts at 2)",
    )
    parser.add_argument("--device-tflops", type=float, default=6.0, help="replayed device rate, TFLOP/s")
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.worker:
        worker(json.loads(args.worker))
        return {}
    from bench import netns

    capped, why = netns.available()
    impls = args.impls.split(",")
    rows = []
    notes = [
        f"replayed device rate {args.device_tflops} TFLOP/s; "
        "compression arithmetic real, on this CPU, for every implementation",
        f"PowerSGD rank {args.rank} for ours and DDP's hook; {args.workers} workers",
    ]
    if not capped:
        notes.append(
            f"network namespaces unavailable ({why}): "
            "our processes were capped by the library's shaper, DDP ran UNCAPPED"
        )
    for link in args.links.split(","):
        for model in args.models.split(","):
            runs = {impl: [] for impl in impls}
            for rep in range(args.repeats):
                for impl in impls:
                    try:
                        if capped:
                            with netns.hosts(args.workers, RATES[link][0]) as names:
                                result = run_config(impl, model, args.workers, link, args, names)
                        else:
                            result = run_config(impl, model, args.workers, link, args, None)
                    except RuntimeError as exc:  # one implementation failing is a finding, not the end of the run
                        notes.append(
                            f"{impl} on {model}, {link}{f' (repeat {rep + 1})' if args.repeats > 1 else ''}: "
                            f"FAILED ({str(exc).splitlines()[0]}); see stderr"
                        )
                        print(exc, file=sys.stderr, flush=True)
                        result = None
                    runs[impl].append(result)
                    if result is not None:
                        print(
                            f"  {link} {model} x{args.workers} {impl}"
                            + (f" (repeat {rep + 1})" if args.repeats > 1 else "")
                            + f": {result['step_s'] * 1e3:.1f} ms, "
                            f"CPU {result['cpu_s'] * 1e3:.1f} ms a step (all ranks)",
                            file=sys.stderr,
                            flush=True,
                        )
            results = {impl: median_run([r for r in rs if r]) for impl, rs in runs.items() if any(rs)}
            row = {"link": link, "model": model, **{i: results[i]["step_s"] for i in impls if i in results}}
            row["cpu"] = {i: results[i]["cpu_s"] for i in impls if i in results}
            if "auto" in results:
                schemes = results["auto"]["rank0"].get("schemes", {})
                row["lossy"] = {k: v for k, v in schemes.items() if v in LOSSY}
                row["merged"] = results["auto"]["rank0"].get("groups", [])
                row["layers"] = len(schemes)
                for base in ("ddp", "ddp_powersgd", "ddp_powersgd_1bucket", "ddp_fp16", "exact"):
                    ratios = sorted(
                        b["step_s"] / a["step_s"] for b, a in zip(runs.get(base, []), runs["auto"]) if a and b
                    )
                    if ratios:
                        row[f"auto_vs_{base}"] = statistics.median(ratios)
                        row[f"auto_vs_{base}_spread"] = (ratios[0], ratios[-1])
            # Our CPU a step ÷ DDP's (exact, no hook), repeat by repeat.
            for ours in ("auto", "exact"):
                cpus = sorted(
                    a["cpu_s"] / d["cpu_s"] for d, a in zip(runs.get("ddp", []), runs.get(ours, [])) if a and d
                )
                if cpus:
                    row[f"cpu_{ours}_vs_ddp"] = (statistics.median(cpus), cpus[0], cpus[-1])
            rows.append(row)
    lines = [
        "Lossy against exact: auto compresses the layers listed (the rest exact); ddp and exact are exact; "
        "ddp+PowerSGD and ddp+fp16 are lossy on every bucket.",
        "",
        f"Step time, ms (median of the slowest rank), {args.workers} workers, replayed compute; speed-up = other ÷ auto"
        + (f" (median of {args.repeats} interleaved repeats' ratios, min–max)" if args.repeats > 1 else ""),
        "",
        "| link | model | "
        + " | ".join(impls)
        + " | auto vs ddp | vs ddp+PowerSGD | vs ddp+PowerSGD, one bucket | vs ddp+fp16 | vs exact | lossy layers |",
        "|---|---|" + "---|" * (len(impls) + 6),
    ]

    def fmt(r, k):
        if k not in r:
            return "-"
        lo, hi = r[f"{k}_spread"]
        return f"{r[k]:.2f}" + (f" ({lo:.2f}–{hi:.2f})" if args.repeats > 1 else "")

    for r in rows:
        cells = " | ".join(f"{r[i] * 1e3:.1f}" if i in r else "failed" for i in impls)
        lossy = f"{len(r['lossy'])} of {r['layers']}" if "lossy" in r else "-"
        lines.append(
            f"| {r['link']} | {r['model']} | {cells} | {fmt(r, 'auto_vs_ddp')} | {fmt(r, 'auto_vs_ddp_powersgd')} | "
            f"{fmt(r, 'auto_vs_ddp_powersgd_1bucket')} | {fmt(r, 'auto_vs_ddp_fp16')} | {fmt(r, 'auto_vs_exact')} | "
            f"{lossy} |"
        )
    lines += [
        "",
        "CPU a step, ms: every thread of a worker process, over its timed steps ÷ steps, "
        f"summed over the {args.workers} ranks "
        f"(this host has {os.cpu_count()} cores: past {os.cpu_count()} x the step time, the CPU bounds the step)",
        "",
        "| link | model | " + " | ".join(impls) + " | auto ÷ ddp | exact ÷ ddp |",
        "|---|---|" + "---|" * (len(impls) + 2),
    ]

    def cpu_ratio(r, k):
        if k not in r:
            return "-"
        m, lo, hi = r[k]
        return f"{m:.2f}" + (f" ({lo:.2f}–{hi:.2f})" if args.repeats > 1 else "")

    for r in rows:
        lines.append(
            f"| {r['link']} | {r['model']} | "
            + " | ".join(f"{r['cpu'][i] * 1e3:.1f}" if i in r["cpu"] else "-" for i in impls)
            + f" | {cpu_ratio(r, 'cpu_auto_vs_ddp')} | {cpu_ratio(r, 'cpu_exact_vs_ddp')} |"
        )
    print("\n".join(lines))
    for n in notes:
        print(f"\nnote: {n}")
    for r in rows:
        if "lossy" in r:
            print(f"auto's lossy layers ({r['model']}, {r['link']}): {r['lossy']}; merged messages: {r['merged']}")

    def worst(link: str, key: str):
        values = [r[key] for r in rows if r["link"] == link and key in r]
        return round(min(values), 2) if values else None

    cpus = [r[k][0] for r in rows for k in ("cpu_auto_vs_ddp", "cpu_exact_vs_ddp") if k in r]
    out = {
        "bench": "compress",
        "max_cpu_vs_ddp": round(max(cpus), 2) if cpus else None,
        "min_speedup_auto_vs_ddp_100mbit": worst("100mbit", "auto_vs_ddp"),
        "min_speedup_auto_vs_ddp_powersgd_100mbit": worst("100mbit", "auto_vs_ddp_powersgd"),
        "min_speedup_auto_vs_ddp_fp16_100mbit": worst("100mbit", "auto_vs_ddp_fp16"),
        "min_speedup_auto_vs_ddp_1gbit": worst("1gbit", "auto_vs_ddp"),
        "min_speedup_auto_vs_ddp_powersgd_1gbit": worst("1gbit", "auto_vs_ddp_powersgd"),
        "min_speedup_auto_vs_ddp_powersgd_1bucket_100mbit": worst("100mbit", "auto_vs_ddp_powersgd_1bucket"),
        "workers": args.workers,
        "powersgd_rank": args.rank,
        "repeats": args.repeats,
        "ddp_capped": capped,
        "device_tflops": args.device_tflops,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        **{
            f"{k}_{r['model']}_{r['link']}": round(r[k], 2)
            for r in rows
            for k in (
                "auto_vs_ddp",
                "auto_vs_ddp_powersgd",
                "auto_vs_ddp_powersgd_1bucket",
                "auto_vs_ddp_fp16",
                "auto_vs_exact",
            )
            if k in r
        },
    }
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
