"""``python -m bench paper``: ATC'17's scaling experiments, trace-driven, with our real code path.

Every worker is a real process in its own network namespace behind tc tbf (bench/netns.py), with
the papers' models' real layer shapes (``poseidon_aio.plan.models.trace``: VGG19, VGG19-22K,
Inception-V3, ResNet-152) and their compute **replayed** per layer at a stated device rate; every
parameter, gradient, sufficient factor and byte on the wire is real. Rows: naive PS, WFBP (PS),
poseidon (WFBP + HybComm + MG-WFBP) and DDP (gloo, the same caps), at 1, 2, 4, 8 and 16 workers;
throughput speed-up over one worker (P x t(1) / t(P)), and each iteration's lower bound
max(compute, bytes on poseidon's busiest link / rate).

What is scaled, and why the figures still are the paper's:

* **Bytes**, by ``--scale`` s (16: VGG19-22K's 229 M parameters would take 16 x 1.8 GB on this
  24 GiB machine): a conv layer's parameters become ``numel / s`` floats; a fully-connected layer
  M x N and its rows K become M/√s x N/√s and K/√s, so its matrix (MN) and its sufficient
  factors (K(M + N)) both shrink by s and HybComm's comparison is unchanged. The link rate is
  divided by s too: every transfer takes the time it takes at full size. DDP's bucket sizes
  (1 MiB first, then 25 MiB) are divided by s too, so a bucket holds the layers it would hold
  at full size and overlaps the backward as much; so is the PS's key-value pair (2 MiB), so a
  layer is cut into the keys, over the shards, that it has at full size.
* **Time**, by ``--dilation`` d (2 cores must move 16 processes' bytes): replayed compute runs d
  times slower and the link d times slower still; reported times are divided by d.
* **Compute** is replayed at ``--device-tflops`` (default 4.2: a Titan X running VGG19 at the
  35.5 images/s ATC'17 measured, 3 x 39.3 GFLOP forward per image), at each layer's full-size
  FLOPs (the SFB rebuild included), whatever the byte scaling.

Without root there are no namespaces: the bench says so and stops.
The report beside the emulation (the simulator at every point, poseidon's lower bound, the figures)
is bench/paper_report.py.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from typing import Optional

from bench import MERGE_WARMUP, launch
from bench.paper_report import IMPLS, figures, impl_variant, lower_bound, simulate_beside
from poseidon_aio.units import parse_rate

# The modes whose merge plan is measured, then tried: their warm-up holds the trials.
MERGING = ("mgwfbp", "poseidon")
MODELS = ["vgg19", "vgg19_22k", "inception_v3", "resnet152"]


# -- the replayed model ---------------------------------------------------------------------------


def scaled_layers(model: str, batch: int, scale: float) -> list:
    """``[(name, kind, shapes, rows, full-size forward FLOPs)]``: the trace with every layer's
    bytes divided by ``scale`` (see the module docstring)."""
    from poseidon_aio.plan.models import trace

    root = math.sqrt(scale)
    out = []
    for layer in trace(model, batch):
        if layer.fully_connected:
            m, n = layer.shapes[0]
            m2, n2 = max(1, round(m / root)), max(1, round(n / root))
            shapes = [(m2, n2)] + ([(m2,)] if len(layer.shapes) > 1 else [])
            out.append((layer.name, "fc", shapes, max(1, round(batch / root)), layer.flops))
        else:
            shapes = [(max(1, round(math.prod(s) / scale)),) for s in layer.shapes]
            out.append((layer.name, "other", shapes, 0, layer.flops))
    return out


def build_model(layers: list, tflops: float, dilation: float, scale: float):
    """A ``torch.nn.Module`` whose layers own the scaled parameters and replay the full-size
    compute; fully-connected layers are ``nn.Linear`` subclasses so HybComm sees them as such."""
    import torch
    from torch import nn

    from bench.models import Replay

    rate = tflops * 1e12

    class Linear(nn.Linear):
        def __init__(self, m: int, n: int, rows: int, flops: float, bias: bool) -> None:
            super().__init__(n, m, bias=bias)
            self.replay_fwd_s, self.replay_skip_weight_grad = flops / rate * dilation, False
            self.replay_out = torch.zeros(rows, m)
            self.replay_grads = [torch.randn_like(p) * 1e-3 for p in self.parameters()]

        def forward(self, x):
            return Replay.apply(x, self, *self.parameters())

    class Other(nn.Module):
        def __init__(self, shapes, flops: float, out_shape) -> None:
            super().__init__()
            self.params = nn.ParameterList([nn.Parameter(torch.zeros(s)) for s in shapes])
            self.replay_fwd_s, self.replay_skip_weight_grad = flops / rate * dilation, False
            self.replay_out = torch.zeros(out_shape)
            self.replay_grads = [torch.randn(s) * 1e-3 for s in shapes]

        def forward(self, x):
            return Replay.apply(x, self, *self.params)

    modules = []
    for i, (name, kind, shapes, rows, flops) in enumerate(layers):
        nxt = layers[i + 1] if i + 1 < len(layers) else None
        if kind == "fc":
            modules.append(Linear(shapes[0][0], shapes[0][1], rows, flops, bias=len(shapes) > 1))
        else:
            # What the next layer reads: a fully-connected layer's K x N input, else one column.
            out_shape = (nxt[3], nxt[2][0][1]) if nxt is not None and nxt[1] == "fc" else (8, 1)
            modules.append(Other(shapes, flops, out_shape))
    first = layers[0]
    in_shape = (first[3], first[2][0][1]) if first[1] == "fc" else (8, 1)
    return nn.Sequential(*modules), torch.zeros(in_shape)


# -- one worker process ---------------------------------------------------------------------------


def worker(cfg: dict) -> None:
    import torch

    from bench.netns import tcp_counters

    torch.set_num_threads(1)
    tcp = {}  # this namespace's TCP counters when the timed steps begin and end
    layers = scaled_layers(cfg["model"], cfg["batch"], cfg["scale"])
    model, x = build_model(layers, cfg["tflops"], cfg["dilation"], cfg["scale"])
    loss_fn = lambda out, _: out.float().mean()  # noqa: E731 - replayed outputs are zeros
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    total, times, extra = cfg["warmup"] + cfg["steps"], [], {}
    mode, variant = impl_variant(cfg["impl"])
    if mode == "ddp":
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        # DDP's buckets (1 MiB first, then 25 MiB) are sized for full-size models: at bytes / scale
        # each would hold scale x more of the model and overlap less with the backward than at
        # full size, so they shrink by the same factor (the simulator's DDP has them at full size).
        import torch.nn.parallel.distributed as ddp_defaults

        dist._DEFAULT_FIRST_BUCKET_BYTES = int(dist._DEFAULT_FIRST_BUCKET_BYTES / cfg["scale"])
        ddp_defaults._DEFAULT_BUCKET_CAP_MB = ddp_defaults._DEFAULT_BUCKET_CAP_MB / cfg["scale"]
        dist.init_process_group("gloo", rank=cfg["rank"], world_size=cfg["world"])
        ddp = DistributedDataParallel(model) if cfg["world"] > 1 else model
        # One barrier, then the steps back to back, as a user's loop runs them and as ours are
        # timed: a barrier before every step would leave out of DDP's step the time a rank waits
        # for a slower one (3-4 ms of the transformer's 46 at 4 workers, 1 Gbit).
        dist.barrier()
        for t in range(total):
            if t == cfg["warmup"]:
                tcp["begin"] = tcp_counters()
            started = time.perf_counter()
            opt.zero_grad()
            loss_fn(ddp(x), None).backward()
            opt.step()
            times.append(time.perf_counter() - started)
        dist.barrier()
    else:
        import poseidon_aio
        from poseidon_aio import kernels
        from poseidon_aio.cluster.book import DEFAULT_CHUNK_BYTES
        from poseidon_aio.plan import MergeConfig

        rate, grow = cfg["tflops"] * 1e12, cfg["scale"] ** 1.5  # an FC layer's K M N shrank by s^1.5

        def replayed_reconstruct(us, vs, scale, out_w, out_b=None):
            time.sleep(2 * sum(u.shape[0] for u in us) * out_w.numel() * grow / rate * cfg["dilation"])

        kernels.reconstruct = replayed_reconstruct

        async def main():
            stats = []
            # The merge trials' DDP buckets shrink with the bytes, as DDP's own do (above), and so
            # do the PS's key-value pairs: at 2 MiB a pair of the scaled model, a layer that is
            # several keys on several shards at full size would be one key on one shard, its
            # P - 1 pushes converging on one link (Inception-V3's 512 KiB head at 8 workers:
            # TCP retransmissions on every link, WFBP 11 % slower than the full-size plan).
            merge = MergeConfig(bucket_bytes=tuple(int(b / cfg["scale"]) for b in MergeConfig().bucket_bytes))
            ps = poseidon_aio.PSConfig(chunk_bytes=max(64, int(DEFAULT_CHUNK_BYTES / cfg["scale"])))
            async with poseidon_aio.Trainer(
                model, opt, loss_fn, mode=mode, broadcast_buffers=False, merge=merge, ps=ps, **variant
            ) as trainer:
                for t in range(total):
                    if t == cfg["warmup"]:
                        tcp["begin"] = tcp_counters()
                    started = time.perf_counter()
                    stats.append(await trainer.step((x, None)))
                    times.append(time.perf_counter() - started)
                    if t == 0:  # layers synced by factors compute no weight gradient (train.layers)
                        for module, scheme in zip(model, stats[0].schemes.values()):
                            module.replay_skip_weight_grad = scheme in ("sfb", "adam")
            return stats, trainer.merge_info

        stats, info = poseidon_aio.run(main())
        stats = stats[cfg["warmup"] :]
        extra = {
            "schemes": stats[-1].schemes,
            "compute_s": statistics.median(s.compute_s for s in stats) / cfg["dilation"],
            "bytes": statistics.median(sum(s.bytes.values()) for s in stats),
            "merge_groups": len(info.get("groups", [])),
            "alpha_s": info.get("alpha_s"),
            "beta_s_per_byte": info.get("beta_s_per_byte"),
            # each distinct plan: its groups' layer counts from the output (backward order), and what the model
            # predicted
            "candidates": [
                {
                    "planner": c["planner"],
                    "predicted_s": c["predicted_s"],
                    "groups": [len(g) for g in c["groups"]][::-1],
                }
                for c in info.get("candidates", [])
            ],
            # what the plan's trials tried (ms a step) and kept: why a merged row is what it is
            "trial": info.get("trial"),
        }
    end = tcp_counters()
    extra["tcp"] = {k: end[k] - tcp["begin"][k] for k in end} if "begin" in tcp else {}
    d = cfg["dilation"]
    with open(cfg["out"], "w") as f:
        json.dump({"times": [t / d for t in times[cfg["warmup"] :]], **extra}, f)
    sys.stdout.flush()
    os._exit(0)  # gloo's teardown can hang once peers are gone; the result is written


# -- the harness ----------------------------------------------------------------------------------


def run(model: str, impl: str, world: int, args, rate_bits: float) -> dict:
    from bench import netns

    cfg = dict(
        model=model,
        impl=impl,
        batch=args.batch,
        scale=args.scale,
        dilation=args.dilation,
        tflops=args.device_tflops,
        warmup=args.warmup if impl_variant(impl)[0] in MERGING else args.warmup_plain,
        steps=args.steps,
    )
    cap = f"{rate_bits / args.scale / args.dilation / 1e3:.0f}kbit"
    with netns.hosts(world, cap) as names:
        ranks = launch(
            "bench.paper", world, cfg, namespaces=names, timeout=args.timeout, what=f"{impl} {model} x{world}"
        )
    steps = [max(r["times"][i] for r in ranks) for i in range(len(ranks[0]["times"]))]
    out = {"step_s": statistics.median(steps), "steps_s": steps, "rank0": ranks[0]}
    for key in ("merge_groups", "alpha_s", "beta_s_per_byte", "candidates", "trial"):
        if ranks[0].get(key) is not None:
            out[key] = ranks[0][key]
    # The links' losses over the timed steps, every namespace's summed (each rank reads its own).
    out["tcp"] = {
        k: sum(r.get("tcp", {}).get(k, 0) for r in ranks) for k in ("retrans_segs", "timeouts", "loss_probes")
    }
    if "bytes" in ranks[0]:
        out["compute_s"] = max(r["compute_s"] for r in ranks)
        # Bytes crossed the scaled link: scale back to what the full-size model moves.
        out["bytes"] = max(r["bytes"] for r in ranks) * args.scale
    return out


def _efficiency(args, worlds: list, rate_bits: float) -> Optional[dict]:
    """``{senders: fraction}`` for the simulator (see ``--efficiency``), or None for ideal links."""
    from poseidon_aio.plan.simulator import FlowEfficiency

    if args.efficiency == "ideal":
        return None
    if args.efficiency != "measure":
        return FlowEfficiency.parse(args.efficiency).points
    saved = os.path.join(os.path.dirname(args.from_json) if args.from_json else args.out, "paper-efficiency.json")
    if args.from_json:
        if not os.path.exists(saved):
            return None
        with open(saved) as f:
            return {int(n): fraction for n, fraction in json.load(f).items()}
    from bench.patterns import fan_in_efficiency

    # The emulation's own links: the scaled, dilated rate, at the worker counts it ran.
    measured = fan_in_efficiency(
        worlds, rate_bits / args.scale / args.dilation, seconds=args.efficiency_seconds, repeats=args.efficiency_repeats
    )
    print(f"  fan-in efficiency of the emulation's links: {measured}", file=sys.stderr, flush=True)
    with open(saved, "w") as f:
        json.dump(measured, f)
    return measured or None


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench paper", description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--workers", default="1,2,4,8,16")
    parser.add_argument(
        "--impls",
        default=",".join(IMPLS),
        help="of " + ", ".join(IMPLS) + "; poseidon:hybcomm=ps+allreduce narrows HybComm's schemes",
    )
    parser.add_argument("--link", default="10gbit", help="each worker's link at full size (the paper's 10 GbE)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument(
        "--scale", type=float, default=16.0, help="every layer's bytes and the link rate divided by this"
    )
    parser.add_argument(
        "--dilation", type=float, default=10.0, help="compute and link slowed by this; times divided back"
    )
    parser.add_argument("--device-tflops", type=float, default=4.2)
    parser.add_argument(
        "--alpha-us",
        type=float,
        default=50.0,
        help="start-up per message the simulator charges (our event loop's, measured ~50 us)",
    )
    parser.add_argument("--steps", type=int, default=10, help="timed iterations a point (the median is reported)")
    parser.add_argument(
        "--warmup",
        type=int,
        default=MERGE_WARMUP,
        help="untimed iterations of a merging mode (bench.MERGE_WARMUP: the merge plan and its trials)",
    )
    parser.add_argument(
        "--warmup-plain",
        type=int,
        default=4,
        help="untimed iterations of the others (naive, wfbp, ddp: TCP's windows, first-touch pages; "
        "they have no merge plan to try, which is what a merging mode's longer warm-up holds)",
    )
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--out", default="bench/out", help="where the figures and the raw results go")
    parser.add_argument(
        "--simulate", action="store_true", default=True, help="run the simulator beside the emulation (default)"
    )
    parser.add_argument("--no-simulate", dest="simulate", action="store_false")
    parser.add_argument(
        "--efficiency-seconds",
        type=float,
        default=2.0,
        help="with --efficiency measure: each round of the fan-in patterns moves this many seconds of bytes",
    )
    parser.add_argument(
        "--efficiency-repeats",
        type=int,
        default=7,
        help="with --efficiency measure: rounds per pattern, the median taken "
        "(3 rounds of 1 s spread 0.65-0.82 at 3 senders)",
    )
    parser.add_argument(
        "--from-json", help="report (tables, simulator, figures) from a saved paper-emulated.json instead of emulating"
    )
    parser.add_argument(
        "--efficiency",
        default="measure",
        help="what the simulator's links deliver with n senders into one: "
        "'measure' (bench patterns' ring and all-to-all on the emulation's "
        "links at every worker count, saved beside the results; with --from-json, the saved one if any), "
        "'ideal', or 'senders:fraction,...'",
    )
    args = parser.parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return {}
    rate_bits = parse_rate(args.link)
    os.makedirs(args.out, exist_ok=True)
    worlds = [int(w) for w in args.workers.split(",")]
    impls = args.impls.split(",")
    for impl in impls:
        impl_variant(impl)  # a wrong one fails now, not after an hour of emulation
    results: dict = {}
    if args.from_json:  # report only: no namespaces needed
        with open(args.from_json) as f:
            for key, r in json.load(f).items():
                m, w, i = key.split("|")
                results[(m, int(w), i)] = {**r, "rank0": {"schemes": r.get("schemes")}}
        keep = set(args.models.split(","))
        results = {k: v for k, v in results.items() if k[0] in keep and k[1] in worlds and (k[2] in impls or k[1] == 1)}
    else:
        from bench import netns

        capped, why = netns.available()
        if not capped:
            print(f"bench paper needs network namespaces (root and iproute2): {why}")
            return {}
        for model in args.models.split(","):
            for world in worlds:
                for impl in impls if world > 1 else ["wfbp"]:  # one worker: compute alone, whatever the scheme
                    res = run(model, impl, world, args, rate_bits)
                    results[(model, world, impl)] = res
                    tcp = res.get("tcp", {})
                    print(
                        f"  {model} x{world} {impl}: {res['step_s'] * 1e3:.0f} ms "
                        f"(timed steps: {tcp.get('retrans_segs', 0)} TCP segments "
                        f"retransmitted, {tcp.get('timeouts', 0)} retransmission timeouts, all links)",
                        file=sys.stderr,
                        flush=True,
                    )
        with open(os.path.join(args.out, "paper-emulated.json"), "w") as f:
            json.dump(
                {
                    f"{m}|{w}|{i}": {k: v for k, v in r.items() if k != "rank0"}
                    | {"schemes": r["rank0"].get("schemes")}
                    for (m, w, i), r in results.items()
                },
                f,
            )
    efficiency = _efficiency(args, worlds, rate_bits) if args.simulate else None
    lines, summary = [], {}
    for model in args.models.split(","):
        single = results[(model, 1, "wfbp")]["step_s"] if (model, 1, "wfbp") in results else None
        lines += [
            f"{model}: iteration time, ms (full size: bytes x {args.scale:g}, dilation {args.dilation:g} divided out), "
            "and speed-up over one worker (P t(1) / t(P))",
            "",
            "| workers | "
            + " | ".join(impls)
            + " | poseidon bound | "
            + " | ".join(f"speed-up {i}" for i in impls)
            + " |",
            "|---|" + "---|" * (2 * len(impls) + 1),
        ]
        for world in worlds:
            row = [results.get((model, world, i if world > 1 else "wfbp")) for i in impls]
            cells = " | ".join(f"{r['step_s'] * 1e3:.0f}" if r else "-" for r in row)
            bound = lower_bound(results, model, world, rate_bits)
            speed = " | ".join(f"{world * single / r['step_s']:.1f}" if r and single else "-" for r in row)
            lines.append(
                f"| {world} | {cells} | {bound * 1e3:.0f} | {speed} |"
                if bound
                else f"| {world} | {cells} | - | {speed} |"
            )
            for impl, r in zip(impls, row):
                if r and single:
                    summary[f"speedup_{model}_{impl}_{world}w"] = round(world * single / r["step_s"], 2)
        lines.append("")
    sim_error = sim_error_ideal = mg_sim = None
    held_out: dict = {}
    if args.simulate:
        sim_lines, sim_error, sim_error_ideal, mg_sim, held_out = simulate_beside(results, args, rate_bits, efficiency)
        lines += sim_lines
    paths = figures(args.out, results, args, rate_bits)
    lines += [
        "",
        f"Figures: {', '.join(paths)}"
        if paths
        else "Figures: skipped (matplotlib is not installed: pip install '.[bench]')",
    ]
    print("\n".join(lines))
    out = {
        "bench": "paper",
        "speedup_vgg19_22k_16w": summary.get("speedup_vgg19_22k_poseidon_16w"),
        "sim_vs_emulated_max_error": round(sim_error, 3) if sim_error is not None else None,
        "sim_vs_emulated_max_error_ideal_links": round(sim_error_ideal, 3) if sim_error_ideal is not None else None,
        "sim_vs_emulated_max_error_heldout": held_out.get("max"),
        "sim_vs_emulated_mean_error_heldout": held_out.get("mean"),
        "heldout_points": held_out.get("points", 0),
        "heldout_errors": held_out.get("by_point", {}),  # "model workers scheme": error
        "fan_in_efficiency": efficiency,
        "speedup_mgwfbp_vs_wfbp_64_sim": round(mg_sim, 3) if mg_sim is not None else None,
        "scale": args.scale,
        "dilation": args.dilation,
        "device_tflops": args.device_tflops,
        "link": args.link,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        **summary,
    }
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
