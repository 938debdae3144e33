"""``python -m bench ps``: parameter-server aggregation and our all-reduce against gloo ``all_reduce``, same processes.

Four worker processes (``--workers``) meet at one TCPStore. gloo's process group, our PS nodes
(one co-located shard per worker) and our worker mesh (``sync.allreduce``) share it. For each case
all of them average the same float32 tensors, interleaved repeat by repeat after a barrier, after
``--warmup`` untimed rounds; a repeat's time is the slowest rank's, the figure the median over
repeats. Every tensor is its own sync of ours, all started at once (what the trainer does for layers
ready together).

gloo runs twice, both computing the sum (then dividing, to give the mean ours return), and every
result is checked against the per-tensor one's: per tensor, one ``all_reduce`` a tensor (all started
async, then waited: what a naive caller does; 38 calls for VGG19, 29 small ones for the
transformer); and coalesced as PyTorch DDP does it, the tensors in reverse order (DDP's gradient-ready
order) flattened into buckets of DDP's default sizes (the first closed at 1 MiB, the rest at
25 MiB), one async ``all_reduce`` a bucket, then waited, divided and copied back into the tensors
(flattening and copy-back timed, as DDP pays them; a bucket of one tensor, the 64 MiB case's, is
reduced in place).

Links: ``loopback``, and ``1gbit`` / ``100mbit``: every process in its own network namespace
behind tc tbf (both directions), gloo capped exactly like us.

Cases: one 64 MiB tensor; VGG19's 38 parameter tensors (143.7 M floats, 575 MB per worker); the
transformer of ``bench train`` (29 tensors, 0.65 M floats: many small ones); a chunk-size sweep
(256 KiB to 16 MiB) on the 64 MiB tensor (loopback); with ``--bucket-sweep``, the transformer as
the one message MG-WFBP makes of it, at each chunk size given, on every link. Then the
shard-load table for VGG19: our ~2 MiB key-value pairs against one tensor per shard (stock
TensorFlow's placement).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

from bench import launch
from poseidon_aio.plan import mgwfbp

MiB = 1 << 20


LINKS = {"loopback": None, "1gbit": "1gbit", "100mbit": "100mbit"}
IMPLS = ("gloo", "gloo_coalesced", "ps", "allreduce", "direct")


def ddp_buckets(shapes, itemsize: int = 4) -> list:
    """The tensor indices of each bucket DDP would all-reduce, in the order it launches them, each
    in the order its tensors' gradients come (the reverse of ``shapes``): the trainer's rule for
    DDP's buckets (``plan.mgwfbp.ddp_buckets``, 1 MiB first, then 25 MiB) on these tensors."""
    sizes = [int(np.prod(s)) * itemsize for s in shapes]
    return [[layer - 1 for layer in reversed(bucket)] for bucket in mgwfbp.ddp_buckets(sizes)]


def _transformer_shapes() -> list:
    from bench.models import build

    model, _, _ = build("transformer")
    return [list(p.shape) for p in model.parameters()]


def _cases(args, link: str) -> list:
    from poseidon_aio.plan.models import vgg19

    cases = [] if args.skip_64mib else [("64MiB", [(16 * MiB,)], 2 * MiB)]
    if not args.skip_vgg19:
        cases.append(("vgg19", [list(s.shape) for s in vgg19()], 2 * MiB))
    cases.append(("transformer", _transformer_shapes(), 2 * MiB))
    # The transformer merged into one message (what MG-WFBP sends it as), its chunk swept: on a
    # capped link a ring step's wake-up is latency the next chunk's bytes can hide.
    flat = sum(int(np.prod(s)) for s in _transformer_shapes())
    for kib in args.bucket_sweep:
        cases.append((f"transformer-bucket@{kib}KiB", [(flat,)], kib * 1024))
    if link == "loopback":
        for kib in args.sweep:
            cases.append((f"64MiB@{kib}KiB", [(16 * MiB,)], kib * 1024))
    return cases


