"""CReFF (Shang, Lu, Huang & Wang, IJCAI 2022, "Federated Learning on Heterogeneous and Long-Tailed
Data via Classifier Re-Training with Federated Features").

FedAvg trains and averages the model; the server additionally keeps learnable *federated features*
(``creff_features`` per class) and, every round, (1) moves them so that the gradient they induce
on the classifier matches the real per-class gradients the clients uploaded, and (2) re-trains a
classifier on them, which replaces the averaged classifier in the evaluated global model.
References: the paper's method section (Fig. 3: "clients send updated local models and real
feature gradients to the server, and the server sends the aggregated global model and the
re-trained model to clients") and the official code shangxinyi/CReFF-FL ``main.py``
(``Local.compute_gradient``, ``Global.update_feature_syn``, ``Global.feature_re_train``,
``Dataset/Gradient_matching_loss.py``), and its port Yutong-Dai/FedNH
``src/flbase/strategies/CReFF.py``.

Per round t (the classifier is the model's head, one Linear ``W`` (C x d) with optional bias ``b``):

* **Down**: the FedAvg model w^t (``"model"``, what the clients train from) and the re-trained
  classifier of the previous round (``"creff_head"``). Clients compute their gradients with the
  received body and *that* classifier, because the server matches against the same classifier:
  both references build ``syn_feature_params`` = averaged body + last re-trained classifier for
  ``compute_gradient`` and ``update_feature_syn``. Before the first round it is the model's initial
  head (the reference uses a separately drawn ``nn.Linear``; both are default-initialised Linears).
* **Client**: FedAvg's local training, plus, for each class c it holds, the real feature gradient

      g_c = d/d(W, b) mean_{i: y_i = c} CE(W h_i + b, c),   h_i = body(x_i) of the received model

  in eval mode (the reference: ``local_model.eval()``; only the classifier is in train mode, a
  no-op for a Linear), uploaded as ``"creff_grads"``: ``classes``, ``weight`` (m x C x d), ``bias``
  (m x C, with a bias) and, under ``creff_weighting: counts``, ``count``.
  [D] fedhet takes the mean over *all* the client's class-c samples. The reference averages the
  gradients of 10 random batches of ``batch_real`` = 32 class-c images (with DSA augmentation in
  the original, none in FedNH's port): for a class with at most 32 samples each batch is the whole
  class and the two agree exactly; otherwise the reference's value is a random estimate whose
  expectation is fedhet's (CE's gradient is linear in the per-sample terms).
* **Server**: FedAvg's aggregation for the model, then

  1. aggregate the real gradients per class over the clients that hold it. ``uniform`` (default):
     the plain mean, as both references (``weight_temp = 1 / len(...)``; the paper stresses that
     CReFF leaks no class distribution, and the clients upload no counts). ``counts``: weighted by
     the clients' class-c sample counts (each client's mean times its count: the gradient of the
     pooled class-c mean, as if all class-c samples were on one client).
  2. ``creff_match_iters`` (reference ``match_epoch`` = 100) SGD steps (lr ``creff_lr_feature``
     = 0.1, no momentum) on the federated features of the classes that have an aggregated
     gradient, on the sum over those classes of the matching distance (``match_loss`` with
     ``dis_metric='ours'``, ``distance_wb``):

         D(g_syn, g_real) = sum_{rows r of the weight gradient} (1 - cos(g_syn[r], g_real[r]))
                            + (1 - cos(g_syn_bias, g_real_bias))      [with a bias]

     cos(a, b) = <a, b> / (|a| |b| + 1e-6); the weight gradient of a Linear is compared row by
     row (one cosine per output class), the bias as one vector. g_syn is the gradient of
     ``mean CE(W s + b, c)`` over the class-c federated features s, differentiated again w.r.t.
     the features (the reference's ``create_graph=True``). Features of classes without a real
     gradient this round are not moved.
  3. Re-train a classifier (``feature_re_train``): ``creff_crt_epochs`` (``crt_epoch`` = 300)
     epochs of plain SGD (lr ``creff_lr_net`` = 0.01) on mean CE over all the federated features
     with their class labels, shuffled each epoch, batches of ``creff_crt_batch_size`` (the
     reference uses the local batch size, 32; the last partial batch is kept). ``creff_crt_init``:
     ``fresh`` (default, as both references: a new ``nn.Linear`` every round, drawn here with
     PyTorch's default Linear init U(-1/sqrt(d), 1/sqrt(d)) for weight and bias) or ``global``
     (a copy of the round's averaged classifier). The re-trained classifier has the head's own
     parameters (FedNH's port trains a bias for a bias-free head and drops it; here a bias-free
     head stays bias-free).

* **Evaluation**: ``global_model`` is the averaged body with the re-trained classifier (the
  references evaluate ``ft_params``); clients keep training from the plain FedAvg model (the
  original reloads ``fedavg_params`` after evaluating, FedNH's port keeps
  ``server_model_state_dict``). ``client_model`` is that same evaluated model.

Defaults are the official ``options.py`` / FedNH ``main.py``: 100 federated features per class
(``num_of_feature`` / ``CReFF_num_of_fl_feature``), ``match_epoch`` 100, ``crt_epoch`` 300,
``lr_feature`` 0.1, ``lr_net`` 0.01, batch 32. The federated features start as standard normal
draws (``torch.randn``), made lazily in the first round from the round's server stream
(``ctx.rng``), as are the fresh classifiers and the re-training order: the server is
deterministic given the run's seed. State is plain tensors (checkpointable with ``torch.save``).

The head must be a single Linear layer (the default split of ``cnn2`` (``fc2``) and
``simple_cnn`` (``fc3``)).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from fedhet.algorithms.fedavg import FedAvg
from fedhet.core.contract import (
    Arrays,
    ClientData,
    ClientRuntime,
    LocalResult,
    Message,
    Replies,
    RoundContext,
    State,
)
from fedhet.core.split import HEAD, linear_classifier, linear_head_names
from fedhet.training.local import forward
from fedhet.training.mode import in_mode

HEAD_GROUP = "creff_head"      # down: the re-trained classifier the clients take gradients at
GRAD_GROUP = "creff_grads"     # up: per-class classifier gradients
COS_EPS = 1e-6                 # distance_wb's denominator guard


def linear_head(weights: Arrays) -> tuple[str, str | None]:
    """``(weight name, bias name or None)`` of a head that is one Linear layer, from a weight dict."""
    names = linear_head_names(weights)
    if names is None:
        raise ValueError("CReFF re-trains a linear classifier: the model's head must be a single Linear layer "
                         f"(use the architecture's default split); head tensors: {sorted(k for k in weights if k.startswith(HEAD))}")
    return names


# --- client: real feature gradients ---------------------------------------------------------
@torch.no_grad()
def class_gradients(model: torch.nn.Module, weights: Arrays, data: ClientData, num_classes: int,
                    weight_name: str, bias_name: str | None, batch_size: int = 1024
                    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Per class c: the gradient of ``mean_{i: y_i = c} CE(W h_i + b, c)`` w.r.t. ``W`` and ``b``,
    with ``h`` the features of ``weights`` in eval mode over the client's training split.

    Closed form of the Linear + CE gradient: ``dW = (softmax(z) - onehot(c))^T h / n_c``,
    ``db = mean(softmax(z) - onehot(c))`` (the test checks it against autograd). Returns
    ``(weight grads (C, C, d), bias grads (C, C) or None, counts (C,))``, float32 with zero rows for
    absent classes; sums are accumulated in float64. The model's train/eval mode is restored."""
    w = weights[weight_name]
    b = weights[bias_name] if bias_name is not None else None
    n = len(data.train_idx)
    g_w = torch.zeros(num_classes, *w.shape, dtype=torch.float64, device=w.device)
    g_b = torch.zeros(num_classes, w.shape[0], dtype=torch.float64, device=w.device)
    counts = torch.zeros(num_classes, dtype=torch.int64, device=w.device)
    with in_mode(model, training=False):
        for i in range(0, n, batch_size):
            batch = data.batch(torch.arange(i, min(i + batch_size, n)))
            h = forward(model, weights, batch.x).features.float()
            y = batch.y.to(h.device)
            onehot = F.one_hot(y, w.shape[0]).to(h.dtype)
            err = (F.linear(h, w.to(h.dtype), None if b is None else b.to(h.dtype)).softmax(dim=1) - onehot).double()
            member = F.one_hot(y, num_classes).double()                   # (B, C): the sample's class
            g_w += torch.einsum("bc,bk,bd->ckd", member, err, h.double())
            g_b += member.T @ err
            counts += torch.bincount(y, minlength=num_classes)
    denom = counts.clamp(min=1).double()
    g_w = (g_w / denom.view(-1, 1, 1)).float()
    return g_w, ((g_b / denom.view(-1, 1)).float() if b is not None else None), counts


