"""Reference models as shapes and FLOPs: the papers' networks, without torch.

Each model is one list of its parameter-owning layers in forward order (what the trainer calls a
layer: a module with parameters of its own — a convolution, a batch norm, a fully-connected
layer), with every parameter's shape and the layer's forward FLOPs per sample. From that one list
come both the manifest (:func:`vgg19`, :func:`resnet50`, ...: what the information book and the
cost model read) and the per-layer trace (:func:`trace`: what the simulator and the trace-driven
emulation replay), so the two can never disagree.

FLOPs count a multiply-add as 2: a convolution is ``2 C_in C_out k_h k_w H_out W_out``, a
fully-connected layer ``2 N M``, a batch norm 8 per element (normalize, scale, shift and the
statistics). Layers without parameters (ReLU, pooling, the residual additions) are not counted:
under 2 % of any of these models' FLOPs.

=============  ===========================  =================  ==========================
model          parameters (ours)            the papers' count  forward GFLOPs per sample
=============  ===========================  =================  ==========================
vgg19          143 667 240                  143 M (ATC'17)     39.3 (224 x 224)
vgg19_22k      229 052 817 (21 841 classes) 229 M (ATC'17)     39.4
alexnet        61 100 840                   61 M               1.43 (torchvision's)
googlenet      6 998 552 (no auxiliary)     5 M (ATC'17)       3.2
inception_v3   27 161 264 (with AuxLogits)  27 M (ATC'17)      11.5 (299 x 299)
resnet50       25 557 032                   25.6 M             8.3
resnet152      60 192 808                   60.2 M (ATC'17)    23.2
=============  ===========================  =================  ==========================

Inception-V3, ResNet-50 and ResNet-152 are torchvision's layer for layer (the counts are
torchvision's exactly). GoogLeNet is the 2014 network as Caffe's bvlc_googlenet has it (biases,
no batch norm) without its two auxiliary classifiers: 7.0 M parameters, of which the 1000 x 1024
classifier is 1.0 M; the paper's "5 M" is the figure of the GoogLeNet paper, which counts fewer.
"""

from __future__ import annotations

from typing import Callable, Dict, NamedTuple, Sequence, Tuple

from ..errors import ConfigError
from ..cluster.manifest import Manifest, ParamSpec

# Forward FLOPs per element of a batch norm: mean, variance, normalize, scale and shift.
BN_FLOPS_PER_ELEMENT = 8


class TraceLayer(NamedTuple):
    """One parameter-owning layer of a trace: ``(name, [param shapes], forward FLOPs at the batch)``."""

    name: str
    shapes: tuple
    flops: float

    @property
    def params(self) -> int:
        total = 0
        for shape in self.shapes:
            n = 1
            for d in shape:
                n *= d
            total += n
        return total

    @property
    def fully_connected(self) -> bool:
        """A 2-D weight: the layer has sufficient factors (``u`` K x M, ``v`` K x N)."""
        return len(self.shapes[0]) == 2


class Trace(tuple):
    """A model's layers in forward order at one batch size, with the names of their parameters.

    Unpacks as ``(name, shapes, flops)`` triples. ``batch`` is the per-worker batch, which is
    also the rows K a fully-connected layer's sufficient factors have (every FC layer of these
    models sees one row per sample).

    >>> t = trace("vgg19", batch=32)
    >>> len(t), t.batch, t[-1].name, t[-1].shapes
    (19, 32, 'fc8', ((1000, 4096), (1000,)))
    >>> round(t.flops / 32 / 1e9, 1)   # forward GFLOPs per sample
    39.3
    """

    model: str
    batch: int
    leaves: tuple

    def __new__(
        cls, layers: Sequence[TraceLayer], *, model: str, batch: int, leaves: Sequence[Sequence[str]]
    ) -> "Trace":
        self = super().__new__(cls, (TraceLayer(*layer) for layer in layers))
        if len(leaves) != len(self) or any(len(names) != len(layer.shapes) for names, layer in zip(leaves, self)):
            raise ConfigError(f"trace {model!r}: every parameter of every layer needs a name")
        self.model = model
        self.batch = batch
        self.leaves = tuple(tuple(names) for names in leaves)
        return self

    @property
    def flops(self) -> float:
        """Forward FLOPs of the whole batch."""
        return float(sum(layer.flops for layer in self))

    @property
    def params(self) -> int:
        return sum(layer.params for layer in self)

    def param_names(self, index: int) -> tuple:
        """Full names of layer ``index``'s parameters (``"fc8.weight"``, ``"fc8.bias"``)."""
        return tuple(f"{self[index].name}.{leaf}" for leaf in self.leaves[index])

    def manifest(self, layers: Sequence[int] = ()) -> Manifest:
        """The parameters of ``layers`` (all by default), in the given order, as a manifest."""
        chosen = layers if layers else range(len(self))
        return Manifest(
            ParamSpec(name, shape) for i in chosen for name, shape in zip(self.param_names(i), self[i].shapes)
        )


