"""A job that trains until it is stopped: each rank says "ready" once its first step is done
(tests/test_cli.py sends SIGTERM then)."""

import torch
from torch import nn

import poseidon_aio


async def main():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    batch = torch.randn(4, 8), torch.randint(0, 2, (4,))
    async with poseidon_aio.Trainer(model, torch.optim.SGD(model.parameters(), 0.1), nn.functional.cross_entropy) as t:
        await t.step(batch)
        print(f"rank {t.rank} ready", flush=True)
        while True:
            await t.step(batch)


poseidon_aio.run(main())
