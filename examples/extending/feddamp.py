"""A method of your own, outside the package: FedAvg with a damped server step and small logits.

Two changes from FedAvg, each one hook:

* a loss term: ``logit_penalty * mean(logits^2)`` added to every client's cross-entropy;
* the server rule: the global model moves ``server_lr`` of the way from where it was to the
  clients' average (``server_lr: 1`` is FedAvg's step).

Run it by its import path, with this folder on PYTHONPATH (or installed):

    PYTHONPATH=examples/extending fedhet run configs/quickstart.yaml --set algorithm.name=feddamp:FedDamp \
        --set name=feddamp
"""

from __future__ import annotations

import torch
from pydantic import Field

from fedhet.extend import Arrays, Batch, FedAvg, Forward, LossTerm, Replies, RoundContext, State


class LogitPenalty(LossTerm):
    """``weight * mean(logits^2)``: a pure function of the forward pass, so every engine can vmap it."""

    name = "logit_l2"
    vectorizable = True

    def __init__(self, weight: float):
        self.weight = weight

    def __call__(self, out: Forward, batch: Batch, weights: Arrays) -> torch.Tensor:
        return self.weight * out.logits.pow(2).mean()


class FedDamp(FedAvg):
    name = "feddamp"

    class Params(FedAvg.Params):
        server_lr: float = Field(0.5, gt=0, le=1)
        logit_penalty: float = Field(1e-3, ge=0)

    def local_terms(self, msg, state, client):
        return [*super().local_terms(msg, state, client), LogitPenalty(self.params.logit_penalty)]

    def aggregate(self, state: State, replies: Replies, ctx: RoundContext) -> State:
        before = state["model"]
        state = super().aggregate(state, replies, ctx)
        lr = self.params.server_lr
        state["model"] = {k: v + lr * (state["model"][k] - v) if v.is_floating_point() else state["model"][k]
                          for k, v in before.items()}
        return state