class _Net:
    """Collects ``(name, ((leaf, shape), ...), forward FLOPs per sample)`` in forward order."""

    def __init__(self) -> None:
        self.layers: list = []

    def conv(self, name: str, cin: int, cout: int, k, out, *, bias: bool = True) -> None:
        kh, kw = (k, k) if isinstance(k, int) else k
        oh, ow = (out, out) if isinstance(out, int) else out
        params = [("weight", (cout, cin, kh, kw))] + ([("bias", (cout,))] if bias else [])
        self.layers.append((name, tuple(params), 2 * cin * cout * kh * kw * oh * ow))

    def bn(self, name: str, channels: int, out) -> None:
        oh, ow = (out, out) if isinstance(out, int) else out
        self.layers.append(
            (name, (("weight", (channels,)), ("bias", (channels,))), BN_FLOPS_PER_ELEMENT * channels * oh * ow)
        )

    def fc(self, name: str, n_in: int, n_out: int) -> None:
        self.layers.append((name, (("weight", (n_out, n_in)), ("bias", (n_out,))), 2 * n_in * n_out))

    def basic_conv(self, name: str, cin: int, cout: int, k, out) -> None:
        """torchvision's BasicConv2d: a convolution without bias, then a batch norm."""
        self.conv(f"{name}.conv", cin, cout, k, out, bias=False)
        self.bn(f"{name}.bn", cout, out)


# -- the models ------------------------------------------------------------------------------------