def _worker(cfg: dict) -> None:
    rank, world, cases, warmup, repeats = cfg["rank"], cfg["world"], cfg["cases"], cfg["warmup"], cfg["repeats"]
    import torch
    import torch.distributed as dist

    from poseidon_aio.cluster import ClusterEnv, Manifest, ParamSpec, Rendezvous
    from poseidon_aio.cluster.mesh import Mesh
    from poseidon_aio.net import run
    from poseidon_aio.net.credentials import config_from_env
    from poseidon_aio.ps import PSConfig, PSNode
    from poseidon_aio.sync.allreduce import AllReduceSyncer
    from poseidon_aio.sync.bucket import Bucket

    torch.set_num_threads(1)

    async def main():
        rdzv = Rendezvous(ClusterEnv.from_env(), timeout=300)
        await rdzv.start()
        dist.init_process_group("gloo", store=dist.PrefixStore("gloo", rdzv.store), rank=rank, world_size=world)
        mesh = await Mesh.start(rdzv.scoped("mesh"), config_from_env())
        results = {}
        for n, (name, shapes, chunk) in enumerate(cases):
            manifest = Manifest(ParamSpec(f"t{i}", s) for i, s in enumerate(shapes))
            grads = [
                np.random.default_rng([rank, i]).standard_normal(s, dtype=np.float32) for i, s in enumerate(shapes)
            ]
            outs = [np.empty_like(g) for g in grads]
            # No new copy of the tensors for gloo coalesced (VGG19's are 575 MB a copy, and four ranks
            # with two more each overflow a 23 GB machine): its tensors are `outs` (the PS's, written
            # after it in the round) and its buckets' flat buffers hold the per-tensor side's tensors,
            # so it runs first and its result is checked before either is overwritten.
            coalesced, views = _flat_buckets(torch, [torch.from_numpy(o) for o in outs], ddp_buckets(shapes))
            gloo_bufs = [torch.empty(s) if v is None else v for s, v in zip(shapes, views)]
            node = await PSNode.start(
                manifest, PSConfig(chunk_bytes=chunk, sync_timeout=600), rendezvous=rdzv.job(f"case{n}")
            )
            reducers = {
                a: AllReduceSyncer(rank, world, mesh.peers, timeout=600, chunk_bytes=chunk, algorithm=a)
                for a in ("ring", "direct")
            }
            reduced = [np.empty_like(g) for g in grads]
            buckets = [Bucket(f"t{i}", [i], [i], [r], grads=[g]) for i, (g, r) in enumerate(zip(grads, reduced))]
            times = {impl: [] for impl in IMPLS}
            for clock in range(warmup + repeats):
                for o, g in zip(outs, grads):
                    np.copyto(o, g)
                await asyncio.to_thread(dist.barrier)
                started = time.perf_counter()
                await asyncio.to_thread(_gloo_coalesced_mean, dist, coalesced, world)
                times["gloo_coalesced"].append(time.perf_counter() - started)
                for b, g in zip(gloo_bufs, grads):
                    b.copy_(torch.from_numpy(g))
                await asyncio.to_thread(dist.barrier)
                started = time.perf_counter()
                await asyncio.to_thread(_gloo_mean, dist, gloo_bufs, world)
                times["gloo"].append(time.perf_counter() - started)
                if clock == warmup + repeats - 1:  # gloo coalesced (in outs) against gloo per tensor
                    for o, b in zip(outs, gloo_bufs):
                        np.testing.assert_allclose(o, b.numpy(), rtol=1e-4, atol=1e-5)
                await asyncio.to_thread(dist.barrier)
                started = time.perf_counter()
                await asyncio.gather(
                    *(node.client.push([i], [g], [o], clock) for i, (g, o) in enumerate(zip(grads, outs)))
                )
                times["ps"].append(time.perf_counter() - started)
                for impl, algorithm in (("allreduce", "ring"), ("direct", "direct")):
                    await asyncio.to_thread(dist.barrier)
                    started = time.perf_counter()
                    await asyncio.gather(*(reducers[algorithm].start(b, clock) for b in buckets))
                    times[impl].append(time.perf_counter() - started)
            times = {k: v[warmup:] for k, v in times.items()}
            for o, r, b in zip(outs, reduced, gloo_bufs):
                np.testing.assert_allclose(o, b.numpy(), rtol=1e-4, atol=1e-5)
                np.testing.assert_allclose(r, b.numpy(), rtol=1e-4, atol=1e-5)
            await node.close()
            results[f"{n}:{name}"] = times
            del grads, outs, gloo_bufs, coalesced, views, reduced, buckets
        await mesh.close()
        dist.destroy_process_group()
        await rdzv.leave()
        return results

    results = run(main())
    with open(cfg["out"], "w") as f:
        json.dump(results, f)
    sys.stdout.flush()
    os._exit(0)  # gloo's teardown can hang once peers are gone; the result is written


