"""FedNTD (Lee et al., NeurIPS 2022, "Preservation of the Global Knowledge by Not-True Distillation in FL").

Local objective (paper Eq. 5; official code ``Lee-Gihun/FedNTD`` ``algorithms/fedntd/criterion.py``):

    loss = CE(z, y) + beta * tau^2 * KL( softmax(z~_g / tau) || softmax(z~ / tau) )

where z~ are the logits with the true class's column removed (the "not-true" classes), z_g the
received global model's logits on the same batch (no gradient) and KL averaged over the batch.
Only the global model's knowledge of the *other* classes is kept; the true class is learned freely.
Defaults ``tau`` = 1, ``beta`` = 1: the official repository's ``config/fedntd.json``. The ``tau^2``
factor is PFLlib's ``clientntd`` form (the official criterion has none); at ``tau`` = 1 the two agree.
The teacher runs in the local model's mode (train mode, as the official code's copied global
model) on its own copy of the BatchNorm statistics, so the received weights are never changed.
Server: FedAvg.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import Field

from fedhet.algorithms.fedavg import FedAvg
from fedhet.core.contract import Arrays, Batch, ClientRuntime, Forward, Message, State
from fedhet.training.local import forward
from fedhet.training.objective import LossTerm


def not_true(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(B, C-1): each row without its true class's entry, the other classes in order."""
    keep = torch.ones_like(logits, dtype=torch.bool).scatter_(1, y.unsqueeze(1), False)
    return logits[keep].view(logits.shape[0], logits.shape[1] - 1)


def not_true_kl(student: torch.Tensor, teacher: torch.Tensor, y: torch.Tensor, tau: float) -> torch.Tensor:
    """``tau^2 * mean_batch KL(softmax(teacher~/tau) || softmax(student~/tau))`` over the not-true classes."""
    s = not_true(student, y) / tau
    t = not_true(teacher, y) / tau
    return tau * tau * F.kl_div(s.log_softmax(1), t.log_softmax(1), reduction="batchmean", log_target=True)


class NotTrueDistillation(LossTerm):
    name = "ntd"

    def __init__(self, model: torch.nn.Module, global_weights: Arrays, tau: float, beta: float):
        self.model = model
        # a train-mode forward updates BatchNorm running statistics in place: the teacher's own copy
        buffers = {name for name, _ in model.named_buffers()}
        self.global_weights = {k: v.clone() if k in buffers else v for k, v in global_weights.items()}
        self.tau = float(tau)
        self.beta = float(beta)

    def __call__(self, out: Forward, batch: Batch, weights: Arrays) -> torch.Tensor:
        with torch.no_grad():
            teacher = forward(self.model, self.global_weights, batch.x).logits.float()
        return self.beta * not_true_kl(out.logits, teacher, batch.y, self.tau)


class FedNTD(FedAvg):
    name = "fedntd"
    takes_mixup = False          # the not-true distillation drops the label's logit as it is

    class Params(FedAvg.Params):
        ntd_tau: float = Field(1.0, gt=0)
        ntd_beta: float = Field(1.0, ge=0)

    def local_terms(self, msg: Message, state: State | None, client: ClientRuntime) -> list[LossTerm]:
        term = NotTrueDistillation(client.model, msg.arrays["model"], self.params.ntd_tau, self.params.ntd_beta)
        return [*super().local_terms(msg, state, client), term]
