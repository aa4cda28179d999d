"""Model registry: every model is a :class:`SplitModel` (body -> features -> head -> logits).

``build_model`` raises ``ValueError`` for a bad name, split, option or image size, with the
valid choices in the message; config-level callers turn it into ``ConfigError``.
"""

from __future__ import annotations

import inspect
import math
import numbers
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from fedhet.core.plugins import describe, is_import_path, load_object
from fedhet.core.suggest import did_you_mean
from fedhet.models.base import SplitModel, count_params, param_groups
from fedhet.models.cnn import alexnet_cifar, alexnet_fedrema, cnn2, pfl_cnn, simple_cnn
from fedhet.models.hetero import (
    fca_alexnet,
    fca_cnn_a,
    fca_cnn_b,
    fca_cnn_c,
    fca_cnn_d,
    fca_googlenet,
    fca_resnet18,
    fca_shufflenetv2,
    fca_tiny_a,
    fca_tiny_b,
    fca_tiny_c,
    fca_tiny_d,
)
from fedhet.models.resnet import resnet


@dataclass(frozen=True)
class _Entry:
    build: Callable[..., SplitModel]
    default_split: str
    options: tuple[str, ...] = ()  # extra keyword arguments the builder accepts
    has_norm: bool = False  # whether the `norm` argument means anything for this model


_RESNET_OPTIONS = ("stem", "gn_groups", "fc_bias")
_MODELS: dict[str, _Entry] = {
    "cnn2": _Entry(cnn2, "fc2"),
    "simple_cnn": _Entry(simple_cnn, "fc3"),
    "pfl_cnn": _Entry(pfl_cnn, "fc2"),
    "alexnet_cifar": _Entry(alexnet_cifar, "fc3"),
    "alexnet_fedrema": _Entry(alexnet_fedrema, "fc1"),
    "resnet18": _Entry(partial(resnet, 18), "fc", _RESNET_OPTIONS, has_norm=True),
    "resnet34": _Entry(partial(resnet, 34), "fc", _RESNET_OPTIONS, has_norm=True),
    "resnet50": _Entry(partial(resnet, 50), "fc", _RESNET_OPTIONS, has_norm=True),
    # FedClassAvg's heterogeneous models: 512-d features, shared head "classifier" (hetero/)
    "fca_resnet18": _Entry(fca_resnet18, "classifier", ("gn_groups", "relu_features"), has_norm=True),
    "fca_shufflenetv2": _Entry(fca_shufflenetv2, "classifier", ("gn_groups", "relu_features"), has_norm=True),
    "fca_googlenet": _Entry(fca_googlenet, "classifier", ("gn_groups", "dropout", "relu_features"), has_norm=True),
    "fca_alexnet": _Entry(fca_alexnet, "classifier", ("dropout", "relu_features")),
    "fca_cnn_a": _Entry(fca_cnn_a, "classifier", ("relu_features",)),
    "fca_cnn_b": _Entry(fca_cnn_b, "classifier", ("relu_features",)),
    "fca_cnn_c": _Entry(fca_cnn_c, "classifier", ("relu_features",)),
    "fca_cnn_d": _Entry(fca_cnn_d, "classifier", ("relu_features",)),
    # cheaper than cnn2 per sample each: a federation that runs 100 rounds on one CPU core
    "fca_tiny_a": _Entry(fca_tiny_a, "classifier", ("relu_features",)),
    "fca_tiny_b": _Entry(fca_tiny_b, "classifier", ("relu_features",)),
    "fca_tiny_c": _Entry(fca_tiny_c, "classifier", ("relu_features",)),
    "fca_tiny_d": _Entry(fca_tiny_d, "classifier", ("relu_features",)),
}
MODEL_NAMES: tuple[str, ...] = tuple(_MODELS)

__all__ = [
    "MODEL_NAMES",
    "SplitModel",
    "build_model",
    "count_params",
    "default_split",
    "describe_model",
    "param_groups",
    "resolved_options",
]


def _entry(name: str) -> _Entry:
    if name not in _MODELS:
        raise ValueError(f"unknown model {name!r}{did_you_mean(name, _MODELS)}; "
                         f"valid models: {', '.join(MODEL_NAMES)}")
    return _MODELS[name]


# What the config gives a builder itself (model.split, model.norm) or its positional inputs: not options.
_NOT_OPTIONS = ("in_channels", "num_classes", "image_size", "split", "norm")


