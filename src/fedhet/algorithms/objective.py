"""Functional local objectives: a loss is a sum of terms over (forward output, batch, weights).

A term is a small callable built per client update with the constants it needs (the
received global weights for FedProx, anchors for FedFM, ...), so one objective object never
holds hidden state across clients. Terms compose: ``[CrossEntropy(), Proximal(w_g, mu)]``
is FedProx, and a method's own term is appended the same way (``fedprox+fm``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from fedhet.algorithms.base import Arrays


@dataclass
class Batch:
    x: torch.Tensor          # normalised float inputs
    y: torch.Tensor          # int64 labels
    index: torch.Tensor      # positions of these samples in the client's training split
    extras: dict = field(default_factory=dict)   # what an augmentation adds (mixup partner labels, views)


@dataclass
class Forward:
    features: torch.Tensor   # body output h, (B, feature_dim)
    logits: torch.Tensor     # head output, (B, num_classes)


class LossTerm:
    """One additive term of a local objective. ``name`` labels it in the logged loss parts."""

    name: str = "term"

    def __call__(self, out: Forward, batch: Batch, weights: Arrays) -> torch.Tensor:
        raise NotImplementedError


class CrossEntropy(LossTerm):
    """Mean cross-entropy of the logits, the data term of every method in fedhet."""

    name = "ce"

    def __call__(self, out: Forward, batch: Batch, weights: Arrays) -> torch.Tensor:
        return F.cross_entropy(out.logits, batch.y)


def total_loss(terms: list[LossTerm], out: Forward, batch: Batch, weights: Arrays) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Sum of the terms, and each term's (detached) value for logging."""
    parts = {}
    loss = None
    for term in terms:
        value = term(out, batch, weights)
        parts[term.name] = value.detach()
        loss = value if loss is None else loss + value
    return loss, parts
