"""Loss terms shared by several methods (one place each): pulls towards a reference point,
linear corrections and per-class logit offsets. Terms of a single method live in that method's file."""

from __future__ import annotations

import torch

from fedhet.core.contract import Arrays, Batch, Forward
from fedhet.training.augment import mixed_cross_entropy
from fedhet.training.objective import LossTerm


class Proximal(LossTerm):
    """``(mu/2) * sum_p ||w_p - anchor_p||^2`` over ``names`` (default: every tensor of ``anchor``).

    Its gradient with respect to ``w_p`` is ``mu * (w_p - anchor_p)``. The anchor is detached
    and never modified, so the term can be built from the tensors of a received message.
    """

    name = "prox"
    vectorizable = True
    takes_mixup = True         # reads no labels

    def __init__(self, anchor: Arrays, mu: float, names: list[str] | None = None, name: str | None = None):
        keys = list(anchor) if names is None else [k for k in names if k in anchor]
        self.anchor = {k: anchor[k].detach() for k in keys}
        self.mu = float(mu)
        if name is not None:
            self.name = name

    def __call__(self, out: Forward, batch: Batch, weights: Arrays) -> torch.Tensor:
        if not self.anchor:
            return out.logits.new_zeros(())
        sq = torch.stack([(weights[k] - a).pow(2).sum() for k, a in self.anchor.items()]).sum()
        return 0.5 * self.mu * sq


class Linear(LossTerm):
    """``sum_p <v_p, w_p>``: a term whose gradient with respect to ``w_p`` is exactly ``v_p``.

    SCAFFOLD's drift correction (``v = c - c_i``) and FedDyn's linear penalty (``v = -grad_i``).
    """

    name = "linear"
    vectorizable = True
    takes_mixup = True         # reads no labels

    def __init__(self, coefficients: Arrays, name: str | None = None):
        self.coefficients = {k: v.detach() for k, v in coefficients.items()}
        if name is not None:
            self.name = name

    def __call__(self, out: Forward, batch: Batch, weights: Arrays) -> torch.Tensor:
        if not self.coefficients:
            return out.logits.new_zeros(())
        return torch.stack([(weights[k] * v).sum() for k, v in self.coefficients.items()]).sum()


class OffsetCrossEntropy(LossTerm):
    """``CE(logits + offset, y)`` with a fixed per-class offset: logit adjustment by the client's
    label counts (FedROD's balanced softmax adds ``log pi``; FedLC's calibration adds ``-tau n^(-1/4)``).
    Under mixup, ``lam CE(y) + (1 - lam) CE(y_partner)`` with the same offset."""

    vectorizable = True
    takes_mixup = True

    def __init__(self, offset: torch.Tensor, name: str = "offset_ce"):
        self.offset = offset
        self.name = name

    def __call__(self, out: Forward, batch: Batch, weights: Arrays) -> torch.Tensor:
        return mixed_cross_entropy(out.logits + self.offset.to(out.logits.device, out.logits.dtype), batch)