def _plain(value: object) -> object:
    """``value`` as the same text in every process: what a config's JSON round trip makes of it (a
    tuple a list, a numpy number a number), a function or class by its import path (its repr holds
    an address), a NaN as "nan" (never equal to itself), any other object by its type."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return "nan" if math.isnan(float(value)) else float(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', None) or '?'}:{value.__qualname__}"
    return f"<{type(value).__module__}.{type(value).__qualname__}>"


def _parameters(builder: Callable[..., object]) -> dict[str, inspect.Parameter]:
    """A builder's parameters by name; none where its signature cannot be read (a builtin or C callable)."""
    try:
        return dict(inspect.signature(builder).parameters)
    except (TypeError, ValueError):
        return {}


def resolved_options(name: str, given: dict) -> dict:
    """The options model ``name`` is built with: ``given`` (``model.options`` for it) and its
    builder's defaults for the ones left out, each as :func:`_plain` writes it. A changed default
    changes the model a config builds (a dropout rate) without changing the config; a resume
    compares these. Empty where the builder's signature cannot be read."""
    if is_import_path(name):
        builder, accepted = load_object(name), None
    else:
        entry = _entry(name)
        builder, accepted = entry.build, set(entry.options)
    params = _parameters(builder)
    if not params:
        return {}
    found = {k: p.default for k, p in params.items()
             if p.default is not p.empty and k not in _NOT_OPTIONS and (accepted is None or k in accepted)}
    found.update(given)
    return {k: _plain(v) for k, v in sorted(found.items())}


def _check_switches(name: str, builder: Callable[..., SplitModel], options: dict) -> None:
    """An option whose default is true or false takes true or false: YAML's ``no`` is false, but a
    quoted "false" is a string, which Python reads as true."""
    params = _parameters(builder)
    for key, value in options.items():
        if key in params and isinstance(params[key].default, bool) and not isinstance(value, bool):
            raise ValueError(f"model {name!r} option {key} is true or false, got {value!r}: write "
                             f"{key}: true or {key}: false, unquoted")


def default_split(name: str) -> str:
    """Name of the stage where ``name``'s head starts by default."""
    return _entry(name).default_split


def describe_model(name: str) -> dict:
    """What ``fedhet list NAME`` says of a built-in model: its builder's first docstring line,
    its default head split, its options with their defaults, and whether ``model.norm`` applies."""
    entry = _entry(name)
    doc = (entry.build.func if isinstance(entry.build, partial) else entry.build).__doc__ or ""
    return {"doc": doc.strip().split("\n")[0], "split": entry.default_split,
            "options": resolved_options(name, {}), "norm": entry.has_norm}


