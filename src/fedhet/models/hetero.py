"""FedClassAvg's heterogeneous client models (Jang et al., ICPP 2022) as :class:`SplitModel` stages.

Every model here ends its body with a Linear stage ``fcin`` whose 512-d output is the feature,
with NO activation after it, and starts its head with the shared classifier stage
``classifier = Sequential(ReLU(), Linear(512, num_classes))``. The default split is
"classifier", so the head parameters are ``head.classifier.1.weight`` (num_classes x 512) and
``head.classifier.1.bias`` for every architecture: the only tensors FedClassAvg communicates.

Architectures (the authors' ``supcon_utils.define_model`` with ``feat_dim=512``, written here
without torchvision, same layer shapes):

* ``fca_resnet18``: torchvision ResNet-18 (7x7/2 stem conv + 3x3/2 max-pool), global average
  pool, ``fcin = Linear(512, 512)``.
* ``fca_shufflenetv2``: torchvision ShuffleNetV2 x1.0 (stages of 4, 8, 4 units, channels
  24-116-232-464-1024), global average pool, ``fcin = Linear(1024, 512)``.
* ``fca_googlenet``: torchvision GoogLeNet (Inception v1, including torchvision's 3x3 conv in
  the "5x5" branch), ``fcin = Linear(1024, 512)``. The two auxiliary classifiers are left out:
  they hang off inception4a/4d, never feed the main path, and the authors' training uses only
  ``.logits``, so they contribute nothing to FedClassAvg's features or loss.
* ``fca_alexnet``: the authors' custom ``alexnet_mnist(in_ch, 512)`` (three 3x3 convs,
  3x3 adaptive average pool, Linear(2304, 512) + ReLU, then ``fcin = Linear(512, 512)``), the
  same layout for 1x28x28 and 3x32x32 inputs.
* ``fca_cnn_a`` .. ``fca_cnn_d``: four small CNNs of different depth and width (80k to 340k
  parameters) with the same 512-d ``fcin`` and head, for fast heterogeneous runs on CPU.

For 1-channel inputs the stem conv is the authors' FMNIST replacement (ResNet-18 and GoogLeNet:
``Conv2d(1, 64, 7, 2, 3)``; ShuffleNetV2: ``Conv2d(1, 24, 3, 2, 1)``), which the authors swap in
after torchvision's initialisation, so it keeps PyTorch's default init here too. Likewise
``fcin`` keeps PyTorch's default Linear init (the authors replace ``fc`` after construction);
every other layer gets torchvision's init for that model (ResNet: Kaiming-normal fan-out convs;
GoogLeNet: truncated normal, std 0.01; ShuffleNetV2 and AlexNet: PyTorch defaults).

``relu_features=True`` moves the head's ReLU to the end of the body (stage ``feature_relu``; the
head keeps an Identity in its place, so parameter names and logits are unchanged): the features
are then the input of the classifier's Linear, as prototype methods define them (FedProto's
nearest-prototype evaluation needs a one-Linear head on the features). FedClassAvg keeps the
default: its SupCon loss works on the unactivated 512-d output.

Dropout (GoogLeNet: 0.2 after the pool; AlexNet: 0.5 before its first Linear) is an option,
``dropout``, off by default. Pass ``dropout=0.2`` / ``0.5`` for the published layers; their
masks come from each client's own stream (``fedhet.training.dropout``), so such runs are
reproducible for a seed and vectorize.

``norm`` ("bn" default, as published, or "gn" with ``gn_groups``, which must divide every
channel count) applies to the ResNet, ShuffleNetV2 and GoogLeNet, which use BatchNorm; GoogLeNet
keeps torchvision's ``eps=0.001``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from fedhet.models.base import SplitModel
from fedhet.models.resnet import BasicBlock
from fedhet.training.dropout import StreamDropout

FEATURE_DIM = 512
NORMS = ("bn", "gn")
NormFactory = Callable[[int], nn.Module]


# ----------------------------------------------------------------------------------- shared parts


def _classifier(num_classes: int, relu_features: bool = False) -> nn.Sequential:
    """The head every FedClassAvg model shares: ReLU, then Linear(512, num_classes); with
    ``relu_features`` the ReLU sits at the end of the body and the head keeps an Identity in
    its place (same parameter names, same logits)."""
    return nn.Sequential(nn.Identity() if relu_features else nn.ReLU(), nn.Linear(FEATURE_DIM, num_classes))


def _finish(
    stages: list[tuple[str, nn.Module]],
    in_features: int,
    num_classes: int,
    in_channels: int,
    image_size: int,
    split: str,
    relu_features: bool = False,
) -> SplitModel:
    stages.append(("fcin", nn.Linear(in_features, FEATURE_DIM)))
    if relu_features:
        stages.append(("feature_relu", nn.ReLU()))
    stages.append(("classifier", _classifier(num_classes, relu_features)))
    return SplitModel(stages, split, (in_channels, image_size, image_size))


def _require_min_size(name: str, image_size: int, min_size: int) -> None:
    if image_size < min_size:
        raise ValueError(
            f"{name} needs image_size >= {min_size} (got {image_size}): its strided convs and "
            f"pools would shrink a smaller image to nothing"
        )


def _norm_factory(norm: str, gn_groups: int, eps: float = 1e-5) -> NormFactory:
    if norm == "bn":
        return lambda channels: nn.BatchNorm2d(channels, eps=eps)
    if norm == "gn":
        if isinstance(gn_groups, bool) or not isinstance(gn_groups, int) or gn_groups < 1:
            raise ValueError(f"gn_groups must be a positive integer, got {gn_groups!r}")

        def group_norm(channels: int) -> nn.Module:
            if channels % gn_groups:
                raise ValueError(
                    f"gn_groups={gn_groups} must divide every channel count of the model, "
                    f"but a layer has {channels} channels"
                )
            return nn.GroupNorm(gn_groups, channels, eps=eps)

        return group_norm
    raise ValueError(f"unknown norm {norm!r}; valid norms: {', '.join(NORMS)}")


def _dropout(p: float) -> nn.Module:
    """Dropout with masks from the client's stream (``StreamDropout``, an ``nn.Dropout``), or
    ``nn.Identity`` for p == 0."""
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p < 1:
        raise ValueError(f"dropout must be a probability in [0, 1), got {p!r}")
    return StreamDropout(float(p)) if p > 0 else nn.Identity()


def _global_pool() -> nn.Sequential:
    return nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())


def _conv_norm_relu(
    cin: int, cout: int, kernel: int, norm: NormFactory, stride: int = 1, padding: int = 0, groups: int = 1
) -> nn.Sequential:
    return nn.Sequential(
        OrderedDict(
            [
                ("conv", nn.Conv2d(cin, cout, kernel, stride=stride, padding=padding, groups=groups, bias=False)),
                ("norm", norm(cout)),
                ("relu", nn.ReLU()),
            ]
        )
    )


# ------------------------------------------------------------------------------------- ResNet-18


def _init_resnet(module: nn.Module) -> None:
    """torchvision's ResNet init: Kaiming-normal (fan_out, relu) convs, unit-scale norms."""
    for m in module.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


