"""``python -m bench simulate``: the discrete-event simulator from 1 to 1024 workers.

One process, no sockets: ``poseidon_aio.plan.simulator`` on the models' traces
(``poseidon_aio.plan.models.trace``), with the trainer's own HybComm plan, information book
and MG-WFBP planners. Sections, each a markdown table:

1. Speed-up over one worker (``P t(1) / t(P)``, batch 32 per worker) at 1, 2, 4, ..., 1024
   workers for VGG19, VGG19-22K, Inception-V3 and ResNet-152, per mode: naive PS, WFBP,
   Poseidon (WFBP + HybComm over PS, SFB and all-reduce + the trainer's default merging,
   ``best``: the fastest of Algorithm 1's plan, the exact one, one message, DDP's buckets and the
   tapered ones, or none, as its trials keep), Poseidon with the paper's HybComm (PS and SFB) and DDP
   (gloo's ring over 25 MiB buckets); at the paper's setting, a Titan X (6 TFLOP/s effective) on 10 GbE, then 40 GbE;
   then the 10 GbE figures at 32 and 1024 workers with the start-up charged as latency in
   flight instead of sender time (the two bounds of the network model).
2. HybComm's switch points: where each fully-connected layer leaves SFB as P grows (SFB's bytes
   grow with P^2 over the cluster, the PS's with the model), beside Algorithm 1's crossover on
   bytes, ``P* = 2MN / (K(M + N))``; and how many other layers go by all-reduce.
3. The iteration-time breakdown at 32 workers (the paper's largest cluster): compute and the
   communication it did not hide, the busiest link's bytes, the messages; then Poseidon (PS+SFB)
   with and without the trainer's default merging at 64, 256 and 1024 workers.
4. MG-WFBP on the ResNet-50 trace at 2 TFLOP/s (``bench mgwfbp``'s K80) on 10 Gbit/s: WFBP, one
   message (SyncEASGD), Algorithm 1 and the exact planner, to 64 workers and beyond, with the
   paper's start-up. MG-WFBP's measured all-reduce start-ups, 90.52, 271.56 and 633.64 us on 2,
   4 and 8 nodes, are exactly ``a(N) = 2 (N - 1) alpha`` with ``alpha = 45.26 us`` (a ring's
   start-up, the paper's Table II), so they extrapolate as that line: 5.70 ms at 64 workers.
   Two ways to charge it: (a) as ``bench mgwfbp`` emulates it, ``a(N)`` on every push of the PS
   (modes ``wfbp`` / ``mgwfbp``); (b) the paper's own all-reduce, ``alpha`` on every message, so
   each all-reduce pays ``2 (P - 1) alpha`` on every link (mode ``poseidon`` with
   ``hybcomm=("allreduce",)``).
5. Is the exact planner the better default? Algorithm 1 against ``optimal_plan`` over models,
   2 to 1024 workers, alpha 10 us to 1 ms and 2 to 100 TFLOP/s, in modes ``mgwfbp`` and
   ``poseidon``: how often each is faster in the simulator, and the worst cases; and what the
   default, ``best`` (both plans and one message tried, the fastest kept, or none), gains over
   Algorithm 1 alone.

The network (``plan/simulator/network.py``): every worker's NIC has an up- and a down-link, FIFO each;
a message takes ``alpha + bytes * beta`` of its sender's up-link and ``bytes * beta`` of its
receiver's down-link. alpha is 45.26 us on both networks (a per-message software start-up;
MG-WFBP's 10GbE figure). Figures (PNG) go to ``--out`` when matplotlib is installed
(``pip install '.[bench]'``); the tables do not need it. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

from poseidon_aio.plan.cost import PAPER_SCHEMES, Link, Scheme
from poseidon_aio.plan.models import PAPER_BATCH, trace
from poseidon_aio.plan.simulator import FlowEfficiency, Simulator
from poseidon_aio.wire import Kind

TITAN_X = 6e12  # FLOP/s a Titan X sustains on these models (its peak is 11 TFLOP/s)
K80 = 2e12  # bench mgwfbp's device: a K80 GPU at about two thirds of its peak
# MG-WFBP §V: a(N) = 90.52, 271.56, 633.64 us on 2, 4, 8 nodes = 2 (N - 1) x 45.26 us exactly.
ALPHA = 45.26e-6
NETWORKS = {"10GbE": 10e9 / 8, "40GbE": 40e9 / 8}
MODELS = ("vgg19", "vgg19_22k", "inception_v3", "resnet152")
SCHEMES = (
    ("naive PS", "naive", {}),
    ("WFBP", "wfbp", {}),
    ("Poseidon", "poseidon", {}),
    ("Poseidon (PS+SFB)", "poseidon", {"hybcomm": PAPER_SCHEMES}),
    ("DDP", "ddp", {}),
)
SHORT = {"ps": "PS", "sfb": "SFB", "allreduce": "AR"}


def paper_startup(workers: int) -> float:
    """MG-WFBP's measured all-reduce start-up, extended as its own line: ``2 (N - 1) alpha``."""
    return 2 * (workers - 1) * ALPHA


