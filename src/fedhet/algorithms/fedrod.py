"""FedROD (Chen & Chao, ICLR 2022, "On Bridging Generic and Personalized Federated Learning for Image Classification").

Each client trains two classifiers on one feature extractor (reference used by FedACD's
comparison: Yutong-Dai/FedNH ``src/flbase/strategies/FedROD.py``, linear personal head):

* the **generic** model (body + generic head), federated like FedAvg, is trained with the
  balanced softmax: ``CE(f + log pi, y)`` with ``pi_c = n_c / n`` the client's label distribution
  (``pi_c = 1e-12 / n`` for absent classes), so the model learns the class-balanced posterior;
* a **personal** head of the same shape, kept on the client, is trained with plain CE on
  ``p_head(h) + f_generic(x)`` with the features and generic logits detached.

The reference offers the two updates interleaved per batch or one after the other
(``FedROD_phead_separate``); fedhet implements the separate schedule: E epochs of the generic
model, then E epochs of the personal head against the finished generic model (SGD, the run's
lr, no momentum, the reference's ``p_head_optimizer``). As the generic model is fixed in the
second phase, its features and logits are computed once. The personal head is the reference's
linear one (``FedROD_hyper_clf: False``; its ``main.py`` defaults to the hypernetwork head); it
does not enter the global model, so FedACD's tables (global model) do not depend on it.

Evaluation: ``global_acc`` is the generic model (FedACD Table 1). The personal model, tested on
each client's local split, is the current global model with the head ``W_g + W_p`` (a linear
head's logits add up: ``p_head(h) + g_head(h)``), where the reference tests the client's own
local model. Like for like with the other methods of FedACD's comparison, the server averages
by sample counts (FedAvg's rule; the reference codebase of FedNH averages uniformly) and there is
no gradient clipping unless ``train.clip_grad_norm`` asks (the reference clips at norm 10).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fedhet.algorithms.base import add_reasons
from fedhet.algorithms.fedavg import FedAvg
from fedhet.core.contract import Arrays, ClientRuntime, LocalResult, Message, State, TrainSettings
from fedhet.core.split import HEAD, linear_classifier, select
from fedhet.training.dropout import batch_masks, masks_applied
from fedhet.training.local import epoch_batches, forward
from fedhet.training.mode import in_mode
from fedhet.training.objective import LossTerm
from fedhet.training.terms import OffsetCrossEntropy


def log_prior(counts: torch.Tensor, absent: float = 1e-12) -> torch.Tensor:
    """``log pi_c`` of the client's label distribution, ``absent`` standing in for a zero count."""
    n = torch.where(counts > 0, counts.double(), torch.full_like(counts, absent, dtype=torch.float64))
    return (n / n.sum()).log().float()


def train_personal_head(features: torch.Tensor, generic_logits: torch.Tensor, y: torch.Tensor,
                        head: dict[str, torch.Tensor], weight_name: str, bias_name: str | None, *,
                        epochs: int, batch_size: int, lr: float, generator_of_epoch) -> dict[str, torch.Tensor]:
    """Plain SGD on ``CE(F.linear(h, W_p, b_p) + generic_logits, y)`` over the given detached
    features; returns the new personal head."""
    w = head[weight_name].detach().clone().requires_grad_(True)
    b = head[bias_name].detach().clone().requires_grad_(True) if bias_name else None
    params = [w] + ([b] if b is not None else [])
    for e in range(epochs):
        batches = epoch_batches(len(y), batch_size, False, generator_of_epoch(e))
        if not batches:
            break
        # The positions go to the features' device in one copy an epoch, not one a batch: on a GPU each
        # indexing by CPU positions is its own small copy and wait.
        on_device = torch.cat(batches).to(features.device).split([len(batch) for batch in batches])
        for positions in on_device:
            logits = F.linear(features[positions], w, b) + generic_logits[positions]
            grads = torch.autograd.grad(F.cross_entropy(logits, y[positions]), params)
            with torch.no_grad():
                for p, g in zip(params, grads):
                    p.sub_(lr * g)
    out = {weight_name: w.detach()}
    if bias_name and b is not None:
        out[bias_name] = b.detach()
    return out


class FedROD(FedAvg):
    name = "fedrod"

    def settings_not_applied(self, settings: TrainSettings) -> dict[str, str]:
        why = "to the personal head, trained by plain SGD in fp32 (the reference's p_head_optimizer)"
        dropped = {"train.optimizer": settings.optimizer != "sgd", "train.momentum": settings.momentum != 0,
                   "train.weight_decay": settings.weight_decay != 0,
                   "train.clip_grad_norm": settings.clip_grad_norm is not None, "run.precision": settings.precision != "fp32"}
        return add_reasons(super().settings_not_applied(settings), [key for key, on in dropped.items() if on], why)

    def check_model(self, arch: str, model: torch.nn.Module) -> None:
        super().check_model(arch, model)
        linear_classifier(model, "FedROD", arch)      # the personal head trains as one Linear map of the features

    def data_terms(self, msg: Message, state: State | None, client: ClientRuntime) -> list[LossTerm]:
        counts = client.data.label_counts(client.num_classes)
        return [OffsetCrossEntropy(log_prior(counts), name="balanced_ce")]   # balanced softmax (Ren et al. 2020)

    def after_training(self, result: LocalResult, msg: Message, state: State | None,
                       client: ClientRuntime) -> State | None:
        state = super().after_training(result, msg, state, client)
        weight_name, bias_name = linear_classifier(client.model, "FedROD")
        personal = (state or {}).get("personal_head") or select(client.init_weights(), HEAD)
        data = client.data
        model = client.model
        n, chunk = len(data.train_idx), client.settings.batch_size
        # Train mode as the reference (BatchNorm uses batch statistics, in chunks of the batch size),
        # on a copy of the running statistics so that the uploaded model is not changed.
        generic = {k: v.clone() if k in client.buffer_names else v for k, v in result.weights.items()}
        generator = client.generator("fedrod_generic")          # the chunks' dropout masks, if any
        outs = []
        with torch.no_grad(), in_mode(model, training=True):
            for i in range(0, n, chunk):
                x = data.batch(torch.arange(i, min(i + chunk, n))).x
                with masks_applied(batch_masks(model, x, generator)):
                    outs.append(forward(model, generic, x))
        features = torch.cat([o.features for o in outs]).float()
        logits = torch.cat([o.logits for o in outs]).float()
        y = data.y[data.train_idx]
        settings = client.settings
        new_head = train_personal_head(features, logits, y, personal, weight_name, bias_name,
                                       epochs=settings.epochs, batch_size=settings.batch_size, lr=settings.lr,
                                       generator_of_epoch=lambda e: client.generator("fedrod_personal_head", e))
        return {**(state or {}), "personal_head": new_head}

    def client_model(self, cid: int, state: State, client_state: State | None) -> Arrays | None:
        base = super().client_model(cid, state, client_state)
        personal = (client_state or {}).get("personal_head")
        if base is None or not personal:
            return base
        return {**base, **{k: base[k] + v for k, v in personal.items()}}
