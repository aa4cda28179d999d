"""ResNet-18/34/50 (He et al. 2016, torchvision layout) as :class:`SplitModel` stages.

Stages: stem, layer1..layer4, pool (global average pool + flatten), fc. Default split "fc":
features are the 512-d (ResNet-50: 2048-d) post-ReLU pooled vector, as FedFM's f_mid and
FedClassAvg's extractor input. Any other stage may be the split; the feature is then the
flattened map entering that stage.

``stem="imagenet"`` is torchvision's 7x7/stride-2 conv + 3x3/stride-2 max-pool (FedFM
``resnet18_7``, FedClassAvg); ``stem="cifar"`` is a 3x3/stride-1 conv without max-pool
(FedFM ``resnet18``, "v2"). ``norm="gn"`` replaces every BatchNorm by
``GroupNorm(gn_groups, C)``; the default of 2 groups follows the FL practice of Hsieh et al.
2020 and Reddi et al. 2021 (GroupNorm keeps no running statistics, so nothing depends on a
client's batch statistics). ``fc_bias=False`` leaves the classifier's bias out, as the FedNH code
base's ``ResNetMod`` does (FedNH's prototypes are a bias-free classifier).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch.nn.functional as F
from torch import Tensor, nn

from fedhet.models.base import SplitModel

STEMS = ("cifar", "imagenet")
NORMS = ("bn", "gn")
NormFactory = Callable[[int], nn.Module]


def _conv3x3(in_planes: int, planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)


def _conv1x1(in_planes: int, planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False)


def _shortcut(in_planes: int, out_planes: int, stride: int, norm: NormFactory) -> nn.Module | None:
    if stride == 1 and in_planes == out_planes:
        return None
    return nn.Sequential(_conv1x1(in_planes, out_planes, stride), norm(out_planes))


class BasicBlock(nn.Module):
    """Two 3x3 convs with an identity (or 1x1 projection) shortcut; ResNet-18/34."""

    expansion = 1

    def __init__(self, in_planes: int, planes: int, stride: int, norm: NormFactory) -> None:
        super().__init__()
        self.conv1 = _conv3x3(in_planes, planes, stride)
        self.norm1 = norm(planes)
        self.conv2 = _conv3x3(planes, planes)
        self.norm2 = norm(planes)
        self.downsample = _shortcut(in_planes, planes, stride, norm)

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = F.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return F.relu(out + identity)


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (carries the stride, torchvision "v1.5"), 1x1 expand by 4; ResNet-50."""

    expansion = 4

    def __init__(self, in_planes: int, planes: int, stride: int, norm: NormFactory) -> None:
        super().__init__()
        out_planes = planes * self.expansion
        self.conv1 = _conv1x1(in_planes, planes)
        self.norm1 = norm(planes)
        self.conv2 = _conv3x3(planes, planes, stride)
        self.norm2 = norm(planes)
        self.conv3 = _conv1x1(planes, out_planes)
        self.norm3 = norm(out_planes)
        self.downsample = _shortcut(in_planes, out_planes, stride, norm)

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = F.relu(self.norm1(self.conv1(x)))
        out = F.relu(self.norm2(self.conv2(out)))
        out = self.norm3(self.conv3(out))
        return F.relu(out + identity)


_DEPTHS: dict[int, tuple[type[BasicBlock] | type[Bottleneck], tuple[int, ...]]] = {
    18: (BasicBlock, (2, 2, 2, 2)),
    34: (BasicBlock, (3, 4, 6, 3)),
    50: (Bottleneck, (3, 4, 6, 3)),
}


def _norm_factory(norm: str, gn_groups: int) -> NormFactory:
    if norm == "bn":
        return nn.BatchNorm2d
    if norm == "gn":
        # every channel count in these ResNets is a multiple of 64
        if not isinstance(gn_groups, int) or gn_groups < 1 or 64 % gn_groups:
            raise ValueError(f"gn_groups must be a positive divisor of 64, got {gn_groups!r}")
        return lambda channels: nn.GroupNorm(gn_groups, channels)
    raise ValueError(f"unknown norm {norm!r}; valid norms: {', '.join(NORMS)}")


def _stem(kind: str, in_channels: int, norm: NormFactory) -> nn.Sequential:
    if kind == "cifar":
        layers = [("conv", _conv3x3(in_channels, 64)), ("norm", norm(64)), ("relu", nn.ReLU())]
    elif kind == "imagenet":
        layers = [
            ("conv", nn.Conv2d(in_channels, 64, 7, stride=2, padding=3, bias=False)),
            ("norm", norm(64)),
            ("relu", nn.ReLU()),
            ("maxpool", nn.MaxPool2d(3, stride=2, padding=1)),
        ]
    else:
        raise ValueError(f"unknown stem {kind!r}; valid stems: {', '.join(STEMS)}")
    return nn.Sequential(OrderedDict(layers))


def resnet(
    depth: int,
    in_channels: int,
    num_classes: int,
    image_size: int,
    split: str,
    norm: str = "bn",
    stem: str = "cifar",
    gn_groups: int = 2,
    fc_bias: bool = True,
) -> SplitModel:
    """ResNet-``depth`` (18, 34 or 50); see the module docstring for stem/norm options."""
    block, blocks = _DEPTHS[depth]
    norm_layer = _norm_factory(norm, gn_groups)
    stages: list[tuple[str, nn.Module]] = [("stem", _stem(stem, in_channels, norm_layer))]
    in_planes = 64
    for i, (planes, n) in enumerate(zip((64, 128, 256, 512), blocks), start=1):
        layer = []
        for j in range(n):
            stride = 2 if i > 1 and j == 0 else 1
            layer.append(block(in_planes, planes, stride, norm_layer))
            in_planes = planes * block.expansion
        stages.append((f"layer{i}", nn.Sequential(*layer)))
    stages.append(("pool", nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())))
    stages.append(("fc", nn.Linear(in_planes, num_classes, bias=fc_bias)))
    for _, stage in stages:
        _init_weights(stage)
    return SplitModel(stages, split, (in_channels, image_size, image_size))


def _init_weights(module: nn.Module) -> None:
    """torchvision's ResNet init: Kaiming-normal (fan_out) convs, unit-scale norms."""
    for m in module.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
