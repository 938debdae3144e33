"""Worker bodies for the tests of what a DDP user's loop needs (tests/test_user_loop.py): modes
left to the user, collectives, and the errors of a misused trainer."""

from __future__ import annotations

import threading

import torch
from torch import nn


class Counted(nn.Module):
    """A conv, a BatchNorm (frozen by the test), an FC head; counts its forwards."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 6 * 6, 3)
        self.forwards = 0
        self.threads: set = set()  # the threads its forwards ran on

    def forward(self, x):
        self.forwards += 1
        self.threads.add(threading.get_ident())
        return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))


def counted_batch(seed: int, rank: int, step: int):
    g = torch.Generator().manual_seed(seed * 1009 + rank * 97 + step)
    return torch.randn(6, 1, 8, 8, generator=g), torch.randint(0, 3, (6,), generator=g)


def frozen_bn_worker(rank: int, seed: int, steps: int, mode: str):
    """The BatchNorm is put in eval mode before training: it must stay so, its statistics
    unchanged, and the model must run one forward a step (none extra for planning). Records the
    threads that ran the forwards and the optimizer's steps, and the caller's."""
    import poseidon_aio

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    model = Counted()
    with torch.no_grad():
        model.bn.running_mean.uniform_(-1, 1)  # not the defaults: a reset would show
    model.bn.eval()
    before = {k: v.clone() for k, v in model.bn.named_buffers()}
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    stepped_on: set = set()
    opt.register_step_post_hook(lambda *_: stepped_on.add(threading.get_ident()))

    async def main():
        async with poseidon_aio.Trainer(model, opt, nn.functional.cross_entropy, mode=mode) as trainer:
            for t in range(steps):
                await trainer.step(counted_batch(seed, rank, t))
        return {
            "caller": threading.get_ident(),
            "forward_threads": sorted(model.threads),
            "optimizer_threads": sorted(stepped_on),
            "forwards": model.forwards,
            "bn_training": model.bn.training,
            "model_training": model.training,
            "bn_unchanged": all(torch.equal(before[k], v) for k, v in model.bn.named_buffers()),
        }

    return poseidon_aio.run(main())


def collectives_worker(rank: int):
    """Every op on several dtypes, a barrier, rank and world_size."""
    import poseidon_aio

    torch.set_num_threads(1)
    model = nn.Linear(3, 2)

    async def main():
        out = {}
        async with poseidon_aio.Trainer(model, torch.optim.SGD(model.parameters(), 0.1), nn.functional.mse_loss) as t:
            out["rank"], out["world"] = t.rank, t.world_size
            g = torch.Generator().manual_seed(rank)
            values = torch.randn(5, generator=g) * 1e3
            for op in ("mean", "sum", "max", "min"):
                x = values.clone()
                assert await t.all_reduce(x, op=op) is x
                out[f"float32 {op}"] = x.numpy().copy()
            counts = torch.tensor([rank + 1, 10 * rank], dtype=torch.int64)
            await t.all_reduce(counts, op="sum")
            out["int64 sum"] = counts.numpy().copy()
            half = torch.full((2, 2), 0.5 + rank, dtype=torch.bfloat16)
            await t.all_reduce(half)
            out["bfloat16 mean"] = half.float().numpy().copy()
            out["values"] = values.numpy().copy()
            await t.barrier()
        return out

    return poseidon_aio.run(main())


def mismatched_worker(rank: int):
    """Rank 1 all-reduces a tensor of another size than rank 0's."""
    import poseidon_aio
    from poseidon_aio.errors import PoseidonError

    torch.set_num_threads(1)
    model = nn.Linear(3, 2)

    async def main():
        try:
            async with poseidon_aio.Trainer(
                model, torch.optim.SGD(model.parameters(), 0.1), nn.functional.mse_loss
            ) as t:
                await t.all_reduce(torch.zeros(2 + rank))
        except PoseidonError as exc:
            return f"{type(exc).__name__}: {exc}"
        return "no error"

    return poseidon_aio.run(main())


def absent_worker(rank: int, flag: str):
    """Rank 0 all-reduces; rank 1 never does, and leaves only once rank 0 has given up."""
    import asyncio
    import os

    import poseidon_aio
    from poseidon_aio.errors import PoseidonError
    from poseidon_aio.ps import PSConfig

    torch.set_num_threads(1)
    model = nn.Linear(3, 2)

    async def main():
        try:
            async with poseidon_aio.Trainer(
                model, torch.optim.SGD(model.parameters(), 0.1), nn.functional.mse_loss, ps=PSConfig(sync_timeout=2)
            ) as t:
                if rank == 0:
                    try:
                        await t.all_reduce(torch.ones(3))
                    finally:
                        open(flag, "w").close()
                    return "no error"
                for _ in range(600):  # rank 0's sync timeout is 2 s; 60 s is a hang
                    if os.path.exists(flag):
                        break
                    await asyncio.sleep(0.1)
                raise RuntimeError("rank 0 is done")
        except PoseidonError as exc:
            return f"{type(exc).__name__}: {exc}"
        except RuntimeError as exc:
            return str(exc)

    return poseidon_aio.run(main())


