"""The body/head split of every fedhet model, defined once.

Parameters and buffers of a split model are named ``body.<stage>...`` (feature extractor) and
``head.<stage>...`` (classifier); every method that treats the two parts differently (FedPer,
FedRep, FedBABU, FedPAC, FedReMa, FedCME's classifier exchange, FedProto) uses these helpers.
"""

from __future__ import annotations

from typing import Any

from fedhet.core.contract import Arrays
from fedhet.core.errors import ConfigError

BODY = "body."
HEAD = "head."


def is_body(name: str) -> bool:
    return name.startswith(BODY)


def is_head(name: str) -> bool:
    return name.startswith(HEAD)


def select(weights: Arrays, prefix: str) -> Arrays:
    """The tensors whose names start with ``prefix`` (:data:`BODY` or :data:`HEAD`)."""
    return {k: v for k, v in weights.items() if k.startswith(prefix)}


def strip_prefix(weights: Arrays, prefix: str) -> Arrays:
    """``select(weights, prefix)`` with the prefix removed from the names (a head as a module's state dict)."""
    return {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}


def linear_head_names(weights: Arrays) -> tuple[str, str | None] | None:
    """``(weight name, bias name or None)`` when the head's tensors are those of one Linear layer (a 2-d
    ``weight`` and, optionally, its ``bias``), else None: what :func:`linear_classifier` asks of the
    model, read from its weights alone."""
    head = [k for k in weights if k.startswith(HEAD)]
    owners = {k.rpartition(".")[0] for k in head}
    if len(owners) == 1:
        (owner,) = owners
        w, b = f"{owner}.weight", f"{owner}.bias"
        if w in weights and weights[w].dim() == 2 and set(head) <= {w, b}:
            return w, (b if b in weights else None)
    return None


def is_linear_head(weights: Arrays) -> bool:
    return linear_head_names(weights) is not None


def linear_classifier(model: Any, method: str) -> tuple[str, str | None]:
    """Names of the weight and the bias (None without one) of a head that is one Linear layer
    (the classifier that FedRS restricts, FedROD personalises and FedNH fixes)."""
    from torch import nn

    head = model.head
    owners = {name.rpartition(".")[0] for name, _ in head.named_parameters()}
    linears = [name for name, m in head.named_modules() if isinstance(m, nn.Linear)]
    if len(linears) != 1 or owners != {linears[0]}:
        raise ConfigError(f"{method} needs a linear classifier: the model's head (from model.split on) must be a "
                          "single Linear layer; leave model.split at the architecture's default (a model of "
                          "one's own: end it in one nn.Linear stage and split there)")
    layer = head.get_submodule(linears[0])
    prefix = f"{HEAD}{linears[0]}"
    return f"{prefix}.weight", (f"{prefix}.bias" if layer.bias is not None else None)
