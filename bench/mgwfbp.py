"""``python -m bench mgwfbp``: WFBP, one message per iteration (SyncEASGD) and MG-WFBP, same run.

The model is ResNet-50-shaped: its 107 parameter-owning layers (53 convolutions, 53 batch norms,
the classifier; 161 tensors, 25.6 M parameters) with their real sizes, from the library's trace
(``plan.models.trace("resnet50")``, the simulator's too). Compute is replayed by sleeping for
each layer's FLOPs at batch 32 on 224x224 images at ``--device-tflops`` (2 TFLOP/s: a K80 GPU at
about two thirds of its peak, the paper's hardware), forward 1x, backward 2x.
Every gradient byte crosses a real socket between real processes.

The network is the paper's 10GbE, emulated in user space on each process's outbound frames (netem
is not available): a token bucket at 10 Gbit/s in which every push also pays a start-up as link
time, so messages occupy the link for ``a + b p`` one after another — the paper's measured all-reduce start-up
``a`` (91 us, 272 us and 634 us on 2, 4 and 8 nodes; MG-WFBP §V), paid by every push: the start-up of one layer's
synchronization.
A time-dilation factor ``--dilation`` multiplies compute and start-up times and divides the rate,
so the two CPU cores stay mostly idle; reported times are divided back, and ratios do not depend
on it.

Schemes: ``wfbp`` (every layer its own message as soon as it is ready), ``single`` (SyncEASGD: all
layers in one message after the backward), ``algorithm1`` (MG-WFBP's Algorithm 1 on calibrated
alpha, beta and measured per-layer backward times, its plan kept untried, as in the paper),
``optimal`` (the exact planner, untried) and ``mgwfbp``: the trainer's default, both plans and
``single``'s tried for ``--trial`` steps each and the fastest kept (or one message per layer if
none beat it); its untimed steps cover the trials. The last line is one JSON object with
``speedup_mgwfbp_vs_wfbp_8`` (the default planner).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import statistics
import time

from bench import free_port, rank_env

ALPHA = {2: 90.52e-6, 4: 271.56e-6, 8: 633.64e-6}
ROWS = 32
SCHEMES = ["wfbp", "single", "algorithm1", "optimal", "mgwfbp"]


def resnet50_layers() -> list:
    """``[(name, [param shapes], forward FLOPs at batch 32)]`` in forward order: the library's
    trace (``poseidon_aio.plan.models.trace``), which the simulator replays too."""
    from poseidon_aio.plan.models import trace

    return list(trace("resnet50", batch=ROWS))


def _worker(rank: int, world: int, port: int, scheme: str, args: dict, out) -> None:
    os.environ.update(rank_env(rank, world, port))
    import torch
    from torch import nn

    import poseidon_aio
    from poseidon_aio.net import ShaperConfig
    from poseidon_aio.net.credentials import config_from_env
    from poseidon_aio.plan import MergeConfig
    from poseidon_aio.plan.merging import BEST_PLANNERS

    torch.set_num_threads(1)
    dilation, rate = args["dilation"], args["tflops"] * 1e12

    class Replay(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, module, *params):
            ctx.module = module
            time.sleep(module.fwd_s)
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            time.sleep(2 * ctx.module.fwd_s)
            return (grad, None, *ctx.module.grads)

    class Layer(nn.Module):
        def __init__(self, shapes, flops):
            super().__init__()
            self.params = nn.ParameterList([nn.Parameter(torch.zeros(s)) for s in shapes])
            self.grads = [torch.randn(s) for s in shapes]
            self.fwd_s = flops / rate * dilation

        def forward(self, x):
            return Replay.apply(x, self, *self.params)

    model = nn.Sequential(*[Layer(shapes, flops) for _, shapes, flops in resnet50_layers()])
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    alpha = ALPHA.get(world, ALPHA[8]) * dilation
    from poseidon_aio.wire import Kind

    # The paper's ``a`` is the start-up of one layer's synchronization: each push pays it, as link
    # time before its bytes (T = a + b p per message, messages one after another on the link).
    link = ShaperConfig(egress_rate=10e9 / 8 / dilation, message_cost=alpha, costed_kinds=frozenset({Kind.PUSH}))
    mode, kind = (
        ("wfbp", "none")
        if scheme == "wfbp"
        else ("mgwfbp", {"single": "single", "algorithm1": "algorithm1", "optimal": "optimal", "mgwfbp": None}[scheme])
    )
    # algorithm1, optimal: the planner's plan is what is measured (trial=0); mgwfbp: the default,
    # whose trials pick a plan, untimed (every plan best can try, then the verdict's first step)
    trial = args["trial"] if scheme == "mgwfbp" else 0
    untimed = args["measure"] + (len(BEST_PLANNERS) * trial + 1 if trial else 0)
    merge = MergeConfig(
        kind=kind, after=args["measure"], calibration_sizes=(4 << 10, 64 << 10, 1 << 20, 4 << 20), trial=trial
    )
    x = torch.zeros(ROWS, 1, requires_grad=True)
    loss_fn = lambda out, _: out.sum()  # noqa: E731

    async def main():
        times = []
        async with poseidon_aio.Trainer(
            model, opt, loss_fn, mode=mode, merge=merge, net=config_from_env(bandwidth=link), broadcast_buffers=False
        ) as trainer:
            for _ in range(untimed + args["steps"]):
                started = time.perf_counter()
                await trainer.step((x, None))
                times.append((time.perf_counter() - started) / dilation)
            groups = len(trainer.merge_groups)
            info = trainer.merge_info
        return times[untimed:], groups, info

    times, groups, info = poseidon_aio.run(main())
    verdict = info.get("trial") or {}
    kept = (verdict["planner"] if verdict["kept"] else "none") if verdict else info.get("planner", "-")
    out.put(
        (
            rank,
            {
                "times": times,
                "groups": groups,
                "predicted": info.get("predicted_s"),
                "alpha": info.get("alpha_s"),
                "kept": kept,
            },
        )
    )


def measure(world: int, scheme: str, args: dict) -> dict:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, scheme, args, out)) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    deadline = time.monotonic() + args["timeout"]
    while len(results) < world:
        rank, value = out.get(timeout=max(1, deadline - time.monotonic()))
        results[rank] = value
    for p in procs:
        p.join(30)
    r0 = results[0]
    return {
        "iter_s": statistics.median(r0["times"]),
        "groups": r0["groups"],
        "predicted": r0["predicted"],
        "alpha": r0["alpha"],
        "kept": r0["kept"],
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench mgwfbp", description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="2,4,8")
    parser.add_argument("--schemes", default=",".join(SCHEMES))
    parser.add_argument("--device-tflops", type=float, default=2.0)
    parser.add_argument("--dilation", type=float, default=10.0)
    parser.add_argument("--measure", type=int, default=2, help="warm-up steps that measure before merging")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (the median is reported)")
    parser.add_argument(
        "--trial", type=int, default=3, help="trial steps of each plan for the default planner (mgwfbp)"
    )
    parser.add_argument("--timeout", type=float, default=1200)
    parser.add_argument("--sweep-tflops", default="8,32", help="more device rates, at the largest worker count")
    a = parser.parse_args(argv)
    args = {
        "tflops": a.device_tflops,
        "dilation": a.dilation,
        "measure": a.measure,
        "steps": a.steps,
        "timeout": a.timeout,
        "trial": a.trial,
    }
    schemes = a.schemes.split(",")
    layers = resnet50_layers()
    total_flops = sum(f for *_, f in layers)
    rows, summary = [], {}
    for world in (int(w) for w in a.workers.split(",")):
        res = {s: measure(world, s, args) for s in schemes}
        rows.append((world, res))
        if "wfbp" in res:
            for s in ("mgwfbp", "algorithm1", "optimal", "single"):
                if s in res:
                    summary[f"speedup_{s}_vs_wfbp_{world}"] = round(res["wfbp"]["iter_s"] / res[s]["iter_s"], 3)
            if "single" in res and "mgwfbp" in res:
                summary[f"speedup_mgwfbp_vs_single_{world}"] = round(
                    res["single"]["iter_s"] / res["mgwfbp"]["iter_s"], 3
                )
    sweep = []
    biggest = max(int(w) for w in a.workers.split(","))
    for tflops in (float(x) for x in a.sweep_tflops.split(",") if x):
        res = {s: measure(biggest, s, {**args, "tflops": tflops}) for s in schemes}
        sweep.append((tflops, res))
        for s in ("mgwfbp", "algorithm1", "optimal"):
            if "wfbp" in res and s in res:
                summary[f"speedup_{s}_vs_wfbp_{biggest}_at_{tflops:g}tflops"] = round(
                    res["wfbp"]["iter_s"] / res[s]["iter_s"], 3
                )
    lines = [
        f"ResNet-50-shaped model ({len(layers)} layers, 25.6 M parameters), batch {ROWS} per worker, "
        "compute replayed at "
        f"{a.device_tflops} TFLOP/s ({total_flops * 3 / a.device_tflops / 1e12 * 1e3:.0f} ms forward+backward), "
        "10 Gbit/s with the paper's start-up per message; "
        f"iteration time, ms (rank 0's median, dilation {a.dilation} divided out)",
        "",
        "| workers | alpha | "
        + " | ".join(schemes)
        + " | MG-WFBP vs WFBP | MG-WFBP vs single | messages per iteration (mgwfbp) | plan kept (mgwfbp) |",
        "|---|---|" + "---|" * (len(schemes) + 4),
    ]
    for world, res in rows:
        cells = " | ".join(f"{res[s]['iter_s'] * 1e3:.0f}" for s in schemes)
        sp = summary.get(f"speedup_mgwfbp_vs_wfbp_{world}", float("nan"))
        ss = summary.get(f"speedup_mgwfbp_vs_single_{world}", float("nan"))
        groups, kept = res.get("mgwfbp", {}).get("groups", "-"), res.get("mgwfbp", {}).get("kept", "-")
        lines.append(
            f"| {world} | {ALPHA.get(world, ALPHA[8]) * 1e6:.0f} us | {cells} | "
            f"{sp:.2f} | {ss:.2f} | {groups} | {kept} |"
        )
    if sweep:
        lines += [
            "",
            f"{biggest} workers at other device rates "
            "(faster devices leave less compute to hide communication behind):",
            "",
            "| TFLOP/s | forward+backward | "
            + " | ".join(schemes)
            + " | MG-WFBP vs WFBP | Alg. 1 vs WFBP | optimal vs WFBP | plan kept (mgwfbp) |",
            "|---|---|" + "---|" * (len(schemes) + 4),
        ]
        for tflops, res in sweep:
            cells = " | ".join(f"{res[s]['iter_s'] * 1e3:.0f}" for s in schemes)
            ratios = " | ".join(
                f"{summary.get(f'speedup_{s}_vs_wfbp_{biggest}_at_{tflops:g}tflops', float('nan')):.2f}"
                for s in ("mgwfbp", "algorithm1", "optimal")
            )
            lines.append(
                f"| {tflops:g} | {total_flops * 3 / tflops / 1e12 * 1e3:.0f} ms | {cells} | {ratios} | "
                f"{res.get('mgwfbp', {}).get('kept', '-')} |"
            )
    print("\n".join(lines))
    out = {
        "bench": "mgwfbp",
        "speedup_mgwfbp_vs_wfbp_8": summary.get("speedup_mgwfbp_vs_wfbp_8"),
        "device_tflops": a.device_tflops,
        "dilation": a.dilation,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        **summary,
    }
    print(json.dumps(out))
    return out