def gradient_upload(g_w: torch.Tensor, g_b: torch.Tensor | None, counts: torch.Tensor,
                    with_counts: bool) -> Arrays:
    """The ``"creff_grads"`` group: the rows of the classes the client holds (count > 0)."""
    classes = torch.nonzero(counts > 0).flatten()
    group = {"classes": classes, "weight": g_w[classes]}
    if g_b is not None:
        group["bias"] = g_b[classes]
    if with_counts:
        group["count"] = counts[classes]
    return group


# --- server: aggregation, matching, re-training ---------------------------------------------
def aggregate_gradients(uploads: list[Arrays], num_classes: int, weighting: str = "uniform"
                        ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor] | None:
    """Per class, the mean of the uploaded gradients over the clients that hold the class:
    ``uniform`` (the references) or weighted by the uploaded ``count`` (``counts``). Returns
    ``(weight (C, C, d), bias (C, C) or None, present (C,) bool)``, or None without uploads."""
    if not uploads:
        return None
    if weighting not in ("uniform", "counts"):
        raise ValueError(f"unknown gradient weighting {weighting!r}; use 'uniform' or 'counts'")
    first = uploads[0]["weight"]
    device = first.device
    total_w = torch.zeros(num_classes, *first.shape[1:], dtype=torch.float64, device=device)
    has_bias = "bias" in uploads[0]
    total_b = torch.zeros(num_classes, first.shape[1], dtype=torch.float64, device=device)
    mass = torch.zeros(num_classes, dtype=torch.float64, device=device)
    for up in uploads:
        classes = up["classes"].to(device)
        if weighting == "counts":
            if "count" not in up:
                raise ValueError("creff_weighting 'counts' needs the clients' class counts, and an upload has none")
            wt = up["count"].to(device).double()
        else:
            wt = torch.ones(len(classes), dtype=torch.float64, device=device)
        total_w.index_add_(0, classes, wt.view(-1, 1, 1) * up["weight"].to(device).double())
        if has_bias:
            total_b.index_add_(0, classes, wt.view(-1, 1) * up["bias"].to(device).double())
        mass.index_add_(0, classes, wt)
    present = mass > 0
    denom = mass.clamp(min=1e-300)
    mean_w = (total_w / denom.view(-1, 1, 1)).float()
    mean_b = (total_b / denom.view(-1, 1)).float() if has_bias else None
    return mean_w, mean_b, present


