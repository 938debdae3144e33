"""``python -m bench paper``'s report beside the emulation: the simulator at every emulated point
(on ideal links, on links with the fan-in the emulation's links showed, with the per-layer
overhead one worker measured), poseidon's lower bound on an iteration, and the figures.
bench/paper.py runs the emulation and prints the tables; this is what it reports them against."""

from __future__ import annotations

import os
from typing import Optional

from bench import parse_impl

IMPLS = ["naive", "wfbp", "poseidon", "ddp"]
# The runs the simulator may learn from (it fits a layer's overhead on the one-worker run; the
# fan-in comes from bench patterns). Points at more workers than these are held out: predicted unseen.
FIT_WORLDS = (1, 2)


def impl_variant(impl: str) -> tuple:
    """``"poseidon:hybcomm=ps+allreduce"`` -> ``("poseidon", {"hybcomm": ("ps", "allreduce")})``: our
    mode with the schemes HybComm weighs narrowed, run and reported beside the others (the
    simulator gets the same schemes)."""
    mode, variant = parse_impl(impl, {m: {"hybcomm"} if m == "poseidon" else set() for m in IMPLS})
    return mode, {"hybcomm": tuple(variant["hybcomm"].split("+"))} if variant else {}


# -- the simulator beside the emulation ----------------------------------------------------------


def layer_overheads(results: dict, args) -> dict:
    """``{model: seconds}``: what each layer's pass cost the emulation beyond its replayed FLOPs,
    from the one-worker iteration (compute alone): (emulated - simulated) / (2 x layers), a
    forward and a backward a layer. The replay's per-layer costs (autograd, the trainer's hooks,
    the sleep's overshoot) are the framework's, which the trace's FLOPs leave out; a model with
    many small layers pays them most (ResNet-152: 311 layers)."""
    from poseidon_aio.plan.models import trace
    from poseidon_aio.plan.cost import Link
    from poseidon_aio.plan.simulator import Simulator

    out = {}
    for (model, world, impl), res in results.items():
        if world == 1:
            tr = trace(model, args.batch)
            nominal = Simulator(tr, 1, rate=args.device_tflops * 1e12, link=Link(0.0, 0.0), mode="wfbp").run().time
            out[model] = max(0.0, (res["step_s"] - nominal) / (2 * len(tr)))
    return out


