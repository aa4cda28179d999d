"""FedClassAvg's four published client architectures at full size: ResNet-18, ShuffleNetV2 x1.0,
GoogLeNet and the authors' AlexNet variant (the package docstring has their layouts and inits)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from fedhet.models.base import SplitModel
from fedhet.models.hetero.parts import (
    NormFactory,
    conv_norm_relu,
    dropout_layer,
    finish,
    global_pool,
    norm_factory,
    require_min_size,
)
from fedhet.models.resnet import BasicBlock

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
    norm_layer = norm_factory(norm, gn_groups)
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
    stages.append(("pool", global_pool()))
    for _, stage in stages:
        _init_resnet(stage)
    if in_channels != 3:  # the authors' FMNIST conv1, swapped in after torchvision's init
        stem.conv = nn.Conv2d(in_channels, 64, 7, stride=2, padding=3, bias=False)
    return finish(stages, 512, num_classes, in_channels, image_size, split, relu_features)


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
    norm_layer = norm_factory(norm, gn_groups)
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
    stages.append(("conv5", conv_norm_relu(channels, 1024, 1, norm_layer)))
    stages.append(("pool", global_pool()))
    return finish(stages, 1024, num_classes, in_channels, image_size, split, relu_features)


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
        self.branch1 = conv_norm_relu(cin, ch1, 1, norm)
        self.branch2 = nn.Sequential(
            conv_norm_relu(cin, ch3_reduce, 1, norm), conv_norm_relu(ch3_reduce, ch3, 3, norm, padding=1)
        )
        self.branch3 = nn.Sequential(
            conv_norm_relu(cin, ch5_reduce, 1, norm), conv_norm_relu(ch5_reduce, ch5, 3, norm, padding=1)
        )
        self.branch4 = nn.Sequential(
            nn.MaxPool2d(3, stride=1, padding=1, ceil_mode=True), conv_norm_relu(cin, pool_proj, 1, norm)
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
    dropout: float = 0.2,
    relu_features: bool = False,
) -> SplitModel:
    """torchvision GoogLeNet without auxiliary heads + ``fcin = Linear(1024, 512)`` + classifier.

    Stages: stem (7x7/2 conv 64, 3x3/2 max-pool, 1x1 conv 64, 3x3 conv 192, 3x3/2 max-pool; the
    pools use ``ceil_mode=True``), inception3 (3a, 3b, 3x3/2 pool), inception4 (4a..4e, 2x2/2
    pool), inception5 (5a, 5b), pool (global average, flatten, then torchvision's dropout of 0.2;
    ``dropout=0`` leaves it out), fcin, classifier. Norms are BatchNorm with eps 0.001 as
    torchvision's ``BasicConv2d``; ``transform_input`` is off, as in torchvision without
    pretrained weights. Maps: 28x28 -> 14 -> 7 -> 3 -> 1 entering inception4,
    so inception4/5 run on 1x1 maps at FMNIST size (as in the authors' runs); 32x32 -> ... -> 2x2
    entering inception4, 1x1 entering inception5. The smallest valid input is 15x15.
    """
    require_min_size("fca_googlenet", image_size, 15)
    norm_layer = norm_factory(norm, gn_groups, eps=1e-3)
    stem_conv = conv_norm_relu(in_channels, 64, 7, norm_layer, stride=2, padding=3)
    stem = nn.Sequential(
        OrderedDict(
            [
                ("conv1", stem_conv),
                ("maxpool1", nn.MaxPool2d(3, stride=2, ceil_mode=True)),
                ("conv2", conv_norm_relu(64, 64, 1, norm_layer)),
                ("conv3", conv_norm_relu(64, 192, 3, norm_layer, padding=1)),
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
        ("pool", nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), dropout_layer(dropout))),
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
    return finish(stages, 1024, num_classes, in_channels, image_size, split, relu_features)


# -------------------------------------------------------------------------------------- AlexNet


def fca_alexnet(
    in_channels: int,
    num_classes: int,
    image_size: int,
    split: str,
    dropout: float = 0.5,
    relu_features: bool = False,
) -> SplitModel:
    """The authors' ``alexnet_mnist(in_channels, 512)`` (hukla/FedClassAvg ``src/models.py``).

    conv1(in->64, 3x3 same)+ReLU+MaxPool(2, stride 1, pad 1) -> conv2(64->128, 3x3 same)+ReLU
    +MaxPool(2, stride 2, pad 1) -> conv3(128->256, 3x3 same)+ReLU -> pool (adaptive average to
    3x3, flatten: 2304) -> fc (dropout, Linear(2304, 512), ReLU) -> fcin = Linear(512, 512) (the
    authors' ``fcout``, whose output is the feature) -> classifier. 28x28: 28 -> 29 -> 15 -> 3x3;
    32x32: 32 -> 33 -> 17 -> 3x3. The authors use the same model for 3-channel CIFAR-10.
    The dropout before Linear(2304, 512) is the authors' 0.5 (``dropout=0`` leaves it out).
    PyTorch default init throughout, as the authors'.
    """
    # below 3 the map entering the 3x3 adaptive pool is smaller than 3x3 and cells get repeated
    require_min_size("fca_alexnet", image_size, 3)
    stages: list[tuple[str, nn.Module]] = [
        (
            "conv1",
            nn.Sequential(nn.Conv2d(in_channels, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2, stride=1, padding=1)),
        ),
        ("conv2", nn.Sequential(nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2, padding=1))),
        ("conv3", nn.Sequential(nn.Conv2d(128, 256, 3, padding=1), nn.ReLU())),
        ("pool", nn.Sequential(nn.AdaptiveAvgPool2d(3), nn.Flatten())),
        ("fc", nn.Sequential(dropout_layer(dropout), nn.Linear(256 * 3 * 3, 512), nn.ReLU())),
    ]
    return finish(stages, 512, num_classes, in_channels, image_size, split, relu_features)
