"""``python -m bench train``: step time against DistributedDataParallel (gloo), real and replayed compute.

Models (bench/models.py): ``fc`` (an FC-heavy MLP, 12.6 M parameters, K = 32), ``cnn`` (a small
CNN), ``resnet`` (a ResNet-20-style CNN with batch norm) and ``transformer`` (a two-block encoder:
embedding, attention, MLP blocks: Linear on 3-D inputs). 2 and 4 worker processes, every
implementation in the same run.

Links and compute:

* ``loopback``: real compute on this machine's CPU, uncapped loopback. Correctness and overheads.
* ``1gbit`` and ``100mbit``: every process in its own network namespace whose link tc tbf caps in
  both directions, so DDP's gloo traffic is capped exactly like ours, with **real** compute on
  this machine's 2 cores (``real``) or compute **replayed** per layer at ``--device-tflops``
  (6 TFLOP/s: the ATC'17 Titan X class; forward 1x, backward 2x, SFB's reconstruction GEMM
  too; ``replayed``). Parameters, gradients, factors and every byte on the wire are real.
  Without root, our processes are capped by the library's shaper and DDP runs uncapped, and the
  report says so.

A step's time is the median over the timed steps of the slowest rank, every implementation's steps
run back to back (DDP's too: no barrier between them since 2026-11-25); with ``--repeats R`` every
implementation runs R times, interleaved, and a row's speedup is the median of the R ratios (min–max
shown): the noise a single run hides. Each row also has the **lower bound** of poseidon's step:
max(its compute (forward + backward on the compute thread), the bytes on its busiest link ÷ the
link's rate), the rate being the cap (none on loopback).

The last line is one JSON object: ``speedup_vs_ddp_fc_1gbit`` (replayed, 4 workers, as before),
``speedup_vs_ddp_fc_1gbit_real``, ``min_speedup_vs_ddp`` (the worst row),
``max_over_bound`` (poseidon's step ÷ its lower bound, the worst row) and ``max_cpu_vs_ddp`` (our
CPU a step, every thread of every rank, ÷ DDP's: the worst row's median over the repeats).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

from bench import MERGE_WARMUP, job_cpu, launch, median_run, parse_impl
from poseidon_aio.units import parse_rate

IMPLS = ["ddp", "wfbp", "poseidon"]
RATES = {link: (link, parse_rate(link) / 8) for link in ("1gbit", "100mbit")}  # tc rate, bytes/s
# (link, compute) rows run by default.
SETUPS = [("loopback", "real"), ("1gbit", "real"), ("1gbit", "replayed"), ("100mbit", "real"), ("100mbit", "replayed")]


def impl_variant(impl: str) -> tuple:
    """``bench.parse_impl`` with this bench's settings: ours ``chunk``, ``merge``, ``allreduce``,
    ``hybcomm`` (as ``ps+allreduce``), ``spread`` and ``pipeline`` (``PSConfig.group_spread_bytes``
    and ``group_pipeline_bytes``), ``early`` (``OptimizerConfig.early_step_bytes``, 0: off),
    ``loop=own`` (the user's own loop: ``loss.backward()``, ``await trainer.synchronize()``,
    ``opt.step()``, instead of ``await trainer.step(batch)``), ``hosts`` (``Trainer(hosts=...)``,
    bench hosts); DDP's ``sparse=1``."""
    ours = {"chunk", "merge", "allreduce", "hybcomm", "spread", "pipeline", "early", "loop", "hosts"}
    return parse_impl(impl, {"ddp": {"sparse"}, **{m: ours for m in IMPLS if m != "ddp"}})


# -- one worker process ---------------------------------------------------------------------------