def _gloo_mean(dist, tensors, world: int) -> None:
    works = [dist.all_reduce(t, async_op=True) for t in tensors]
    for w, t in zip(works, tensors):
        w.wait()
        t.div_(world)


def _flat_buckets(torch, tensors, buckets) -> tuple:
    """``[(flat, [(view of flat, tensor), ...]), ...]``, a bucket each: the flat buffer DDP allocates
    once, the pairs what is copied in and back (a bucket of one tensor is that tensor, flat, reduced
    in place, no pairs); and each tensor's view in its bucket's flat buffer (None in a bucket of one).
    """
    plan, views = [], [None] * len(tensors)
    for idx in buckets:
        if len(idx) == 1:
            plan.append((tensors[idx[0]].view(-1), []))
            continue
        flat = torch.empty(sum(tensors[i].numel() for i in idx))
        pairs, offset = [], 0
        for i in idx:
            n = tensors[i].numel()
            views[i] = flat[offset : offset + n].view_as(tensors[i])
            pairs.append((views[i], tensors[i]))
            offset += n
        plan.append((flat, pairs))
    return plan, views


def _gloo_coalesced_mean(dist, buckets, world: int) -> None:
    """DDP's way: each bucket filled, then its ``all_reduce`` started; all waited, divided, copied back."""
    works = []
    for flat, pairs in buckets:
        for view, t in pairs:
            view.copy_(t)
        works.append(dist.all_reduce(flat, async_op=True))
    for w, (flat, pairs) in zip(works, buckets):
        w.wait()
        flat.div_(world)
        for view, t in pairs:
            t.copy_(view)