def synthetic_gradients(features: torch.Tensor, classes: torch.Tensor, weight: torch.Tensor,
                        bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """For each row p: the gradient of ``mean_j CE(W s_pj + b, classes[p])`` over the features
    ``features[p]`` (P x m x d) w.r.t. ``W`` (P x C x d) and ``b`` (P x C); differentiable in the features."""
    m = features.shape[1]
    err = F.linear(features, weight, bias).softmax(dim=-1) - F.one_hot(classes, weight.shape[0]).to(features.dtype).unsqueeze(1)
    g_w = torch.einsum("pmk,pmd->pkd", err, features) / m
    return g_w, (err.mean(dim=1) if bias is not None else None)


def _one_minus_cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return 1 - (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1) + COS_EPS)


def matching_distance(syn_w: torch.Tensor, real_w: torch.Tensor, syn_b: torch.Tensor | None = None,
                      real_b: torch.Tensor | None = None) -> torch.Tensor:
    """Per class (leading dim): ``sum_r (1 - cos(syn_w[r], real_w[r])) + (1 - cos(syn_b, real_b))``
    (CReFF-FL ``distance_wb``: a Linear weight gradient row by row, a bias as one vector)."""
    dist = _one_minus_cos(syn_w, real_w).sum(-1)
    if syn_b is not None and real_b is not None:
        dist = dist + _one_minus_cos(syn_b, real_b)
    return dist