def _vgg19(classes: int = 1000) -> list:
    net = _Net()
    cfg = [64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M", 512, 512, 512, 512, "M"]
    cin, block, idx, side = 3, 1, 1, 224
    for v in cfg:
        if v == "M":
            block, idx, side = block + 1, 1, side // 2
            continue
        net.conv(f"conv{block}_{idx}", cin, v, 3, side)
        cin, idx = v, idx + 1
    net.fc("fc6", 512 * 7 * 7, 4096)
    net.fc("fc7", 4096, 4096)
    net.fc("fc8", 4096, classes)
    return net.layers


def _alexnet(classes: int = 1000) -> list:
    # torchvision's AlexNet on 224 x 224: 55, 27, 13, 13, 13 after each convolution.
    net = _Net()
    net.conv("conv1", 3, 64, 11, 55)
    net.conv("conv2", 64, 192, 5, 27)
    net.conv("conv3", 192, 384, 3, 13)
    net.conv("conv4", 384, 256, 3, 13)
    net.conv("conv5", 256, 256, 3, 13)
    net.fc("fc6", 256 * 6 * 6, 4096)
    net.fc("fc7", 4096, 4096)
    net.fc("fc8", 4096, classes)
    return net.layers


def _resnet(blocks: Sequence[int], classes: int = 1000) -> list:
    """torchvision's bottleneck ResNet (v1.5: the stride sits on the 3 x 3 convolution)."""
    net = _Net()
    net.conv("conv1", 3, 64, 7, 112, bias=False)
    net.bn("bn1", 64, 112)
    cin, side = 64, 56  # after the stem's max pool
    for stage, (width, count) in enumerate(zip((64, 128, 256, 512), blocks), start=1):
        out_side = side if stage == 1 else side // 2
        for b in range(count):
            p = f"layer{stage}.{b}"
            cout = width * 4
            in_side = side if b == 0 else out_side
            net.conv(f"{p}.conv1", cin, width, 1, in_side, bias=False)
            net.bn(f"{p}.bn1", width, in_side)
            net.conv(f"{p}.conv2", width, width, 3, out_side, bias=False)
            net.bn(f"{p}.bn2", width, out_side)
            net.conv(f"{p}.conv3", width, cout, 1, out_side, bias=False)
            net.bn(f"{p}.bn3", cout, out_side)
            if b == 0:
                net.conv(f"{p}.downsample.0", cin, cout, 1, out_side, bias=False)
                net.bn(f"{p}.downsample.1", cout, out_side)
            cin = cout
        side = out_side
    net.fc("fc", 2048, classes)
    return net.layers


def _inception_v3(classes: int = 1000, aux: bool = True) -> list:
    """torchvision's Inception-V3 on 299 x 299 (35, 17 and 8 the sides of its three stages)."""
    net = _Net()
    c = net.basic_conv
    c("Conv2d_1a_3x3", 3, 32, 3, 149)
    c("Conv2d_2a_3x3", 32, 32, 3, 147)
    c("Conv2d_2b_3x3", 32, 64, 3, 147)
    c("Conv2d_3b_1x1", 64, 80, 1, 73)
    c("Conv2d_4a_3x3", 80, 192, 3, 71)

    def block_a(name: str, cin: int, pool: int) -> int:
        c(f"{name}.branch1x1", cin, 64, 1, 35)
        c(f"{name}.branch5x5_1", cin, 48, 1, 35)
        c(f"{name}.branch5x5_2", 48, 64, 5, 35)
        c(f"{name}.branch3x3dbl_1", cin, 64, 1, 35)
        c(f"{name}.branch3x3dbl_2", 64, 96, 3, 35)
        c(f"{name}.branch3x3dbl_3", 96, 96, 3, 35)
        c(f"{name}.branch_pool", cin, pool, 1, 35)
        return 64 + 64 + 96 + pool

    def block_c(name: str, c7: int) -> None:
        c(f"{name}.branch1x1", 768, 192, 1, 17)
        c(f"{name}.branch7x7_1", 768, c7, 1, 17)
        c(f"{name}.branch7x7_2", c7, c7, (1, 7), 17)
        c(f"{name}.branch7x7_3", c7, 192, (7, 1), 17)
        c(f"{name}.branch7x7dbl_1", 768, c7, 1, 17)
        c(f"{name}.branch7x7dbl_2", c7, c7, (7, 1), 17)
        c(f"{name}.branch7x7dbl_3", c7, c7, (1, 7), 17)
        c(f"{name}.branch7x7dbl_4", c7, c7, (7, 1), 17)
        c(f"{name}.branch7x7dbl_5", c7, 192, (1, 7), 17)
        c(f"{name}.branch_pool", 768, 192, 1, 17)

    def block_e(name: str, cin: int) -> None:
        c(f"{name}.branch1x1", cin, 320, 1, 8)
        c(f"{name}.branch3x3_1", cin, 384, 1, 8)
        c(f"{name}.branch3x3_2a", 384, 384, (1, 3), 8)
        c(f"{name}.branch3x3_2b", 384, 384, (3, 1), 8)
        c(f"{name}.branch3x3dbl_1", cin, 448, 1, 8)
        c(f"{name}.branch3x3dbl_2", 448, 384, 3, 8)
        c(f"{name}.branch3x3dbl_3a", 384, 384, (1, 3), 8)
        c(f"{name}.branch3x3dbl_3b", 384, 384, (3, 1), 8)
        c(f"{name}.branch_pool", cin, 192, 1, 8)

    cin = block_a("Mixed_5b", 192, 32)
    cin = block_a("Mixed_5c", cin, 64)
    cin = block_a("Mixed_5d", cin, 64)
    c("Mixed_6a.branch3x3", cin, 384, 3, 17)
    c("Mixed_6a.branch3x3dbl_1", cin, 64, 1, 35)
    c("Mixed_6a.branch3x3dbl_2", 64, 96, 3, 35)
    c("Mixed_6a.branch3x3dbl_3", 96, 96, 3, 17)
    for name, c7 in (("Mixed_6b", 128), ("Mixed_6c", 160), ("Mixed_6d", 160), ("Mixed_6e", 192)):
        block_c(name, c7)
    if aux:
        c("AuxLogits.conv0", 768, 128, 1, 5)
        c("AuxLogits.conv1", 128, 768, 5, 1)
        net.fc("AuxLogits.fc", 768, classes)
    c("Mixed_7a.branch3x3_1", 768, 192, 1, 17)
    c("Mixed_7a.branch3x3_2", 192, 320, 3, 8)
    c("Mixed_7a.branch7x7x3_1", 768, 192, 1, 17)
    c("Mixed_7a.branch7x7x3_2", 192, 192, (1, 7), 17)
    c("Mixed_7a.branch7x7x3_3", 192, 192, (7, 1), 17)
    c("Mixed_7a.branch7x7x3_4", 192, 192, 3, 8)
    block_e("Mixed_7b", 1280)
    block_e("Mixed_7c", 2048)
    net.fc("fc", 2048, classes)
    return net.layers


def _googlenet(classes: int = 1000) -> list:
    """GoogLeNet (2014) as Caffe's bvlc_googlenet, without the auxiliary classifiers."""
    net = _Net()
    net.conv("conv1", 3, 64, 7, 112)
    net.conv("conv2_reduce", 64, 64, 1, 56)
    net.conv("conv2", 64, 192, 3, 56)
    # (name, side, 1x1, 3x3 reduce, 3x3, 5x5 reduce, 5x5, pool projection)
    cfg = [
        ("inception_3a", 28, 64, 96, 128, 16, 32, 32),
        ("inception_3b", 28, 128, 128, 192, 32, 96, 64),
        ("inception_4a", 14, 192, 96, 208, 16, 48, 64),
        ("inception_4b", 14, 160, 112, 224, 24, 64, 64),
        ("inception_4c", 14, 128, 128, 256, 24, 64, 64),
        ("inception_4d", 14, 112, 144, 288, 32, 64, 64),
        ("inception_4e", 14, 256, 160, 320, 32, 128, 128),
        ("inception_5a", 7, 256, 160, 320, 32, 128, 128),
        ("inception_5b", 7, 384, 192, 384, 48, 128, 128),
    ]
    cin = 192
    for name, side, b1, r3, b3, r5, b5, pool in cfg:
        net.conv(f"{name}.1x1", cin, b1, 1, side)
        net.conv(f"{name}.3x3_reduce", cin, r3, 1, side)
        net.conv(f"{name}.3x3", r3, b3, 3, side)
        net.conv(f"{name}.5x5_reduce", cin, r5, 1, side)
        net.conv(f"{name}.5x5", r5, b5, 5, side)
        net.conv(f"{name}.pool_proj", cin, pool, 1, side)
        cin = b1 + b3 + b5 + pool
    net.fc("loss3_classifier", 1024, classes)
    return net.layers


_MODELS: Dict[str, Callable[[], list]] = {
    "vgg19": _vgg19,
    "vgg19_22k": lambda: _vgg19(21841),
    "alexnet": _alexnet,
    "googlenet": _googlenet,
    "inception_v3": _inception_v3,
    "resnet50": lambda: _resnet((3, 4, 6, 3)),
    "resnet152": lambda: _resnet((3, 8, 36, 3)),
}

# The batch per worker each model is trained with in ATC'17 (GoogLeNet 128, the others 32).
PAPER_BATCH = {
    "vgg19": 32,
    "vgg19_22k": 32,
    "alexnet": 32,
    "googlenet": 128,
    "inception_v3": 32,
    "resnet50": 32,
    "resnet152": 32,
}


def _manifest(layers: list) -> Manifest:
    return Manifest(ParamSpec(f"{name}.{leaf}", shape) for name, params, _ in layers for leaf, shape in params)


def vgg19(classes: int = 1000) -> Manifest:
    """VGG19 (143.7 M parameters with 1000 classes; VGG19-22K with ``classes=21841``)."""
    return _manifest(_vgg19(classes))


def vgg19_22k() -> Manifest:
    """VGG19 with ImageNet-22K's 21 841-class head: 229.1 M parameters, 89.5 M of them in fc8."""
    return _manifest(_vgg19(21841))


def alexnet(classes: int = 1000) -> Manifest:
    return _manifest(_alexnet(classes))


def googlenet(classes: int = 1000) -> Manifest:
    """GoogLeNet without its auxiliary classifiers: 7.0 M parameters."""
    return _manifest(_googlenet(classes))


def inception_v3(classes: int = 1000, aux: bool = True) -> Manifest:
    """Inception-V3 as torchvision builds it: 27.2 M parameters with AuxLogits, 23.8 M without."""
    return _manifest(_inception_v3(classes, aux))


def resnet50(classes: int = 1000) -> Manifest:
    """ResNet-50 with its real layer sizes (25.6 M parameters, 161 tensors with batch norm)."""
    return _manifest(_resnet((3, 4, 6, 3), classes))


def resnet152(classes: int = 1000) -> Manifest:
    """ResNet-152 with its real layer sizes (60.2 M parameters, 467 tensors with batch norm)."""
    return _manifest(_resnet((3, 8, 36, 3), classes))


PRESETS = {
    "vgg19": vgg19,
    "vgg19_22k": vgg19_22k,
    "alexnet": alexnet,
    "googlenet": googlenet,
    "inception_v3": inception_v3,
    "resnet50": resnet50,
    "resnet152": resnet152,
}


def trace(name: str, batch: int = 32) -> Trace:
    """Per layer in forward order, ``(name, [param shapes], forward FLOPs at batch)``.

    Args:
        name: one of :data:`PRESETS`.
        batch: samples per worker per iteration (each FC layer's K).
    Returns:
        a :class:`Trace` (a tuple of :class:`TraceLayer`; ``.manifest()`` gives its parameters).
    Raises:
        ConfigError: an unknown model or a batch under 1.

    >>> t = trace("resnet50", batch=32)
    >>> len(t), t.params, t[0]
    (107, 25557032, TraceLayer(name='conv1', shapes=((64, 3, 7, 7),), flops=7552892928.0))
    """
    build = _MODELS.get(name)
    if build is None:
        raise ConfigError(f"no model trace named {name!r}; known: {sorted(_MODELS)}")
    if batch < 1:
        raise ConfigError(f"a trace needs a batch of at least 1 sample, got {batch}")
    layers = build()
    return Trace(
        [TraceLayer(n, tuple(shape for _, shape in params), float(batch * flops)) for n, params, flops in layers],
        model=name,
        batch=batch,
        leaves=[[leaf for leaf, _ in params] for _, params, _ in layers],
    )


def trace_of(model: str, layers: Sequence[Tuple[str, Sequence[tuple], float]], batch: int) -> Trace:
    """A trace of your own: ``[(name, [shapes], forward FLOPs at batch)]``; parameters are named
    ``weight``, ``bias``, then ``p2``, ``p3``, ... in each layer.

    >>> t = trace_of("one-fc", [("fc", [(4096, 4096), (4096,)], 2 * 32 * 4096 * 4096)], batch=32)
    >>> t.manifest()[1].name
    'fc.bias'
    """
    leaves = [["weight", "bias", *(f"p{i}" for i in range(2, len(shapes)))][: len(shapes)] for _, shapes, _ in layers]
    return Trace(
        [TraceLayer(n, tuple(tuple(s) for s in shapes), float(f)) for n, shapes, f in layers],
        model=model,
        batch=batch,
        leaves=leaves,
    )