def fca_resnet18(
    in_channels: int,
    num_classes: int,
    image_size: int,
    split: str,
    norm: str = "bn",
    gn_groups: int = 2,
    relu_features: bool = False,
) -> SplitModel:
    """torchvision ResNet-18 + ``fcin = Linear(512, 512)`` + the shared classifier.

    Stages: stem (7x7/2 conv, norm, ReLU, 3x3/2 max-pool), layer1..layer4 (2 BasicBlocks each,
    64-128-256-512 channels), pool (global average + flatten), fcin, classifier. layer4 outputs
    1x1 maps at both sizes (28 -> 14 -> 7 -> 7 -> 4 -> 2 -> 1; 32 -> 16 -> 8 -> 8 -> 4 -> 2 -> 1).
    """
    norm_layer = _norm_factory(norm, gn_groups)
    stem_conv = nn.Conv2d(in_channels, 64, 7, stride=2, padding=3, bias=False)
    stem = nn.Sequential(
        OrderedDict(
            [
                ("conv", stem_conv),
                ("norm", norm_layer(64)),
                ("relu", nn.ReLU()),
                ("maxpool", nn.MaxPool2d(3, stride=2, padding=1)),
            ]
        )
    )
    stages: list[tuple[str, nn.Module]] = [("stem", stem)]
    in_planes = 64
    for i, planes in enumerate((64, 128, 256, 512), start=1):
        blocks = []
        for j in range(2):
            blocks.append(BasicBlock(in_planes, planes, 2 if i > 1 and j == 0 else 1, norm_layer))
            in_planes = planes
        stages.append((f"layer{i}", nn.Sequential(*blocks)))
    stages.append(("pool", _global_pool()))
    for _, stage in stages:
        _init_resnet(stage)
    if in_channels != 3:  # the authors' FMNIST conv1, swapped in after torchvision's init
        stem.conv = nn.Conv2d(in_channels, 64, 7, stride=2, padding=3, bias=False)
    return _finish(stages, 512, num_classes, in_channels, image_size, split, relu_features)


