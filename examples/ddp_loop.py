"""A typical DDP training script, the one examples/poseidon_loop.py ports.

    poseidon-aio run -n 4 examples/ddp_loop.py      (or torchrun --nproc-per-node 4 ...)

A small CNN with a frozen BatchNorm on scikit-learn's handwritten digits: a DistributedSampler,
gradient accumulation over 4 micro-batches, bf16 autocast on the CPU, gradient clipping, SGD with
StepLR, the test accuracy summed over ranks, and rank 0 saving the bare model's state_dict.
"""

import argparse
import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

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


def main():
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
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = DDP(net)
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
            with contextlib.nullcontext() if last else model.no_sync():
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = nn.functional.cross_entropy(model(x), y) / ACCUMULATE
                loss.backward()
            total += loss.item()
            if last:
                nn.utils.clip_grad_norm_(net.parameters(), max_norm=1.0)
                optimizer.step()
                optimizer.zero_grad()
        scheduler.step()
        net.eval()
        counts = torch.zeros(2)
        with torch.no_grad():
            for x, y in test_loader:
                counts += torch.tensor([float((net(x).argmax(1) == y).sum()), float(len(y))])
        dist.all_reduce(counts)
        if rank == 0:
            print(
                f"epoch {epoch + 1}: loss {total / len(loader) * ACCUMULATE:.3f}, "
                f"test accuracy {100 * counts[0] / counts[1]:.2f}%",
                flush=True,
            )
    if rank == 0:
        torch.save(net.state_dict(), args.save)
    dist.barrier()
    del model  # DDP's reducer holds the group; freed first, gloo's teardown waits without the GIL (torch #56297)
    dist.destroy_process_group()


main()
