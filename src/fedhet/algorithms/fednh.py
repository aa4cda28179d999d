"""FedNH (Dai et al., AAAI 2023, "Tackling Data Heterogeneity in Federated Learning with Class Prototypes").

The classifier is a set of class prototypes, one unit vector per class, that clients never train
(reference: Yutong-Dai/FedNH ``src/flbase/strategies/FedNH.py`` and ``FedUH.py``):

* **Initialisation** - prototypes spread uniformly: orthonormal rows (the reference's
  ``orthogonal`` init; here the QR factor of the run's seeded initial classifier, so it follows the seed).
* **Client** - trains the body only, on ``CE(s * cos(h, W_c), y)``: the cosine of the feature and
  each prototype scaled by ``s``. By default ``s`` is fixed at ``cosine_scale`` = 30, the
  reference's ``FedNH_fix_scaling`` option ("a common choice in the paper", its code says). The
  reference's shipped experiment configs leave that option off and train ``s`` as a model
  parameter, from 1.0 in its small CNN (``Conv2CifarNH``) and 20.0 in its ResNet: ``learn_scale:
  true`` does the same here, starting from ``cosine_scale`` (set it to 1.0 for the small CNN's
  start). The learned ``s`` is one more trained entry of the model (``fednh.logit_scale``): each
  client trains it with the body (same optimizer, weight decay and clipping) and the server
  averages it with the body. After training it computes,
  with its new model in eval mode over its training split, the mean of the L2-normalised features
  of each class, normalises it, and uploads it with the class counts, beside its model without the
  head (the prototypes it never trains, which the server rebuilds from these means).
* **Server** - the body is averaged like FedAvg, by sample counts (like for like with the other
  methods of FedACD's comparison; the reference averages uniformly, and clips gradients at norm
  10, which here is the run's ``train.clip_grad_norm``); the new prototypes are
  ``normalize(rho W + (1 - rho) normalize(sum_m n_mc mu_mc / sum_m n_mc))`` per class
  (``rho`` = ``FedNH_smoothing`` = 0.9); a class no participant has keeps its prototype.

The head must be one bias-free Linear layer (``simple_cnn``'s ``fc3``, FedNH's ``Conv2Cifar``). Its
rows are unit vectors, so the plain logits ``h @ W^T`` used in evaluation rank the classes exactly
as the scaled cosine does (``|h|`` and a positive ``s`` are positive factors per sample):
accuracies are the method's. A learned ``s`` that turned negative would invert that ranking, so
the server refuses one (from a positive start the cross-entropy usually drives ``s`` up; weight
decay pulls it towards 0). A learned ``s`` combines with FedProx, FedDyn, SCAFFOLD and Per-FedAvg
(``fednh+perfedavg``: FedNH first, whose ``client_update`` leaves the prototypes out of the upload),
whose terms, corrections and steps cover every trained entry, but not with a method whose phases
know only the network's body and head (``only_body_and_head``). FedPer, FedRep, FedPAC and FedBABU
do not combine with FedNH at all: their clients train with a head of their own, never the server's
prototypes (``compose`` refuses them).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from pydantic import Field

from fedhet.algorithms.fedavg import FedAvg
from fedhet.algorithms.prototypes import class_statistics
from fedhet.core.contract import (
    Arrays,
    Batch,
    ClientRuntime,
    Forward,
    LocalResult,
    Message,
    Replies,
    RoundContext,
    State,
)
from fedhet.core.errors import ConfigError, NumericalError
from fedhet.core.split import is_head, linear_classifier, linear_head_names
from fedhet.training.augment import mixed_cross_entropy
from fedhet.training.local import trains_in_channels_last
from fedhet.training.objective import LossTerm


def orthonormal_rows(weight: torch.Tensor) -> torch.Tensor:
    """Rows with unit norm, pairwise orthogonal (needs ``rows <= columns``), from ``weight``'s QR."""
    rows, cols = weight.shape
    if rows > cols:
        raise ValueError(f"FedNH needs at least as many feature dimensions as classes ({cols} < {rows}): its "
                         f"prototypes are orthogonal; choose a model (model.arch) whose features have at least "
                         f"{rows} dimensions")
    q, r = torch.linalg.qr(weight.double().T)
    q = q * torch.sign(torch.diagonal(r)).unsqueeze(0)   # a unique factor (positive diagonal of r)
    return q.T.contiguous().to(weight.dtype)


