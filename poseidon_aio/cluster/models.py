"""Parameter shapes of reference models, for the cost model, the bench and the tests.

Shapes only (no torch): the models the papers evaluate, so the information book and the cost model
can be checked against their figures without building the networks.
"""

from __future__ import annotations

from .manifest import Manifest, ParamSpec


def _conv(name: str, cin: int, cout: int, k: int) -> list:
    return [ParamSpec(f"{name}.weight", (cout, cin, k, k)), ParamSpec(f"{name}.bias", (cout,))]


def _fc(name: str, n_in: int, n_out: int) -> list:
    return [ParamSpec(f"{name}.weight", (n_out, n_in)), ParamSpec(f"{name}.bias", (n_out,))]


def vgg19(classes: int = 1000) -> Manifest:
    """VGG19 (143.7 M parameters with 1000 classes; VGG19-22K with ``classes=21841``)."""
    cfg = [64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M", 512, 512, 512, 512, "M"]
    specs, cin, block, idx = [], 3, 1, 1
    for v in cfg:
        if v == "M":
            block, idx = block + 1, 1
            continue
        specs += _conv(f"conv{block}_{idx}", cin, v, 3)
        cin, idx = v, idx + 1
    specs += _fc("fc6", 512 * 7 * 7, 4096) + _fc("fc7", 4096, 4096) + _fc("fc8", 4096, classes)
    return Manifest(specs)


def alexnet(classes: int = 1000) -> Manifest:
    specs = (
        _conv("conv1", 3, 64, 11)
        + _conv("conv2", 64, 192, 5)
        + _conv("conv3", 192, 384, 3)
        + _conv("conv4", 384, 256, 3)
        + _conv("conv5", 256, 256, 3)
        + _fc("fc6", 256 * 6 * 6, 4096)
        + _fc("fc7", 4096, 4096)
        + _fc("fc8", 4096, classes)
    )
    return Manifest(specs)


def resnet50(classes: int = 1000) -> Manifest:
    """ResNet-50 with its real layer sizes (25.6 M parameters, 161 tensors with batch norm)."""
    specs = [ParamSpec("conv1.weight", (64, 3, 7, 7)), ParamSpec("bn1.weight", (64,)), ParamSpec("bn1.bias", (64,))]
    cin = 64
    for stage, (width, blocks) in enumerate([(64, 3), (128, 4), (256, 6), (512, 3)], start=1):
        for b in range(blocks):
            p = f"layer{stage}.{b}"
            cout = width * 4
            specs += [ParamSpec(f"{p}.conv1.weight", (width, cin, 1, 1)), ParamSpec(f"{p}.bn1.weight", (width,)), ParamSpec(f"{p}.bn1.bias", (width,))]
            specs += [ParamSpec(f"{p}.conv2.weight", (width, width, 3, 3)), ParamSpec(f"{p}.bn2.weight", (width,)), ParamSpec(f"{p}.bn2.bias", (width,))]
            specs += [ParamSpec(f"{p}.conv3.weight", (cout, width, 1, 1)), ParamSpec(f"{p}.bn3.weight", (cout,)), ParamSpec(f"{p}.bn3.bias", (cout,))]
            if b == 0:
                specs += [ParamSpec(f"{p}.downsample.0.weight", (cout, cin, 1, 1)), ParamSpec(f"{p}.downsample.1.weight", (cout,)), ParamSpec(f"{p}.downsample.1.bias", (cout,))]
            cin = cout
    specs += _fc("fc", 2048, classes)
    return Manifest(specs)


PRESETS = {"vgg19": vgg19, "alexnet": alexnet, "resnet50": resnet50}