# --------------------------------------------------------------------------------- ShuffleNetV2


def _channel_shuffle(x: Tensor, groups: int) -> Tensor:
    b, c, h, w = x.shape
    return x.reshape(b, groups, c // groups, h, w).transpose(1, 2).reshape(b, c, h, w)


class ShuffleUnit(nn.Module):
    """ShuffleNetV2 unit (torchvision ``InvertedResidual``).

    Stride 1: split the channels in half, pass one half through, transform the other (1x1 conv,
    3x3 depthwise conv, 1x1 conv), concatenate, shuffle. Stride 2: both branches see the whole
    input (branch1: depthwise 3x3/2 + 1x1; branch2 as above with the depthwise conv strided),
    so the map halves and the channels go to ``out_channels``.
    """

    def __init__(self, in_channels: int, out_channels: int, stride: int, norm: NormFactory) -> None:
        super().__init__()
        if stride == 1 and in_channels != out_channels:
            raise ValueError("a stride-1 ShuffleNetV2 unit keeps its channel count")
        self.stride = stride
        half = out_channels // 2
        self.branch1: nn.Module
        if stride > 1:
            self.branch1 = nn.Sequential(
                nn.Conv2d(in_channels, in_channels, 3, stride=stride, padding=1, groups=in_channels, bias=False),
                norm(in_channels),
                nn.Conv2d(in_channels, half, 1, bias=False),
                norm(half),
                nn.ReLU(),
            )
        else:
            self.branch1 = nn.Identity()
        self.branch2 = nn.Sequential(
            nn.Conv2d(in_channels if stride > 1 else half, half, 1, bias=False),
            norm(half),
            nn.ReLU(),
            nn.Conv2d(half, half, 3, stride=stride, padding=1, groups=half, bias=False),
            norm(half),
            nn.Conv2d(half, half, 1, bias=False),
            norm(half),
            nn.ReLU(),
        )

    def forward(self, x: Tensor) -> Tensor:
        if self.stride == 1:
            x1, x2 = x.chunk(2, dim=1)
            out = torch.cat((x1, self.branch2(x2)), dim=1)
        else:
            out = torch.cat((self.branch1(x), self.branch2(x)), dim=1)
        return _channel_shuffle(out, 2)


def fca_shufflenetv2(
    in_channels: int,
    num_classes: int,
    image_size: int,
    split: str,
    norm: str = "bn",
    gn_groups: int = 2,
    relu_features: bool = False,
) -> SplitModel:
    """torchvision ShuffleNetV2 x1.0 + ``fcin = Linear(1024, 512)`` + the shared classifier.

    Stages: stem (3x3/2 conv to 24 channels, norm, ReLU, 3x3/2 max-pool), stage2..stage4 (4, 8,
    4 units to 116, 232, 464 channels, the first of each strided), conv5 (1x1 to 1024, norm,
    ReLU), pool (global average = torchvision's ``x.mean([2, 3])``), fcin, classifier.
    torchvision applies no custom init to ShuffleNetV2, so every layer has PyTorch's default.
    """
    norm_layer = _norm_factory(norm, gn_groups)
    stem = nn.Sequential(
        OrderedDict(
            [
                ("conv", nn.Conv2d(in_channels, 24, 3, stride=2, padding=1, bias=False)),
                ("norm", norm_layer(24)),
                ("relu", nn.ReLU()),
                ("maxpool", nn.MaxPool2d(3, stride=2, padding=1)),
            ]
        )
    )
    stages: list[tuple[str, nn.Module]] = [("stem", stem)]
    channels = 24
    for i, (repeats, out_channels) in enumerate(zip((4, 8, 4), (116, 232, 464)), start=2):
        units = [ShuffleUnit(channels, out_channels, 2, norm_layer)]
        units += [ShuffleUnit(out_channels, out_channels, 1, norm_layer) for _ in range(repeats - 1)]
        stages.append((f"stage{i}", nn.Sequential(*units)))
        channels = out_channels
    stages.append(("conv5", _conv_norm_relu(channels, 1024, 1, norm_layer)))
    stages.append(("pool", _global_pool()))
    return _finish(stages, 1024, num_classes, in_channels, image_size, split, relu_features)


# ------------------------------------------------------------------------------------ GoogLeNet


class Inception(nn.Module):
    """Inception v1 module as torchvision writes it: four branches concatenated.

    1x1 | 1x1 reduce -> 3x3 | 1x1 reduce -> 3x3 (torchvision's stand-in for the paper's 5x5) |
    3x3/1 max-pool -> 1x1 projection; every conv is conv (no bias) + norm + ReLU.
    """

    def __init__(
        self,
        cin: int,
        ch1: int,
        ch3_reduce: int,
        ch3: int,
        ch5_reduce: int,
        ch5: int,
        pool_proj: int,
        norm: NormFactory,
    ) -> None:
        super().__init__()
        self.out_channels = ch1 + ch3 + ch5 + pool_proj
        self.branch1 = _conv_norm_relu(cin, ch1, 1, norm)
        self.branch2 = nn.Sequential(
            _conv_norm_relu(cin, ch3_reduce, 1, norm), _conv_norm_relu(ch3_reduce, ch3, 3, norm, padding=1)
        )
        self.branch3 = nn.Sequential(
            _conv_norm_relu(cin, ch5_reduce, 1, norm), _conv_norm_relu(ch5_reduce, ch5, 3, norm, padding=1)
        )
        self.branch4 = nn.Sequential(
            nn.MaxPool2d(3, stride=1, padding=1, ceil_mode=True), _conv_norm_relu(cin, pool_proj, 1, norm)
        )

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat((self.branch1(x), self.branch2(x), self.branch3(x), self.branch4(x)), dim=1)


# (in, 1x1, 3x3 reduce, 3x3, "5x5" reduce, "5x5", pool proj), torchvision / Szegedy et al. Table 1
_INCEPTIONS: dict[str, tuple[int, int, int, int, int, int, int]] = {
    "3a": (192, 64, 96, 128, 16, 32, 32),
    "3b": (256, 128, 128, 192, 32, 96, 64),
    "4a": (480, 192, 96, 208, 16, 48, 64),
    "4b": (512, 160, 112, 224, 24, 64, 64),
    "4c": (512, 128, 128, 256, 24, 64, 64),
    "4d": (512, 112, 144, 288, 32, 64, 64),
    "4e": (528, 256, 160, 320, 32, 128, 128),
    "5a": (832, 256, 160, 320, 32, 128, 128),
    "5b": (832, 384, 192, 384, 48, 128, 128),
}


def _inceptions(keys: Sequence[str], norm: NormFactory) -> list[tuple[str, nn.Module]]:
    return [(f"inception{k}", Inception(*_INCEPTIONS[k], norm=norm)) for k in keys]


def fca_googlenet(
    in_channels: int,
    num_classes: int,
    image_size: int,
    split: str,
    norm: str = "bn",
    gn_groups: int = 2,
    dropout: float = 0.0,
    relu_features: bool = False,
) -> SplitModel:
    """torchvision GoogLeNet without auxiliary heads + ``fcin = Linear(1024, 512)`` + classifier.

    Stages: stem (7x7/2 conv 64, 3x3/2 max-pool, 1x1 conv 64, 3x3 conv 192, 3x3/2 max-pool; the
    pools use ``ceil_mode=True``), inception3 (3a, 3b, 3x3/2 pool), inception4 (4a..4e, 2x2/2
    pool), inception5 (5a, 5b), pool (global average, flatten, then dropout: torchvision's 0.2
    with ``dropout=0.2``, none by default, see the module docstring), fcin, classifier. Norms are
    BatchNorm with eps 0.001 as torchvision's ``BasicConv2d``; ``transform_input`` is off, as in
    torchvision without pretrained weights. Maps: 28x28 -> 14 -> 7 -> 3 -> 1 entering inception4,
    so inception4/5 run on 1x1 maps at FMNIST size (as in the authors' runs); 32x32 -> ... -> 2x2
    entering inception4, 1x1 entering inception5. The smallest valid input is 15x15.
    """
    _require_min_size("fca_googlenet", image_size, 15)
    norm_layer = _norm_factory(norm, gn_groups, eps=1e-3)
    stem_conv = _conv_norm_relu(in_channels, 64, 7, norm_layer, stride=2, padding=3)
    stem = nn.Sequential(
        OrderedDict(
            [
                ("conv1", stem_conv),
                ("maxpool1", nn.MaxPool2d(3, stride=2, ceil_mode=True)),
                ("conv2", _conv_norm_relu(64, 64, 1, norm_layer)),
                ("conv3", _conv_norm_relu(64, 192, 3, norm_layer, padding=1)),
                ("maxpool2", nn.MaxPool2d(3, stride=2, ceil_mode=True)),
            ]
        )
    )
    stages: list[tuple[str, nn.Module]] = [
        ("stem", stem),
        (
            "inception3",
            nn.Sequential(
                OrderedDict([*_inceptions(("3a", "3b"), norm_layer), ("maxpool", nn.MaxPool2d(3, 2, ceil_mode=True))])
            ),
        ),
        (
            "inception4",
            nn.Sequential(
                OrderedDict(
                    [
                        *_inceptions(("4a", "4b", "4c", "4d", "4e"), norm_layer),
                        ("maxpool", nn.MaxPool2d(2, 2, ceil_mode=True)),
                    ]
                )
            ),
        ),
        ("inception5", nn.Sequential(OrderedDict(_inceptions(("5a", "5b"), norm_layer)))),
        ("pool", nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), _dropout(dropout))),
    ]
    for _, stage in stages:  # torchvision GoogLeNet(init_weights=True)
        for m in stage.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.trunc_normal_(m.weight, mean=0.0, std=0.01, a=-2, b=2)
            elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
    if in_channels != 3:  # the authors' FMNIST conv1.conv, swapped in after torchvision's init
        stem_conv.conv = nn.Conv2d(in_channels, 64, 7, stride=2, padding=3, bias=False)
    return _finish(stages, 1024, num_classes, in_channels, image_size, split, relu_features)


