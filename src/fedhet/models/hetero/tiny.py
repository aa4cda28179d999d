"""Four tiny CNNs, each cheaper than cnn2 per sample (4.3M multiply-adds at 28x28), with FedClassAvg's
512-d ``fcin`` and shared head, so that a federation of 20 clients (``fca_tiny``) runs 100 rounds on
one CPU core in about an hour: one shallow and wide, one deep and narrow, one with BatchNorm, one
mixing 5x5 and 3x3 kernels."""

from __future__ import annotations

from torch import nn

from fedhet.models.base import SplitModel
from fedhet.models.hetero.parts import conv_norm_relu, conv_relu, finish, global_pool, norm_factory, require_min_size


def fca_tiny_a(in_channels: int, num_classes: int, image_size: int, split: str,
               relu_features: bool = False) -> SplitModel:
    """Tiny CNN A, shallow and wide (one conv, about 0.4M parameters; 0.7M multiply-adds at 28x28).

    conv1(in->16, 5x5 same)+ReLU+pool4 -> pool (adaptive average to 7x7, flatten: 784) ->
    fcin = Linear(784, 512) -> classifier.
    """
    require_min_size("fca_tiny_a", image_size, 4)
    stages: list[tuple[str, nn.Module]] = [
        ("conv1", nn.Sequential(nn.Conv2d(in_channels, 16, 5, padding=2), nn.ReLU(), nn.MaxPool2d(4))),
        ("pool", nn.Sequential(nn.AdaptiveAvgPool2d(7), nn.Flatten())),
    ]
    return finish(stages, 16 * 7 * 7, num_classes, in_channels, image_size, split, relu_features)


def fca_tiny_b(in_channels: int, num_classes: int, image_size: int, split: str,
               relu_features: bool = False) -> SplitModel:
    """Tiny CNN B, deep and narrow (four 3x3 convs, about 40k parameters; 1.9M multiply-adds).

    conv1(in->16)+ReLU+pool2 -> conv2(16->16)+ReLU -> conv3(16->32)+ReLU+pool2 ->
    conv4(32->32)+ReLU (3x3 same convs) -> pool (global average: 32) -> fcin = Linear(32, 512)
    -> classifier.
    """
    require_min_size("fca_tiny_b", image_size, 4)
    stages: list[tuple[str, nn.Module]] = [
        ("conv1", conv_relu(in_channels, 16, 3, pool=True)),
        ("conv2", conv_relu(16, 16, 3, pool=False)),
        ("conv3", conv_relu(16, 32, 3, pool=True)),
        ("conv4", conv_relu(32, 32, 3, pool=False)),
        ("pool", global_pool()),
    ]
    return finish(stages, 32, num_classes, in_channels, image_size, split, relu_features)


def fca_tiny_c(in_channels: int, num_classes: int, image_size: int, split: str,
               relu_features: bool = False) -> SplitModel:
    """Tiny CNN C, with BatchNorm (two 3x3 convs, about 75k parameters; 1.1M multiply-adds).

    conv1(in->16, no bias)+BatchNorm+ReLU+pool2 -> conv2(16->32, no bias)+BatchNorm+ReLU+pool2
    (3x3 same convs) -> pool (adaptive average to 2x2, flatten: 128) -> fcin = Linear(128, 512)
    -> classifier. Its BatchNorm statistics stay with the client, as every body parameter does
    under FedClassAvg.
    """
    require_min_size("fca_tiny_c", image_size, 4)
    norm = norm_factory("bn", 1)
    stages: list[tuple[str, nn.Module]] = [
        ("conv1", nn.Sequential(conv_norm_relu(in_channels, 16, 3, norm, padding=1), nn.MaxPool2d(2))),
        ("conv2", nn.Sequential(conv_norm_relu(16, 32, 3, norm, padding=1), nn.MaxPool2d(2))),
        ("pool", nn.Sequential(nn.AdaptiveAvgPool2d(2), nn.Flatten())),
    ]
    return finish(stages, 32 * 2 * 2, num_classes, in_channels, image_size, split, relu_features)


def fca_tiny_d(in_channels: int, num_classes: int, image_size: int, split: str,
               relu_features: bool = False) -> SplitModel:
    """Tiny CNN D, a 5x5 then two 3x3 convs (about 50k parameters; 1.9M multiply-adds).

    conv1(in->16, 5x5)+ReLU+pool2 -> conv2(16->32, 3x3)+ReLU+pool2 -> conv3(32->48, 3x3)+ReLU
    (same convs) -> pool (global average: 48) -> fcin = Linear(48, 512) -> classifier.
    """
    require_min_size("fca_tiny_d", image_size, 4)
    stages: list[tuple[str, nn.Module]] = [
        ("conv1", conv_relu(in_channels, 16, 5, pool=True)),
        ("conv2", conv_relu(16, 32, 3, pool=True)),
        ("conv3", conv_relu(32, 48, 3, pool=False)),
        ("pool", global_pool()),
    ]
    return finish(stages, 48, num_classes, in_channels, image_size, split, relu_features)