def smoothed_prototypes(previous: torch.Tensor, uploads: list[tuple[torch.Tensor, torch.Tensor]],
                        rho: float) -> torch.Tensor:
    """The server's prototype update from ``[(normalised class means (C, d), counts (C,)), ...]``."""
    total = torch.zeros_like(previous, dtype=torch.float64)
    count = torch.zeros(previous.shape[0], dtype=torch.float64)
    for means, counts in uploads:
        total += counts.double().unsqueeze(1) * means.double()
        count += counts.double()
    average = F.normalize(total / count.clamp(min=1e-12).unsqueeze(1), dim=1)   # zero rows stay zero
    mixed = rho * previous.double() + (1 - rho) * average
    return F.normalize(mixed, dim=1).to(previous.dtype)


# The learned logit scale's entry in the model's weights (``learn_scale``): not a parameter of the
# network, trained and averaged with it (fedhet.training.local.trained_names).
SCALE_NAME = "fednh.logit_scale"


class CosineCrossEntropy(LossTerm):
    """``CE(s * normalize(h) @ normalize(W)^T, y)`` with the classifier weight ``W`` taken from the weights
    (under mixup, both labels' CE weighted by lam). ``s`` is ``scale``, or with ``scale_name`` the
    weights' entry of that name (a learned scale, shape (1,))."""

    name = "cosine_ce"
    vectorizable = True
    takes_mixup = True

    def __init__(self, weight_name: str, scale: float, scale_name: str | None = None):
        self.weight_name = weight_name
        self.scale = float(scale)
        self.scale_name = scale_name

    def __call__(self, out: Forward, batch: Batch, weights: Arrays) -> torch.Tensor:
        w = F.normalize(weights[self.weight_name].to(out.features.dtype), dim=1)
        scale = self.scale if self.scale_name is None else weights[self.scale_name].to(out.features.dtype)
        return mixed_cross_entropy((scale * F.normalize(out.features, dim=1)) @ w.T, batch)


