"""A job whose ranks build different models: every rank must fail with one line naming the cause."""

import os

import torch
from torch import nn

import poseidon_aio


async def main():
    width = 8 + int(os.environ["RANK"])  # rank 1's model differs from rank 0's
    model = nn.Linear(width, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    async with poseidon_aio.Trainer(model, opt, nn.functional.cross_entropy) as trainer:
        await trainer.step((torch.zeros(4, width), torch.zeros(4, dtype=torch.long)))


poseidon_aio.run(main())
