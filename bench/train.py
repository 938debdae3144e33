"""``python -m bench train``: step time of each mode against DistributedDataParallel (gloo).

Models: ``fc``, an FC-heavy MLP (1024 -> 2048 -> 2048 -> 2048 -> 10, 12.6 M parameters) and
``cnn``, a small CNN (three 3x3 convolutions with 2x2 pooling, 32-64-64 channels, on 32x32 images,
and an FC classifier), K = 32 rows per worker, 2 and 4 worker processes, every implementation in the same run.

Links:

* ``loopback``: real compute on this machine's CPU, uncapped loopback. Correctness and overheads;
  with 2 cores shared by 4 workers, compute dominates.
* ``1gbit`` and ``100mbit``: trace-driven emulation (../shared/DESIGN.md, "Performance method").
  Every process runs in its own network namespace whose link tc tbf caps in both directions, so
  DDP's gloo traffic is capped exactly like ours. Compute is replayed by sleeping for the layer's
  FLOPs at ``--device-tflops`` (6 TFLOP/s: the ATC'17 Titan X class), forward 1x and backward 2x,
  and so is SFB's reconstruction GEMM; the parameters, gradients, sufficient factors and every byte
  on the wire are real. Without root, our processes are capped by the library's shaper and DDP runs
  uncapped, and the report says so.

A step's time is rank 0's median over the timed steps after warm-up. The last line is one JSON
object; ``speedup_vs_ddp_fc_1gbit`` is DDP's step time over poseidon's for the FC model, 4 workers,
1 Gbit.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from torch import nn

from bench import BENCH_TOKEN, free_port

IMPLS = ["ddp", "naive", "wfbp", "poseidon"]
ROWS = 32
FC_DIMS = [1024, 2048, 2048, 2048, 10]
RATES = {"1gbit": ("1gbit", 125e6), "100mbit": ("100mbit", 12.5e6)}


# -- models ---------------------------------------------------------------------------------------


class Replay(torch.autograd.Function):
    """Sleeps for a layer's compute at the emulated device rate; returns tensors of the right shapes."""

    @staticmethod
    def forward(ctx, x, weight, bias, module):
        ctx.module, ctx.in_shape = module, x.shape
        time.sleep(module.fwd_s)
        return x.new_zeros(module.out_shape(x.shape))

    @staticmethod
    def backward(ctx, grad):
        m = ctx.module
        time.sleep(2 * m.fwd_s)
        return grad.new_zeros(ctx.in_shape), m.grad_w, m.grad_b, None


class EmulatedLinear(nn.Linear):
    """An ``nn.Linear`` (so HybComm treats it as one) whose compute is replayed, not done."""

    def __init__(self, n_in: int, n_out: int, tflops: float) -> None:
        super().__init__(n_in, n_out)
        self.fwd_s = 2 * ROWS * n_in * n_out / (tflops * 1e12)
        self.grad_w, self.grad_b = torch.randn_like(self.weight), torch.randn_like(self.bias)

    def out_shape(self, shape):
        return (*shape[:-1], self.out_features)

    def forward(self, x):
        return Replay.apply(x.reshape(x.shape[0], -1), self.weight, self.bias, self)