def build_model(
    name: str,
    in_channels: int,
    num_classes: int,
    image_size: int,
    split: str | None = None,
    norm: str = "bn",
    projection_dim: int | None = None,
    **kwargs: object,
) -> SplitModel:
    """Build model ``name`` for square ``image_size`` inputs with ``in_channels`` channels.

    ``split`` names the first head stage (default: ``default_split(name)``). ``norm`` ("bn"
    or "gn") applies to the ResNets, which also take ``stem`` ("cifar" default, or
    "imagenet"), ``gn_groups`` (default 2) and ``fc_bias`` (default true). The other models
    have no normalization layers, so anything but the default ``norm="bn"`` is rejected rather
    than ignored.
    ``projection_dim`` (any model) appends MOON's projection head to the body, so the
    features are the ``projection_dim``-d projection (see ``SplitModel.add_projection``).
    """
    if is_import_path(name):
        return _user_model(name, in_channels, num_classes, image_size, split, norm, projection_dim, **kwargs)
    entry = _entry(name)
    for arg, value in (
        ("in_channels", in_channels),
        ("num_classes", num_classes),
        ("image_size", image_size),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{arg} must be a positive integer, got {value!r}")
    unknown = sorted(set(kwargs) - set(entry.options))
    if unknown:
        accepted = ", ".join(entry.options) or "none"
        raise ValueError(f"model {name!r} does not take option(s) {unknown}; accepted: {accepted}")
    _check_switches(name, entry.build, kwargs)
    if entry.has_norm:
        kwargs["norm"] = norm
    elif norm != "bn":
        with_norm = ", ".join(n for n, e in _MODELS.items() if e.has_norm)
        raise ValueError(
            f"model {name!r} has no normalization layers, so norm={norm!r} cannot apply; "
            f"models with a norm option: {with_norm}"
        )
    chosen = entry.default_split if split is None else split
    model = entry.build(in_channels, num_classes, image_size, chosen, **kwargs)
    if projection_dim is not None:
        model.add_projection(projection_dim)
    return model


def _check_shapes(model: SplitModel, in_channels: int, num_classes: int, image_size: int) -> None:
    """A builder of one's own must build for the data's images and give one logit a class: a
    head of another width fails deep in training (fewer) or trains logits no label ever uses (more)."""
    import torch

    expected = (in_channels, image_size, image_size)
    if tuple(model.input_shape) != expected:
        raise ValueError(f"the builder built the model for inputs of shape {tuple(model.input_shape)} (its "
                         f"SplitModel input_shape), and the data's images are {expected} (channels, height, width): "
                         "build it from the in_channels and image_size it is called with")
    training = model.training
    model.eval()                  # one sample through BatchNorm; no dropout, and no running statistic moves
    try:
        with torch.no_grad():
            logits = model.head(torch.zeros(1, model.feature_dim))
    finally:
        model.train(training)
    if logits.dim() != 2 or logits.shape[1] != num_classes:
        raise ValueError(f"the model's head gives outputs of shape {tuple(logits.shape[1:])} a sample, and the data "
                         f"has {num_classes} classes: its last layer must have num_classes ({num_classes}) outputs, "
                         "the number the builder is called with")


def _user_model(
    spec: str,
    in_channels: int,
    num_classes: int,
    image_size: int,
    split: str | None,
    norm: str,
    projection_dim: int | None,
    **options: object,
) -> SplitModel:
    """A model of the user's own: ``spec`` (``MODULE:FUNCTION``) names a builder called as
    ``builder(in_channels, num_classes, image_size, **options)``, plus ``split=`` when the config
    sets ``model.split`` and ``norm=`` (``model.norm``) when the builder has a ``norm`` parameter;
    it must return a :class:`SplitModel` (body -> features -> head)."""
    builder = load_object(spec)
    if not callable(builder):
        raise ValueError(f"it names {describe(builder)}, not a model builder: name a function "
                         "(in_channels, num_classes, image_size, **options) -> SplitModel")
    try:
        signature: inspect.Signature | None = inspect.signature(builder)
    except (TypeError, ValueError):          # a builtin or C callable: no signature to read
        signature = None
    params = signature.parameters if signature is not None else None
    own_norm = params.get("norm") if params is not None else None
    takes_any = params is None or any(p.kind is p.VAR_KEYWORD for p in params.values())
    if split is not None and not takes_any and "split" not in params:
        raise ValueError(f"model.split {split!r} is passed to the builder as split=, and it has no split parameter: "
                         "add one (split=None, the stage its body ends at) or leave model.split out of the config")
    if own_norm is not None and own_norm.default is not own_norm.empty and own_norm.default != norm:
        warnings.warn(f"model {spec}: the builder's own default norm={own_norm.default!r} is replaced by model.norm "
                      f"{norm!r} (a builder with a norm parameter gets model.norm, 'bn' unless set); set model.norm, "
                      "or give the parameter another name and set it in model.options", UserWarning, stacklevel=2)
    if own_norm is None and norm != "bn":
        raise ValueError(f"model.norm {norm}: this builder has no norm parameter to receive it; add one "
                         "(norm='bn', as fedhet's models: 'bn' or 'gn') or give it an option of its own "
                         "(model.options)")
    extra = {"split": split} if split is not None else {}
    if own_norm is not None:
        extra["norm"] = norm
    if signature is not None:
        try:
            signature.bind(in_channels, num_classes, image_size, **extra, **options)
        except TypeError as e:
            given = ", ".join(["in_channels", "num_classes", "image_size", *extra, *options])
            raise ValueError(f"the builder is called as builder({given}) ({e}); its signature is "
                             f"{signature}: take (in_channels, num_classes, image_size, **options) "
                             "as docs/extending.md shows, or set model.options to its own parameters") from None
    model = builder(in_channels, num_classes, image_size, **extra, **options)
    if not isinstance(model, SplitModel):
        raise ValueError(f"the builder returned {describe(model)}, not a fedhet SplitModel: build it as "
                         "SplitModel(stages, split, input_shape) so that fedhet knows its body and its head "
                         "(docs/extending.md)")
    _check_shapes(model, in_channels, num_classes, image_size)
    if projection_dim is not None:
        model.add_projection(projection_dim)
    return model
