"""What every FedClassAvg model shares: the 512-d feature stage ``fcin``, the classifier head, the
norm and dropout layers and the input-size check (the package docstring says how they fit)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from torch import nn

from fedhet.models.base import SplitModel
from fedhet.training.dropout import StreamDropout

FEATURE_DIM = 512
NORMS = ("bn", "gn")
NormFactory = Callable[[int], nn.Module]


def classifier(num_classes: int, relu_features: bool = False) -> nn.Sequential:
    """The head every FedClassAvg model shares: ReLU, then Linear(512, num_classes); with
    ``relu_features`` the ReLU sits at the end of the body and the head keeps an Identity in
    its place (same parameter names, same logits)."""
    return nn.Sequential(nn.Identity() if relu_features else nn.ReLU(), nn.Linear(FEATURE_DIM, num_classes))


def finish(
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
    stages.append(("classifier", classifier(num_classes, relu_features)))
    return SplitModel(stages, split, (in_channels, image_size, image_size))


def require_min_size(name: str, image_size: int, min_size: int) -> None:
    if image_size < min_size:
        raise ValueError(
            f"{name} needs image_size >= {min_size} (got {image_size}): its strided convs and "
            f"pools would shrink a smaller image to nothing"
        )


def norm_factory(norm: str, gn_groups: int, eps: float = 1e-5) -> NormFactory:
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


def dropout_layer(p: float) -> nn.Module:
    """Dropout with masks from the client's stream (``StreamDropout``, an ``nn.Dropout``), or
    ``nn.Identity`` for p == 0."""
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p < 1:
        raise ValueError(f"dropout must be a probability in [0, 1), got {p!r}")
    return StreamDropout(float(p)) if p > 0 else nn.Identity()


def global_pool() -> nn.Sequential:
    return nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())


def conv_norm_relu(
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


def conv_relu(cin: int, cout: int, kernel: int, pool: bool) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Conv2d(cin, cout, kernel, padding=kernel // 2), nn.ReLU()]
    if pool:
        layers.append(nn.MaxPool2d(2))
    return nn.Sequential(*layers)
