"""FedDistill: federated distillation by per-class average logits.

Jeong et al. 2018 ("Communication-efficient on-device machine learning: federated distillation
and augmentation under non-IID private data", FD without the augmentation part), as implemented
in PFLlib ``clientfd.py`` / ``serverfd.py`` (formerly ``clientdistill``/``serverdistill``),
the implementation behind the FedDistill rows of FedReMa's tables. No model is ever averaged or
sent: every client trains its own model, kept in its client state (starting from the common
initialisation of its architecture), and only logits travel.

Client (PFLlib ``clientFD.train``): local SGD on

    loss = CE(z, y) + distill_weight * D(z, g[y])

where z are the model's logits for a sample of class y and g[y] is the global average logit
vector of class y from the previous aggregation. For a sample whose class has no global logit
yet, the target is the sample's own detached logits (PFLlib's ``logit_new`` keeps the output
row), which contributes no gradient; before the first aggregation the term is absent. While
training, the client accumulates (the term's statistics) the detached logits of every sample of every batch of every
epoch (training mode, the evolving model) and uploads their per-class means with the per-class
counts (PFLlib ``agg_func`` over the round's outputs).

Server (PFLlib ``serverFD.train`` / ``proto_aggregation``): for each class, the UNWEIGHTED mean of
the uploaded per-class means over the clients that saw the class (count > 0). A class no
replying client saw has no global logit - the aggregate is rebuilt from this round's uploads
only, with no memory of earlier rounds (PFLlib replaces ``global_logits`` every round). If no
client replied, the previous global logits stay.

The distillation term D (``distill_loss``) - the reference changed it over time:

* ``soft_ce`` (default): cross-entropy of the logits against the softmax of the target,
  ``-sum_j softmax(g[y])_j log softmax(z)_j``, batch mean - PFLlib from April 2024 (commit
  83e2182, ``self.loss(output, logit_new.softmax(dim=1))`` with ``nn.CrossEntropyLoss``) until
  November 2025, the period of FedReMa's experiments. It equals KL(softmax(g[y]) || softmax(z))
  plus the target's entropy, a constant: the same gradient as the KL form, at temperature 1.
* ``mse``: mean squared error between logits and target over all B x C entries (PFLlib before
  April 2024, ``nn.MSELoss()(logit_new, output)``).
* PFLlib's latest version (November 2025) passes the raw global logits as soft targets of
  ``CrossEntropyLoss`` (not a distribution); it is not offered.

``leave_one_out: true`` sends each client the mean over the *other* clients' uploads of the last
aggregation (a class only it saw then has no global logit for it), as Jeong et al.'s global
ensembling, where device i distils towards (sum_j F_j,l - F_i,l) / (M - 1); a client that did
not reply then gets the mean over all. PFLlib (the default) sends every client the same mean,
its own upload included.

``distill_weight`` = 1.0 is PFLlib's ``--lamda`` default (FedReMa keeps baselines at their
defaults). ``personalized = True`` and ``has_global_model = False``: each client is evaluated
with its own model.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from fedhet.algorithms.base import Algorithm, update_reply
from fedhet.algorithms.prototypes import aggregate_prototypes
from fedhet.core.contract import (
    Arrays,
    Batch,
    ClientRuntime,
    Forward,
    Message,
    Replies,
    RoundContext,
    State,
)
from fedhet.training.objective import CrossEntropy, LossTerm


class Distillation(LossTerm):
    """``weight * D(z, target)`` with target = g[y] where class y has a global logit, else z detached.

    Pure and vmappable (the vectorized engine runs it under ``vmap``): no state, no branching on
    data (with no class defined at all the value is multiplied by 0). Its :meth:`statistics`
    are the batch's per-class sums (float64) and counts (int64) of the detached logits, which
    local training accumulates over every step as ``"distill.sums"`` / ``"distill.counts"``
    (PFLlib's ``agg_func`` over the round's outputs)."""

    name = "distill"
    vectorizable = True

    def __init__(self, weight: float, num_classes: int, global_logits: torch.Tensor | None = None,
                 defined: torch.Tensor | None = None, kind: str = "soft_ce"):
        if kind not in ("soft_ce", "mse"):
            raise ValueError(f"unknown distillation loss {kind!r}; use 'soft_ce' or 'mse'")
        self.weight = float(weight)
        self.num_classes = num_classes
        self.global_logits = global_logits
        if global_logits is not None and defined is None:
            defined = torch.ones(num_classes, dtype=torch.bool, device=global_logits.device)
        self.defined = defined.bool() if defined is not None else None
        self.kind = kind

    def __call__(self, out: Forward, batch: Batch, weights: Arrays) -> torch.Tensor:
        z = out.logits
        if self.global_logits is None:
            return z.sum() * 0.0
        defined = self.defined.to(z.device)
        have = defined[batch.y].unsqueeze(1)
        target = torch.where(have, self.global_logits.to(z.device, z.dtype)[batch.y], z.detach())
        if self.kind == "soft_ce":
            value = F.cross_entropy(z, target.softmax(dim=1))
        else:
            value = F.mse_loss(z, target)
        # x 1.0 (exact) when some class has a global logit, x 0 when none does (the term is absent).
        return self.weight * value * defined.any().to(value.dtype)

    def statistics(self, out: Forward, batch: Batch) -> dict[str, torch.Tensor]:
        onehot = (batch.y.unsqueeze(1) == torch.arange(self.num_classes, device=batch.y.device)).to(torch.float64)
        return {"sums": onehot.T @ out.logits.detach().double(), "counts": onehot.sum(0).long()}


def local_logits(statistics: dict[str, torch.Tensor], num_classes: int,
                 name: str = Distillation.name) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-class mean logits (C, C), zeros for unseen classes; counts (C,)) from a result's
    statistics (zeros and zero counts when no batch was seen)."""
    sums = statistics.get(f"{name}.sums", torch.zeros(num_classes, num_classes, dtype=torch.float64))
    counts = statistics.get(f"{name}.counts", torch.zeros(num_classes, dtype=torch.int64))
    means = torch.where(counts.unsqueeze(1) > 0, sums / counts.clamp(min=1).double().unsqueeze(1),
                        torch.zeros_like(sums))
    return means.float(), counts.clone()