def misuse_worker(rank: int, how: str):
    """One mistake a new user makes; returns the error it gave."""
    import numpy as np

    import poseidon_aio
    from poseidon_aio.errors import PoseidonError

    torch.set_num_threads(1)
    model = nn.Linear(3, 2)
    x, y = torch.randn(4, 3), torch.randn(4, 2)

    async def main():
        try:
            async with poseidon_aio.Trainer(
                model, torch.optim.SGD(model.parameters(), 0.1), nn.functional.mse_loss
            ) as t:
                if how == "numpy":
                    await t.step((x.numpy(), y.numpy()))
                elif how == "array":
                    await t.step(np.zeros((4, 3)))
                elif how == "no await":
                    t.step((x, y))  # the mistake
                    await t.step((x, y))
                elif how == "no await at the end":
                    await t.step((x, y))
                    t.step((x, y))  # the mistake
                elif how == "no targets":  # a loss_fn that takes none
                    t.loss_fn = lambda out, _: out.pow(2).mean()
                    await t.step((x, None))
                elif how == "mean of ints":
                    await t.all_reduce(torch.ones(2, dtype=torch.int64), op="mean")
        except PoseidonError as exc:
            return f"{type(exc).__name__}: {exc}"
        return "no error"

    return poseidon_aio.run(main())


def user_loop_worker(rank: int, spec: dict, seed: int, steps: int, accumulate: int, clip, runs: list):
    """The user's own loop, for each ``(label, mode, schemes)`` of ``runs``: ``accumulate``
    backward passes a step (all but the last inside ``no_sync``), a GradScaler, clipping."""
    import contextlib

    import poseidon_aio

    from .trainworkers import batch, build_model, make_optimizer

    torch.set_num_threads(1)

    async def one(rdzv, mode: str, schemes) -> dict:
        model = build_model(spec, seed)
        opt = make_optimizer(model)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        async with poseidon_aio.Trainer(model, opt, mode=mode, schemes=schemes, rendezvous=rdzv) as trainer:
            for t in range(steps):
                opt.zero_grad()
                for m in range(accumulate):
                    x, y = batch(spec, seed, rank, t * accumulate + m, 4)
                    with trainer.no_sync() if m < accumulate - 1 else contextlib.nullcontext():
                        loss = nn.functional.cross_entropy(model(x), y) / accumulate
                        scaler.scale(loss).backward()
                stats = await trainer.synchronize()
                scaler.unscale_(opt)
                if clip is not None:
                    nn.utils.clip_grad_norm_(model.parameters(), clip)
                scaler.step(opt)
                scaler.update()
        return {"params": [p.detach().numpy().copy() for p in model.parameters()], "schemes": stats.schemes}

    return _each_in_a_job_of_its_own(one, runs)


