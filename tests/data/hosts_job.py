"""A job over several hosts: each rank prints its hosts, the schemes, and a digest of its
parameters after a few steps (every replica must print the same one)."""

import hashlib
import os

import torch
from torch import nn

import poseidon_aio


async def main():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8), nn.Tanh(), nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    schemes = {"0": "sfb", "2": "allreduce", "4": "allreduce"}
    async with poseidon_aio.Trainer(model, opt, nn.functional.cross_entropy, schemes=schemes) as trainer:
        g = torch.Generator().manual_seed(int(os.environ["RANK"]))
        for _ in range(3):
            await trainer.step((torch.randn(6, 16, generator=g), torch.randint(0, 4, (6,), generator=g)))
        digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
        line = f"rank {trainer.rank} hosts {list(map(list, trainer.topology.hosts))} digest {digest[:16]}\n"
        os.write(1, line.encode())  # one write: the ranks share the launcher's stdout


poseidon_aio.run(main())
