"""MOON (Li, He & Song, CVPR 2021): model-contrastive federated learning.

Local training adds a contrastive term that pulls the local representation z towards the global
model's and pushes it away from the client's previous local model's (paper eq. 2-3; reference
code: QinbinLi/MOON ``train_net_fedcon`` with ``ModelFedCon``):

  l_con = -log( exp(cos(z, z_glob)/tau) / (exp(cos(z, z_glob)/tau) + exp(cos(z, z_prev)/tau)) )
        = CE([cos(z, z_glob)/tau, cos(z, z_prev)/tau], label 0)
  loss  = CE(logits, y) + mu * l_con

z is the model's feature output. The paper's z is the output of a projection head
(Linear(d, d) + ReLU + Linear(d, 256)) placed before the classifier: build the model with
``model.options: {projection_dim: 256}`` (``fedhet.models.build_model``), which makes the
features the projection; without it MOON contrasts the plain body features.

z_glob comes from the received global weights and z_prev from the client's previous local model,
both evaluated with no gradient and in eval mode (the reference freezes and ``eval()``s both).
The previous model is kept in the client's own state (``moon_prev``); on its first
participation a client uses the global model, like the reference's initial model buffer. MOON
sends one model down and one up, like FedAvg.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import Field

from fedhet.algorithms.fedavg import FedAvg
from fedhet.core.contract import (
    Arrays,
    Batch,
    ClientRuntime,
    Forward,
    LocalResult,
    Message,
    State,
)
from fedhet.training.local import forward
from fedhet.training.mode import in_mode
from fedhet.training.objective import LossTerm


def contrastive_loss(z: torch.Tensor, z_glob: torch.Tensor, z_prev: torch.Tensor, tau: float) -> torch.Tensor:
    """Mean over the batch of CE([cos(z, z_glob), cos(z, z_prev)] / tau, label 0)."""
    pos = F.cosine_similarity(z, z_glob, dim=-1)
    neg = F.cosine_similarity(z, z_prev, dim=-1)
    logits = torch.stack([pos, neg], dim=1) / tau
    return F.cross_entropy(logits, torch.zeros(len(z), dtype=torch.long, device=z.device))


class ModelContrastive(LossTerm):
    """mu * l_con, with z_glob and z_prev computed by ``model`` under frozen weight dicts."""

    name = "moon"
    vectorizable = True
    takes_mixup = True         # contrasts features of the batch's images; reads no labels

    def __init__(self, model: torch.nn.Module, global_weights: Arrays, prev_weights: Arrays, mu: float, tau: float):
        self.model = model
        self.global_weights = global_weights
        self.prev_weights = prev_weights
        self.mu = mu
        self.tau = tau

    def __call__(self, out: Forward, batch: Batch, weights: Arrays) -> torch.Tensor:
        # frozen reference models, in eval mode: BatchNorm must not touch their statistics
        with in_mode(self.model, training=False), torch.no_grad():
            z_glob = forward(self.model, self.global_weights, batch.x).features.float()
            z_prev = forward(self.model, self.prev_weights, batch.x).features.float()
        return self.mu * contrastive_loss(out.features, z_glob, z_prev, self.tau)


class Moon(FedAvg):
    name = "moon"

    class Params(FedAvg.Params):
        mu: float = Field(1.0, ge=0)
        tau: float = Field(0.5, gt=0)

    def local_terms(self, msg: Message, state: State | None, client: ClientRuntime):
        glob = self.with_local_buffers(msg.arrays["model"], state, client)
        prev = state["moon_prev"] if state and "moon_prev" in state else glob
        term = ModelContrastive(client.model, glob, prev, self.params.mu, self.params.tau)
        return [*super().local_terms(msg, state, client), term]

    def after_training(self, result: LocalResult, msg: Message, state: State | None,
                       client: ClientRuntime) -> State | None:
        state = super().after_training(result, msg, state, client)
        return {**(state or {}), "moon_prev": result.weights}
