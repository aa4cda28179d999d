"""Four small CNNs (80k to 340k parameters) with FedClassAvg's 512-d ``fcin`` and shared head: for
fast heterogeneous runs (the ``fca_cnn`` federation)."""

from __future__ import annotations

from torch import nn

from fedhet.models.base import SplitModel
from fedhet.models.hetero.parts import conv_relu, finish, global_pool, require_min_size


def fca_cnn_a(in_channels: int, num_classes: int, image_size: int, split: str,
              relu_features: bool = False) -> SplitModel:
    """Small CNN A (about 80k parameters): two 5x5 convs, 2x2 average map, 128 -> 512.

    conv1(in->16, 5x5 same)+ReLU+pool2 -> conv2(16->32, 5x5 same)+ReLU+pool2 -> pool (adaptive
    average to 2x2, flatten: 128) -> fcin = Linear(128, 512) -> classifier.
    """
    require_min_size("fca_cnn_a", image_size, 4)
    stages: list[tuple[str, nn.Module]] = [
        ("conv1", conv_relu(in_channels, 16, 5, pool=True)),
        ("conv2", conv_relu(16, 32, 5, pool=True)),
        ("pool", nn.Sequential(nn.AdaptiveAvgPool2d(2), nn.Flatten())),
    ]
    return finish(stages, 32 * 2 * 2, num_classes, in_channels, image_size, split, relu_features)


def fca_cnn_b(in_channels: int, num_classes: int, image_size: int, split: str,
              relu_features: bool = False) -> SplitModel:
    """Small CNN B (about 160k parameters): three 3x3 convs doubling the width, global pool.

    conv1(in->32)+ReLU+pool2 -> conv2(32->64)+ReLU+pool2 -> conv3(64->128)+ReLU+pool2 (3x3 same
    convs) -> pool (global average: 128) -> fcin = Linear(128, 512) -> classifier.
    """
    require_min_size("fca_cnn_b", image_size, 8)
    stages: list[tuple[str, nn.Module]] = [
        ("conv1", conv_relu(in_channels, 32, 3, pool=True)),
        ("conv2", conv_relu(32, 64, 3, pool=True)),
        ("conv3", conv_relu(64, 128, 3, pool=True)),
        ("pool", global_pool()),
    ]
    return finish(stages, 128, num_classes, in_channels, image_size, split, relu_features)


def fca_cnn_c(in_channels: int, num_classes: int, image_size: int, split: str,
              relu_features: bool = False) -> SplitModel:
    """Small CNN C (about 100k parameters): four 3x3 convs in two VGG-style pairs, global pool.

    conv1(in->32)+ReLU -> conv2(32->32)+ReLU+pool2 -> conv3(32->64)+ReLU -> conv4(64->64)+ReLU
    +pool2 (3x3 same convs) -> pool (global average: 64) -> fcin = Linear(64, 512) -> classifier.
    """
    require_min_size("fca_cnn_c", image_size, 4)
    stages: list[tuple[str, nn.Module]] = [
        ("conv1", conv_relu(in_channels, 32, 3, pool=False)),
        ("conv2", conv_relu(32, 32, 3, pool=True)),
        ("conv3", conv_relu(32, 64, 3, pool=False)),
        ("conv4", conv_relu(64, 64, 3, pool=True)),
        ("pool", global_pool()),
    ]
    return finish(stages, 64, num_classes, in_channels, image_size, split, relu_features)


def fca_cnn_d(in_channels: int, num_classes: int, image_size: int, split: str,
              relu_features: bool = False) -> SplitModel:
    """Small CNN D (about 340k parameters): two wide 3x3 convs, 2x2 average map, 512 -> 512.

    conv1(in->64)+ReLU+pool2 -> conv2(64->128)+ReLU+pool2 (3x3 same convs) -> pool (adaptive
    average to 2x2, flatten: 512) -> fcin = Linear(512, 512) -> classifier.
    """
    require_min_size("fca_cnn_d", image_size, 4)
    stages: list[tuple[str, nn.Module]] = [
        ("conv1", conv_relu(in_channels, 64, 3, pool=True)),
        ("conv2", conv_relu(64, 128, 3, pool=True)),
        ("pool", nn.Sequential(nn.AdaptiveAvgPool2d(2), nn.Flatten())),
    ]
    return finish(stages, 128 * 2 * 2, num_classes, in_channels, image_size, split, relu_features)