# -- 1. speed-ups ------------------------------------------------------------------------------


def scaling(models, workers, rate, alpha, efficiency=None) -> dict:
    """``{network: {model: {scheme label: {P: Iteration}}}}`` (``efficiency``: the simulator's
    ``FlowEfficiency``, None for ideal links)."""
    out = {}
    for net, bandwidth in NETWORKS.items():
        link = Link.of_bandwidth(bandwidth, alpha)
        out[net] = {}
        for model in models:
            tr = trace(model, PAPER_BATCH[model])
            rows = out[net][model] = {}
            for label, mode, extra in SCHEMES:
                rows[label] = {
                    p: Simulator(tr, p, rate=rate, link=link, mode=mode, efficiency=efficiency, **extra).run()
                    for p in workers
                }
    return out


def scaling_tables(results, workers, rate) -> list:
    lines = []
    for net, models in results.items():
        for model, rows in models.items():
            one = next(iter(rows.values()))[1]
            lines += [
                "",
                f"**{model}** on {net}, {rate / 1e12:g} TFLOP/s, batch {PAPER_BATCH[model]} per worker "
                f"(one worker: {one.compute * 1e3:.0f} ms per iteration); speed-up over one worker:",
                "",
                "| scheme | " + " | ".join(str(p) for p in workers) + " |",
                "|---|" + "---|" * len(workers),
            ]
            for label, by_p in rows.items():
                lines.append(f"| {label} | " + " | ".join(f"{by_p[p].speedup(one):.1f}" for p in workers) + " |")
    return lines


def latency_sensitivity(results, models, rate, alpha, points, efficiency=None) -> list:
    """The same start-up as latency in flight instead of sender time: the bounds of the model."""
    link = Link.of_bandwidth(NETWORKS["10GbE"], 0.0)
    lines = [
        "",
        f"How much rests on charging the start-up as sender time: 10GbE speed-ups with {alpha * 1e6:g} us per message "
        f"occupying the sender's link (the tables above) or in flight as latency, occupying nothing "
        "(fan-outs overlap it; a ring pays it every step).",
        "",
        "| model | scheme | " + " | ".join(f"{p}: sender time | {p}: latency" for p in points) + " |",
        "|---|---|" + "---|---|" * len(points),
    ]
    for model in models:
        tr = trace(model, PAPER_BATCH[model])
        rows = results["10GbE"][model]
        one = rows["WFBP"][1]
        for label, mode, extra in SCHEMES:
            cells = []
            for p in points:
                lat = Simulator(
                    tr, p, rate=rate, link=link, mode=mode, latency=alpha, efficiency=efficiency, **extra
                ).run()
                cells += [f"{rows[label][p].speedup(one):.1f}", f"{lat.speedup(one):.1f}"]
            lines.append(f"| {model} | {label} | " + " | ".join(cells) + " |")
    return lines


# -- 2. switch points ---------------------------------------------------------------------------


def runs_of(pairs) -> str:
    """``[(P, scheme)]`` as runs: ``"SFB 2-128, PS 256-1024"``."""
    out, start, last, prev = [], None, None, None
    for p, scheme in pairs:
        if scheme != last:
            if last is not None:
                out.append(f"{SHORT[last]} {start}" + (f"-{prev}" if prev != start else ""))
            start, last = p, scheme
        prev = p
    if last is not None:
        out.append(f"{SHORT[last]} {start}" + (f"-{prev}" if prev != start else ""))
    return ", ".join(out)


