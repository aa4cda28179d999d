"""Small CNNs and AlexNet variants used by the seed papers, as :class:`SplitModel` stages.

Each builder takes ``(in_channels, num_classes, image_size, split)``. The flatten size is
computed from ``image_size``, so a model written for 32x32 also runs on 28x28; an image too
small to survive the convs and pools raises ``ValueError`` naming the smallest valid size.

The docstrings below give each paper's layer order. cnn2 and simple_cnn compute their
conv -> ReLU -> max-pool blocks as conv -> max-pool -> ReLU. The two orders give the same values
and the same gradients (ReLU is monotone, so the max of the rectified window is the rectified max,
taken at the same element; where the max is not positive both pass no gradient), and ReLU then
runs on a quarter of the map: a training step in channels_last was 1.06x (cnn2) and 1.14x
(simple_cnn) as fast on an Intel Xeon, level in the default layout
(``benchmarks/results/step_profile_pool_relu_intel.md``). The other models, not measured, keep
their papers' order.
"""

from __future__ import annotations

from torch import nn

from fedhet.models.base import SplitModel
from fedhet.training.dropout import StreamDropout


def _require_min_size(name: str, image_size: int, min_size: int) -> None:
    if image_size < min_size:
        raise ValueError(
            f"{name} needs image_size >= {min_size} (got {image_size}): its convs and "
            f"pools would shrink a smaller image to nothing"
        )