class EmulatedConv(nn.Conv2d):
    """A 3x3 convolution then 2x2 pooling, replayed."""

    def __init__(self, c_in: int, c_out: int, side: int, tflops: float) -> None:
        super().__init__(c_in, c_out, 3, padding=1)
        self.fwd_s = 2 * ROWS * c_out * c_in * 9 * side * side / (tflops * 1e12)
        self.grad_w, self.grad_b = torch.randn_like(self.weight), torch.randn_like(self.bias)

    def out_shape(self, shape):
        return (shape[0], self.out_channels, shape[2] // 2, shape[3] // 2)

    def forward(self, x):
        return Replay.apply(x, self.weight, self.bias, self)


def build(name: str, emulate: bool, tflops: float):
    torch.manual_seed(0)
    if name == "fc":
        in_shape = (ROWS, FC_DIMS[0])
        if emulate:
            return nn.Sequential(*[EmulatedLinear(FC_DIMS[i], FC_DIMS[i + 1], tflops) for i in range(len(FC_DIMS) - 1)]), in_shape
        layers = []
        for i in range(len(FC_DIMS) - 1):
            layers += [nn.Linear(FC_DIMS[i], FC_DIMS[i + 1]), nn.ReLU()]
        return nn.Sequential(*layers[:-1]), in_shape
    in_shape = (ROWS, 3, 32, 32)
    convs = [(3, 32, 32), (32, 64, 16), (64, 64, 8)]
    if emulate:
        return nn.Sequential(*[EmulatedConv(a, b, s, tflops) for a, b, s in convs], EmulatedLinear(64 * 4 * 4, 10, tflops)), in_shape
    layers = []
    for a, b, _ in convs:
        layers += [nn.Conv2d(a, b, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)]
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(64 * 4 * 4, 10)), in_shape


# -- one worker process ---------------------------------------------------------------------------


def worker(cfg: dict) -> None:
    torch.set_num_threads(1)
    model, in_shape = build(cfg["model"], cfg["emulate"], cfg["tflops"])
    n_classes = 10
    x = torch.randn(*in_shape)
    y = torch.randint(0, n_classes, (ROWS,))
    loss_fn = (lambda out, _: out.float().mean()) if cfg["emulate"] else nn.functional.cross_entropy
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    total = cfg["warmup"] + cfg["steps"]
    times = []
    if cfg["impl"] == "ddp":
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        dist.init_process_group("gloo", rank=cfg["rank"], world_size=cfg["world"])
        ddp = DistributedDataParallel(model)
        for _ in range(total):
            dist.barrier()
            started = time.perf_counter()
            opt.zero_grad()
            loss_fn(ddp(x), y).backward()
            opt.step()
            times.append(time.perf_counter() - started)
        dist.barrier()
        extra = {}
    else:
        import poseidon_aio
        from poseidon_aio import kernels
        from poseidon_aio.net import NetConfig, ShaperConfig

        if cfg["emulate"]:
            rate = cfg["tflops"] * 1e12

            def replayed_reconstruct(us, vs, scale, out_w, out_b=None):
                time.sleep(2 * sum(u.shape[0] for u in us) * out_w.numel() / rate)

            kernels.reconstruct = replayed_reconstruct
        net = None
        if cfg.get("shaper_rate"):
            shaper = ShaperConfig(egress_rate=cfg["shaper_rate"], ingress_rate=cfg["shaper_rate"])
            net = NetConfig(token=b"bench-train-token-0123456789abcd", shaper=shaper)

        async def main():
            stats = []
            async with poseidon_aio.Trainer(model, opt, loss_fn, mode=cfg["impl"], net=net) as trainer:
                for _ in range(total):
                    started = time.perf_counter()
                    stats.append(await trainer.step((x, y)))
                    times.append(time.perf_counter() - started)
            return stats

        stats = poseidon_aio.run(main())
        extra = {"schemes": stats[-1].schemes, "stall_s": statistics.median(s.stall_s for s in stats[cfg["warmup"]:]), "bytes": stats[-1].bytes}
    with open(cfg["out"], "w") as f:
        json.dump({"times": times[cfg["warmup"]:], **extra}, f)
    # gloo's teardown can hang once peers are gone; the result is written, leave at once.
    sys.stdout.flush()
    os._exit(0)


# -- the harness ----------------------------------------------------------------------------------


