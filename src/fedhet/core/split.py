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


def linear_classifier(model: Any, method: str, arch: str | None = None) -> tuple[str, str | None]:
    """Names of the weight and the bias (None without one) of a head that computes one Linear map of
    the features: a single ``nn.Linear``, every other layer of the head an identity at evaluation
    (Identity, Flatten, Dropout). The methods that call it (FedRS, FedROD, FedNH, CReFF, FedProto's
    nearest-prototype evaluation) compute logits as ``W h + b`` from the body's features ``h``, so an
    activation before the Linear (FedClassAvg's ``ReLU + Linear`` heads) would make the model they
    train differ from the one they evaluate. Raises a ConfigError that names the model ``arch`` when
    given and says how to fix it."""
    from torch import nn

    head = model.head
    whose = f"model {arch}'s head" if arch else "the model's head"
    owners = {name.rpartition(".")[0] for name, _ in head.named_parameters()}
    linears = [name for name, m in head.named_modules() if isinstance(m, nn.Linear)]
    if len(linears) != 1 or owners != {linears[0]}:
        last = linears[-1].split(".")[0] if linears and linears[-1] else None
        fix = (f"set model.split to the stage of its last Linear layer ({last!r})" if last and len(linears) > 1
               else "leave model.split at the architecture's default")
        raise ConfigError(f"{method} needs a linear classifier: {whose} (from model.split on) must be a single "
                          f"Linear layer; {fix} (a model of one's own: end it in one nn.Linear stage and split "
                          "there)")
    passive = (nn.Linear, nn.Identity, nn.Flatten, nn.Dropout)
    active = sorted({type(m).__name__ for _, m in head.named_modules()
                     if not list(m.children()) and not isinstance(m, passive)})
    if active:
        raise ConfigError(f"{method} needs a linear classifier: {whose} applies {', '.join(active)} besides its "
                          "Linear layer, so its logits are not a linear map of the features the method works on; "
                          "FedClassAvg's models (fca_*): set model.options.relu_features: true, which moves the "
                          "ReLU to the end of the body (a model of one's own: end the head in one nn.Linear and "
                          "nothing else)")
    layer = head.get_submodule(linears[0])
    prefix = f"{HEAD}{linears[0]}"
    return f"{prefix}.weight", (f"{prefix}.bias" if layer.bias is not None else None)