class FedNH(FedAvg):
    name = "fednh"
    trains_on_server_head = True       # the prototypes: the server's, frozen on the clients
    uploads_no_head = True             # ... and rebuilt by the server, not uploaded

    class Params(FedAvg.Params):
        prototype_smoothing: float = Field(0.9, ge=0, le=1)   # rho
        cosine_scale: float = Field(30.0, gt=0)                # s, or its start with learn_scale
        learn_scale: bool = False                              # train s with the body (the reference's configs)

    def check_model(self, arch: str, model: torch.nn.Module) -> None:
        super().check_model(arch, model)
        try:
            bias = linear_classifier(model, "FedNH", arch)[1]
        except ConfigError as e:      # both needs in one message: fixing the split alone meets the bias next
            raise ConfigError(f"{e}; its Linear must also have no bias (simple_cnn: model.split fc3)") from None
        if bias is not None:
            raise ConfigError(f"FedNH's class prototypes are a bias-free classifier, and model {arch}'s head has a "
                              "bias: use simple_cnn (its head has none), or a model of one's own whose head is "
                              "nn.Linear(..., bias=False)")

    # --- server ---------------------------------------------------------------------------
    def init_server_state(self, init_models: dict[str, Arrays]) -> State:
        state = super().init_server_state(init_models)
        weight_name, bias_name = linear_head_names(state["model"]) or (None, None)
        if weight_name is None or bias_name is not None:      # FedNH.check_model says why, when the host is made
            raise ValueError("FedNH needs a bias-free linear classifier as the head (simple_cnn's default split)")
        state["model"] = {**state["model"], weight_name: orthonormal_rows(state["model"][weight_name])}
        if self.params.learn_scale:
            if self.only_body_and_head:
                other = next(c.name for c in type(self).__mro__[1:] if getattr(c, "only_body_and_head", False))
                raise ConfigError(f"algorithm.params.learn_scale: {self.name} combines FedNH with {other}, "
                                  "whose phases know only the network's body and head, not the learned scale; "
                                  "learn it without that method, or keep it fixed (learn_scale: false)")
            state["model"][SCALE_NAME] = torch.tensor([self.params.cosine_scale])
        return state

    def aggregate(self, state: State, replies: Replies, ctx: RoundContext) -> State:
        previous = state["model"]
        state = super().aggregate(state, replies, ctx)              # the uploads hold no head
        (name,) = [k for k in previous if is_head(k)]
        uploads = [(replies[c].arrays["prototypes"]["mean"], replies[c].arrays["prototypes"]["count"])
                   for c in sorted(replies)]
        averaged = {**state["model"], name: smoothed_prototypes(previous[name], uploads, self.params.prototype_smoothing)}
        state["model"] = {k: averaged[k] for k in previous}
        if self.params.learn_scale and not float(state["model"][SCALE_NAME]) > 0:
            raise NumericalError(
                f"FedNH's learned logit scale became {float(state['model'][SCALE_NAME])} in round {ctx.round + 1}: "
                "a scale that is not positive inverts the prototypes' ranking. Lower train.lr, or fix the "
                "scale (algorithm.params.learn_scale: false); the run directory keeps every round recorded so far.")
        return state

    def round_metrics(self, state: State) -> dict[str, Any]:
        """The learned scale after the round's aggregation (``fednh_logit_scale``), so a run's
        metrics show how far it moved from ``cosine_scale``."""
        metrics = super().round_metrics(state)
        if self.params.learn_scale:
            metrics["fednh_logit_scale"] = float(state["model"][SCALE_NAME])
        return metrics

    # --- client ---------------------------------------------------------------------------
    def data_terms(self, msg: Message, state: State | None, client: ClientRuntime) -> list[LossTerm]:
        weight_name, _ = linear_classifier(client.model, "FedNH")     # bias-free: check_model
        return [CosineCrossEntropy(weight_name, self.params.cosine_scale,
                                   SCALE_NAME if self.params.learn_scale else None)]

    def train_options(self, msg: Message, state: State | None, client: ClientRuntime) -> dict:
        options = super().train_options(msg, state, client)
        frozen = options.get("trainable")
        options["trainable"] = (lambda name: not is_head(name) and (frozen is None or frozen(name)))
        return options

    def client_update(self, msg: Message, state: State | None, client: ClientRuntime) -> tuple[Message, State | None]:
        reply, state = super().client_update(msg, state, client)
        # the prototypes stay home (frozen in training, rebuilt by the server); trimmed here, not in
        # uploaded_model, so that a component's own client_update (Per-FedAvg's) is trimmed too
        if "model" in reply.arrays:
            reply.arrays["model"] = self.without_prototypes(reply.arrays["model"])
        return reply, state

    @staticmethod
    def without_prototypes(model: Arrays) -> Arrays:
        return {k: v for k, v in model.items() if not is_head(k)}

    def local_model(self, uploaded: Arrays, init: Arrays) -> Arrays:
        """The upload with the prototypes the client trained against (``init``'s, unchanged)."""
        model = {**{k: v for k, v in init.items() if is_head(k)}, **super().local_model(uploaded, init)}
        return {k: model[k] for k in init if k in model}

    def uploads(self, result: LocalResult, msg: Message, state: State | None, client: ClientRuntime) -> dict[str, Arrays]:
        stats = class_statistics(client.model, result.weights, client.data, client.num_classes,
                                 of=lambda out: F.normalize(out.features, dim=1),
                                 fast_passes=trains_in_channels_last(client.settings))
        means = F.normalize(stats.means, dim=1).float()
        return {**super().uploads(result, msg, state, client), "prototypes": {"mean": means, "count": stats.counts}}