def match_features(features: torch.Tensor, real_w: torch.Tensor, real_b: torch.Tensor | None,
                   present: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   iters: int, lr: float) -> tuple[torch.Tensor, list[float]]:
    """``iters`` SGD steps on the federated features of the ``present`` classes minimising the summed
    matching distance at the classifier ``(weight, bias)``. Returns the new features (C x m x d; other
    classes unchanged) and the loss before each step and after the last (``iters + 1`` values)."""
    classes = torch.nonzero(present).flatten()
    out = features.detach().clone()
    if len(classes) == 0:
        return out, []
    s = out[classes].clone().requires_grad_(True)
    w, b = weight.detach(), (bias.detach() if bias is not None else None)
    rw, rb = real_w[classes], (real_b[classes] if real_b is not None else None)
    losses = []
    for step in range(iters + 1):
        with torch.enable_grad():
            gw, gb = synthetic_gradients(s, classes, w, b)
            loss = matching_distance(gw, rw, gb, rb).sum()
        losses.append(float(loss.detach()))
        if step == iters:
            break
        (grad,) = torch.autograd.grad(loss, [s])
        with torch.no_grad():
            s -= lr * grad
    out[classes] = s.detach()
    return out, losses


def retrain_classifier(features: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *,
                       epochs: int, lr: float, batch_size: int, generator: torch.Generator
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Plain SGD on mean CE of the classifier ``(weight, bias)`` (the starting point, not modified)
    over the federated features (C x m x d, labels = the class index), reshuffled each epoch by
    ``generator`` (CPU), last partial batch kept. The Linear + CE gradient in closed form:
    ``dW = (softmax(z) - onehot(y))^T x / B``, ``db = sum(softmax(z) - onehot(y)) / B``."""
    num_classes, m, d = features.shape
    x = features.detach().reshape(num_classes * m, d)
    onehot = F.one_hot(torch.arange(num_classes, device=x.device).repeat_interleave(m), num_classes).to(x.dtype)
    w = weight.detach().clone()
    b = bias.detach().clone() if bias is not None else None
    n = len(x)
    for _ in range(epochs):
        order = torch.randperm(n, generator=generator).to(x.device)
        xs, ys = x[order], onehot[order]                 # one gather per epoch; batches are views
        for i in range(0, n, batch_size):
            xb, yb = xs[i:i + batch_size], ys[i:i + batch_size]
            err = F.linear(xb, w, b).softmax(dim=1).sub_(yb)
            scale = lr / len(xb)
            w.addmm_(err.T, xb, alpha=-scale)
            if b is not None:
                b.sub_(err.sum(0), alpha=scale)
    return w, b


def fresh_linear(num_classes: int, dim: int, bias: bool, generator: torch.Generator
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A newly initialised Linear(dim, num_classes) as ``nn.Linear.reset_parameters`` draws it:
    weight and bias ~ U(-1/sqrt(dim), 1/sqrt(dim)), from ``generator``."""
    bound = 1.0 / dim ** 0.5
    w = (torch.rand(num_classes, dim, generator=generator) * 2 - 1) * bound
    b = (torch.rand(num_classes, generator=generator) * 2 - 1) * bound if bias else None
    return w, b


def mean_ce(features: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[float, float]:
    """(mean CE, accuracy) of the classifier on all federated features (C x m x d) with their labels."""
    num_classes, m, d = features.shape
    x = features.reshape(-1, d)
    y = torch.arange(num_classes, device=x.device).repeat_interleave(m)
    logits = F.linear(x, weight, bias)
    return float(F.cross_entropy(logits, y)), float((logits.argmax(1) == y).double().mean())


class CReFF(FedAvg):
    """Classifier re-training with federated features; see the module docstring."""

    name = "creff"
    reads_averaged_head = True         # its server re-trains the averaged model's classifier

    class Params(FedAvg.Params):
        creff_features: int = Field(100, ge=1)            # num_of_feature: federated features per class
        creff_match_iters: int = Field(100, ge=0)         # match_epoch
        creff_lr_feature: float = Field(0.1, gt=0)        # lr_feature
        creff_crt_epochs: int = Field(300, ge=1)          # crt_epoch
        creff_lr_net: float = Field(0.01, gt=0)           # lr_net
        creff_crt_batch_size: int = Field(32, ge=1)       # batch_size_local_training
        creff_weighting: Literal["uniform", "counts"] = "uniform"
        creff_crt_init: Literal["fresh", "global"] = "fresh"

    params: Params

    def check_model(self, arch: str, model: torch.nn.Module) -> None:
        super().check_model(arch, model)
        linear_classifier(model, "CReFF", arch)      # the re-trained classifier is one Linear map of the features

    # --- server ---------------------------------------------------------------------------
    def init_server_state(self, init_models: dict[str, Arrays]) -> State:
        state = super().init_server_state(init_models)
        model = state["model"]
        w_name, b_name = linear_head(model)
        head = {k: model[k].clone() for k in (w_name, b_name) if k is not None}
        return {**state, "creff_head": head, "creff_features": None, "creff_global": {**model, **head}}

    def train_message(self, state: State, cid: int, ctx: RoundContext) -> Message:
        msg = super().train_message(state, cid, ctx)
        return Message(msg.kind, {**msg.arrays, HEAD_GROUP: state["creff_head"]}, msg.scalars)

    def aggregate(self, state: State, replies: Replies, ctx: RoundContext) -> State:
        matched_head = state["creff_head"]              # the classifier the clients took gradients at
        state = super().aggregate(state, replies, ctx)
        model = state["model"]
        w_name, b_name = linear_head(model)
        num_classes, dim = model[w_name].shape
        device = model[w_name].device
        g = torch.Generator().manual_seed(int(ctx.rng.integers(2**62)))
        features = state.get("creff_features")
        if features is None:
            features = torch.randn(num_classes, self.params.creff_features, dim, generator=g).to(device)
        uploads = [replies[c].arrays[GRAD_GROUP] for c in sorted(replies) if GRAD_GROUP in replies[c].arrays]
        agg = aggregate_gradients(uploads, num_classes, self.params.creff_weighting)
        losses: list[float] = []
        if agg is not None:
            real_w, real_b, present = (agg[0].to(device), agg[1].to(device) if agg[1] is not None else None,
                                       agg[2].to(device))
            features, losses = match_features(
                features, real_w, real_b, present, matched_head[w_name].to(device),
                matched_head[b_name].to(device) if b_name is not None else None,
                self.params.creff_match_iters, self.params.creff_lr_feature)
        if self.params.creff_crt_init == "fresh":
            w0, b0 = fresh_linear(num_classes, dim, b_name is not None, g)
            w0, b0 = w0.to(device), (b0.to(device) if b0 is not None else None)
        else:
            w0, b0 = model[w_name], (model[b_name] if b_name is not None else None)
        w, b = retrain_classifier(features, w0, b0, epochs=self.params.creff_crt_epochs,
                                  lr=self.params.creff_lr_net, batch_size=self.params.creff_crt_batch_size,
                                  generator=g)
        head = {w_name: w} if b is None or b_name is None else {w_name: w, b_name: b}
        state["creff_features"] = features
        state["creff_head"] = head
        state["creff_global"] = {**model, **head}
        state["creff_match_loss"] = [losses[0], losses[-1]] if losses else None
        return state

    # --- client ---------------------------------------------------------------------------
    def uploads(self, result: LocalResult, msg: Message, state: State | None, client: ClientRuntime) -> dict[str, Arrays]:
        """Beside the trained model: the real feature gradients of the received model (body) at the
        received re-trained classifier, per class the client holds."""
        ups = super().uploads(result, msg, state, client)
        received = {**msg.arrays["model"], **msg.arrays.get(HEAD_GROUP, {})}
        w_name, b_name = linear_head(received)
        g_w, g_b, counts = class_gradients(client.model, received, client.data, client.num_classes, w_name, b_name)
        return {**ups, GRAD_GROUP: gradient_upload(g_w, g_b, counts, self.params.creff_weighting == "counts")}

    # --- evaluation -----------------------------------------------------------------------
    def global_model(self, state: State) -> Arrays | None:
        return state["creff_global"]

    def round_metrics(self, state: State) -> dict[str, Any]:
        losses = state.get("creff_match_loss")
        out = dict(super().round_metrics(state))
        if losses:
            out.update(creff_match_loss_start=losses[0], creff_match_loss_end=losses[1])
        return out