def simulate_beside(results: dict, args, rate_bits: float, efficiency: Optional[dict] = None) -> tuple:
    """The simulator (poseidon_aio.plan.simulator) at every emulated point, full size, same rate and
    link, start-up ``--alpha-us`` per message: on ideal links; given ``efficiency`` (``{senders:
    fraction}``, measured on the emulation's links by ``bench.patterns.fan_in_efficiency``), on
    links that lose what the emulated ones lose to fan-in; and, where one worker was emulated,
    with that model's per-layer overhead too (:func:`layer_overheads`: the compute the emulation
    measured, so what is compared beyond one worker is the network and its overlap). And MG-WFBP
    at 64 workers on ResNet-50 with the paper's start-up (``bench simulate``'s case). Returns
    (markdown lines, max relative error of the last column over the points with 2 and more
    workers (one worker is the overhead's measurement), the ideal links' max error, MG-WFBP
    speed-up over WFBP, ``{"max", "mean", "points"}`` of the last column's error over the
    held-out points: those with more workers than :data:`FIT_WORLDS`)."""
    from poseidon_aio.plan.models import trace
    from poseidon_aio.plan.cost import Link
    from poseidon_aio.plan.simulator import FlowEfficiency, Simulator
    from poseidon_aio.wire import Kind

    from bench.simulate import paper_startup

    link = Link.of_bandwidth(rate_bits / 8, args.alpha_us * 1e-6)
    overheads = layer_overheads(results, args)
    measured = FlowEfficiency(efficiency) if efficiency else None
    columns = {"ideal links": (None, False)}
    if measured:
        columns["measured fan-in"] = (measured, False)
    if overheads:
        columns["measured fan-in and layer overhead" if measured else "layer overhead"] = (measured, True)
    lines = [
        "Simulated vs emulated iteration, ms (simulator: same model trace, "
        f"{args.device_tflops:g} TFLOP/s, the full-size link, "
        f"{args.alpha_us:g} us start-up per message; ideal links, "
        "and links that deliver what the emulation's delivered with "
        f"n senders into one: {efficiency or 'not measured'}; per-layer overhead measured on one worker, us a pass: "
        f"{ {m: round(o * 1e6, 1) for m, o in overheads.items()} or 'not measured' }); "
        "error = |sim - emulated| / emulated",
        "",
        "| model | workers | scheme | points | emulated (min–max of the timed steps) | "
        + " | ".join(f"simulated, {c} | error" for c in columns)
        + " |",
        "|---|---|---|---|---|" + "---|---|" * len(columns),
    ]
    errors = {c: [] for c in columns}
    held_out: dict = {}  # "model workers scheme": the error of the last column (everything the simulator knows)
    for (model, world, impl), res in sorted(results.items()):
        mode, variant = impl_variant(impl) if world > 1 else ("wfbp", {})
        tr = trace(model, args.batch)
        cells = []
        for name, (eff, with_overhead) in columns.items():
            overhead = overheads.get(model, 0.0) if with_overhead else 0.0
            sim = Simulator(
                tr,
                world,
                rate=args.device_tflops * 1e12,
                link=link,
                mode=mode,
                efficiency=eff,
                layer_overhead=overhead,
                **variant,
            ).run()
            err = abs(sim.time - res["step_s"]) / res["step_s"]
            if world > 1 or not with_overhead:
                errors[name].append(err)
            cells.append(f"{sim.time * 1e3:.0f} | {err * 100:.1f} %")
        held = world > max(FIT_WORLDS)
        if held:
            held_out[f"{model} {world} {impl}"] = err
        steps = res.get("steps_s") or [res["step_s"]]
        emulated = f"{res['step_s'] * 1e3:.0f} ({min(steps) * 1e3:.0f}–{max(steps) * 1e3:.0f} of {len(steps)})"
        kind = "held out" if held else "fit" if world == 1 else "seen"
        lines.append(f"| {model} | {world} | {impl} | {kind} | {emulated} | " + " | ".join(cells) + " |")
    summary = {}
    if held_out:
        errs = list(held_out.values())
        summary = {
            "max": round(max(errs), 3),
            "mean": round(sum(errs) / len(errs), 3),
            "points": len(errs),
            "by_point": {point: round(e, 3) for point, e in held_out.items()},
        }
        lines += [
            "",
            f"Held out (more than {max(FIT_WORLDS)} workers; the simulator fitted only the one-worker runs and "
            f"bench patterns' fan-in): {len(held_out)} points, error max {summary['max'] * 100:.1f} %, "
            f"mean {summary['mean'] * 100:.1f} %, {sum(e > 0.10 for e in errs)} over 10 %",
            "",
        ]
    tr = trace("resnet50", 32)
    sim = Simulator(
        tr, 64, rate=2e12, link=Link.of_bandwidth(10e9 / 8, paper_startup(64)), mode="mgwfbp", costed=[Kind.PUSH]
    )
    wfbp, alg1, exact, merged = sim.run("none"), sim.run("algorithm1"), sim.run("optimal"), sim.run()
    mg = wfbp.time / merged.time
    lines += [
        "",
        "MG-WFBP (the default planner: the fastest of Algorithm 1's plan, the exact one, one message, "
        "DDP's buckets and the tapered ones) vs WFBP, simulated, ResNet-50, "
        f"64 workers, 2 TFLOP/s, 10 Gbit/s, a(64) = {paper_startup(64) * 1e3:.2f} ms per push: "
        f"{wfbp.time * 1e3:.0f} -> "
        f"{merged.time * 1e3:.0f} ms, {mg:.2f} x "
        f"(Algorithm 1 {wfbp.time / alg1.time:.2f} x, exact {wfbp.time / exact.time:.2f} x)",
        "",
    ]
    worst = {c: (max(errs) if errs else None) for c, errs in errors.items()}
    return lines, worst[list(columns)[-1]], worst["ideal links"], mg, summary


