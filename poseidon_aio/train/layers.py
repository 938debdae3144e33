"""Layers of a torch model as the synchronization sees them, and the backward hooks that report them.

A *layer* is a module that directly owns trainable parameters. A parameter shared by several
modules (tied weights) belongs to the first that owns it; a shared weight is never sent by SFB,
whose factors only describe one module's use of it.

Hooks run on the backward's thread. They never block and never touch a socket: they record what they
must (for SFB the input rows in the forward, the output-gradient rows in the backward) and hand
the layer to the event loop (:class:`~poseidon_aio.train.handoff.Handoff`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..plan.cost import LayerKind, LayerShape


@dataclass
class Layer:
    """One synchronization unit: a module and the trainable parameters it owns.

    ``factorable``: an unshared float32 ``nn.Linear`` whose weight and bias are all it owns: its
    gradient is a sum of sufficient factors, so SFB or Project Adam can sync it.
    ``row_sparse``: an unshared float32 ``nn.Embedding`` or ``nn.EmbeddingBag`` with a dense
    gradient, its weight all it owns: the gradient's rows are zero but for the batch's tokens, so
    the rows scheme can sync it (a weight tied to an output layer gets that layer's dense gradient
    too).
    """

    index: int
    name: str
    module: nn.Module
    params: list  # [(qualified name, Parameter)]
    param_ids: list = field(default_factory=list)  # manifest indices
    factorable: bool = False
    row_sparse: bool = False

    @property
    def kind(self) -> LayerKind:
        if isinstance(self.module, nn.Linear):
            return LayerKind.FC
        if self.row_sparse:
            return LayerKind.EMBEDDING
        if isinstance(self.module, nn.modules.conv._ConvNd):
            return LayerKind.CONV
        return LayerKind.OTHER

    def shape(self, rows: int = 0) -> LayerShape:
        if self.kind is LayerKind.FC:
            m, n = self.module.weight.shape
            return LayerShape(self.name, LayerKind.FC, m, n, rows=rows, bias=self.module.bias is not None)
        if self.kind is LayerKind.EMBEDDING:
            vocab, width = self.module.weight.shape
            return LayerShape(self.name, LayerKind.EMBEDDING, vocab, width, rows=rows)
        total = sum(p.numel() for _, p in self.params)
        return LayerShape(self.name, self.kind, total, 1)


def discover(model: nn.Module) -> list:
    """The model's layers in module order, each trainable parameter in exactly one of them."""
    seen: dict = {}
    users: dict = {}
    for _, module in model.named_modules():
        for p in module.parameters(recurse=False):
            users[id(p)] = users.get(id(p), 0) + 1
    layers = []
    for name, module in model.named_modules():
        own = []
        for pname, p in module.named_parameters(recurse=False):
            if not p.requires_grad or id(p) in seen:
                continue
            seen[id(p)] = True
            own.append((f"{name}.{pname}" if name else pname, p))
        if not own:
            continue
        factorable = (
            isinstance(module, nn.Linear)
            and module.weight.dtype is torch.float32
            and module.weight.requires_grad
            and users[id(module.weight)] == 1
            and (module.bias is None or (module.bias.requires_grad and users[id(module.bias)] == 1))
            and len(own) == (2 if module.bias is not None else 1)
        )
        row_sparse = (
            isinstance(module, (nn.Embedding, nn.EmbeddingBag))
            and not module.sparse
            and module.weight.dtype is torch.float32
            and users[id(module.weight)] == 1
            and len(own) == 1
        )
        layers.append(Layer(len(layers), name or "<root>", module, own, factorable=factorable, row_sparse=row_sparse))
    return layers


class _FactoredLinear(torch.autograd.Function):
    """``F.linear`` whose backward keeps the output-gradient rows ``u`` and returns the input's
    gradient only: no weight or bias gradient. The reconstruction from every rank's factors
    yields those, so computing them here too would be a K×M by K×N GEMM per layer per step
    thrown away (a third of the layer's compute)."""

    @staticmethod
    def forward(ctx, x, weight, bias, capture, call):
        ctx.save_for_backward(weight)
        ctx.capture, ctx.call = capture, call
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, g):
        (weight,) = ctx.saved_tensors
        ctx.capture.keep_u(ctx.call, g)
        # Under autocast the output (so g) is in the autocast dtype while the weight is float32.
        grad_x = g.matmul(weight.to(g.dtype)) if ctx.needs_input_grad[0] else None
        return grad_x, None, None, None, None


