"""Worker bodies for the compression tests across real processes (run in child processes forked from the tests'
fork server, tests/support/cluster.py)."""

from __future__ import annotations

import torch
from torch import nn

from .trainworkers import Resumable, batch, build_model, make_optimizer, resumable_batch


def max_gradient(spec: dict, seed: int, workers: int, steps: int, size: int) -> float:
    """The largest |gradient| any rank's batch produces along the single-process trajectory
    (what bounds the fp16 scheme's rounding error per step)."""
    torch.set_num_threads(1)
    model = build_model(spec, seed)
    opt = make_optimizer(model)
    top = 0.0
    for t in range(steps):
        for r in range(workers):
            model.zero_grad()
            x, y = batch(spec, seed, r, t, size)
            nn.functional.cross_entropy(model(x), y).backward()
            top = max(top, max(float(p.grad.abs().max()) for p in model.parameters()))
        xs, ys = zip(*(batch(spec, seed, r, t, size) for r in range(workers)))
        opt.zero_grad()
        nn.functional.cross_entropy(model(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
    return top


def lossy_checkpoint_worker(rank: int, runs: list, seed: int, steps: int):
    """``runs``: ``(label, directory, crash_after)``; each trains ``steps`` steps of
    :class:`Resumable` with fc1 by PowerSGD and the convolution and fc2 by top-k (their error
    feedback in play), resuming from ``directory`` when it holds a checkpoint, saving every 2
    steps; ``crash_after`` kills the process (no goodbye) right after that step."""
    import os

    import poseidon_aio
    from poseidon_aio.cluster import ClusterEnv, Rendezvous
    from poseidon_aio.ps import PSConfig
    from poseidon_aio.plan import CompressionConfig, Link

    torch.set_num_threads(1)

    async def main():
        rdzv = Rendezvous(ClusterEnv.from_env(), timeout=60)
        await rdzv.start()
        out = {}
        for label, directory, crash_after in runs:
            torch.manual_seed(seed + rank)
            model = Resumable()
            opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            compression = CompressionConfig(
                "auto", rank=2, ratio=0.05, min_elements=32, link=Link.of_bandwidth(12.5e6, 1e-4)
            )
            trainer = poseidon_aio.Trainer(
                model,
                opt,
                nn.functional.cross_entropy,
                rendezvous=rdzv.job(label),
                ps=PSConfig(sync_timeout=30),
                compression=compression,
                schemes={"fc1": "powersgd", "conv": "topk", "fc2": "topk"},
            )
            async with trainer:
                start = await trainer.restore(directory) if os.path.isdir(directory) else 0
                restored = len(trainer.feedback)
                for t in range(start, steps):
                    stats = await trainer.step(resumable_batch(seed, rank, t))
                    if (t + 1) % 2 == 0:
                        await trainer.save(directory)
                    if t == crash_after:
                        os._exit(137)
            out[label] = {
                "start": start,
                "restored": restored,
                "schemes": stats.schemes,
                "state": {k: v.detach().numpy().copy() for k, v in model.state_dict().items()},
                "feedback": trainer.feedback.state(),
            }
        await rdzv.leave()
        return out

    return poseidon_aio.run(main())