def _two_conv_side(image_size: int) -> int:
    """Side of the map after two (unpadded 5x5 conv, 2x2 max-pool) blocks."""
    return ((image_size - 4) // 2 - 4) // 2


def cnn2(in_channels: int, num_classes: int, image_size: int, split: str) -> SplitModel:
    """McMahan et al. 2017 FedAvg "CNN"; = PFLlib ``FedAvgCNN`` = FedReMa ``FedAvgCNN``.

    conv1(in->32, 5x5)+ReLU+pool2 -> conv2(32->64, 5x5)+ReLU+pool2 -> flatten (1024 at
    28x28, 1600 at 32x32) -> fc1(->512)+ReLU -> fc2(512->C).
    Split "fc2": 512-d post-ReLU features (FedCME, FedFM on FMNIST). Split "fc1": head =
    fc1+fc2 on 1024-d features (FedReMa's FMNIST classifier).
    """
    _require_min_size("cnn2", image_size, 16)
    side = _two_conv_side(image_size)
    stages = [
        ("conv1", nn.Sequential(nn.Conv2d(in_channels, 32, 5), nn.MaxPool2d(2), nn.ReLU())),
        (
            "conv2",
            nn.Sequential(nn.Conv2d(32, 64, 5), nn.MaxPool2d(2), nn.ReLU(), nn.Flatten()),
        ),
        ("fc1", nn.Sequential(nn.Linear(64 * side * side, 512), nn.ReLU())),
        ("fc2", nn.Linear(512, num_classes)),
    ]
    return SplitModel(stages, split, (in_channels, image_size, image_size))


def simple_cnn(in_channels: int, num_classes: int, image_size: int, split: str) -> SplitModel:
    """FedNH / FedROD ``Conv2Cifar`` (Chen & Chao), Yutong-Dai/FedNH ``models/CNN.py``.

    conv1(in->64, 5x5)+ReLU+pool2 -> conv2(64->64, 5x5)+ReLU+pool2 -> flatten (64*5*5 at
    32x32, 64*4*4 at 28x28) -> fc1(->384)+ReLU -> fc2(384->192)+ReLU -> fc3(192->C, no bias).
    fc3 is FedNH's bias-free "prototype" layer; default split "fc3" (192-d features).
    """
    _require_min_size("simple_cnn", image_size, 16)
    side = _two_conv_side(image_size)
    stages = [
        ("conv1", nn.Sequential(nn.Conv2d(in_channels, 64, 5), nn.MaxPool2d(2), nn.ReLU())),
        (
            "conv2",
            nn.Sequential(nn.Conv2d(64, 64, 5), nn.MaxPool2d(2), nn.ReLU(), nn.Flatten()),
        ),
        ("fc1", nn.Sequential(nn.Linear(64 * side * side, 384), nn.ReLU())),
        ("fc2", nn.Sequential(nn.Linear(384, 192), nn.ReLU())),
        ("fc3", nn.Linear(192, num_classes, bias=False)),
    ]
    return SplitModel(stages, split, (in_channels, image_size, image_size))


def alexnet_cifar(in_channels: int, num_classes: int, image_size: int, split: str) -> SplitModel:
    """FedLab ``AlexNet_CIFAR10`` (FedCME's CIFAR-10 model); dropout left out as in FedLab.

    conv1(in->64, 3x3, s2, p1)+ReLU+pool2 -> conv2(64->192, p1)+ReLU+pool2 ->
    conv3(192->384)+ReLU -> conv4(384->256)+ReLU -> conv5(256->256)+ReLU+pool2 -> flatten
    (256*2*2 = 1024 at 32x32) -> fc1(->4096)+ReLU -> fc2(4096->4096)+ReLU -> fc3(4096->C).
    Default split "fc3" (4096-d features); "fc1" and "fc2" are also meaningful.
    """
    _require_min_size("alexnet_cifar", image_size, 15)
    side = ((image_size - 1) // 2 + 1) // 2 // 2 // 2
    stages = [
        (
            "conv1",
            nn.Sequential(
                nn.Conv2d(in_channels, 64, 3, stride=2, padding=1), nn.ReLU(), nn.MaxPool2d(2)
            ),
        ),
        ("conv2", nn.Sequential(nn.Conv2d(64, 192, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))),
        ("conv3", nn.Sequential(nn.Conv2d(192, 384, 3, padding=1), nn.ReLU())),
        ("conv4", nn.Sequential(nn.Conv2d(384, 256, 3, padding=1), nn.ReLU())),
        (
            "conv5",
            nn.Sequential(
                nn.Conv2d(256, 256, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten()
            ),
        ),
        ("fc1", nn.Sequential(nn.Linear(256 * side * side, 4096), nn.ReLU())),
        ("fc2", nn.Sequential(nn.Linear(4096, 4096), nn.ReLU())),
        ("fc3", nn.Linear(4096, num_classes)),
    ]
    return SplitModel(stages, split, (in_channels, image_size, image_size))


def alexnet_fedrema(
    in_channels: int, num_classes: int, image_size: int, split: str
) -> SplitModel:
    """FedReMa simplified AlexNet, liangh68/FedReMa ``system/flcore/trainmodel/alexnet.py``.

    conv1(in->32, 3x3, p1)-pool2-ReLU -> conv2(32->64)-pool2-ReLU -> conv3(64->128) ->
    conv4(128->256) -> conv5(256->256)-MaxPool(3, 2)-ReLU (no ReLU between the last three
    convs) -> flatten (256*3*3 = 2304 at 32x32) -> fc1(->1024) -> fc2(1024->512) ->
    fc3(512->C), with no nonlinearity between the linears, as in FedReMa.
    Default split "fc1": FedReMa's classifier is all three linears (2304-d features).
    """
    _require_min_size("alexnet_fedrema", image_size, 12)
    side = (image_size // 2 // 2 - 3) // 2 + 1
    stages = [
        (
            "conv1",
            nn.Sequential(nn.Conv2d(in_channels, 32, 3, padding=1), nn.MaxPool2d(2), nn.ReLU()),
        ),
        ("conv2", nn.Sequential(nn.Conv2d(32, 64, 3, padding=1), nn.MaxPool2d(2), nn.ReLU())),
        ("conv3", nn.Conv2d(64, 128, 3, padding=1)),
        ("conv4", nn.Conv2d(128, 256, 3, padding=1)),
        (
            "conv5",
            nn.Sequential(
                nn.Conv2d(256, 256, 3, padding=1),
                nn.MaxPool2d(3, stride=2),
                nn.ReLU(),
                nn.Flatten(),
            ),
        ),
        ("fc1", nn.Linear(256 * side * side, 1024)),
        ("fc2", nn.Linear(1024, 512)),
        ("fc3", nn.Linear(512, num_classes)),
    ]
    return SplitModel(stages, split, (in_channels, image_size, image_size))


def pfl_cnn(in_channels: int, num_classes: int, image_size: int, split: str) -> SplitModel:
    """The small CNN of the cross-device CIFAR-10 benchmark of pfl-research (Granqvist et al.,
    "pfl-research: simulation framework for accelerating research in Private Federated Learning",
    NeurIPS 2024, Sec. 4.1; their ``simple_cnn``).

    conv1(in->32, 3x3)+ReLU -> conv2(32->64, 3x3)+ReLU+pool2 -> dropout 0.25 -> flatten (64*14*14
    at 32x32) -> fc1(->128)+ReLU -> dropout 0.5 -> fc2(128->C); Glorot-uniform weights, as theirs.
    Default split "fc2": the head is the second dropout and fc2 on the 128-d features. The dropout
    masks come from each client's stream (:class:`fedhet.training.dropout.StreamDropout`).
    """
    _require_min_size("pfl_cnn", image_size, 6)
    side = (image_size - 4) // 2
    stages = [
        ("conv1", nn.Sequential(nn.Conv2d(in_channels, 32, 3), nn.ReLU())),
        ("conv2", nn.Sequential(nn.Conv2d(32, 64, 3), nn.ReLU(), nn.MaxPool2d(2), StreamDropout(0.25), nn.Flatten())),
        ("fc1", nn.Sequential(nn.Linear(64 * side * side, 128), nn.ReLU())),
        ("fc2", nn.Sequential(StreamDropout(0.5), nn.Linear(128, num_classes))),
    ]
    model = SplitModel(stages, split, (in_channels, image_size, image_size))
    for m in model.modules():
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            nn.init.xavier_uniform_(m.weight)
    return model