class FactorCapture:
    """Keeps an ``nn.Linear``'s sufficient factors.

    ``v``: the input rows (K×N), kept in the forward; ``u``: the output-gradient rows (K×M),
    kept in the backward. A module called several times in one forward keeps the rows of every
    call, paired call by call, so ``sum u^T v`` is still its whole gradient.

    A plain ``nn.Linear`` runs, while capturing, through :class:`_FactoredLinear`: autograd then
    computes no weight gradient at all. A subclass with a forward of its own keeps it, and its
    factors come from hooks (autograd's weight gradient is computed, unused).
    """

    def __init__(self, layer: Layer, on_ready: Callable[[Layer], None]) -> None:
        self.layer = layer
        self.on_ready = on_ready
        self.enabled = False
        self.alongside = False  # factors kept beside autograd's own gradient (the planning step)
        self.rows: list = []
        self._vs: list = []
        self._us: dict = {}
        self._calls = 0
        self._lock = threading.Lock()
        module = layer.module
        self._replaced = type(module).forward is nn.Linear.forward
        if self._replaced:
            module.forward = self._forward  # an instance attribute, shadowing Linear.forward
            self._handle = None
        else:
            self._handle = module.register_forward_hook(self._hooked)

    def reset(self, enabled: bool, alongside: bool = False) -> None:
        """Forget the last step's rows; capture this step's if ``enabled``. ``alongside``: keep
        the factors without reporting the layer ready, and let autograd compute the weight's
        gradient too (the first step, planned once its backward is over, may send either)."""
        self._vs, self._us, self._calls, self.rows = [], {}, 0, []
        self.enabled, self.alongside = enabled, enabled and alongside

    def _capturing(self, x: torch.Tensor, grad_flows: bool) -> Optional[int]:
        """Count the call's rows; if its factors are wanted, keep v and return the call number."""
        module = self.layer.module
        n = module.weight.shape[1]
        self.rows.append(x.numel() // n)
        # A call under torch.no_grad, or with the weight frozen for this step, adds no gradient.
        if not self.enabled or not grad_flows or not module.weight.requires_grad:
            return None
        call = self._calls
        self._calls += 1
        self._vs.append(x.detach().reshape(-1, n))
        return call

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        module = self.layer.module
        call = self._capturing(x, torch.is_grad_enabled())
        if call is None:
            return F.linear(x, module.weight, module.bias)
        if self.alongside:
            out = F.linear(x, module.weight, module.bias)
            out.register_hook(lambda g: self.keep_u(call, g))
            return out
        return _FactoredLinear.apply(x, module.weight, module.bias, self, call)

    def _hooked(self, module: nn.Module, inputs, output) -> None:
        call = self._capturing(inputs[0], output.requires_grad)
        if call is not None:
            output.register_hook(lambda g: self.keep_u(call, g))

    def keep_u(self, call: int, g: torch.Tensor) -> None:
        """The backward reached call ``call``: keep its output-gradient rows (backward's thread)."""
        with self._lock:
            self._us[call] = g.detach().reshape(-1, self.layer.module.weight.shape[0])
            done = len(self._us) == self._calls
        if done and not self.alongside:
            self.on_ready(self.layer)

    def factors(self) -> tuple:
        """``(u, v)``: all calls' rows, contiguous float32, in call order."""
        us = [self._us[i] for i in range(self._calls)]
        u = torch.cat(us) if len(us) > 1 else us[0]
        v = torch.cat(self._vs) if len(self._vs) > 1 else self._vs[0]
        return u.contiguous(), v.contiguous()

    @property
    def captured(self) -> bool:
        return self._calls > 0 and len(self._us) == self._calls

    def remove(self) -> None:
        if self._replaced:
            del self.layer.module.forward
        elif self._handle is not None:
            self._handle.remove()


class GradReady:
    """Post-accumulate-grad hooks on a layer's parameters: the layer is ready once all have fired."""

    def __init__(self, layer: Layer, on_ready: Callable[[Layer], None]) -> None:
        self.layer = layer
        self.on_ready = on_ready
        self.enabled = False
        self._fired: set = set()
        self._lock = threading.Lock()
        self._handles = [p.register_post_accumulate_grad_hook(self._hook) for _, p in layer.params]

    def reset(self, enabled: bool) -> None:
        """Forget the last step's hooks; report this step's if ``enabled``."""
        self._fired = set()
        self.enabled = enabled

    def rearm(self) -> None:
        """Forget the hooks of the backward passes so far (accumulated without a sync): the
        next backward reports the layer once all its parameters are in again."""
        with self._lock:
            self._fired = set()

    def _hook(self, param: torch.Tensor) -> None:
        if not self.enabled:
            return
        with self._lock:
            self._fired.add(id(param))
            done = len(self._fired) == len(self.layer.params)
        if done:
            self.on_ready(self.layer)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


class TokenCount:
    """A forward pre-hook on an embedding that keeps the tokens it is called with: their distinct
    count is the rows its gradient can have."""

    def __init__(self, layer: Layer) -> None:
        self.layer = layer
        self._seen: list = []
        self._handle = layer.module.register_forward_pre_hook(self._hook)

    def _hook(self, module: nn.Module, inputs) -> None:
        self._seen.append(inputs[0].detach().reshape(-1))

    @property
    def rows(self) -> int:
        return int(torch.cat(self._seen).unique().numel()) if self._seen else 0

    def remove(self) -> None:
        self._handle.remove()