def user_loop_single(spec: dict, seed: int, workers: int, steps: int, accumulate: int, clip) -> list:
    """The reference: one process over every rank's batches, the same scaler and clipping."""
    from .trainworkers import batch, build_model, make_optimizer

    torch.set_num_threads(1)
    model = build_model(spec, seed)
    opt = make_optimizer(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    for t in range(steps):
        opt.zero_grad()
        xs, ys = zip(*(batch(spec, seed, r, t * accumulate + m, 4) for r in range(workers) for m in range(accumulate)))
        # Each rank's micro-batch loss / accumulate, averaged over ranks: the mean over all of them.
        scaler.scale(nn.functional.cross_entropy(model(torch.cat(xs)), torch.cat(ys))).backward()
        scaler.unscale_(opt)
        if clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        scaler.step(opt)
        scaler.update()
    return [p.detach().numpy().copy() for p in model.parameters()]


def user_overlap_worker(rank: int, mode: str):
    """The user's own loop on a CNN whose backward takes a while: how many of each step's syncs
    had started when ``loss.backward()`` returned."""
    import time

    import poseidon_aio

    from .trainworkers import overlap_model

    torch.set_num_threads(1)
    model = overlap_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    async def main():
        started_during = []
        async with poseidon_aio.Trainer(model, opt, mode=mode) as trainer:
            for t in range(4):
                g = torch.Generator().manual_seed(t * 10 + rank)
                x, y = torch.randn(32, 3, 16, 16, generator=g), torch.randint(0, 10, (32,), generator=g)
                opt.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                ended = time.perf_counter()
                spans = list(trainer._armed.spans)  # (this step's syncs so far)
                started_during.append(sum(1 for s in spans if s.start < ended))
                await trainer.synchronize()
                opt.step()
        return started_during

    return poseidon_aio.run(main())


def short_form_amp_worker(rank: int, spec: dict, seed: int, steps: int, clip, inf_at):
    """``step(batch, scaler=...)`` with the settings' clipping, under the caller's bf16 autocast
    (the dtypes the first layer's output came in are recorded); at step ``inf_at`` rank 1's batch
    holds an inf."""
    import poseidon_aio
    from poseidon_aio.train import OptimizerConfig

    from .trainworkers import batch, build_model, make_optimizer

    torch.set_num_threads(1)
    model = build_model(spec, seed)
    opt = make_optimizer(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    seen: set = set()
    model[0].register_forward_hook(lambda m, i, out: seen.add(str(out.dtype)))

    async def main():
        scales, params = [], []
        config = OptimizerConfig(clip_grad_norm=clip)
        async with poseidon_aio.Trainer(
            model, opt, nn.functional.cross_entropy, mode="wfbp", optimizer_config=config
        ) as trainer:
            for t in range(steps):
                x, y = batch(spec, seed, rank, t, 4)
                if t == inf_at and rank == 1:
                    x[0, 0] = float("inf")
                if t == 0:
                    await trainer.step((x, y), scaler=scaler)
                else:
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        await trainer.step((x, y), scaler=scaler)
                scales.append(scaler.get_scale())
                params.append([p.detach().numpy().copy() for p in model.parameters()])
        return {"scales": scales, "params": params, "dtypes": sorted(seen)}

    return poseidon_aio.run(main())


def uneven_worker(rank: int, batches: list, form: str, hybcomm: tuple = ("ps", "sfb", "allreduce")):
    """Rank ``r`` trains on ``batches[r]`` batches, then leaves the trainer; returns how it ended
    and how long its last step took. ``hybcomm``: the schemes its layers may take (the parameter
    server's links or the mesh's)."""
    import time

    import poseidon_aio
    from poseidon_aio.errors import PoseidonError
    from poseidon_aio.ps import PSConfig

    from .trainworkers import batch, build_model, make_optimizer

    torch.set_num_threads(1)
    spec = {"kind": "mlp", "inputs": 12, "hidden": [16], "classes": 3}
    model = build_model(spec, 0)
    opt = make_optimizer(model)
    loss_fn = nn.functional.cross_entropy if form == "step" else None

    async def main():
        last = time.monotonic()
        try:
            async with poseidon_aio.Trainer(
                model, opt, loss_fn, ps=PSConfig(sync_timeout=60), hybcomm=hybcomm
            ) as trainer:
                for t in range(batches[rank]):
                    last = time.monotonic()
                    if form == "step":
                        await trainer.step(batch(spec, 0, rank, t, 4))
                    else:
                        x, y = batch(spec, 0, rank, t, 4)
                        opt.zero_grad()
                        nn.functional.cross_entropy(model(x), y).backward()
                        await trainer.synchronize()
                        opt.step()
        except PoseidonError as exc:
            return f"{type(exc).__name__}: {exc}", time.monotonic() - last
        return "finished", time.monotonic() - last

    return poseidon_aio.run(main())


def resize_worker(rank: int, directory: str, steps: int):
    """Train ``steps`` steps and save (``steps`` > 0), or restore what is in ``directory``
    (saved at another world size), report it, and take one more step."""
    import poseidon_aio

    from .trainworkers import batch, build_model, make_optimizer

    torch.set_num_threads(1)
    spec = {"kind": "mlp", "inputs": 12, "hidden": [16], "classes": 3}
    model = build_model(spec, 1 + rank)  # different at first: the start-up broadcast, then the checkpoint win
    opt = make_optimizer(model)

    async def main():
        async with poseidon_aio.Trainer(model, opt, nn.functional.cross_entropy) as trainer:
            if steps:
                for t in range(steps):
                    await trainer.step(batch(spec, 0, rank, t, 4))
                await trainer.save(directory)
                return None
            clock = await trainer.restore(directory)
            restored = {
                "clock": clock,
                "params": [p.detach().numpy().copy() for p in model.parameters()],
                "momentum": [opt.state[p]["momentum_buffer"].numpy().copy() for p in model.parameters()],
            }
            await trainer.step(batch(spec, 0, rank, clock, 4))
            restored["next_clock"] = trainer.clock
        return restored

    return poseidon_aio.run(main())


def half_worker(rank: int, dtype: str):
    """A model in ``dtype`` in the user's own loop: the payload bytes of the run, per scheme."""
    import poseidon_aio

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)).to(getattr(torch, dtype))
    opt = torch.optim.SGD(model.parameters(), 0.1)

    async def main():
        # WFBP: every layer by the PS, one message a layer (a merge plan, made on a link measured
        # under load, would move which keys a rank's own shard holds, so the bytes it counts)
        async with poseidon_aio.Trainer(model, opt, mode="wfbp") as trainer:
            for t in range(3):
                g = torch.Generator().manual_seed(t * 10 + rank)
                x, y = (
                    torch.randn(8, 64, generator=g).to(getattr(torch, dtype)),
                    torch.randint(0, 10, (8,), generator=g),
                )
                opt.zero_grad()
                nn.functional.cross_entropy(model(x).float(), y).backward()
                await trainer.synchronize()
                opt.step()
        # (the whole run's: a step's own count takes the shard's replies to the others as they
        # have gone out by then, which is up to timing)
        return trainer.bytes_total, [str(p.grad.dtype) for p in model.parameters()]

    return poseidon_aio.run(main())


