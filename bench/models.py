"""The bench's models, real and replayed.

* ``fc``: an FC-heavy MLP, 1024 -> 2048 -> 2048 -> 2048 -> 10 (12.6 M parameters), K = 32 rows.
* ``cnn``: a small CNN, three 3x3 convolutions with 2x2 pooling (32-64-64 channels) on 32x32
  images and an FC classifier (0.07 M parameters).
* ``resnet``: a ResNet-20-style CNN with batch norm: a 16-channel stem and three stages of two
  basic blocks (16, 32, 64 channels), global pooling, an FC head (0.27 M parameters).
* ``transformer``: a two-block transformer encoder on token sequences: an embedding (1000 x 128),
  per block LayerNorm, a QKV and an output projection, a 128 -> 512 -> 128 MLP (Linear layers on
  3-D inputs: K = batch x sequence rows), and a vocabulary head (0.66 M parameters).

``replay(model, batch, tflops)`` keeps a model's parameters, shapes and autograd graph but
replaces the compute of every layer that owns parameters by a sleep for its FLOPs at ``tflops``
(forward 1x, backward 2x: the input's and the weight's gradient), measured once on a real
forward. A replayed layer's weight gradient is a fixed random tensor. Layers the trainer syncs by
sufficient factors compute no weight gradient (``train.layers``): ``skip_weight_grad(model,
names)`` makes their replayed backward 1x.

What is not a layer (activations, pooling, residual additions, attention's softmax and
matmuls) is not run: the replayed model's forward is the chain of its layers in the order the
real forward called them, each fed zeros of the shape its real input had, so the backward
produces the layers' gradients in the real backward's order. Those operations are a few percent
of these models' FLOPs on the emulated device; run for real on this CPU (as ``replay`` did up
to 2026-11-24) they took 30-50 times the replayed layers' time (cnn: 7.8 ms a step against 0.26
ms replayed, one process; 18-23 ms with four processes on the two cores), so every
implementation's step was this CPU's, not the device's. Zeros are zero-stride views, never
materialised, except where an implementation reads them (sufficient factors' v rows).
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F
from torch import nn

ROWS = 32
FC_DIMS = [1024, 2048, 2048, 2048, 10]


class Block(nn.Module):
    """A ResNet basic block: two 3x3 convolutions with batch norm, a projection when the shape changes."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.short = None
        if stride != 1 or c_in != c_out:
            self.short = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        h = self.bn2(self.conv2(h))
        return F.relu(h + (x if self.short is None else self.short(x)))


class ResNet(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, 1, 1, bias=False)
        self.bn = nn.BatchNorm2d(16)
        blocks, c = [], 16
        for width, stride in ((16, 1), (32, 2), (64, 2)):
            blocks += [Block(c, width, stride), Block(width, width, 1)]
            c = width
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(64, classes)

    def forward(self, x):
        h = self.blocks(F.relu(self.bn(self.stem(x))))
        return self.head(h.mean(dim=(2, 3)))


class Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).reshape(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        w = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d // self.heads), dim=-1)
        return self.out((w @ v).transpose(1, 2).reshape(b, t, d))


class EncoderBlock(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Transformer(nn.Module):
    def __init__(self, vocab: int = 1000, d: int = 128, heads: int = 4, blocks: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.Sequential(*[EncoderBlock(d, heads) for _ in range(blocks)])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens):
        return self.head(self.ln(self.blocks(self.embed(tokens))))


def build(name: str, seed: int = 0):
    """``(model, (inputs, targets), loss_fn)`` for one worker's batch."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    if name == "fc":
        layers = []
        for i in range(len(FC_DIMS) - 1):
            layers += [nn.Linear(FC_DIMS[i], FC_DIMS[i + 1]), nn.ReLU()]
        return (
            nn.Sequential(*layers[:-1]),
            (torch.randn(ROWS, FC_DIMS[0], generator=g), torch.randint(0, 10, (ROWS,), generator=g)),
            F.cross_entropy,
        )
    if name == "cnn":
        layers = []
        for a, b in ((3, 32), (32, 64), (64, 64)):
            layers += [nn.Conv2d(a, b, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)]
        model = nn.Sequential(*layers, nn.Flatten(), nn.Linear(64 * 4 * 4, 10))
        return (
            model,
            (torch.randn(ROWS, 3, 32, 32, generator=g), torch.randint(0, 10, (ROWS,), generator=g)),
            F.cross_entropy,
        )
    if name == "resnet":
        return (
            ResNet(),
            (torch.randn(16, 3, 32, 32, generator=g), torch.randint(0, 10, (16,), generator=g)),
            F.cross_entropy,
        )
    if name == "transformer":
        tokens = torch.randint(0, 1000, (8, 32), generator=g)

        def lm_loss(logits, targets):
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

        return Transformer(), (tokens, torch.roll(tokens, -1, dims=1)), lm_loss
    raise ValueError(f"unknown model {name!r}")


# -- replay -----------------------------------------------------------------------------------


class _Clock:
    """Replayed time owed and not yet slept. ``time.sleep`` overshoots by 50-60 us on Linux (the
    timer slack), more than most of these layers' whole replayed time (resnet: 63 sleeps of 7 us
    on average a step): sleeping each layer's time alone would replay 4 ms where 0.44 are due. So
    a layer's time is added to a debt, slept once it reaches ``grain``, and the overshoot is paid
    back by the layers after: the total is kept, each gradient is at most ``grain`` early."""

    grain = 1e-4
    debt = 0.0

    @classmethod
    def spend(cls, seconds: float) -> None:
        cls.debt += seconds
        if cls.debt >= cls.grain:
            started = time.perf_counter()
            time.sleep(cls.debt)
            cls.debt -= time.perf_counter() - started


class Replay(torch.autograd.Function):
    """A layer's compute replayed: sleep ``layer.replay_fwd_s`` forward (twice that backward, once
    without a weight gradient), return ``layer.replay_out`` and ``layer.replay_grads``."""

    @staticmethod
    def forward(ctx, x, layer, *params):
        ctx.layer, ctx.x_shape, ctx.x_dtype = layer, x.shape, x.dtype
        if getattr(layer, "replay_lazy", False):
            _Clock.spend(layer.replay_fwd_s)
            return _zeros(layer.replay_out.shape, layer.replay_out.dtype)
        time.sleep(layer.replay_fwd_s)
        return layer.replay_out.clone()

    @staticmethod
    def backward(ctx, grad):
        layer = ctx.layer
        lazy = getattr(layer, "replay_lazy", False)
        (_Clock.spend if lazy else time.sleep)(layer.replay_fwd_s * (1 if layer.replay_skip_weight_grad else 2))
        zeros = _zeros if lazy else torch.zeros
        grad_x = zeros(ctx.x_shape, dtype=ctx.x_dtype) if ctx.needs_input_grad[0] else None
        if layer.replay_skip_weight_grad:  # no weight gradient at all, as train.layers does for real
            return (grad_x, None, *(None for _ in layer.replay_grads))
        if getattr(layer, "sparse", False):  # nn.Embedding(sparse=True): its rows as a sparse gradient, as for real
            if getattr(layer, "replay_sparse", None) is None:
                layer.replay_sparse = [g.to_sparse(sparse_dim=1) for g in layer.replay_grads]  # rows, as an embedding's
            return (grad_x, None, *(g.clone() for g in layer.replay_sparse))
        return (grad_x, None, *layer.replay_grads)


def _zeros(shape, dtype=torch.float32) -> torch.Tensor:
    """Zeros of ``shape`` that cost one element: a zero-stride view."""
    return torch.zeros((), dtype=dtype).expand(shape)


class _Feed(torch.autograd.Function):
    """The chain's link between two replayed layers: the next layer's input, zeros of the shape
    its real input had; backward, zeros of the previous layer's output."""

    @staticmethod
    def forward(ctx, h, shape, dtype):
        ctx.h_shape, ctx.h_dtype = h.shape, h.dtype
        return _zeros(shape, dtype)

    @staticmethod
    def backward(ctx, grad):
        return _zeros(ctx.h_shape, ctx.h_dtype), None, None