def switch_points(results, net: str) -> tuple:
    """Per model, the FC layers' schemes as P grows under both HybComms, and the other layers'."""
    lines = [
        "",
        f"HybComm's choice per layer as P grows ({net}; the trainer's link: alpha {ALPHA * 1e6:.2f} us, "
        "beta from the bandwidth). PS+SFB is Algorithm 1 on bytes; Poseidon weighs PS, SFB and all-reduce "
        "by predicted time. P* = 2MN / (K(M + N)): Algorithm 1's crossover (SFB while P <= P*).",
        "",
        "| model | layer (M x N) | P* | PS+SFB | Poseidon |",
        "|---|---|---|---|---|",
    ]
    summary = {}
    for model, rows in results[net].items():
        tr = trace(model, PAPER_BATCH[model])
        k = tr.batch
        paper, ours = rows["Poseidon (PS+SFB)"], rows["Poseidon"]
        ps = [p for p in paper if p > 1]
        for layer in tr:
            if not layer.fully_connected:
                continue
            m, n = layer.shapes[0]
            crossover = 2 * m * n / (k * (m + n))
            a = runs_of((p, paper[p].schemes[layer.name]) for p in ps)
            b = runs_of((p, ours[p].schemes[layer.name]) for p in ps)
            lines.append(f"| {model} | {layer.name} ({m} x {n}) | {crossover:.0f} | {a} | {b} |")
            last_sfb = max((p for p in ps if ours[p].schemes[layer.name] == "sfb"), default=None)
            summary[f"{model}.{layer.name}"] = {
                "p_star": round(crossover, 1),
                "last_sfb_poseidon": last_sfb,
                "last_sfb_paper": max((p for p in ps if paper[p].schemes[layer.name] == "sfb"), default=None),
            }
        others = [layer.name for layer in tr if not layer.fully_connected]
        cells = []
        for p in ps:
            n_ar = sum(ours[p].schemes[name] == "allreduce" for name in others)
            cells.append(f"{p}: {n_ar}")
        lines.append(
            f"| {model} | other {len(others)} layers: how many by AR (rest PS) | - | PS | {', '.join(cells)} |"
        )
    return lines, summary


# -- 3. breakdown --------------------------------------------------------------------------------


def breakdown(results, net: str, p: int) -> list:
    lines = [
        "",
        f"Iteration at {p} workers on {net}: ms of compute (forward + backward; SFB layers skip their weight "
        "gradient) and of communication it did not hide; the busiest link direction's MB; messages on the network.",
        "",
        "| model | scheme | iteration | compute | exposed | busiest link MB | messages |",
        "|---|---|---|---|---|---|---|",
    ]
    for model, rows in results[net].items():
        for label, by_p in rows.items():
            it = by_p[p]
            lines.append(
                f"| {model} | {label} | {it.time * 1e3:.0f} | {it.compute * 1e3:.0f} | {it.exposed * 1e3:.0f} | "
                f"{it.link_bytes / 1e6:.0f} | {it.messages} |"
            )
    return lines


def merging_on_the_ps(models, rate, alpha, points) -> tuple:
    """Poseidon (PS+SFB) with and without Algorithm 1's merging, at scale."""
    link = Link.of_bandwidth(NETWORKS["10GbE"], alpha)
    lines = [
        "",
        "Merging on the parameter server at scale: Poseidon (PS+SFB) on 10GbE without merging and with Algorithm 1's "
        "plan, untried (the trainer's trials would drop a plan slower than none). The book never splits a merge "
        "group's keys (one message per shard is what merging "
        "buys), so once the model is under P x 2 MiB a merged group's 2 MiB units land on a few shards, and each of "
        "those shards replies P - 1 times.",
        "",
        "| model | workers | speed-up, unmerged | speed-up, Algorithm 1 | groups "
        "| busiest link MB, unmerged | busiest link MB, Algorithm 1 |",
        "|---|---|---|---|---|---|---|",
    ]
    summary = {}
    for model in models:
        tr = trace(model, PAPER_BATCH[model])
        one = Simulator(tr, 1, rate=rate, link=link).run()
        for p in points:
            sim = Simulator(tr, p, rate=rate, link=link, mode="poseidon", hybcomm=PAPER_SCHEMES)
            none, alg1 = sim.run("none"), sim.run("algorithm1")
            lines.append(
                f"| {model} | {p} | {none.speedup(one):.1f} | {alg1.speedup(one):.1f} | "
                f"{len(alg1.groups.get('ps', ()))} | "
                f"{none.link_bytes / 1e6:.0f} | {alg1.link_bytes / 1e6:.0f} |"
            )
            summary[f"{model}_{p}"] = {
                "unmerged": round(none.speedup(one), 1),
                "algorithm1": round(alg1.speedup(one), 1),
                "link_mb_unmerged": round(none.link_bytes / 1e6),
                "link_mb_algorithm1": round(alg1.link_bytes / 1e6),
            }
    return lines, summary