def amp_worker(rank: int, spec: dict, seed: int, steps: int, device: str, dtype: str, runs: list, inf_at: int):
    """Mixed precision as a DDP user runs it, for each ``(label, form, schemes)`` of ``runs``:
    autocast to ``dtype`` on ``device``, a GradScaler, clipping at 0.05; ``form`` is "loop" (two
    backward passes a step, the first inside ``no_sync``, then ``synchronize``) or "step"
    (``step(batch, scaler=...)`` with the settings' clipping). At step ``inf_at`` rank 1's batch
    holds an inf. Returns, per run, the scale after each step and the parameters after each step."""
    import contextlib

    import poseidon_aio
    from poseidon_aio.train import OptimizerConfig

    from .trainworkers import batch, build_model, make_optimizer

    torch.set_num_threads(1)
    half = getattr(torch, dtype)

    def data(t: int, m: int):
        x, y = batch(spec, seed, rank, t * 2 + m, 4)
        if t == inf_at and rank == 1:
            x[0, 0] = float("inf")
        return x.to(device), y.to(device)

    async def one(rdzv, form: str, schemes) -> dict:
        model = build_model(spec, seed).to(device)
        opt = make_optimizer(model)
        scaler = torch.amp.GradScaler(device, init_scale=2.0**10)
        seen: set = set()
        model[0].register_forward_hook(lambda m, i, out: seen.add(str(out.dtype)))
        config = OptimizerConfig(clip_grad_norm=0.05)
        loss_fn = nn.functional.cross_entropy if form == "step" else None
        scales, params = [], []
        async with poseidon_aio.Trainer(
            model, opt, loss_fn, schemes=schemes, rendezvous=rdzv, optimizer_config=config
        ) as trainer:
            for t in range(steps):
                if form == "step":
                    with torch.autocast(device, dtype=half):
                        await trainer.step(data(t, 0), scaler=scaler)
                else:
                    opt.zero_grad()
                    for m in range(2):
                        x, y = data(t, m)
                        with trainer.no_sync() if m == 0 else contextlib.nullcontext():
                            with torch.autocast(device, dtype=half):
                                loss = nn.functional.cross_entropy(model(x), y) / 2
                            scaler.scale(loss).backward()
                    await trainer.synchronize()
                    scaler.unscale_(opt)
                    nn.utils.clip_grad_norm_(model.parameters(), 0.05)
                    scaler.step(opt)
                    scaler.update()
                scales.append(scaler.get_scale())
                params.append([p.detach().cpu().numpy().copy() for p in model.parameters()])
        return {"scales": scales, "params": params, "dtypes": sorted(seen)}

    return _each_in_a_job_of_its_own(one, runs)


def _each_in_a_job_of_its_own(one, runs: list) -> dict:
    """``{label: await one(job, *args)}`` for each ``(label, *args)`` of ``runs``, each run a job
    of its own under one rendezvous."""
    import poseidon_aio
    from poseidon_aio.cluster import ClusterEnv, Rendezvous

    async def main():
        rdzv = Rendezvous(ClusterEnv.from_env(), timeout=60)
        await rdzv.start()
        out = {label: await one(rdzv.job(label), *args) for label, *args in runs}
        await rdzv.leave()
        return out

    return poseidon_aio.run(main())
