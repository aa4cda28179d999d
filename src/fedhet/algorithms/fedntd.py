"""FedNTD (Lee et al., NeurIPS 2022, "Preservation of the Global Knowledge by Not-True Distillation in FL").

Local objective (paper Eq. 5; official code ``Lee-Gihun/FedNTD`` ``algorithms/fedntd/criterion.py``):

    loss = CE(z, y) + beta * KL( softmax(z~_g / tau) || softmax(z~ / tau) )

where z~ are the logits with the true class's column removed (the "not-true" classes), z_g the
received global model's logits on the same batch (no gradient) and KL averaged over the batch.
Only the global model's knowledge of the *other* classes is kept; the true class is learned freely.
Defaults ``tau`` = 1, ``beta`` = 1: the official repository's ``config/fedntd.json``.

* ``ntd_tau_squared: true`` multiplies the term by ``tau^2``, PFLlib's ``clientntd`` form; the
  paper's loss and the official criterion have no such factor. At ``tau`` = 1 the two agree.
* ``ntd_teacher``: the mode the global model's forward runs in. ``"eval"`` (default): BatchNorm on
  its running statistics, no dropout. In the official code the copied global model takes the
  mode of the trainer, which its evaluation after each client leaves in eval mode, so from the
  second client of a run on the teacher runs in eval mode. ``"train"``: batch statistics (on the
  teacher's own copy of the BatchNorm statistics, so the received weights are never changed) and
  dropout. Models without BatchNorm or dropout give the same loss either way.
Server: FedAvg.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from fedhet.algorithms.fedavg import FedAvg
from fedhet.core.contract import Arrays, Batch, ClientRuntime, Forward, Message, State
from fedhet.training.local import forward
from fedhet.training.mode import in_mode
from fedhet.training.objective import LossTerm


def not_true(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(B, C-1): each row without its true class's entry, the other classes in order."""
    keep = torch.ones_like(logits, dtype=torch.bool).scatter_(1, y.unsqueeze(1), False)
    return logits[keep].view(logits.shape[0], logits.shape[1] - 1)


def not_true_kl(student: torch.Tensor, teacher: torch.Tensor, y: torch.Tensor, tau: float,
                tau_squared: bool = False) -> torch.Tensor:
    """``mean_batch KL(softmax(teacher~/tau) || softmax(student~/tau))`` over the not-true classes,
    times ``tau^2`` with ``tau_squared``."""
    s = not_true(student, y) / tau
    t = not_true(teacher, y) / tau
    kl = F.kl_div(s.log_softmax(1), t.log_softmax(1), reduction="batchmean", log_target=True)
    return tau * tau * kl if tau_squared else kl


class NotTrueDistillation(LossTerm):
    name = "ntd"

    def __init__(self, model: torch.nn.Module, global_weights: Arrays, tau: float, beta: float,
                 tau_squared: bool = False, teacher_mode: str = "eval"):
        if teacher_mode not in ("eval", "train"):
            raise ValueError(f"unknown teacher mode {teacher_mode!r}; use 'eval' or 'train'")
        self.model = model
        self.teacher_training = teacher_mode == "train"
        # a train-mode forward updates BatchNorm running statistics in place: the teacher's own copy
        buffers = {name for name, _ in model.named_buffers()} if self.teacher_training else set()
        self.global_weights = {k: v.clone() if k in buffers else v for k, v in global_weights.items()}
        self.tau = float(tau)
        self.beta = float(beta)
        self.tau_squared = bool(tau_squared)

    def __call__(self, out: Forward, batch: Batch, weights: Arrays) -> torch.Tensor:
        with torch.no_grad(), in_mode(self.model, training=self.teacher_training):
            teacher = forward(self.model, self.global_weights, batch.x).logits.float()
        return self.beta * not_true_kl(out.logits, teacher, batch.y, self.tau, self.tau_squared)


class FedNTD(FedAvg):
    name = "fedntd"
    takes_mixup = False          # the not-true distillation drops the label's logit as it is

    class Params(FedAvg.Params):
        ntd_tau: float = Field(1.0, gt=0)
        ntd_beta: float = Field(1.0, ge=0)
        ntd_tau_squared: bool = False                  # PFLlib's tau^2 factor (not in the paper)
        ntd_teacher: Literal["eval", "train"] = "eval"  # the global model's mode (module docstring)

    def local_terms(self, msg: Message, state: State | None, client: ClientRuntime) -> list[LossTerm]:
        p = self.params
        term = NotTrueDistillation(client.model, msg.arrays["model"], p.ntd_tau, p.ntd_beta, p.ntd_tau_squared,
                                   p.ntd_teacher)
        return [*super().local_terms(msg, state, client), term]