def lower_bound(results: dict, model: str, world: int, rate_bits: float) -> Optional[float]:
    """Poseidon's per-iteration lower bound at ``world`` workers (one worker: its compute):
    max(compute, the busiest link's bytes each way ÷ the rate); None where not emulated."""
    pos = results.get((model, world, "poseidon" if world > 1 else "wfbp"))
    if not pos or "compute_s" not in pos:
        return None
    return max(pos["compute_s"], pos["bytes"] / 2 / (rate_bits / 8))


# -- figures -------------------------------------------------------------------------------------


def figures(out: str, results: dict, args, rate_bits: float) -> list:
    """Per model: speed-up over one worker against workers, every scheme emulated, the
    simulator's poseidon and naive PS beside them and on to 64 workers (ATC'17's scaling figure);
    and the emulated iteration against its lower bound. PNGs in ``out``; none without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    from poseidon_aio.plan.models import trace
    from poseidon_aio.plan.cost import Link
    from poseidon_aio.plan.simulator import Simulator

    link = Link.of_bandwidth(rate_bits / 8, args.alpha_us * 1e-6)
    paths = []
    for model in sorted({m for m, _, _ in results}):
        single = results.get((model, 1, "wfbp"))
        if single is None:
            continue
        worlds = sorted({w for m, w, _ in results if m == model})
        impls = [i for i in IMPLS if any((model, w, i) in results for w in worlds if w > 1)]
        fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.8))
        far = sorted({*worlds, 32, 64})
        ax.plot(far, far, "k:", label="linear")
        for impl in impls:
            ws = [w for w in worlds if (model, w, impl if w > 1 else "wfbp") in results]
            ax.plot(
                ws,
                [w * single["step_s"] / results[(model, w, impl if w > 1 else "wfbp")]["step_s"] for w in ws],
                marker="o",
                label=f"{impl}, emulated",
            )
        tr = trace(model, args.batch)
        rate = args.device_tflops * 1e12
        one = Simulator(tr, 1, rate=rate, link=link, mode="wfbp").run().time
        for impl, style in (("poseidon", "--"), ("naive", "-.")):
            if impl in impls:
                sims = [Simulator(tr, w, rate=rate, link=link, mode=impl if w > 1 else "wfbp").run().time for w in far]
                ax.plot(far, [w * one / t for w, t in zip(far, sims)], style, label=f"{impl}, simulated")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xlabel("workers")
        ax.set_ylabel("throughput speed-up over one worker")
        ax.set_title(f"{model}, {args.link} per worker (bytes / {args.scale:g}, link / {args.scale:g})")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        width = 0.8 / max(1, len(impls))
        for k, impl in enumerate(impls):
            ws = [w for w in worlds if w > 1 and (model, w, impl) in results]
            xs = [worlds.index(w) + k * width for w in ws]
            bx.bar(xs, [results[(model, w, impl)]["step_s"] * 1e3 for w in ws], width, label=impl)
        bounds = [(lower_bound(results, model, w, rate_bits) or float("nan")) * 1e3 for w in worlds]
        bx.plot(
            [i + 0.4 - width / 2 for i in range(len(worlds))],
            bounds,
            "k_",
            ms=22,
            mew=2,
            label="poseidon's lower bound",
        )
        bx.set_xticks([i + 0.4 - width / 2 for i in range(len(worlds))])
        bx.set_xticklabels([str(w) for w in worlds])
        bx.set_ylim(bottom=0)
        bx.set_xlabel("workers")
        bx.set_ylabel("iteration, ms (full size)")
        bx.set_title("emulated iteration time")
        bx.legend(fontsize=7)
        fig.tight_layout()
        path = os.path.join(out, f"paper_{model}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