# -- 4. MG-WFBP ----------------------------------------------------------------------------------


def mgwfbp(workers, rates) -> tuple:
    """WFBP, single, Algorithm 1, exact on ResNet-50: rows for both ways of charging the start-up."""
    tr = trace("resnet50", 32)
    rows = []  # (variant, rate, P, a, {kind: Iteration})
    for variant in ("ps", "allreduce"):
        for rate in rates:
            for p in workers if rate == rates[0] else [64 if 64 in workers else max(workers)]:
                if variant == "ps":
                    # bench mgwfbp: 10 Gbit/s egress, a(P) of link time on every push.
                    sim = Simulator(
                        tr,
                        p,
                        rate=rate,
                        link=Link.of_bandwidth(10e9 / 8, paper_startup(p)),
                        mode="mgwfbp",
                        costed=[Kind.PUSH],
                    )
                else:
                    sim = Simulator(
                        tr,
                        p,
                        rate=rate,
                        link=Link.of_bandwidth(10e9 / 8, ALPHA),
                        mode="poseidon",
                        hybcomm=(Scheme.ALLREDUCE,),
                    )
                runs = {kind: sim.run(kind) for kind in ("none", "single", "algorithm1", "optimal", "best")}
                rows.append((variant, rate, p, runs))
    lines = []
    for variant, title in (
        ("ps", "(a) PS, a(P) = 2 (P - 1) x 45.26 us on every push (bench mgwfbp's emulation): modes wfbp and mgwfbp"),
        (
            "allreduce",
            "(b) all-reduce, 45.26 us on every message (the paper's setting): mode poseidon, hybcomm=('allreduce',)",
        ),
    ):
        lines += [
            "",
            f"MG-WFBP on ResNet-50 (107 layers, batch 32), 10 Gbit/s; {title}. Iteration ms; groups = messages per "
            "iteration's merge plan (layers travelling together).",
            "",
            "| TFLOP/s | workers | a(P) | WFBP | single | Algorithm 1 | exact "
            "| Alg. 1 vs WFBP | exact vs WFBP | groups (Alg. 1 / exact) |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for v, rate, p, runs in rows:
            if v != variant:
                continue
            w, s, a, o = (runs[k] for k in ("none", "single", "algorithm1", "optimal"))
            groups = lambda it: sum(len(g) for g in it.groups.values())  # noqa: E731
            lines.append(
                f"| {rate / 1e12:g} | {p} | {paper_startup(p) * 1e3:.2f} ms | "
                f"{w.time * 1e3:.0f} | {s.time * 1e3:.0f} | "
                f"{a.time * 1e3:.0f} | {o.time * 1e3:.0f} | {w.time / a.time:.2f} | {w.time / o.time:.2f} | "
                f"{groups(a)} / {groups(o)} |"
            )
    return lines, rows


# -- 5. planner sweep ----------------------------------------------------------------------------


def planner_sweep(models, workers, alphas, rates) -> tuple:
    """Algorithm 1 vs the exact planner in the simulator: ``(lines, summary)``."""
    records = []  # (mode, model, P, alpha, rate, t_none, t_alg1, t_exact, t_default)
    for mode in ("mgwfbp", "poseidon"):
        for model in models:
            tr = trace(model, PAPER_BATCH[model])
            for p in workers:
                for alpha in alphas:
                    for rate in rates:
                        sim = Simulator(tr, p, rate=rate, link=Link.of_bandwidth(10e9 / 8, alpha), mode=mode)
                        # The unmerged run is the planners' warm-up step: no extra simulation.
                        none, alg1, exact = (sim.run(k).time for k in ("none", "algorithm1", "optimal"))
                        records.append((mode, model, p, alpha, rate, none, alg1, exact, sim.run().time))
    lines = [
        "",
        f"Algorithm 1 against the exact planner, each planned as the trainer plans (calibrated start-up, "
        f"per-byte cost refit from a measured unmerged step), then simulated: {len(records)} cases "
        f"(modes mgwfbp and poseidon; {', '.join(models)}; {workers[0]}-{workers[-1]} workers; "
        f"alpha {', '.join(f'{a * 1e6:g}' for a in alphas)} us; "
        f"{', '.join(f'{r / 1e12:g}' for r in rates)} TFLOP/s; 10 GbE). "
        "Ratio = exact / Algorithm 1 iteration time (above 1: the exact planner's plan is slower).",
        "",
        "| mode | cases | exact slower (> 0.1 %) | exact faster (> 0.1 %) | within 0.1 % "
        "| worst ratio | best ratio | median "
        "| Alg. 1 slower than no merging | exact slower than no merging "
        "| default (best) faster than Alg. 1 (> 0.1 %) | its best gain |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    summary = {}
    for mode in ("mgwfbp", "poseidon", "all"):
        rs = [r for r in records if mode == "all" or r[0] == mode]
        ratios = [o / a for *_, a, o, _ in rs]
        alg1_hurts = sum(a > n * 1.001 for *_, n, a, o, _ in rs)
        exact_hurts = sum(o > n * 1.001 for *_, n, a, o, _ in rs)
        worse = [r for r, x in zip(rs, ratios) if x > 1.001]
        better = [r for r, x in zip(rs, ratios) if x < 1 / 1.001]
        worst = max(zip(ratios, rs))
        best = min(zip(ratios, rs))
        # The default tries both plans and one message, and keeps the fastest, or none.
        gains = [a / d for *_, a, o, d in rs]
        lines.append(
            f"| {mode} | {len(rs)} | {len(worse)} | {len(better)} | {len(rs) - len(worse) - len(better)} | "
            f"{worst[0]:.3f} ({_case(worst[1])}) | {best[0]:.3f} ({_case(best[1])}) | {statistics.median(ratios):.4f} "
            f"| {alg1_hurts} | {exact_hurts} | {sum(g > 1.001 for g in gains)} | {max(gains):.2f} x |"
        )
        summary[mode] = {
            "cases": len(rs),
            "exact_slower": len(worse),
            "exact_faster": len(better),
            "worst_ratio": round(worst[0], 4),
            "worst_case": _case(worst[1]),
            "best_ratio": round(best[0], 4),
            "best_case": _case(best[1]),
            "median_ratio": round(statistics.median(ratios), 5),
            "alg1_slower_than_unmerged": alg1_hurts,
            "exact_slower_than_unmerged": exact_hurts,
            "best_faster_than_alg1": sum(g > 1.001 for g in gains),
            "best_max_gain_over_alg1": round(max(gains), 3),
        }
    lines += [
        "",
        "The same cases by worker count (both modes): where each planner loses, and where merging at all loses to "
        "sending every layer alone.",
        "",
        "| workers | cases | exact slower | exact faster | worst ratio "
        "| Alg. 1 slower than no merging | exact slower than no merging |",
        "|---|---|---|---|---|---|---|",
    ]
    by_p = {}
    for p in workers:
        rs = [r for r in records if r[2] == p]
        ratios = [o / a for *_, a, o, _ in rs]
        row = {
            "cases": len(rs),
            "exact_slower": sum(x > 1.001 for x in ratios),
            "exact_faster": sum(x < 1 / 1.001 for x in ratios),
            "worst_ratio": round(max(ratios), 3),
            "alg1_slower_than_unmerged": sum(a > n * 1.001 for *_, n, a, o, _ in rs),
            "exact_slower_than_unmerged": sum(o > n * 1.001 for *_, n, a, o, _ in rs),
        }
        by_p[p] = row
        lines.append(f"| {p} | " + " | ".join(str(v) for v in row.values()) + " |")
    summary["by_workers"] = by_p
    return lines, summary


def _case(r) -> str:
    mode, model, p, alpha, rate, n, a, o, _ = r
    return (
        f"{mode} {model} P={p} alpha={alpha * 1e6:g}us {rate / 1e12:g}TF: "
        f"{a * 1e3:.0f} vs {o * 1e3:.0f} ms (unmerged {n * 1e3:.0f})"
    )


# -- figures -------------------------------------------------------------------------------------


def figures(out: str, results, workers, mg_rows, p_breakdown: int) -> list:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    os.makedirs(out, exist_ok=True)
    paths = []
    for net, models in results.items():
        fig, axes = plt.subplots(2, 2, figsize=(11, 9))
        for ax, (model, rows) in zip(axes.flat, models.items()):
            one = next(iter(rows.values()))[1]
            ax.plot(workers, workers, "k:", label="linear")
            for label, by_p in rows.items():
                ax.plot(workers, [by_p[p].speedup(one) for p in workers], marker="o", ms=3, label=label)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log", base=2)
            ax.set_title(f"{model}, {net}")
            ax.set_xlabel("workers")
            ax.set_ylabel("speed-up over one worker")
            ax.grid(True, which="both", alpha=0.3)
        axes.flat[0].legend(fontsize=8)
        fig.tight_layout()
        path = os.path.join(out, f"simulate_speedup_{net}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    net = "10GbE"
    fig, ax = plt.subplots(figsize=(12, 5))
    labels, compute, exposed = [], [], []
    for model, rows in results[net].items():
        for label, by_p in rows.items():
            it = by_p[p_breakdown]
            labels.append(f"{model}\n{label}")
            compute.append(it.compute * 1e3)
            exposed.append(it.exposed * 1e3)
    xs = range(len(labels))
    ax.bar(xs, compute, label="compute")
    ax.bar(xs, exposed, bottom=compute, label="exposed communication")
    ax.set_xticks(list(xs))
    ax.set_xticklabels(labels, rotation=90, fontsize=7)
    ax.set_ylabel(f"ms per iteration at {p_breakdown} workers, {net}")
    ax.legend()
    fig.tight_layout()
    path = os.path.join(out, "simulate_breakdown.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(path)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, variant in zip(axes, ("ps", "allreduce")):
        rows = [r for r in mg_rows if r[0] == variant and r[1] == mg_rows[0][1]]
        ps = [r[2] for r in rows]
        for kind, label in (
            ("none", "WFBP"),
            ("single", "single message"),
            ("algorithm1", "MG-WFBP, Algorithm 1"),
            ("optimal", "MG-WFBP, exact"),
        ):
            ax.plot(ps, [r[3][kind].time * 1e3 for r in rows], marker="o", ms=3, label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("workers")
        ax.set_ylabel("iteration, ms")
        ax.set_title(
            f"ResNet-50, 10 Gbit/s, {'PS, a(P) per push' if variant == 'ps' else 'all-reduce, alpha per message'}"
        )
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = os.path.join(out, "simulate_mgwfbp.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(path)
    return paths


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench simulate", description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--max-workers", type=int, default=1024)
    parser.add_argument("--tflops", type=float, default=TITAN_X / 1e12, help="device rate for sections 1-3")
    parser.add_argument("--alpha-us", type=float, default=ALPHA * 1e6, help="start-up per message for sections 1-3")
    parser.add_argument("--sweep", choices=("full", "quick", "none"), default="full", help="section 5's size")
    parser.add_argument("--out", default=os.path.join("bench", "out"), help="folder for the PNG figures")
    parser.add_argument(
        "--efficiency",
        default=None,
        help="sections 1-3 on links that deliver a fraction of their rate with n senders into one, "
        "'senders:fraction,...' "
        "(measure yours with bench.patterns.fan_in_efficiency; default: ideal links)",
    )
    a = parser.parse_args(argv)
    started = time.perf_counter()
    models = [m for m in a.models.split(",") if m]
    workers = [p for p in (2**i for i in range(11)) if p <= a.max_workers]
    rate, alpha = a.tflops * 1e12, a.alpha_us * 1e-6
    efficiency = FlowEfficiency.parse(a.efficiency) if a.efficiency else None
    results = scaling(models, workers, rate, alpha, efficiency)
    lines = [
        f"Simulated iteration (plan/simulator); start-up {a.alpha_us:g} us per message; links {efficiency or 'ideal'}."
    ]
    lines += scaling_tables(results, workers, rate)
    lines += latency_sensitivity(results, models, rate, alpha, sorted({min(32, workers[-1]), workers[-1]}), efficiency)
    switch_lines, switch = switch_points(results, "10GbE")
    lines += switch_lines
    p_breakdown = min(32, workers[-1])
    lines += breakdown(results, "10GbE", p_breakdown)
    merge_lines, merge_ps = merging_on_the_ps(models, rate, alpha, [p for p in (64, 256, 1024) if p <= workers[-1]])
    lines += merge_lines
    mg_workers = [p for p in workers if p >= 2]
    mg_lines, mg_rows = mgwfbp(mg_workers, [K80, 8e12, 32e12])
    lines += mg_lines
    if a.sweep != "none":
        quick = a.sweep == "quick"
        sweep_models = ["resnet50", *models] if not quick else ["resnet50", "vgg19"]
        sweep_workers = mg_workers if not quick else [p for p in mg_workers if p in (2, 16, 128, 1024)]
        alphas = [10e-6, 30e-6, 100e-6, 300e-6, 1e-3] if not quick else [10e-6, 100e-6, 1e-3]
        rates = [2e12, 6e12, 20e12, 100e12] if not quick else [2e12, 20e12]
        sweep_lines, sweep = planner_sweep(sweep_models, sweep_workers, alphas, rates)
        lines += sweep_lines
    else:
        sweep = None
    paths = figures(a.out, results, workers, mg_rows, p_breakdown)
    lines += [
        "",
        f"Figures: {', '.join(paths)}"
        if paths
        else "Figures: skipped (matplotlib is not installed: pip install '.[bench]')",
    ]
    print("\n".join(lines))

    def ratio(variant, rate, p, kind):
        for v, r, q, runs in mg_rows:
            if (v, r, q) == (variant, rate, p):
                return round(runs["none"].time / runs[kind].time, 3)
        return None

    top = max(mg_workers)
    out = {"bench": "simulate", "alpha_s": alpha, "device_tflops": a.tflops}
    for p in sorted({min(64, top), top}):
        for variant, suffix in (("ps", ""), ("allreduce", "_allreduce")):
            out[f"speedup_mgwfbp_vs_wfbp_{p}_sim{suffix}"] = ratio(variant, K80, p, "algorithm1")
            out[f"speedup_optimal_vs_wfbp_{p}_sim{suffix}"] = ratio(variant, K80, p, "optimal")
            out[f"speedup_best_vs_wfbp_{p}_sim{suffix}"] = ratio(variant, K80, p, "best")
    for tflops in (8e12, 32e12):
        for variant, suffix in (("ps", ""), ("allreduce", "_allreduce")):
            out[f"speedup_mgwfbp_vs_wfbp_{min(64, top)}_sim{suffix}_at_{tflops / 1e12:g}tflops"] = ratio(
                variant, tflops, min(64, top), "algorithm1"
            )
            out[f"speedup_optimal_vs_wfbp_{min(64, top)}_sim{suffix}_at_{tflops / 1e12:g}tflops"] = ratio(
                variant, tflops, min(64, top), "optimal"
            )
    for net, by_model in results.items():
        for model, rows in by_model.items():
            one = rows["WFBP"][1]
            for label, by_p in rows.items():
                key = label.lower().replace(" ", "_").replace("(", "").replace(")", "").replace("+", "_")
                for p in {min(32, top), top}:
                    out[f"speedup_{model}_{key}_{net}_{p}"] = round(by_p[p].speedup(one), 2)
    out["switch_points_10GbE"] = switch
    out["ps_merging_at_scale_10GbE"] = merge_ps
    out["planner_sweep"] = sweep
    out["figures"] = paths
    out["seconds"] = round(time.perf_counter() - started, 1)
    out["machine"] = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    print(json.dumps(out))
    return out
