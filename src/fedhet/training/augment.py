"""Batch augmentations for ``train_local(augment=...)`` and the losses that read what they add.

An augmentation is a callable ``(batch, generator) -> batch`` that draws from the per-epoch
stream it is given, so it is reproducible per (seed, round, client, epoch) like the batch order.

* :class:`Mixup` (Zhang et al., ICLR 2018; FedACD's local training, papers/002 Sec. 4.2):
  ``x~ = lam x + (1 - lam) x[perm]`` with ``lam ~ Beta(alpha, alpha)`` once per batch and
  ``perm`` a random permutation of the batch. It records the partner labels and ``lam`` in
  ``batch.extras`` (``"mix_y"``, ``"mix_lam"``); a loss term takes them into account with
  :func:`mixed` (``lam L(y) + (1 - lam) L(y[perm])``) or :func:`label_weights`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from fedhet.core.contract import Batch


@dataclass(frozen=True)
class Mixup:
    """Input mixup with one ``lam ~ Beta(alpha, alpha)`` per batch."""

    alpha: float = 1.0

    def __post_init__(self) -> None:
        if not self.alpha > 0:
            raise ValueError(f"mixup alpha must be positive, got {self.alpha}")

    def __call__(self, batch: Batch, generator: torch.Generator) -> Batch:
        perm = torch.randperm(len(batch.y), generator=generator)
        # torch's Beta sampler takes no generator: a numpy Beta seeded from the stream keeps it reproducible.
        seed = int(torch.randint(0, 2**62, (1,), generator=generator))
        lam = float(np.random.default_rng(seed).beta(self.alpha, self.alpha))
        perm = perm.to(batch.x.device)
        x = lam * batch.x + (1.0 - lam) * batch.x[perm]
        return Batch(x, batch.y, batch.index, {**batch.extras, "mix_y": batch.y[perm], "mix_lam": lam})


def mixed(loss_of_labels: Callable[[torch.Tensor], torch.Tensor], batch: Batch) -> torch.Tensor:
    """``loss_of_labels(y)`` on an ordinary batch; ``lam L(y) + (1 - lam) L(y_partner)`` on a mixed one."""
    partner = batch.extras.get("mix_y")
    if partner is None:
        return loss_of_labels(batch.y)
    lam = float(batch.extras["mix_lam"])
    return lam * loss_of_labels(batch.y) + (1.0 - lam) * loss_of_labels(partner)


def label_weights(batch: Batch, num_classes: int) -> torch.Tensor:
    """(B, C) weight of each sample on each class: one-hot labels, or ``lam onehot(y) + (1 - lam)
    onehot(y_partner)`` on a mixed batch (how much of each class a mixed sample is)."""
    classes = torch.arange(num_classes, device=batch.y.device)
    weights = (batch.y.unsqueeze(1) == classes).double()
    partner: torch.Tensor | None = batch.extras.get("mix_y")
    if partner is None:
        return weights
    lam = float(batch.extras["mix_lam"])
    return lam * weights + (1.0 - lam) * (partner.unsqueeze(1) == classes).double()