def run_config(impl: str, model: str, world: int, link: str, args, namespaces) -> dict:
    emulate = link != "loopback"
    port = free_port()
    master = "10.77.0.1" if namespaces else "127.0.0.1"
    shaper_rate = RATES[link][1] if emulate and not namespaces and impl != "ddp" else None
    procs, outs = [], []
    tmp = tempfile.mkdtemp(prefix="bench-train-")
    for rank in range(world):
        out = os.path.join(tmp, f"rank{rank}.json")
        outs.append(out)
        cfg = dict(impl=impl, model=model, emulate=emulate, tflops=args.device_tflops, rank=rank, world=world,
                   warmup=args.warmup, steps=args.steps, out=out, shaper_rate=shaper_rate)
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": master, "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "POSEIDON_TOKEN": BENCH_TOKEN,
               "GLOO_SOCKET_IFNAME": "eth0" if namespaces else "lo", "PYTHONPATH": os.getcwd()}
        command = [sys.executable, "-m", "bench.train", "--worker", json.dumps(cfg)]
        if namespaces:
            command = ["ip", "netns", "exec", namespaces[rank], *command]
        procs.append(subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    deadline = time.monotonic() + args.timeout
    for p in procs:
        try:
            p.wait(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise RuntimeError(f"{impl} {model} x{world} on {link} did not finish within {args.timeout} s")
    failed = [p for p in procs if p.returncode != 0]
    if failed:
        raise RuntimeError(f"{impl} {model} x{world} on {link} failed:\n{failed[0].stderr.read()[-3000:]}")
    with open(outs[0]) as f:
        result = json.load(f)
    result["step_s"] = statistics.median(result["times"])
    return result


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench train", description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--links", default="loopback,1gbit,100mbit")
    parser.add_argument("--models", default="fc,cnn")
    parser.add_argument("--workers", default="2,4")
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device-tflops", type=float, default=6.0, help="emulated device rate, TFLOP/s")
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return {}
    from bench import netns

    capped, why = netns.available()
    impls = args.impls.split(",")
    rows, summary = [], {}
    notes = [f"emulated device rate {args.device_tflops} TFLOP/s; K = {ROWS} rows per worker"]
    if not capped:
        notes.append(f"network namespaces unavailable ({why}): our processes were capped by the library's shaper, DDP ran UNCAPPED")
    for link in args.links.split(","):
        for model in args.models.split(","):
            for world in (int(w) for w in args.workers.split(",")):
                results = {}
                for impl in impls:
                    if link != "loopback" and capped:
                        with netns.hosts(world, RATES[link][0]) as names:
                            results[impl] = run_config(impl, model, world, link, args, names)
                    else:
                        results[impl] = run_config(impl, model, world, link, args, None)
                    print(f"  {link} {model} x{world} {impl}: {results[impl]['step_s'] * 1e3:.1f} ms", file=sys.stderr)
                ddp = results.get("ddp", {}).get("step_s")
                row = {"link": link, "model": model, "workers": world, **{i: results[i]["step_s"] for i in impls}}
                if ddp and "poseidon" in results:
                    row["speedup"] = ddp / results["poseidon"]["step_s"]
                    summary[f"speedup_vs_ddp_{model}_{link}_{world}w"] = round(row["speedup"], 2)
                if "poseidon" in results:
                    row["schemes"] = results["poseidon"].get("schemes")
                rows.append(row)
    lines = ["Step time, ms (rank 0's median); speedup = DDP ÷ poseidon", "",
             "| link | model | workers | " + " | ".join(impls) + " | speedup |", "|---|---|---|" + "---|" * (len(impls) + 1)]
    for r in rows:
        cells = " | ".join(f"{r[i] * 1e3:.1f}" for i in impls)
        lines.append(f"| {r['link']} | {r['model']} | {r['workers']} | {cells} | {r.get('speedup', float('nan')):.2f} |")
    print("\n".join(lines))
    for n in notes:
        print(f"\nnote: {n}")
    for r in rows:
        if r.get("schemes"):
            print(f"poseidon schemes ({r['model']}, x{r['workers']}, {r['link']}): {r['schemes']}")
            break
    out = {
        "bench": "train",
        "speedup_vs_ddp_fc_1gbit": summary.get("speedup_vs_ddp_fc_1gbit_4w"),
        "ddp_capped": capped,
        "device_tflops": args.device_tflops,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        **summary,
    }
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