# -------------------------------------------------------------------------------------- AlexNet


def fca_alexnet(
    in_channels: int,
    num_classes: int,
    image_size: int,
    split: str,
    dropout: float = 0.0,
    relu_features: bool = False,
) -> SplitModel:
    """The authors' ``alexnet_mnist(in_channels, 512)`` (hukla/FedClassAvg ``src/models.py``).

    conv1(in->64, 3x3 same)+ReLU+MaxPool(2, stride 1, pad 1) -> conv2(64->128, 3x3 same)+ReLU
    +MaxPool(2, stride 2, pad 1) -> conv3(128->256, 3x3 same)+ReLU -> pool (adaptive average to
    3x3, flatten: 2304) -> fc (dropout, Linear(2304, 512), ReLU) -> fcin = Linear(512, 512) (the
    authors' ``fcout``, whose output is the feature) -> classifier. 28x28: 28 -> 29 -> 15 -> 3x3;
    32x32: 32 -> 33 -> 17 -> 3x3. The authors use the same model for 3-channel CIFAR-10.
    The dropout before Linear(2304, 512) is the authors' 0.5 with ``dropout=0.5``, off by
    default (module docstring). PyTorch default init throughout, as the authors'.
    """
    # below 3 the map entering the 3x3 adaptive pool is smaller than 3x3 and cells get repeated
    _require_min_size("fca_alexnet", image_size, 3)
    stages: list[tuple[str, nn.Module]] = [
        (
            "conv1",
            nn.Sequential(nn.Conv2d(in_channels, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2, stride=1, padding=1)),
        ),
        ("conv2", nn.Sequential(nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2, padding=1))),
        ("conv3", nn.Sequential(nn.Conv2d(128, 256, 3, padding=1), nn.ReLU())),
        ("pool", nn.Sequential(nn.AdaptiveAvgPool2d(3), nn.Flatten())),
        ("fc", nn.Sequential(_dropout(dropout), nn.Linear(256 * 3 * 3, 512), nn.ReLU())),
    ]
    return _finish(stages, 512, num_classes, in_channels, image_size, split, relu_features)