def shard_load_table(shards: int) -> tuple:
    from poseidon_aio.cluster import InformationBook
    from poseidon_aio.plan.models import vgg19

    balanced = InformationBook(vgg19(), workers=shards, shards=shards)
    tensor = InformationBook(vgg19(), workers=shards, shards=shards, placement="tensor")
    rows = [
        f"VGG19 over {shards} shards, MB per shard (max ÷ mean in the last column):",
        "",
        "| placement | " + " | ".join(f"shard {s}" for s in range(shards)) + " | max/mean |",
        "|---|" + "---|" * (shards + 1),
    ]
    for label, book in (("~2 MiB key-value pairs, LPT (ours)", balanced), ("one tensor per shard (stock TF)", tensor)):
        load = book.shard_bytes()
        rows.append(f"| {label} | " + " | ".join(f"{b / 1e6:.0f}" for b in load) + f" | {book.max_over_mean():.3f} |")
    return "\n".join(rows), balanced.max_over_mean(), tensor.max_over_mean()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench ps", description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--links", default="loopback,1gbit")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument(
        "--capped-repeats", type=int, default=5, help="repeats on a capped link (VGG19 takes ~7 s a round at 1 Gbit)"
    )
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds first (TCP buffers, page faults)")
    parser.add_argument(
        "--sweep",
        type=lambda s: [int(x) for x in s.split(",") if x],
        default=[256, 512, 1024, 2048, 4096, 8192, 16384],
        help="chunk sizes in KiB",
    )
    parser.add_argument(
        "--bucket-sweep",
        type=lambda s: [int(x) for x in s.split(",") if x],
        default=[],
        help="chunk sizes in KiB for the transformer as one bucket, every link",
    )
    parser.add_argument("--skip-vgg19", action="store_true")
    parser.add_argument("--skip-64mib", action="store_true")
    parser.add_argument("--timeout", type=float, default=3600)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(json.loads(args.worker))
        return {}
    from bench import netns

    capped, why = netns.available()
    summary, lines = {}, []
    for link in args.links.split(","):
        if LINKS[link] and not capped:
            print(f"note: skipping {link}: network namespaces unavailable ({why})")
            continue
        cases = _cases(args, link)
        repeats = args.capped_repeats if LINKS[link] else args.repeats
        cfg = {"cases": cases, "warmup": args.warmup, "repeats": repeats}
        if LINKS[link]:
            with netns.hosts(args.workers, LINKS[link]) as names:
                per_rank = launch(
                    "bench.ps", args.workers, cfg, namespaces=names, timeout=args.timeout, what=f"bench ps on {link}"
                )
        else:
            per_rank = launch("bench.ps", args.workers, cfg, timeout=args.timeout, what=f"bench ps on {link}")
        lines += [
            f"Aggregation across {args.workers} processes, {link}, seconds (median over {repeats} of the slowest "
            "rank); ratios: of the medians, with the min-max of the repeats' own ratios",
            "gloo per tensor makes one all_reduce a tensor, as a naive caller does; gloo coalesced one a DDP",
            "bucket (1 MiB first, then 25 MiB, tensors in reverse order), as DDP does. Ratios against each.",
            "",
            "| case | gloo calls (per tensor / coalesced) | gloo per tensor | gloo coalesced | ours (PS) "
            "| ours (all-reduce, ring) | ours (all-reduce, direct) | PS ÷ gloo | ring ÷ gloo | direct ÷ gloo "
            "| PS ÷ gloo coal. | ring ÷ gloo coal. | direct ÷ gloo coal. |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for n, (name, shapes, _) in enumerate(cases):
            med, runs = {}, {}
            for impl in IMPLS:
                runs[impl] = [max(r[f"{n}:{name}"][impl][i] for r in per_rank) for i in range(repeats)]
                med[impl] = statistics.median(runs[impl])

            def spread(ours: str, base: str) -> str:
                """The ratio of the medians, and the min-max of the repeats' own ratios."""
                each = [o / b for o, b in zip(runs[ours], runs[base])]
                return f"{med[ours] / med[base]:.2f} ({min(each):.2f}–{max(each):.2f})"

            ratio, ar_ratio, direct_ratio = (
                med["ps"] / med["gloo"],
                med["allreduce"] / med["gloo"],
                med["direct"] / med["gloo"],
            )
            coal = {impl: med[impl] / med["gloo_coalesced"] for impl in ("ps", "allreduce", "direct", "gloo")}
            key = f"{name.replace('@', '_')}{'' if link == 'loopback' else f'_{link}'}"
            # The keys without "coalesced" are against gloo per tensor, as they always were.
            summary[f"ratio_vs_gloo_{key}"] = round(ratio, 3)
            summary[f"allreduce_vs_gloo_{key}"] = round(ar_ratio, 3)
            summary[f"direct_vs_gloo_{key}"] = round(direct_ratio, 3)
            summary[f"ratio_vs_gloo_coalesced_{key}"] = round(coal["ps"], 3)
            summary[f"allreduce_vs_gloo_coalesced_{key}"] = round(coal["allreduce"], 3)
            summary[f"direct_vs_gloo_coalesced_{key}"] = round(coal["direct"], 3)
            summary[f"gloo_per_tensor_vs_gloo_coalesced_{key}"] = round(coal["gloo"], 3)
            lines.append(
                f"| {name} | {len(shapes)} / {len(ddp_buckets(shapes))} | {med['gloo']:.3f} "
                f"| {med['gloo_coalesced']:.3f} | {med['ps']:.3f} | {med['allreduce']:.3f} | {med['direct']:.3f} "
                f"| {spread('ps', 'gloo')} | {spread('allreduce', 'gloo')} | {spread('direct', 'gloo')} "
                f"| {spread('ps', 'gloo_coalesced')} | {spread('allreduce', 'gloo_coalesced')} "
                f"| {spread('direct', 'gloo_coalesced')} |"
            )
        lines.append("")
    table8, mm8, tf8 = shard_load_table(8)
    print("\n".join(lines))
    print(table8)
    result = {
        "bench": "ps",
        "ratio_vs_gloo_64MiB": summary.get("ratio_vs_gloo_64MiB"),
        "ratio_vs_gloo_64MiB_1gbit": summary.get("ratio_vs_gloo_64MiB_1gbit"),
        "ratio_vs_gloo_vgg19_1gbit": summary.get("ratio_vs_gloo_vgg19_1gbit"),
        "ratio_vs_gloo_coalesced_64MiB": summary.get("ratio_vs_gloo_coalesced_64MiB"),
        "ratio_vs_gloo_coalesced_64MiB_1gbit": summary.get("ratio_vs_gloo_coalesced_64MiB_1gbit"),
        "ratio_vs_gloo_coalesced_vgg19_1gbit": summary.get("ratio_vs_gloo_coalesced_vgg19_1gbit"),
        "max_over_mean_shard_bytes_vgg19_8shards": round(mm8, 4),
        "max_over_mean_one_tensor_per_shard_vgg19_8shards": round(tf8, 3),
        "workers": args.workers,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        **summary,
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
