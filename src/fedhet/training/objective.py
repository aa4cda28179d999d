"""Functional local objectives: a loss is a sum of terms over (forward output, batch, weights).

A term is a small callable built per client update with the constants it needs (the
received global weights for FedProx, anchors for FedFM, ...), so one objective object never
holds hidden state across clients. Terms compose: ``[CrossEntropy(), Proximal(w_g, mu)]``
is FedProx, and a method's own term is appended the same way (``fedprox+fm``).
"""

from __future__ import annotations

import torch

from fedhet.core.contract import Arrays, Batch, Forward
from fedhet.core.errors import ConfigError
from fedhet.training.augment import Mixup, mixed_cross_entropy


class LossTerm:
    """One additive term of a local objective. ``name`` labels it in the logged loss parts."""

    name: str = "term"
    # True when the call is a pure function of (forward, batch, weights) and the term's tensor
    # attributes - no Python-side state, no data-dependent Python branching - so the vectorized
    # engine may rebuild it under ``vmap`` from stacked constants. Terms opt in.
    vectorizable: bool = False
    # True when the term is right on a mixup batch (``training.augment.Mixup``): it reads the labels
    # through ``mixed`` / ``label_weights``, which take both images' labels, or reads none. A term
    # that reads ``batch.y`` as is would learn the first image's label only, so local training
    # refuses mixup with a term that does not opt in (``check_terms_take_mixup``).
    takes_mixup: bool = False

    def __call__(self, out: Forward, batch: Batch, weights: Arrays) -> torch.Tensor:
        raise NotImplementedError

    def statistics(self, out: Forward, batch: Batch) -> dict[str, torch.Tensor]:
        """Detached per-batch totals this term observes (FedCME's per-class feature sums).

        Local training adds them up over every step, in step order, under the key
        ``"<name>.<key>"`` of ``LocalResult.statistics``; the term itself keeps no state, so
        ``__call__`` stays a pure function. Default: none. Like ``__call__`` of a vectorizable
        term, it must be vmappable (no data-dependent Python branching)."""
        return {}


class CrossEntropy(LossTerm):
    """Mean cross-entropy of the logits, the data term of every method in fedhet (under mixup,
    ``lam CE(y) + (1 - lam) CE(y_partner)``)."""

    name = "ce"
    vectorizable = True
    takes_mixup = True

    def __call__(self, out: Forward, batch: Batch, weights: Arrays) -> torch.Tensor:
        return mixed_cross_entropy(out.logits, batch)


def check_terms_take_mixup(terms: list[LossTerm], augment: object, where: str = "") -> None:
    """Refuse mixup with a term that would read only the first image's label (``LossTerm.takes_mixup``):
    a ConfigError, so the command line says it in one line (the setting to change is the config's)."""
    if not isinstance(augment, Mixup):
        return
    refused = [f"{term.name} ({type(term).__name__})" for term in terms if not term.takes_mixup]
    if refused:
        raise ConfigError(f"mixup{' ' + where if where else ''}: the loss terms {', '.join(refused)} do not say "
                          "they take mixed batches (LossTerm.takes_mixup); one that reads the labels as they are "
                          "would learn only the first image's label of each mixed pair. Turn algorithm.params.mixup "
                          "off for this method, or read the labels through fedhet.extend.mixed or label_weights "
                          "(or none) and set takes_mixup = True")


def total_loss(terms: list[LossTerm], out: Forward, batch: Batch, weights: Arrays) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Sum of the terms, and each term's (detached) value for logging."""
    parts = {}
    loss = None
    for term in terms:
        value = term(out, batch, weights)
        parts[term.name] = value.detach()
        loss = value if loss is None else loss + value
    if loss is None:
        raise ValueError("a local objective needs at least one loss term")
    return loss, parts


def accumulate_statistics(terms: list[LossTerm], out: Forward, batch: Batch,
                          totals: dict[str, torch.Tensor]) -> None:
    """Add every term's :meth:`LossTerm.statistics` of this step to ``totals`` (in place):
    ``totals["<name>.<key>"] = totals[...] + value``, the first value taken as is."""
    for term in terms:
        for key, value in term.statistics(out, batch).items():
            full = f"{term.name}.{key}"
            prev = totals.get(full)
            totals[full] = value if prev is None else prev + value