class FedDistill(Algorithm):
    """Federated distillation (PFLlib FD); see the module docstring."""

    name = "feddistill"
    personalized = True
    has_global_model = False

    class Params(Algorithm.Params):
        distill_weight: float = Field(1.0, ge=0)               # PFLlib --lamda
        distill_loss: Literal["soft_ce", "mse"] = "soft_ce"
        leave_one_out: bool = False                            # Jeong et al.: the others' mean (docstring)

    # --- server ---------------------------------------------------------------------------
    def init_server_state(self, init_models: dict[str, Arrays]) -> State:
        return {"logits": None, "defined": None, **({"uploads": {}} if self.params.leave_one_out else {})}

    def train_message(self, state: State, cid: int, ctx: RoundContext) -> Message:
        if state.get("logits") is None:
            return Message("train")
        mean, defined = state["logits"], state["defined"]
        uploads = state.get("uploads") or {}
        if self.params.leave_one_out and cid in uploads:
            others = aggregate_prototypes([u for c, u in sorted(uploads.items()) if c != cid], "uniform")
            if others is None:
                return Message("train")
            mean, defined = others
        return Message("train", {"global_logits": {"mean": mean, "defined": defined}})

    def aggregate(self, state: State, replies: Replies, ctx: RoundContext) -> State:
        got = [c for c in sorted(replies) if "logits" in replies[c].arrays]
        uploads = [(replies[c].arrays["logits"]["mean"], replies[c].arrays["logits"]["count"]) for c in got]
        agg = aggregate_prototypes(uploads, "uniform")     # per class: plain mean over the clients that have it
        if agg is not None:
            state["logits"], state["defined"] = agg
            if self.params.leave_one_out:
                state["uploads"] = dict(zip(got, uploads))
        return state

    # --- client ---------------------------------------------------------------------------
    def client_update(self, msg: Message, state: State | None, client: ClientRuntime) -> tuple[Message, State | None]:
        weights = state["model"] if state and "model" in state else client.init_weights()
        g = msg.arrays.get("global_logits")
        term = Distillation(self.params.distill_weight, client.num_classes,
                            g["mean"] if g else None, g["defined"] if g else None, self.params.distill_loss)
        result = client.train(weights, [CrossEntropy(), term])
        means, counts = local_logits(result.statistics, client.num_classes, term.name)
        reply = update_reply(result, client, {"logits": {"mean": means, "count": counts}})
        return reply, {**(state or {}), "model": result.weights}

    # --- evaluation -----------------------------------------------------------------------
    def client_model(self, cid: int, state: State, client_state: State | None) -> Arrays | None:
        # A client never sampled yet is evaluated with the common initialisation (None -> engine supplies it).
        return client_state["model"] if client_state and "model" in client_state else None

    def round_metrics(self, state: State) -> dict:
        d = state.get("defined")
        return {**super().round_metrics(state), "feddistill_classes_defined": int(d.sum()) if d is not None else 0}