def worker(cfg: dict) -> None:
    import torch

    from bench.models import build, replay, skip_weight_grad

    torch.set_num_threads(1)
    model, batch, loss_fn = build(cfg["model"], seed=0)
    _, mine, _ = build(cfg["model"], seed=1 + cfg["rank"])  # this rank's own data
    device = torch.device(cfg.get("device", "cpu"))
    model, mine = model.to(device), tuple(t.to(device) for t in mine)
    # A GPU runs ahead of the host: a step ends when its kernels have.
    settle = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    replayed = cfg["compute"] == "replayed"
    if replayed:
        replay(model, batch, cfg["tflops"])
        loss_fn = lambda out, _: out.float().mean()  # noqa: E731 - the replayed outputs are zeros
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    total = cfg["warmup"] + cfg["steps"]
    times, cpu, loop_cpu, extra = [], [], [], {}
    # bench hosts: a host's first worker reads its link's interface counters over the timed steps.
    counting = cfg.get("iface") and os.environ.get("LOCAL_RANK", "0") == "0"
    iface = {}

    if counting:
        from bench.netns import tcp_counters
    sampler = None
    if cfg.get("profile"):
        from bench.profile import Sampler

        run = f"{cfg['impl']}-{cfg['model']}-{cfg['link']}-{cfg['compute']}-{cfg['world']}w-{cfg['steps']}steps"
        run = run.replace(":", "_")
        path = os.path.join(cfg["profile"], f"{run}-rank{cfg['rank']}.txt")
        sampler = Sampler(path, native=cfg.get("native"), tool=cfg.get("sampler", "py-spy"))

    from bench.profile import cpu_by_kind, thread_cpu

    threads = {}  # thread_cpu() at the first timed step, then each kind's CPU over the timed steps

    def read_iface(when: str) -> None:
        if when == "start":
            threads["start"] = thread_cpu()
        else:
            threads.update(cpu_by_kind(threads.pop("start"), thread_cpu()))
        if sampler is not None:  # the timed steps, and nothing else, are sampled
            sampler.start() if when == "start" else sampler.stop()
        if counting:
            for way in ("tx", "rx"):
                with open(f"/sys/class/net/{cfg['iface']}/statistics/{way}_bytes") as f:
                    iface[(when, way)] = int(f.read())
            iface[(when, "tcp")] = tcp_counters()  # the namespace's: what its link lost

    if impl_variant(cfg["impl"])[0] == "ddp":
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        dist.init_process_group("gloo", rank=cfg["rank"], world_size=cfg["world"])
        if impl_variant(cfg["impl"])[1].get("sparse") == "1":
            for m in model.modules():
                if isinstance(m, torch.nn.Embedding):
                    m.sparse = True
        ddp = DistributedDataParallel(model)
        # One barrier, then the steps back to back, as a user's loop runs them and as ours are
        # timed: a barrier before every step would leave out of DDP's step the time a rank waits
        # for a slower one (3-4 ms of the transformer's 46 at 4 workers, 1 Gbit).
        dist.barrier()
        for t in range(total):
            if t == cfg["warmup"]:
                read_iface("start")
            started, cpu0 = time.perf_counter(), time.process_time()
            opt.zero_grad()
            loss_fn(ddp(mine[0]), mine[1]).backward()
            opt.step()
            settle()
            times.append(time.perf_counter() - started)
            cpu.append(time.process_time() - cpu0)
        read_iface("end")
        dist.barrier()
    else:
        import poseidon_aio
        from poseidon_aio import kernels
        from poseidon_aio.net import NetConfig, ShaperConfig
        from poseidon_aio.net.credentials import token_from_env
        from poseidon_aio.plan import MergeConfig
        from poseidon_aio.sync import AllReduceConfig
        from poseidon_aio.train import OptimizerConfig

        if replayed:
            rate = cfg["tflops"] * 1e12

            def replayed_reconstruct(us, vs, scale, out_w, out_b=None):
                time.sleep(2 * sum(u.shape[0] for u in us) * out_w.numel() / rate)

            kernels.reconstruct = replayed_reconstruct
        net = None
        if cfg.get("shaper_rate"):
            shaper = ShaperConfig(egress_rate=cfg["shaper_rate"], ingress_rate=cfg["shaper_rate"])
            net = NetConfig(token=token_from_env(), shaper=shaper)

        async def main():
            stats = []
            mode, variant = impl_variant(cfg["impl"])
            ps = poseidon_aio.PSConfig(
                group_spread_bytes=int(variant["spread"]) if "spread" in variant else cfg.get("group_spread_bytes"),
                group_pipeline_bytes=int(variant["pipeline"]) if "pipeline" in variant else None,
                chunk_bytes=int(variant.get("chunk", poseidon_aio.PSConfig.chunk_bytes)),
            )
            allreduce = AllReduceConfig(variant.get("allreduce", cfg["allreduce"]))
            early = OptimizerConfig(
                early_step_bytes=int(variant.get("early", OptimizerConfig.early_step_bytes)) or None
            )
            kind = variant.get("merge", cfg.get("merge"))
            merge = MergeConfig(kind=kind) if kind and mode != "wfbp" else None
            hybcomm = {"hybcomm": tuple(variant["hybcomm"].split("+"))} if "hybcomm" in variant else {}
            async with poseidon_aio.Trainer(
                model,
                opt,
                loss_fn,
                mode=mode,
                net=net,
                ps=ps,
                merge=merge,
                allreduce=allreduce,
                optimizer_config=early,
                hosts=variant.get("hosts", "launcher"),
                **hybcomm,
            ) as trainer:
                own = variant.get("loop") == "own"
                for t in range(total):
                    if t == cfg["warmup"]:
                        read_iface("start")
                    started, cpu0, loop0 = time.perf_counter(), time.process_time(), trainer.loop_cpu_s
                    if own:  # as a DDP user's loop, on this thread
                        opt.zero_grad()
                        loss_fn(model(mine[0]), mine[1]).backward()
                        stats.append(await trainer.synchronize())
                        opt.step()
                    else:
                        stats.append(await trainer.step(mine))
                    settle()
                    times.append(time.perf_counter() - started)
                    cpu.append(time.process_time() - cpu0)
                    loop_cpu.append(trainer.loop_cpu_s - loop0)  # the trainer's event loop thread
                    if t == 0 and replayed:  # the layers synced by factors compute no weight gradient
                        skip_weight_grad(model, [n for n, s in stats[0].schemes.items() if s in ("sfb", "adam")])
                read_iface("end")
                return stats, trainer.merge_groups, trainer.merge_info

        stats, groups, info = poseidon_aio.run(main())
        stats = stats[cfg["warmup"] :]
        extra = {
            "schemes": stats[-1].schemes,
            "groups": [g for g in groups if len(g) > 1],  # the merged messages in force at the end
            # what the planner saw (alpha, serial: seconds a message) and predicted (seconds a step)
            "plan": {k: info[k] for k in ("alpha_s", "serial_s", "predicted_s", "trial") if k in (info or {})},
            "compute_s": statistics.median(s.compute_s for s in stats),
            "bytes": statistics.median(sum(s.bytes.values()) for s in stats),
            "loop_cpu_s": statistics.median(loop_cpu[cfg["warmup"] :]),
        }
    if counting:
        extra["iface"] = {way: iface[("end", way)] - iface[("start", way)] for way in ("tx", "rx")}
        extra["tcp"] = {k: v - iface[("start", "tcp")][k] for k, v in iface[("end", "tcp")].items()}
    with open(cfg["out"], "w") as f:
        # Each thread kind's CPU and runs on a core a timed step (gloo's C++ threads too).
        extra["threads"] = {
            kind: (seconds / cfg["steps"], runs / cfg["steps"]) for kind, (seconds, runs) in threads.items()
        }
        json.dump({"times": times[cfg["warmup"] :], "cpu": cpu[cfg["warmup"] :], **extra}, f)
    # gloo's teardown can hang once peers are gone; the result is written, leave at once.
    sys.stdout.flush()
    os._exit(0)


