"""Models, data and worker bodies for the trainer tests (run in child processes forked from the tests' fork server,
tests/support/cluster.py)."""

from __future__ import annotations

import torch
from torch import nn


class TinyLM(nn.Module):
    """An embedding (a gradient zero but in its batch's tokens' rows), a Linear on 3-D inputs,
    a head."""

    def __init__(self, spec: dict) -> None:
        super().__init__()
        self.bag = spec.get("bag", False)  # an nn.EmbeddingBag (a recommender's sum of rows) instead
        self.embed = (
            nn.EmbeddingBag(spec["vocab"], spec["width"], mode="sum")
            if self.bag
            else nn.Embedding(spec["vocab"], spec["width"])
        )
        self.fc = nn.Linear(spec["width"], spec["hidden"][0])
        self.head = nn.Linear(spec["hidden"][0], spec["classes"])

    def forward(self, tokens):
        if self.bag:
            return self.head(torch.tanh(self.fc(self.embed(tokens))))
        return self.head(torch.tanh(self.fc(self.embed(tokens))).mean(dim=1))


def build_model(spec: dict, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    if spec["kind"] == "lm":
        return TinyLM(spec)
    if spec["kind"] == "mlp":
        layers, width = [], spec["inputs"]
        for h in spec["hidden"]:
            layers += [nn.Linear(width, h), nn.Tanh()]
            width = h
        layers.append(nn.Linear(width, spec["classes"]))
        return nn.Sequential(*layers)
    c = spec["channels"]
    return nn.Sequential(
        nn.Conv2d(1, c, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(c, c, 3),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(c * (spec["side"] - 2) ** 2, spec["hidden"][0]),
        nn.ReLU(),
        nn.Linear(spec["hidden"][0], spec["classes"]),
    )


def batch(spec: dict, seed: int, rank: int, step: int, size: int):
    g = torch.Generator().manual_seed(seed * 7919 + rank * 104729 + step)
    if spec["kind"] == "lm":
        return torch.randint(0, spec["vocab"], (size, spec["sequence"]), generator=g), torch.randint(
            0, spec["classes"], (size,), generator=g
        )
    shape = (size, spec["inputs"]) if spec["kind"] == "mlp" else (size, 1, spec["side"], spec["side"])
    return torch.randn(*shape, generator=g), torch.randint(0, spec["classes"], (size,), generator=g)


def make_optimizer(model: nn.Module):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)


def single_process(spec: dict, seed: int, workers: int, steps: int, size: int) -> list:
    """The reference: one process, the concatenated global batch, the same optimizer."""
    torch.set_num_threads(1)
    model = build_model(spec, seed)
    opt = make_optimizer(model)
    for t in range(steps):
        xs, ys = zip(*(batch(spec, seed, r, t, size) for r in range(workers)))
        opt.zero_grad()
        nn.functional.cross_entropy(model(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
    return [p.detach().numpy().copy() for p in model.parameters()]


def run_failures(res: dict, label: str, spec: dict, reference: list, workers: int) -> list:
    """What is wrong with run ``label`` of ``res`` (``train_worker``'s results by rank), each named
    with its schemes: a rank whose replica differs from rank 0's bit for bit, a parameter off the
    single-process ``reference`` (rtol 1e-4, atol 1e-5: float32 reordering)."""
    import numpy as np

    params, schemes = res[0][label]["params"], res[0][label]["schemes"]
    failures = []
    for r in range(1, workers):
        if any(a.tobytes() != b.tobytes() for a, b in zip(params, res[r][label]["params"])):
            failures.append(f"{label}: rank {r}'s replica differs from rank 0's (schemes {schemes})")
    for (name, _), a, ref in zip(build_model(spec, 0).named_parameters(), params, reference):
        if not np.allclose(a, ref, rtol=1e-4, atol=1e-5):
            worst = float(np.max(np.abs(a - ref)))
            failures.append(
                f"{label}: {name} differs from the single-process CPU run by up to {worst:.2e} (schemes {schemes})"
            )
    return failures


def _two_plans() -> None:
    """Make the planners disagree, whatever this machine measured: Algorithm 1's plan one message
    of every layer, the exact one's the layers in pairs (what the trainer does with two plans is
    under test, not the planners)."""
    from poseidon_aio.sync import runtime

    plan = runtime.MergeRuntime.plan
    if getattr(plan, "two_plans", False):
        return

    def two(self, layers, names, sizes):
        info = plan(self, layers, names, sizes)
        names = list(names)
        one, pairs = [names], [names[i : i + 2] for i in range(0, len(names), 2)]
        info["candidates"] = [
            {"planner": "algorithm1", "groups": one, "predicted_s": 0.0},
            {"planner": "optimal", "groups": pairs, "predicted_s": 0.0},
        ]
        info["groups"], info["planner"] = one, "algorithm1"
        return info

    two.two_plans = True
    runtime.MergeRuntime.plan = two


def train_worker(rank: int, spec: dict, seed: int, runs: list, steps: int, size: int, ps_kwargs: dict):
    """Train once per ``(label, mode, overrides)`` in ``runs`` over one store; return parameters and stats."""
    import poseidon_aio
    from poseidon_aio.cluster import ClusterEnv, Rendezvous
    from poseidon_aio.ps import PSConfig
    from poseidon_aio.plan import MergeConfig
    from poseidon_aio.sync import AllReduceConfig
    from poseidon_aio.train import OptimizerConfig

    torch.set_num_threads(1)

    async def main():
        rdzv = Rendezvous(ClusterEnv.from_env(), timeout=60)
        await rdzv.start()
        out = {}
        for label, mode, overrides, *rest in runs:
            merge = rest[0] if rest else None
            extra = dict(rest[1]) if len(rest) > 1 else {}
            ps = PSConfig(**{**ps_kwargs, **extra.pop("ps", {})})
            if "allreduce" in extra:
                extra["allreduce"] = AllReduceConfig(extra["allreduce"])
            if "early_step_bytes" in extra:
                extra["optimizer_config"] = OptimizerConfig(early_step_bytes=extra.pop("early_step_bytes"))
            model = build_model(spec, seed + (rank if label == "skewed" else 0))
            device = torch.device(extra.pop("device", "cpu"))
            force_staging = extra.pop("force_staging", False)
            model.to(device)
            if device.type == "cuda":  # cuDNN's TF32 convolutions keep 10 bits: not comparable to the CPU
                torch.backends.cudnn.allow_tf32 = False
            if overrides == "adam-first-linear":
                overrides = {next(n for n, m in model.named_modules() if isinstance(m, nn.Linear)): "adam"}
            elif overrides == "as-poseidon":
                overrides = dict(out["poseidon"]["schemes"])
            elif overrides == "every-allreduce":
                overrides = {
                    n: "allreduce" for n, m in model.named_modules() if any(True for _ in m.parameters(recurse=False))
                }
            elif overrides == "rows-mixed":  # the embedding by rows, its Linear by SFB, the head by all-reduce
                overrides = {"embed": "rows", "fc": "sfb", "head": "allreduce"}
            elif overrides == "mixed":  # the first Linear by SFB, then all-reduce and PS in turn
                owners = [(n, m) for n, m in model.named_modules() if any(True for _ in m.parameters(recurse=False))]
                first = next(n for n, m in owners if isinstance(m, nn.Linear))
                rest = [n for n, _ in owners if n != first]
                overrides = {first: "sfb", **{n: ("allreduce", "ps")[i % 2] for i, n in enumerate(rest)}}
            opt = make_optimizer(model)
            # A plan is kept untried unless a run asks for its trial: which way a trial goes is the
            # machine's load, and these tests check what a plan does.
            merging = MergeConfig(
                kind=merge, after=1, calibration_sizes=(4096, 65536), trial=extra.pop("merge_trial", 0)
            )
            if extra.pop("two_plans", False):
                _two_plans()
            trainer = poseidon_aio.Trainer(
                model,
                opt,
                nn.functional.cross_entropy,
                mode=mode,
                schemes=overrides,
                ps=ps,
                rendezvous=rdzv.job(label),
                merge=merging,
                **extra,
            )
            if force_staging:  # the GPU path's host buffers and copies, on CPU tensors
                from poseidon_aio.train.staging import Staging

                trainer.staging = Staging(force=True)
            stats = []
            async with trainer:
                for t in range(steps):
                    x, y = batch(spec, seed, rank, t, size)
                    stats.append(await trainer.step((x.to(device), y.to(device))))
                node = trainer._planning.node
                book = node.book if node is not None else None
                # What carries each link: "shm" inside a host of several, "tcp" across hosts.
                links = {p: c.via for p, c in trainer._job.peers.items()}
                shard_links = (
                    {s: getattr(c, "via", "local") for s, c in node.client.connections.items()} if node else {}
                )
            out[label] = {
                "shard_bytes": book.shard_bytes() if book is not None else None,
                "messages": len(book.messages) if book is not None else None,
                "params": [p.detach().cpu().numpy().copy() for p in model.parameters()],
                "schemes": stats[-1].schemes,
                "bytes": dict(trainer.bytes_total),
                "losses": [s.loss for s in stats],
                "copies": (trainer.staging.copies_to_host, trainer.staging.copies_to_device),
                "groups": trainer.merge_groups,
                "info": trainer.merge_info,
                "hosts": trainer.topology.hosts,
                "book_hosts": book.topology.hosts if book is not None else None,
                "links": links,
                "shard_links": shard_links,
            }
        await rdzv.leave()
        return out

    return poseidon_aio.run(main())


class Tricky(nn.Module):
    """Frozen, tied and sometimes-unused parameters, and a Linear called twice per forward."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(12, 16)
        self.frozen = nn.Linear(16, 16)
        self.frozen.requires_grad_(False)
        self.shared = nn.Linear(16, 16)
        self.head = nn.Linear(16, 5)
        self.tied = nn.Linear(16, 5)
        self.tied.weight = self.head.weight  # tied with head
        self.unused = nn.Linear(16, 16)  # never called

    def forward(self, x):
        h = torch.tanh(self.embed(x))
        h = torch.tanh(self.frozen(h))
        h = torch.tanh(self.shared(torch.tanh(self.shared(h))))  # one Linear, two calls
        return self.head(h) + self.tied(h)


def tricky_single(seed: int, workers: int, steps: int, size: int, staleness: int = 0) -> list:
    torch.manual_seed(seed)
    model = Tricky()
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    spec = {"kind": "mlp", "inputs": 12, "classes": 5}
    for t in range(steps):
        xs, ys = zip(*(batch(spec, seed, r, t, size) for r in range(workers)))
        opt.zero_grad()
        nn.functional.cross_entropy(model(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
        sched.step()
    return [p.detach().numpy().copy() for p in model.parameters()]


def tricky_worker(rank: int, seed: int, steps: int, size: int, staleness: int, mode: str, merge=None, early=False):
    import poseidon_aio
    from poseidon_aio.ps import PSConfig
    from poseidon_aio.plan import MergeConfig
    from poseidon_aio.train import OptimizerConfig

    torch.set_num_threads(1)
    torch.manual_seed(seed + rank)  # different start on every rank: rank 0's must win
    model = Tricky()
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    spec = {"kind": "mlp", "inputs": 12, "classes": 5}

    async def main():
        overlaps = []
        async with poseidon_aio.Trainer(
            # early: the optimizer steps each sync's parameters as it lands, however small
            model,
            opt,
            nn.functional.cross_entropy,
            mode=mode,
            ps=PSConfig(staleness=staleness),
            optimizer_config=OptimizerConfig(early_step_bytes=1) if early else None,
            schemes={"shared": "sfb"} if mode == "poseidon" else None,
            # merged: a group holding a layer that never reports (``unused``) still goes out
            merge=MergeConfig(kind=merge, after=1, calibration_sizes=(4096, 65536), trial=0) if merge else None,
        ) as trainer:
            for t in range(steps):
                stats = await trainer.step(batch(spec, seed, rank, t, size))
                overlaps.append(stats.schemes)
                sched.step()
            groups = trainer.merge_groups
        return [p.detach().numpy().copy() for p in model.parameters()], overlaps[-1], groups

    return poseidon_aio.run(main())


def overlap_model() -> nn.Module:
    """A CNN whose backward takes long enough for syncs to start inside it (inputs 3 x 16 x 16)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 32, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 32, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(32 * 16 * 16, 256),
        nn.ReLU(),
        nn.Linear(256, 10),
    )


def overlap_worker(rank: int, mode: str, trace_path: str):
    """A CNN big enough that its backward takes a while: does sync overlap it?"""
    import json

    import poseidon_aio
    from poseidon_aio.train import TraceConfig

    torch.set_num_threads(1)
    model = overlap_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    async def main():
        stats = []
        async with poseidon_aio.Trainer(
            model, opt, nn.functional.cross_entropy, mode=mode, trace=TraceConfig(trace_path)
        ) as trainer:
            for t in range(3):
                g = torch.Generator().manual_seed(t * 10 + rank)
                stats.append(
                    await trainer.step(
                        (torch.randn(32, 3, 16, 16, generator=g), torch.randint(0, 10, (32,), generator=g))
                    )
                )
        events = None
        if rank == 0:  # rank 0 writes one trace with every rank's events
            with open(trace_path) as f:
                events = json.load(f)["traceEvents"]
        return [s.overlap_s for s in stats], [s.stall_s for s in stats], events

    return poseidon_aio.run(main())


def budget_worker(rank: int, bandwidth: float):
    """A trainer under the bandwidth manager's per-process budget."""
    import poseidon_aio
    from poseidon_aio.net import ShaperConfig
    from poseidon_aio.net.credentials import config_from_env

    torch.set_num_threads(1)
    spec = {"kind": "mlp", "inputs": 64, "hidden": [256], "classes": 4}
    model = build_model(spec, 1)

    async def main():
        steps = []
        async with poseidon_aio.Trainer(
            model,
            make_optimizer(model),
            nn.functional.cross_entropy,
            mode="wfbp",
            net=config_from_env(bandwidth=ShaperConfig(egress_rate=bandwidth)),
        ) as trainer:
            for t in range(3):
                steps.append(await trainer.step(batch(spec, 1, rank, t, 4)))
        return (
            [p.detach().numpy().copy() for p in model.parameters()],
            [s.step_s for s in steps],
            [s.bytes["ps"] for s in steps],
        )

    return poseidon_aio.run(main())


class Branchy(nn.Module):
    """An FC layer used on some ranks in some steps only (a data-dependent branch), and called
    under ``torch.no_grad`` where it is not: its factors are K = 0 rows there."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(12, 16)
        self.extra = nn.Linear(16, 16)
        self.head = nn.Linear(16, 5)

    def forward(self, x, use_extra: bool):
        h = torch.tanh(self.embed(x))
        if use_extra:
            h = h + torch.tanh(self.extra(h))
        else:
            with torch.no_grad():
                self.extra(h)  # a probe: no gradient flows through it
        return self.head(h)


# uses[step][rank]: whether that rank's batch takes the extra branch.
BRANCH_USES = [(True, False), (False, False), (True, True), (False, True)]


def branch_batch(seed: int, rank: int, step: int, size: int) -> dict:
    x, y = batch({"kind": "mlp", "inputs": 12, "classes": 5}, seed, rank, step, size)
    return {"x": x, "y": y, "extra": BRANCH_USES[step][rank]}


def branch_loss(model: nn.Module, b: dict) -> torch.Tensor:
    return nn.functional.cross_entropy(model(b["x"], b["extra"]), b["y"])


def branchy_single(seed: int, workers: int, size: int) -> list:
    """Distributed SGD averages the ranks' gradients: one process steps on the mean of their losses."""
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    model = Branchy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for t in range(len(BRANCH_USES)):
        opt.zero_grad()
        loss = sum(branch_loss(model, branch_batch(seed, r, t, size)) for r in range(workers)) / workers
        loss.backward()
        opt.step()
    return [p.detach().numpy().copy() for p in model.parameters()]


def branchy_worker(rank: int, seed: int, size: int):
    import poseidon_aio

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    model = Branchy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    async def main():
        schemes = None
        async with poseidon_aio.Trainer(
            model, opt, batch_loss=branch_loss, mode="poseidon", schemes={"extra": "sfb"}
        ) as trainer:
            for t in range(len(BRANCH_USES)):
                schemes = (await trainer.step(branch_batch(seed, rank, t, size))).schemes
        return [p.detach().numpy().copy() for p in model.parameters()], schemes

    return poseidon_aio.run(main())


def bn_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(10, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


def bn_worker(rank: int, seed: int, steps: int):
    """BatchNorm statistics, updated by every rank's own forward: rank 0's win at each step end."""
    import poseidon_aio

    torch.set_num_threads(1)
    model = bn_model(seed + rank)  # different everywhere at first: rank 0's must win
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    spec = {"kind": "mlp", "inputs": 10, "classes": 3}

    async def main():
        async with poseidon_aio.Trainer(model, opt, nn.functional.cross_entropy, mode="wfbp") as trainer:
            for t in range(steps):
                await trainer.step(batch(spec, seed, rank, t, 8))
        return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}

    return poseidon_aio.run(main())


def server_sgd_worker(rank: int, spec: dict, seed: int, steps: int, size: int, mode: str):
    """The shards apply SGD to the PS layers; the user's optimizer (same rule) steps the rest."""
    import poseidon_aio
    from poseidon_aio.ps import PSConfig, ServerSGD

    torch.set_num_threads(1)
    model = build_model(spec, seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    config = PSConfig(server_sgd=ServerSGD(lr=0.05, momentum=0.9, weight_decay=1e-4), sync_timeout=30)

    async def main():
        stats = []
        # The paper's HybComm: layers the shards update by PS beside layers the user's optimizer
        # updates by SFB (on loopback, three-way HybComm would send both these small layers by SFB).
        async with poseidon_aio.Trainer(
            model, opt, nn.functional.cross_entropy, mode=mode, ps=config, hybcomm=("ps", "sfb")
        ) as trainer:
            for t in range(steps):
                stats.append(await trainer.step(batch(spec, seed, rank, t, size)))
        return [p.detach().numpy().copy() for p in model.parameters()], stats[-1].schemes

    return poseidon_aio.run(main())


class Resumable(nn.Module):
    """Dropout (RNG state), BatchNorm (buffers), convolutions (PS) and FC layers (SFB)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc1 = nn.Linear(4 * 6 * 6, 64)
        self.drop = nn.Dropout(0.3)
        self.fc2 = nn.Linear(64, 5)

    def forward(self, x):
        h = torch.relu(self.bn(self.conv(x)))
        return self.fc2(self.drop(torch.relu(self.fc1(h.flatten(1)))))


def resumable_batch(seed: int, rank: int, step: int):
    g = torch.Generator().manual_seed(seed * 7919 + rank * 104729 + step)
    return torch.randn(6, 1, 6, 6, generator=g), torch.randint(0, 5, (6,), generator=g)


def checkpoint_worker(rank: int, runs: list, seed: int, steps: int):
    """``runs``: ``(label, variant, directory, crash_after)``; each trains ``steps`` steps (resuming
    from ``directory`` when it holds a checkpoint), saving every 2 steps; ``crash_after`` kills the
    process (no goodbye) right after that step."""
    import os

    import poseidon_aio
    from poseidon_aio.cluster import ClusterEnv, Rendezvous
    from poseidon_aio.ps import PSConfig, ServerSGD
    from poseidon_aio.plan import MergeConfig

    torch.set_num_threads(1)

    async def main():
        rdzv = Rendezvous(ClusterEnv.from_env(), timeout=60)
        await rdzv.start()
        out = {}
        for label, variant, directory, crash_after in runs:
            torch.manual_seed(seed + rank)  # dropout masks differ by rank, and repeat run to run
            model = Resumable()
            if variant == "server":
                opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
                kwargs = dict(mode="wfbp", ps=PSConfig(server_sgd=ServerSGD(lr=0.05, momentum=0.9), sync_timeout=30))
            else:
                opt = torch.optim.Adam(model.parameters(), lr=0.01)
                merge = MergeConfig(after=1, calibration_sizes=(4096, 65536))
                # Every layer's scheme pinned: HybComm weighs the link measured at start-up, which
                # beside a CPU hog differs between the uninterrupted run and the crashed one (whose
                # plan the resumed run restores), and SFB's bits differ from PS's in the last place
                # (1 run in ~10 of the whole file beside a hog: "conv.weight differs after resuming").
                schemes = {"conv": "ps", "bn": "ps", "fc1": "sfb", "fc2": "sfb"}
                kwargs = dict(mode="poseidon", schemes=schemes, merge=merge, ps=PSConfig(sync_timeout=30))
            trainer = poseidon_aio.Trainer(
                model, opt, nn.functional.cross_entropy, rendezvous=rdzv.job(label), **kwargs
            )
            async with trainer:
                start = await trainer.restore(directory) if os.path.isdir(directory) else 0
                for t in range(start, steps):
                    await trainer.step(resumable_batch(seed, rank, t))
                    if (t + 1) % 2 == 0:
                        await trainer.save(directory)
                    if t == crash_after:
                        os._exit(137)
            out[label] = {
                "start": start,
                "state": {k: v.detach().numpy().copy() for k, v in model.state_dict().items()},
            }
        await rdzv.leave()
        return out

    return poseidon_aio.run(main())


def traces_on_the_host() -> dict:
    """What this process holds that could outlive it on the host: files it has open or mapped
    under /dev/shm or /tmp (but the standard streams, which pytest may point at a file there, and
    the harness's queue semaphore, and the interpreter's and the checkout's own files, which a
    clone under /tmp maps as libraries), and the paths of its Unix sockets ("@..." names are
    abstract: no file)."""
    import os
    import sys

    checkout = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    installed = tuple(os.path.join(root, "") for root in {sys.prefix, sys.base_prefix, sys.exec_prefix, checkout})

    def ours(path: str) -> bool:
        return path.startswith(("/dev/shm", "/tmp")) and not path.startswith(installed)

    fds = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds[int(fd)] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass  # the listing's own descriptor, closed by now
    files = sorted({t for fd, t in fds.items() if fd > 2 and ours(t)})
    with open("/proc/self/maps") as f:
        paths = {line.split(maxsplit=5)[-1].strip() for line in f if " /dev/shm/" in line or " /tmp/" in line}
    # The test harness's result queue: multiprocessing's own named semaphore.
    mapped = sorted(p for p in paths if ours(p) and not p.startswith("/dev/shm/sem.mp-"))
    inodes = {t[len("socket:[") : -1] for t in fds.values() if t.startswith("socket:[")}
    with open("/proc/net/unix") as f:
        rows = [line.split() for line in f.readlines()[1:]]
    sockets = sorted(row[7] for row in rows if len(row) > 7 and row[6] in inodes)
    return {"files": files, "mapped": mapped, "unix_paths": sockets}


def killed_worker(rank: int, victim: int, scheme: str, steps: int, record_dir=None):
    """Train a small MLP with every layer by ``scheme``; rank ``victim`` kills itself with SIGKILL
    before its step 2 (as ``kill -9`` from outside would). Returns the survivor's error type and
    message, and the seconds from its failed step's start to the error. With ``record_dir``, each
    rank writes :func:`traces_on_the_host` there as ``<rank>.json`` before its step 2 (the
    victim too, before it dies)."""
    import json
    import os
    import signal
    import time

    import poseidon_aio
    from poseidon_aio.ps import PSConfig

    torch.set_num_threads(1)
    spec = {"kind": "mlp", "inputs": 12, "hidden": [16], "classes": 3}

    async def main():
        model = build_model(spec, 0)
        schemes = {n: scheme for n, m in model.named_modules() if isinstance(m, nn.Linear)}
        trainer = poseidon_aio.Trainer(
            model, make_optimizer(model), nn.functional.cross_entropy, schemes=schemes, ps=PSConfig(sync_timeout=30.0)
        )
        started = time.monotonic()
        try:  # as a script would: the error leaves the `async with`, which closes the trainer failed
            async with trainer:
                for t in range(steps):
                    if t == 2 and record_dir is not None:
                        seen = {"pid": os.getpid(), **traces_on_the_host()}
                        with open(os.path.join(record_dir, f"{rank}.json"), "w") as f:
                            json.dump(seen, f)
                    if t == 2 and rank == victim:
                        os.kill(os.getpid(), signal.SIGKILL)
                    started = time.monotonic()
                    await trainer.step(batch(spec, 0, rank, t, 4))
        except Exception as exc:  # noqa: BLE001 - reported to the test
            return type(exc).__name__, str(exc), time.monotonic() - started
        return "ok", "", 0.0

    return poseidon_aio.run(main())
