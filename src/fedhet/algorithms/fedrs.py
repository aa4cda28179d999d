"""FedRS (Li & Zhan, KDD 2021): federated learning with restricted softmax for label-skewed clients.

A client that lacks some classes pushes their classifier weights away during local training.
FedRS scales each class's logit by how present the class is locally (paper Sec. 4, eq. 6;
reference code: lxcnju/FedRepo ``algorithms/fedrs.py``):

  cdist_c = n_c / max_c' n_c'   over the client's training labels,  cdist = cdist (1 - alpha) + alpha
  logits  = cdist * (h @ W^T),  loss = CE(logits, y)

with h the classifier's input features and W the classifier (last Linear) weight, so a missing
class's logit is damped by alpha (alpha = 1 is plain softmax). The restricted CE *replaces*
the plain cross-entropy during local training; aggregation is FedAvg's.

Bias: the reference classifier product ``hs.mm(ws.T)`` has no bias term, and fedhet keeps that
faithfully: the restricted logits use the weight only. With a classifier that has a bias
(``cnn2``'s ``head.fc2``) the bias gets no gradient under FedRS, so it stays at the common
initialisation and is still added when the model is evaluated (as in the reference, which
evaluates with the full classifier); ``simple_cnn``'s classifier has no bias at all.

The head must be a single Linear (every model's default split); the features reaching it are
``Forward.features``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from fedhet.algorithms.fedavg import FedAvg
from fedhet.core.contract import Arrays, Batch, ClientRuntime, Forward, Message, State
from fedhet.core.split import linear_classifier
from fedhet.training.objective import LossTerm


def restricted_distribution(counts: torch.Tensor, alpha: float) -> torch.Tensor:
    """cdist = (n_c / max n) (1 - alpha) + alpha, as float."""
    counts = counts.float()
    return counts / counts.max() * (1.0 - alpha) + alpha


def classifier_weight_name(model: nn.Module) -> str:
    """Name of the weight of the head's one Linear layer (the classifier FedRS restricts)."""
    return linear_classifier(model, "FedRS")[0]


class RestrictedCrossEntropy(LossTerm):
    """CE of ``cdist * (h @ W^T)``: the restricted softmax, with no bias (as in the reference)."""

    name = "restricted_ce"
    vectorizable = True

    def __init__(self, cdist: torch.Tensor, weight_name: str):
        self.cdist = cdist
        self.weight_name = weight_name

    def logits(self, features: torch.Tensor, weights: Arrays) -> torch.Tensor:
        return self.cdist * (features @ weights[self.weight_name].T)

    def __call__(self, out: Forward, batch: Batch, weights: Arrays) -> torch.Tensor:
        return F.cross_entropy(self.logits(out.features, weights), batch.y)


class FedRS(FedAvg):
    name = "fedrs"
    reads_no_global_model = True      # its term needs the client's own data and model only
    takes_mixup = False          # the restricted softmax's cross-entropy reads the label as it is

    class Params(FedAvg.Params):
        alpha: float = Field(0.5, ge=0, le=1)

    def check_model(self, arch: str, model: nn.Module) -> None:
        super().check_model(arch, model)
        linear_classifier(model, "FedRS", arch)      # the restricted softmax scales W h: one Linear map of h

    def data_terms(self, msg: Message, state: State | None, client: ClientRuntime) -> list[LossTerm]:
        """FedAvg's data term, plain cross-entropy, replaced by the restricted CE."""
        counts = client.data.label_counts(client.num_classes)
        cdist = restricted_distribution(counts, self.params.alpha)
        return [RestrictedCrossEntropy(cdist, classifier_weight_name(client.model))]