# -- the harness ----------------------------------------------------------------------------------


def run_config(impl: str, model: str, world: int, link: str, compute: str, args, namespaces) -> dict:
    shaper_rate = RATES[link][1] if link != "loopback" and not namespaces and impl_variant(impl)[0] != "ddp" else None
    cfg = dict(
        impl=impl,
        model=model,
        compute=compute,
        tflops=args.device_tflops,
        warmup=args.warmup,
        steps=args.steps,
        shaper_rate=shaper_rate,
        allreduce=args.allreduce,
        merge=args.merge,
        group_spread_bytes=args.group_spread_bytes,
        link=link,
        profile=args.profile and os.path.abspath(args.profile),
        native=not os.environ.get("BENCH_PROFILE_NONBLOCKING"),
        sampler=args.sampler,
    )
    ranks = launch(
        "bench.train",
        world,
        cfg,
        namespaces=namespaces,
        timeout=args.timeout,
        what=f"{impl} {model} x{world} on {link} ({compute})",
    )
    # The job's step is its slowest rank's.
    steps = [max(r["times"][i] for r in ranks) for i in range(len(ranks[0]["times"]))]
    result = {"step_s": statistics.median(steps), "rank0": ranks[0], "cpu_s": job_cpu(ranks)}
    if "loop_cpu_s" in ranks[0]:
        result["loop_cpu_s"] = [r["loop_cpu_s"] for r in ranks]
    # Each thread kind's CPU and runs a step, the means over the ranks.
    result["threads"] = by_thread_kind([r["threads"] for r in ranks], statistics.mean)
    if "bytes" in ranks[0]:
        result["compute_s"] = max(r["compute_s"] for r in ranks)
        result["bytes"] = max(r["bytes"] for r in ranks)  # in + out, the busiest rank
    return result


