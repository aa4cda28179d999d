"""The body/head split of every fedhet model, defined once.

Parameters and buffers of a split model are named ``body.<stage>...`` (feature extractor) and
``head.<stage>...`` (classifier); every method that treats the two parts differently (FedPer,
FedRep, FedBABU, FedPAC, FedReMa, FedCME's classifier exchange, FedProto) uses these helpers.
"""

from __future__ import annotations

from typing import Any

from fedhet.core.contract import Arrays

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


def parameter_names(client: Any) -> list[str]:
    """Names of the trainable parameters of a client runtime's model (not its buffers)."""
    return [name for name, _ in client.model.named_parameters()]
