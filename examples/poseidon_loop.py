"""The DDP script examples/ddp_loop.py, ported: only the lines that make the trainer and await it
changed (tests/test_user_loop.py checks that). Your loop stays yours: loss.backward() starts each
layer's sync as the backward is done with it; ``await trainer.synchronize()`` returns when every
gradient is averaged into ``.grad``, before you clip and step.

    poseidon-aio run -n 4 examples/poseidon_loop.py

A plain script can also use ``async with poseidon_aio.Trainer(...) as trainer:``, which closes the
trainer on an error too.
"""

import argparse
import contextlib

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import poseidon_aio

ACCUMULATE = 4


class DigitsCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.bn = nn.BatchNorm2d(16)  # pretrained, kept frozen: its statistics never change
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 4 * 4, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = nn.functional.max_pool2d(torch.relu(self.conv2(torch.relu(self.bn(self.conv1(x))))), 2)
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


def load():
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    return TensorDataset(x[order[360:]], y[order[360:]]), TensorDataset(x[order[:360]], y[order[:360]])


async def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--save", default="digits-cnn.pt")
    args = parser.parse_args()
    torch.set_num_threads(1)
    train, test = load()
    torch.manual_seed(0)
    net = DigitsCNN()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    trainer = poseidon_aio.Trainer(net, optimizer)
    await trainer.start()
    rank, world = trainer.rank, trainer.world_size
    model = trainer.model
    sampler = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(train, batch_size=8, sampler=sampler)
    test_loader = DataLoader(test, batch_size=60, sampler=DistributedSampler(test, world, rank, shuffle=False))
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        net.train()
        net.bn.eval()
        total = 0.0
        for i, (x, y) in enumerate(loader):
            last = (i + 1) % ACCUMULATE == 0
            with contextlib.nullcontext() if last else trainer.no_sync():
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = nn.functional.cross_entropy(model(x), y) / ACCUMULATE
                loss.backward()
            total += loss.item()
            if last:
                await trainer.synchronize()
                nn.utils.clip_grad_norm_(net.parameters(), max_norm=1.0)
                optimizer.step()
                optimizer.zero_grad()
        scheduler.step()
        net.eval()
        counts = torch.zeros(2)
        with torch.no_grad():
            for x, y in test_loader:
                counts += torch.tensor([float((net(x).argmax(1) == y).sum()), float(len(y))])
        await trainer.all_reduce(counts, op="sum")
        if rank == 0:
            print(
                f"epoch {epoch + 1}: loss {total / len(loader) * ACCUMULATE:.3f}, "
                f"test accuracy {100 * counts[0] / counts[1]:.2f}%",
                flush=True,
            )
    if rank == 0:
        torch.save(net.state_dict(), args.save)
    await trainer.close()


poseidon_aio.run(main())