# -------------------------------------------------------------------------- small CNN family


def _conv_relu(cin: int, cout: int, kernel: int, pool: bool) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Conv2d(cin, cout, kernel, padding=kernel // 2), nn.ReLU()]
    if pool:
        layers.append(nn.MaxPool2d(2))
    return nn.Sequential(*layers)


def fca_cnn_a(in_channels: int, num_classes: int, image_size: int, split: str,
              relu_features: bool = False) -> SplitModel:
    """Small CNN A (about 80k parameters): two 5x5 convs, 2x2 average map, 128 -> 512.

    conv1(in->16, 5x5 same)+ReLU+pool2 -> conv2(16->32, 5x5 same)+ReLU+pool2 -> pool (adaptive
    average to 2x2, flatten: 128) -> fcin = Linear(128, 512) -> classifier.
    """
    _require_min_size("fca_cnn_a", image_size, 4)
    stages: list[tuple[str, nn.Module]] = [
        ("conv1", _conv_relu(in_channels, 16, 5, pool=True)),
        ("conv2", _conv_relu(16, 32, 5, pool=True)),
        ("pool", nn.Sequential(nn.AdaptiveAvgPool2d(2), nn.Flatten())),
    ]
    return _finish(stages, 32 * 2 * 2, num_classes, in_channels, image_size, split, relu_features)


def fca_cnn_b(in_channels: int, num_classes: int, image_size: int, split: str,
              relu_features: bool = False) -> SplitModel:
    """Small CNN B (about 160k parameters): three 3x3 convs doubling the width, global pool.

    conv1(in->32)+ReLU+pool2 -> conv2(32->64)+ReLU+pool2 -> conv3(64->128)+ReLU+pool2 (3x3 same
    convs) -> pool (global average: 128) -> fcin = Linear(128, 512) -> classifier.
    """
    _require_min_size("fca_cnn_b", image_size, 8)
    stages: list[tuple[str, nn.Module]] = [
        ("conv1", _conv_relu(in_channels, 32, 3, pool=True)),
        ("conv2", _conv_relu(32, 64, 3, pool=True)),
        ("conv3", _conv_relu(64, 128, 3, pool=True)),
        ("pool", _global_pool()),
    ]
    return _finish(stages, 128, num_classes, in_channels, image_size, split, relu_features)


def fca_cnn_c(in_channels: int, num_classes: int, image_size: int, split: str,
              relu_features: bool = False) -> SplitModel:
    """Small CNN C (about 100k parameters): four 3x3 convs in two VGG-style pairs, global pool.

    conv1(in->32)+ReLU -> conv2(32->32)+ReLU+pool2 -> conv3(32->64)+ReLU -> conv4(64->64)+ReLU
    +pool2 (3x3 same convs) -> pool (global average: 64) -> fcin = Linear(64, 512) -> classifier.
    """
    _require_min_size("fca_cnn_c", image_size, 4)
    stages: list[tuple[str, nn.Module]] = [
        ("conv1", _conv_relu(in_channels, 32, 3, pool=False)),
        ("conv2", _conv_relu(32, 32, 3, pool=True)),
        ("conv3", _conv_relu(32, 64, 3, pool=False)),
        ("conv4", _conv_relu(64, 64, 3, pool=True)),
        ("pool", _global_pool()),
    ]
    return _finish(stages, 64, num_classes, in_channels, image_size, split, relu_features)


def fca_cnn_d(in_channels: int, num_classes: int, image_size: int, split: str,
              relu_features: bool = False) -> SplitModel:
    """Small CNN D (about 340k parameters): two wide 3x3 convs, 2x2 average map, 512 -> 512.

    conv1(in->64)+ReLU+pool2 -> conv2(64->128)+ReLU+pool2 (3x3 same convs) -> pool (adaptive
    average to 2x2, flatten: 512) -> fcin = Linear(512, 512) -> classifier.
    """
    _require_min_size("fca_cnn_d", image_size, 4)
    stages: list[tuple[str, nn.Module]] = [
        ("conv1", _conv_relu(in_channels, 64, 3, pool=True)),
        ("conv2", _conv_relu(64, 128, 3, pool=True)),
        ("pool", nn.Sequential(nn.AdaptiveAvgPool2d(2), nn.Flatten())),
    ]
    return _finish(stages, 128 * 2 * 2, num_classes, in_channels, image_size, split, relu_features)


# ------------------------------------------------------------------------- tiny CNN family
# Four architectures that each cost less than cnn2 per sample (4.3M multiply-adds at 28x28), so
# that a FedClassAvg federation of 20 clients runs 100 rounds on one CPU core in about an hour:
# one shallow and wide, one deep and narrow, one with BatchNorm, one mixing 5x5 and 3x3 kernels.


def fca_tiny_a(in_channels: int, num_classes: int, image_size: int, split: str,
               relu_features: bool = False) -> SplitModel:
    """Tiny CNN A, shallow and wide (one conv, about 0.4M parameters; 0.7M multiply-adds at 28x28).

    conv1(in->16, 5x5 same)+ReLU+pool4 -> pool (adaptive average to 7x7, flatten: 784) ->
    fcin = Linear(784, 512) -> classifier.
    """
    _require_min_size("fca_tiny_a", image_size, 4)
    stages: list[tuple[str, nn.Module]] = [
        ("conv1", nn.Sequential(nn.Conv2d(in_channels, 16, 5, padding=2), nn.ReLU(), nn.MaxPool2d(4))),
        ("pool", nn.Sequential(nn.AdaptiveAvgPool2d(7), nn.Flatten())),
    ]
    return _finish(stages, 16 * 7 * 7, num_classes, in_channels, image_size, split, relu_features)


def fca_tiny_b(in_channels: int, num_classes: int, image_size: int, split: str,
               relu_features: bool = False) -> SplitModel:
    """Tiny CNN B, deep and narrow (four 3x3 convs, about 40k parameters; 1.9M multiply-adds).

    conv1(in->16)+ReLU+pool2 -> conv2(16->16)+ReLU -> conv3(16->32)+ReLU+pool2 ->
    conv4(32->32)+ReLU (3x3 same convs) -> pool (global average: 32) -> fcin = Linear(32, 512)
    -> classifier.
    """
    _require_min_size("fca_tiny_b", image_size, 4)
    stages: list[tuple[str, nn.Module]] = [
        ("conv1", _conv_relu(in_channels, 16, 3, pool=True)),
        ("conv2", _conv_relu(16, 16, 3, pool=False)),
        ("conv3", _conv_relu(16, 32, 3, pool=True)),
        ("conv4", _conv_relu(32, 32, 3, pool=False)),
        ("pool", _global_pool()),
    ]
    return _finish(stages, 32, num_classes, in_channels, image_size, split, relu_features)


def fca_tiny_c(in_channels: int, num_classes: int, image_size: int, split: str,
               relu_features: bool = False) -> SplitModel:
    """Tiny CNN C, with BatchNorm (two 3x3 convs, about 75k parameters; 1.1M multiply-adds).

    conv1(in->16, no bias)+BatchNorm+ReLU+pool2 -> conv2(16->32, no bias)+BatchNorm+ReLU+pool2
    (3x3 same convs) -> pool (adaptive average to 2x2, flatten: 128) -> fcin = Linear(128, 512)
    -> classifier. Its BatchNorm statistics stay with the client, as every body parameter does
    under FedClassAvg.
    """
    _require_min_size("fca_tiny_c", image_size, 4)
    norm = _norm_factory("bn", 1)
    stages: list[tuple[str, nn.Module]] = [
        ("conv1", nn.Sequential(_conv_norm_relu(in_channels, 16, 3, norm, padding=1), nn.MaxPool2d(2))),
        ("conv2", nn.Sequential(_conv_norm_relu(16, 32, 3, norm, padding=1), nn.MaxPool2d(2))),
        ("pool", nn.Sequential(nn.AdaptiveAvgPool2d(2), nn.Flatten())),
    ]
    return _finish(stages, 32 * 2 * 2, num_classes, in_channels, image_size, split, relu_features)


def fca_tiny_d(in_channels: int, num_classes: int, image_size: int, split: str,
               relu_features: bool = False) -> SplitModel:
    """Tiny CNN D, a 5x5 then two 3x3 convs (about 50k parameters; 1.9M multiply-adds).

    conv1(in->16, 5x5)+ReLU+pool2 -> conv2(16->32, 3x3)+ReLU+pool2 -> conv3(32->48, 3x3)+ReLU
    (same convs) -> pool (global average: 48) -> fcin = Linear(48, 512) -> classifier.
    """
    _require_min_size("fca_tiny_d", image_size, 4)
    stages: list[tuple[str, nn.Module]] = [
        ("conv1", _conv_relu(in_channels, 16, 5, pool=True)),
        ("conv2", _conv_relu(16, 32, 3, pool=True)),
        ("conv3", _conv_relu(32, 48, 3, pool=False)),
        ("pool", _global_pool()),
    ]
    return _finish(stages, 48, num_classes, in_channels, image_size, split, relu_features)