def _flops(module: nn.Module, x: torch.Tensor, out: torch.Tensor) -> float:
    if isinstance(module, nn.Linear):
        return 2.0 * (x.numel() // module.in_features) * module.in_features * module.out_features
    if isinstance(module, nn.Conv2d):
        k = module.kernel_size[0] * module.kernel_size[1] * module.in_channels // module.groups
        return 2.0 * out.numel() * k
    return 8.0 * out.numel()  # norms, embeddings: a few operations per output element


def replay(model: nn.Module, batch, tflops: float) -> nn.Module:
    """Replace the compute of every layer that owns parameters by a sleep at ``tflops``, and the
    model's forward by the chain of those layers in their real forward's order (the docstring
    at the top says why)."""
    owners = [m for m in model.modules() if any(True for _ in m.parameters(recurse=False))]
    seen, order = {}, []

    def record(module, inputs, output):
        if module in seen:
            raise ValueError(
                f"replay: {type(module).__name__} is called twice in one forward; a chain cannot replay it"
            )
        seen[module] = (inputs[0], output)
        order.append(module)

    handles = [m.register_forward_hook(record) for m in owners]
    with torch.no_grad():
        model(batch[0])
    for h in handles:
        h.remove()
    for m in owners:
        x, out = seen[m]
        params = list(m.parameters(recurse=False))
        m.replay_fwd_s = _flops(m, x, out) / (tflops * 1e12)
        m.replay_out = torch.zeros_like(out)
        m.replay_grads = [torch.randn_like(p) * 1e-3 for p in params]
        if isinstance(m, nn.Embedding) and not m.sparse:
            # As a real one's: zero but in the rows of the batch's tokens (the rows scheme sends only those).
            touched = torch.zeros(m.num_embeddings, 1)
            touched[x.reshape(-1).unique()] = 1.0
            m.replay_grads[0].mul_(touched)
        m.replay_skip_weight_grad = False
        m.replay_lazy = True
        m.replay_in = (tuple(x.shape), x.dtype)
        # A subclass with its own forward: the trainer then sees a layer with custom compute.
        m.__class__ = type(
            f"Replayed{type(m).__name__}",
            (type(m),),
            {"forward": lambda self, x, *a, **k: Replay.apply(x, self, *self.parameters(recurse=False))},
        )

    def chain(self, x, *args, **kwargs):
        h = order[0](x)
        for m in order[1:]:
            shape, dtype = m.replay_in
            h = m(h if (h.shape, h.dtype) == (shape, dtype) else _Feed.apply(h, shape, dtype))
        return h

    model.forward = chain.__get__(model)
    return model


def skip_weight_grad(model: nn.Module, names) -> None:
    """Replay the backward of layers ``names`` (synced by sufficient factors) without a weight gradient."""
    wanted = set(names)
    for name, module in model.named_modules():
        if name in wanted and hasattr(module, "replay_skip_weight_grad"):
            module.replay_skip_weight_grad = True


def compute_saved_by_factors(repeats: int = 20) -> dict:
    """Forward + backward of the FC model on this CPU with autograd's weight gradients for its
    SFB layers (plain nn.Linear) against the trainer's factored backward (none)."""
    import statistics

    from poseidon_aio.train.layers import FactorCapture, discover

    torch.set_num_threads(1)
    timings = {}
    for label in ("autograd", "factored"):
        model, (x, y), loss_fn = build("fc")
        caps = [FactorCapture(layer, lambda _: None) for layer in discover(model)[:3]] if label == "factored" else []
        times = []
        for _ in range(repeats):
            for c in caps:
                c.reset(True)
            started = time.perf_counter()
            model.zero_grad(set_to_none=True)
            loss_fn(model(x), y).backward()
            times.append(time.perf_counter() - started)
        timings[label] = statistics.median(times)
    return timings


def replay_cost(name: str, tflops: float = 6.0, repeats: int = 25) -> dict:
    """What a replayed forward + backward of model ``name`` costs on this CPU (one process, one
    thread, median of ``repeats`` after 5 untimed) against the replayed FLOPs' time it stands for.

    >>> sorted(replay_cost("cnn", repeats=1))
    ['due_s', 'taken_s']
    """
    import statistics

    torch.set_num_threads(1)
    model, batch, _ = build(name, seed=0)
    _, (x, _), _ = build(name, seed=1)
    replay(model, batch, tflops)
    due = 3 * sum(m.replay_fwd_s for m in model.modules() if hasattr(m, "replay_fwd_s"))
    times = []
    for i in range(5 + repeats):
        started = time.perf_counter()
        model.zero_grad(set_to_none=True)
        model(x).float().mean().backward()
        if i >= 5:
            times.append(time.perf_counter() - started)
    return {"due_s": due, "taken_s": statistics.median(times)}