def by_thread_kind(readings: list, reduce) -> dict:
    """``{thread kind: (CPU s, runs)}``, each of the two ``reduce``d over ``readings`` (ranks, or
    repeats) of the same form; a kind missing from one counts 0 there."""
    kinds = sorted({kind for reading in readings for kind in reading})
    return {k: tuple(reduce([reading.get(k, (0.0, 0.0))[j] for reading in readings]) for j in (0, 1)) for k in kinds}


def threads_text(threads: dict) -> str:
    """``loop 3.22 (12), compute 2.36 (6)``: each thread kind's CPU ms and runs, the busiest first."""
    busiest = sorted(threads.items(), key=lambda kv: -kv[1][0])
    return ", ".join(f"{k} {cpu * 1e3:.2f} ({runs:.0f})" for k, (cpu, runs) in busiest if cpu >= 5e-5)


def lower_bound(result: dict, link: str) -> float:
    """max(compute, the busiest link's bytes each way ÷ its rate): no schedule beats it."""
    bound = result["compute_s"]
    if link != "loopback":
        bound = max(bound, result["bytes"] / 2 / RATES[link][1])
    return bound


def main(argv=None) -> dict:
    from bench.models import compute_saved_by_factors

    parser = argparse.ArgumentParser(prog="python -m bench train", description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument(
        "--setups", default=",".join(f"{link}:{compute}" for link, compute in SETUPS), help="link:compute pairs"
    )
    parser.add_argument("--models", default="fc,cnn,resnet,transformer")
    parser.add_argument("--workers", default="2,4")
    parser.add_argument(
        "--impls",
        default=",".join(IMPLS),
        help="ddp, wfbp, poseidon; a variant of ours runs beside them as e.g. poseidon:chunk=262144:merge=single",
    )
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs of every implementation per row, interleaved; the row is their median, "
        "its speedup the median of the repeats' ratios (min–max shown)",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=MERGE_WARMUP,
        help="untimed steps (bench.MERGE_WARMUP: the merge plan and its trials)",
    )
    parser.add_argument("--device-tflops", type=float, default=6.0, help="replayed device rate, TFLOP/s")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument(
        "--allreduce", default="auto", choices=("auto", "ring", "direct"), help="AllReduceConfig.algorithm for our runs"
    )
    parser.add_argument(
        "--group-spread-bytes",
        type=int,
        default=None,
        help="PSConfig.group_spread_bytes for our runs "
        "(0: every merge group on one shard; default: from the measured link)",
    )
    parser.add_argument(
        "--merge",
        default=None,
        choices=("none", "algorithm1", "optimal", "best", "single", "buckets", "tapered"),
        help="MergeConfig.kind for our runs (default: the trainer's)",
    )
    parser.add_argument(
        "--profile", default=None, help="folder: py-spy samples every rank over its timed steps (bench/profile.py)"
    )
    parser.add_argument(
        "--sampler",
        default="py-spy",
        choices=("py-spy", "perf"),
        help="--profile's: py-spy (by Python frame) or perf (by library, the kernel's and gloo's too)",
    )
    args = parser.parse_args(argv)
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.worker:
        worker(json.loads(args.worker))
        return {}
    from bench import netns

    capped, why = netns.available()
    impls = args.impls.split(",")
    for impl in impls:
        impl_variant(impl)  # a typo fails here, not after the first rows
    rows, summary = [], {}
    notes = [f"replayed device rate {args.device_tflops} TFLOP/s"]
    if not capped:
        notes.append(
            f"network namespaces unavailable ({why}): "
            "our processes were capped by the library's shaper, DDP ran UNCAPPED"
        )
    saved = compute_saved_by_factors()
    notes.append(
        f"SFB layers compute no weight gradient: the fc model's forward+backward on this CPU takes "
        f"{saved['factored'] * 1e3:.1f} ms instead of {saved['autograd'] * 1e3:.1f} ms with autograd's "
        "(one process, real compute)"
    )
    for setup in args.setups.split(","):
        link, compute = setup.split(":")
        for model in args.models.split(","):
            for world in (int(w) for w in args.workers.split(",")):
                # Each repeat runs every implementation once, in turn, so a slow minute of the shared
                # host lands on all of them; the row takes the median repeat of each and the ratio
                # of each repeat's pair (DDP's and ours, minutes apart at most).
                runs = {impl: [] for impl in impls}
                for rep in range(args.repeats):
                    for impl in impls:
                        if link != "loopback" and capped:
                            with netns.hosts(world, RATES[link][0]) as names:
                                result = run_config(impl, model, world, link, compute, args, names)
                        else:
                            result = run_config(impl, model, world, link, compute, args, None)
                        runs[impl].append(result)
                        print(
                            f"  {link} {compute} {model} x{world} {impl}"
                            + (f" (repeat {rep + 1})" if args.repeats > 1 else "")
                            + f": {result['step_s'] * 1e3:.1f} ms, "
                            f"CPU {result['cpu_s'] * 1e3:.1f} ms a step (all ranks)"
                            + (
                                f", event loop CPU per rank {[round(c * 1e3, 1) for c in result['loop_cpu_s']]} ms"
                                if "loop_cpu_s" in result
                                else ""
                            )
                            + f"; a rank's by thread, ms (runs): {threads_text(result['threads'])}",
                            file=sys.stderr,
                            flush=True,
                        )
                results = {impl: median_run(runs[impl]) for impl in impls}
                row = {
                    "link": link,
                    "compute": compute,
                    "model": model,
                    "workers": world,
                    **{i: results[i]["step_s"] for i in impls},
                }
                row["cpu"] = {i: results[i]["cpu_s"] for i in impls}
                # Each thread kind's CPU and runs a step and rank: the median over the repeats.
                row["threads"] = {
                    i: by_thread_kind([run["threads"] for run in runs[i]], statistics.median) for i in impls
                }
                tag = f"{model}_{link}_{compute}_{world}w"
                if "poseidon" in results:
                    row["bound"] = lower_bound(results["poseidon"], link)
                    row["over_bound"] = results["poseidon"]["step_s"] / row["bound"]
                    row["schemes"] = results["poseidon"]["rank0"].get("schemes")
                    row["groups"] = results["poseidon"]["rank0"].get("groups")
                    row["plan"] = results["poseidon"]["rank0"].get("plan")
                    summary[f"over_bound_{tag}"] = round(row["over_bound"], 2)
                if "ddp" in results and "poseidon" in results:
                    ratios = sorted(d["step_s"] / p["step_s"] for d, p in zip(runs["ddp"], runs["poseidon"]))
                    row["speedup"] = statistics.median(ratios)
                    row["spread"] = (ratios[0], ratios[-1])
                    summary[f"speedup_vs_ddp_{tag}"] = round(row["speedup"], 2)
                    # Our CPU a step ÷ DDP's, repeat by repeat, as for the step.
                    cpus = sorted(p["cpu_s"] / d["cpu_s"] for d, p in zip(runs["ddp"], runs["poseidon"]))
                    row["cpu_vs_ddp"] = (statistics.median(cpus), cpus[0], cpus[-1])
                    summary[f"cpu_vs_ddp_{tag}"] = round(row["cpu_vs_ddp"][0], 2)
                # Every other implementation's step ÷ the first's, repeat by repeat (the pairs ran
                # minutes apart at most): the median and the spread.
                row["vs_first"] = {}
                for impl in impls[1:]:
                    ratios = sorted(b["step_s"] / a["step_s"] for a, b in zip(runs[impls[0]], runs[impl]))
                    row["vs_first"][impl] = (statistics.median(ratios), ratios[0], ratios[-1])
                    summary[f"{impl}_over_{impls[0]}_{tag}"] = round(row["vs_first"][impl][0], 3)
                rows.append(row)
    lines = [
        "Step time, ms (median of the slowest rank); "
        "speedup = DDP ÷ poseidon (with repeats: the median of the repeats' ratios, min–max); "
        "bound = max(compute, busiest link bytes ÷ rate); "
        "CPU a step = every thread's CPU ms, summed over the ranks (this host's cores are shared by all of them)",
        "",
        "| link | compute | model | workers | "
        + " | ".join(impls)
        + " | bound | poseidon ÷ bound | speedup vs DDP | CPU a step, all ranks: "
        + " / ".join(impls)
        + " | CPU ÷ DDP's |",
        "|---|---|---|---|" + "---|" * (len(impls) + 5),
    ]
    for r in rows:
        cells = " | ".join(f"{r[i] * 1e3:.1f}" for i in impls)
        bound = f"{r['bound'] * 1e3:.1f} | {r['over_bound']:.2f}" if "bound" in r else "- | -"
        cpu = " / ".join(f"{r['cpu'][i] * 1e3:.0f}" for i in impls)
        speedup = f"{r.get('speedup', float('nan')):.2f}"
        cpu_ratio = f"{r['cpu_vs_ddp'][0]:.2f}" if "cpu_vs_ddp" in r else "-"
        if args.repeats > 1 and "spread" in r:
            speedup += f" ({r['spread'][0]:.2f}–{r['spread'][1]:.2f})"
            cpu_ratio += f" ({r['cpu_vs_ddp'][1]:.2f}–{r['cpu_vs_ddp'][2]:.2f})"
        lines.append(
            f"| {r['link']} | {r['compute']} | {r['model']} | {r['workers']} | {cells} | {bound} | {speedup} "
            f"| {cpu} | {cpu_ratio} |"
        )
    if len(impls) > 1:
        lines += [
            "",
            f"Step time ÷ {impls[0]}'s, the median of the repeats' ratios (min–max):",
            "",
            "| link | compute | model | workers | " + " | ".join(impls[1:]) + " |",
            "|---|---|---|---|" + "---|" * (len(impls) - 1),
        ]
        for r in rows:
            cells = " | ".join(f"{m:.3f} ({lo:.3f}–{hi:.3f})" for m, lo, hi in r["vs_first"].values())
            lines.append(f"| {r['link']} | {r['compute']} | {r['model']} | {r['workers']} | {cells} |")
    lines += [
        "",
        "CPU a step and rank by thread, ms (runs: times the thread was put on a core, a wake-up each), "
        "the median over the repeats:",
        "",
        "| link | compute | model | workers | " + " | ".join(impls) + " |",
        "|---|---|---|---|" + "---|" * len(impls),
    ]
    for r in rows:
        cells = " | ".join(threads_text(r["threads"][i]) for i in impls)
        lines.append(f"| {r['link']} | {r['compute']} | {r['model']} | {r['workers']} | {cells} |")
    print("\n".join(lines))
    for n in notes:
        print(f"\nnote: {n}")
    for r in rows:
        if r.get("schemes"):
            print(f"poseidon schemes ({r['model']}, x{r['workers']}, {r['link']}, {r['compute']}): {r['schemes']}")
            print(
                f"poseidon merged messages ({r['model']}, x{r['workers']}, {r['link']}, {r['compute']}): "
                f"{r.get('groups') or 'none'}"
            )
            if r.get("plan"):
                plan = r["plan"]
                predicted = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in plan.get("predicted_s", {}).items())
                print(
                    f"  the planner's: a message {plan.get('alpha_s', 0) * 1e3:.2f} ms on the link, "
                    f"{plan.get('serial_s', 0) * 1e3:.2f} ms of the backward; predicted ms: {predicted}"
                )
                if plan.get("trial"):
                    trial = plan["trial"]
                    verdict = (
                        f"{trial.get('planner', 'the plan')} kept"
                        if trial["kept"]
                        else "dropped for one message per layer"
                    )
                    tried = ", ".join(f"{name} {ms * 1e3:.1f}" for name, ms in trial.get("tried", {}).items())
                    cpu = ""
                    if trial.get("trials_cpu_s"):  # the job's CPU a step, and the noise the verdict allowed
                        each = ", ".join(f"{c * 1e3:.1f}" if c else "?" for c in trial["trials_cpu_s"])
                        cpu = (
                            f"; CPU ms a step {each} against {(trial['unmerged_cpu_s'] or 0) * 1e3:.1f}, "
                            f"noise {trial['noise_s'] * 1e3:.1f} ms, decided by {trial['by']}"
                        )
                    print(
                        f"  its trial: ms a step {tried or trial['planned_s'] * 1e3} "
                        f"against {trial['unmerged_s'] * 1e3:.1f} unmerged{cpu}: {verdict}"
                    )
    speedups = [r["speedup"] for r in rows if "speedup" in r]
    bounds = [r["over_bound"] for r in rows if "over_bound" in r]
    cpus = [r["cpu_vs_ddp"][0] for r in rows if "cpu_vs_ddp" in r]
    out = {
        "bench": "train",
        "speedup_vs_ddp_fc_1gbit": summary.get("speedup_vs_ddp_fc_1gbit_replayed_4w"),
        "speedup_vs_ddp_fc_1gbit_real": summary.get("speedup_vs_ddp_fc_1gbit_real_4w"),
        "min_speedup_vs_ddp": round(min(speedups), 2) if speedups else None,
        "max_over_bound": round(max(bounds), 2) if bounds else None,
        "max_cpu_vs_ddp": round(max(cpus), 2) if cpus else None,
        "ddp_capped": capped,
        "device_tflops": args.device_tflops,
        "compute_saved_by_factors_ms": round((saved["autograd"] - saved["factored"]) * 1e3, 1),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        **summary,
    }
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
