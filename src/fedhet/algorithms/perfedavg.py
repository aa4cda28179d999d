"""Per-FedAvg (Fallah, Mokhtari & Ozdaglar, NeurIPS 2020): FedAvg on the MAML objective.

Each client k minimises the personalized (MAML) objective F_k(w) = f_k(w - alpha * grad f_k(w)):
the loss *after* one local gradient step. Its gradient is
``(I - alpha * H_k(w)) grad f_k(w - alpha * grad f_k(w))``, estimated on independent batches.
One local step of the paper's Algorithm 1, with batches D, D', D'' drawn from the client's data:

  w_tmp = w - alpha * grad f(w; D)                                   # inner (adaptation) step
  FO:  w <- w - beta * grad f(w_tmp; D')                             # Hessian term dropped
  HF:  w <- w - beta * (grad f(w_tmp; D') - alpha * H(w; D'') grad f(w_tmp; D'))

(Per-FedAvg (FO) drops the Hessian-vector product; Per-FedAvg (HF) keeps it, estimated on a
third, independent batch D''.) The server is FedAvg's. The personalized model of client k is one
gradient step from the global model on its own data, ``w - alpha * grad f(w; D)`` - the
adaptation the objective is built for, and PFLlib's evaluation (``serverperavg.evaluate_one_step``
-> ``clientperavg.train_one_step``: one SGD step at the local learning rate on one batch).

Implementation (own functional loop; :func:`meta_step` is one step of the three lines above):

* Batches: each local epoch draws the usual shuffled batches of the client's training split
  (``client.generator("batches", epoch)``, ``epoch_batches`` with the run's batch size and
  ``drop_last``) and takes them in consecutive groups of 2 (FO) or 3 (HF) as (D, D'[, D''])
  - PFLlib's FO loader likewise cuts one 2B-sample batch into D and D'. An epoch makes
  ``len(batches) // group`` meta steps; a client with fewer batches than a group makes one
  step and reuses its batches cyclically (D' = D for a one-batch client).
* Hessian-vector product (HF): ``perfedavg_hvp: exact`` (default) computes H(w; D'') v by
  double backward (autograd of <grad f(w; D''), v>); ``finite_difference`` uses the
  Hessian-free (HF-MAML style) central difference ``(grad f(w + delta v; D'') - grad f(w - delta v; D'')) /
  (2 delta)`` (``perfedavg_delta``, default 1e-3 as in flgo's Per-FedAvg). On a quadratic both
  agree up to rounding.
* The loss is the method's data term plus any regularisers (``data_terms`` + ``local_terms``),
  so compositions see the same objective in every gradient. Steps are plain SGD as in the
  paper and PFLlib's ``PerAvgOptimizer``: the run's momentum, weight decay, gradient clipping
  and bf16 setting are NOT used (fp32).
* The steps move the trained entries (``fedhet.training.local.trained_names``): the network's
  parameters and a combined method's own (FedNH's learned logit scale), less what a combined
  method's ``train_options`` freezes with ``trainable`` (FedNH's prototypes, FedBABU's head).
  Any other train option of a combined method is refused (``meta_train_restriction``): the meta
  steps would drop it.
* BatchNorm buffers (if any) are updated by every training-mode forward (D, D', D'') and
  carried along, as in PFLlib where both forwards run in ``train()`` mode on the same module.
* The reported loss of a step is f(w_tmp; D'), the meta-objective the step descends (PFLlib's
  ``train_metrics`` reports the same quantity); ``samples`` counts every forward+backward batch.

Defaults and where the references disagree:

* ``perfedavg_alpha`` / ``perfedavg_beta`` default to ``None`` = the run's learning rate for
  both, which is PFLlib's choice (``clientperavg``: ``beta = learning_rate``, the inner step
  uses the optimizer's ``lr``) and hence that of FedReMa's Table 1 (lr 0.01). Other
  implementations use alpha = 0.01 with beta = 0.001, or alpha = 0.01 with beta = lr (flgo);
  set the two parameters to reproduce them.
* PFLlib implements FO only, and its server calls ``client.train()`` twice per round (2E local
  epochs); fedhet runs E epochs (set ``train.local_epochs`` to 2E to mirror PFLlib).
* Aggregation: the paper averages the sampled clients uniformly; fedhet (like PFLlib) weights
  by training-set size - identical when clients are equally sized (FedReMa's partition).

Personalized evaluation: only when the engine evaluates after this round
(``RoundContext.evaluating``) the server adds a phase that sends the new global model to the
clients the evaluation tests (``RoundContext.eval_clients``; array group ``"eval_model"``, so
the ledger shows this evaluation-only traffic apart from ``"model"`` and leaves it out of its up and
down totals). Each client takes one plain SGD step of size alpha on one batch of its
training data (``client.generator("perfedavg_adapt")``), keeps the result in its client state
(``perfedavg_adapted``) and replies with its sample count only; :meth:`client_model` returns
it. The adaptation is evaluation only: it is not counted as training (``account``), the server
state is untouched, and the next training starts from the received global model (the stored
adapted model is dropped then).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import torch
from pydantic import Field

from fedhet.algorithms.base import add_reasons, update_reply
from fedhet.algorithms.fedavg import FedAvg
from fedhet.core.contract import (
    Arrays,
    Batch,
    ClientRuntime,
    LocalResult,
    Message,
    RoundContext,
    RoundGenerator,
    State,
    TrainSettings,
    optimizer_state_kept,
)
from fedhet.core.errors import NumericalError
from fedhet.training.dropout import batch_masks, masks_applied
from fedhet.training.local import check_finite, epoch_batches, forward, trained_names, trains_in_channels_last
from fedhet.training.mode import in_mode
from fedhet.training.objective import LossTerm, total_loss

ADAPTED = "perfedavg_adapted"    # client-state key of the adapted (personalized) model


def _loss_and_grads(model: torch.nn.Module, params: Arrays, buffers: Arrays, terms: list[LossTerm],
                    batch: Batch, create_graph: bool = False, masks: dict[str, torch.Tensor] | None = None):
    """f(params; batch) and its gradient with respect to every tensor of ``params``; ``masks``: the
    batch's dropout masks (:func:`fedhet.training.dropout.batch_masks`), for the forward and the loss."""
    weights = {**params, **buffers}
    with masks_applied(masks):
        out = forward(model, weights, batch.x)
        loss, parts = total_loss(terms, out, batch, weights)
    grads = torch.autograd.grad(loss, list(params.values()), create_graph=create_graph, allow_unused=True)
    grads = {k: (g if g is not None else torch.zeros_like(params[k])) for k, g in zip(params, grads)}
    return loss, parts, grads


def _leaves(params: Arrays) -> Arrays:
    return {k: v.detach().clone().requires_grad_(True) for k, v in params.items()}


def hessian_vector_product(model: torch.nn.Module, params: Arrays, buffers: Arrays, terms: list[LossTerm],
                           batch: Batch, vector: Arrays, method: str = "exact", delta: float = 1e-3,
                           masks: dict[str, torch.Tensor] | None = None) -> Arrays:
    """H(params; batch) @ vector, exactly (double backward) or by the Hessian-free central difference
    (grad f(w + delta v) - grad f(w - delta v)) / (2 delta) (Per-FedAvg (HF)); both sides of the
    difference with the batch's dropout ``masks``."""
    if method == "exact":
        w = _leaves(params)
        _, _, g = _loss_and_grads(model, w, buffers, terms, batch, create_graph=True, masks=masks)
        dot = sum((g[k] * vector[k]).sum() for k in w if g[k].requires_grad)
        if not isinstance(dot, torch.Tensor) or not dot.requires_grad:
            return {k: torch.zeros_like(v) for k, v in params.items()}
        hv = torch.autograd.grad(dot, list(w.values()), allow_unused=True)
        return {k: (h.detach() if h is not None else torch.zeros_like(params[k])) for k, h in zip(w, hv)}
    if method == "finite_difference":
        plus = _leaves({k: params[k].detach() + delta * vector[k] for k in params})
        minus = _leaves({k: params[k].detach() - delta * vector[k] for k in params})
        _, _, gp = _loss_and_grads(model, plus, buffers, terms, batch, masks=masks)
        _, _, gm = _loss_and_grads(model, minus, buffers, terms, batch, masks=masks)
        return {k: (gp[k] - gm[k]) / (2.0 * delta) for k in params}
    raise ValueError(f"unknown Hessian-vector product method {method!r}")


def meta_step(model: torch.nn.Module, params: Arrays, buffers: Arrays, terms: list[LossTerm],
              batches: list[Batch], alpha: float, beta: float, variant: str = "fo",
              hvp: str = "exact", delta: float = 1e-3,
              masks: list[dict[str, torch.Tensor]] | None = None) -> tuple[Arrays, torch.Tensor, dict]:
    """One local Per-FedAvg step (the paper's Algorithm 1, local update) from ``params`` on (D, D'[, D'']),
    each batch with its dropout masks (``masks``, one dict a batch; none: no masks)."""
    masks = masks or [{} for _ in batches]
    w = _leaves(params)
    _, _, g1 = _loss_and_grads(model, w, buffers, terms, batches[0], masks=masks[0])
    w_tmp = _leaves({k: w[k].detach() - alpha * g1[k] for k in w})               # w - alpha grad f(w; D)
    loss, parts, g2 = _loss_and_grads(model, w_tmp, buffers, terms, batches[1], masks=masks[1])   # grad f(w_tmp; D')
    if variant == "fo":
        direction = g2
    elif variant == "hf":
        hv = hessian_vector_product(model, params, buffers, terms, batches[2], g2, hvp, delta, masks[2])
        direction = {k: g2[k] - alpha * hv[k] for k in g2}                        # (I - alpha H(w; D'')) g2
    else:
        raise ValueError(f"unknown Per-FedAvg variant {variant!r}")
    new = {k: (params[k].detach() - beta * direction[k]).detach() for k in params}
    return new, loss.detach(), {k: v.detach() for k, v in parts.items()}


def split_trained(model: torch.nn.Module, weights: Arrays,
                  trainable: Callable[[str], bool] | None) -> tuple[Arrays, Arrays]:
    """(the entries the steps move, the rest), both detached copies: the rest holds the BatchNorm
    buffers that training-mode forwards update in place, and what ``trainable`` freezes."""
    names = set(trained_names(model, weights, trainable))
    params = {k: v.detach().clone() for k, v in weights.items() if k in names}
    return params, {k: v.detach().clone() for k, v in weights.items() if k not in names}


def adapt_one_step(model: torch.nn.Module, weights: Arrays, terms: list[LossTerm], batch: Batch,
                   alpha: float, trainable: Callable[[str], bool] | None = None,
                   masks: dict[str, torch.Tensor] | None = None) -> Arrays:
    """The personalized model w - alpha * grad f(w; batch): one SGD step (PFLlib ``train_one_step``)
    on the trained entries (``trainable``: a combined method's restriction, e.g. FedNH's frozen head),
    with the batch's dropout ``masks``."""
    params, buffers = split_trained(model, weights, trainable)
    with in_mode(model, training=True):
        _, _, g = _loss_and_grads(model, _leaves(params), buffers, terms, batch, masks=masks)
    adapted = {k: (params[k].detach() - alpha * g[k]).detach() for k in params}
    return {k: adapted.get(k, buffers.get(k)) for k in weights}


class PerFedAvg(FedAvg):
    """Per-FedAvg (FO or HF); see the module docstring for the step, defaults and evaluation."""

    name = "perfedavg"
    evaluates_own_model = True         # client_model: its adapted model as it is
    personalized = True
    takes_mixup = False                  # meta_train's own steps take no augmentation
    takes_augment = False

    class Params(FedAvg.Params):
        perfedavg_variant: Literal["fo", "hf"] = "fo"
        # inner (adaptation/personalization) step alpha and outer (meta) step beta;
        # None = the run's learning rate (PFLlib).
        perfedavg_alpha: float | None = Field(None, gt=0)
        perfedavg_beta: float | None = Field(None, gt=0)
        perfedavg_hvp: Literal["exact", "finite_difference"] = "exact"     # HF only
        perfedavg_delta: float = Field(1e-3, gt=0)                          # finite-difference step

    def settings_not_applied(self, settings: TrainSettings) -> dict[str, str]:
        why = "Per-FedAvg's meta steps are plain SGD, as in the paper and PFLlib's PerAvgOptimizer"
        dropped = {"train.optimizer": settings.optimizer != "sgd", "train.momentum": settings.momentum != 0,
                   "train.weight_decay": settings.weight_decay != 0, "train.nesterov": settings.nesterov,
                   "train.dampening": settings.dampening != 0, "train.clip_grad_norm": settings.clip_grad_norm is not None,
                   "train.optimizer_state": optimizer_state_kept(settings.optimizer_state, self.keeps_optimizer_state)}
        out = add_reasons(super().settings_not_applied(settings), [key for key, on in dropped.items() if on], why)
        if settings.precision != "fp32":
            out = add_reasons(out, ["run.precision"], "Per-FedAvg's meta steps run in fp32")
        if trains_in_channels_last(settings):
            out = add_reasons(out, ["run.memory_format"], "Per-FedAvg's meta steps run in the default layout")
        return out

    def alpha(self, client: ClientRuntime) -> float:
        a = self.params.perfedavg_alpha
        return float(client.settings.lr if a is None else a)

    def local_step(self, client: ClientRuntime) -> tuple[float, float]:
        return self.beta(client), 0.0          # the meta-steps: plain SGD at beta

    def beta(self, client: ClientRuntime) -> float:
        b = self.params.perfedavg_beta
        return float(client.settings.lr if b is None else b)

    # --- server ---------------------------------------------------------------------------
    def round(self, state: State, ctx: RoundContext) -> RoundGenerator:
        state = yield from super().round(state, ctx)
        if ctx.evaluating:
            # Evaluation-only phase: each client the evaluation tests adapts the new global model
            # (the replies carry no tensors).
            if chosen := ctx.evaluated_clients():
                yield {cid: Message("adapt", {"eval_model": state["model"]}) for cid in chosen}
        return state

    # --- client ---------------------------------------------------------------------------
    def client_update(self, msg: Message, state: State | None, client: ClientRuntime) -> tuple[Message, State | None]:
        base = {k: v for k, v in (state or {}).items() if k != ADAPTED} or None
        if msg.kind == "adapt":
            return self.adapt(msg, base, client)
        weights = self.with_local_buffers(msg.arrays["model"], base, client)
        terms = [*self.data_terms(msg, base, client), *self.local_terms(msg, base, client)]
        result = self.meta_train(weights, terms, client, self.meta_train_restriction(msg, base, client))
        client.account(result)
        new_state = self.after_training(result, msg, base, client)
        reply = update_reply(result, client, {"model": result.weights, **self.uploads(result, msg, new_state, client)})
        return reply, new_state

    def meta_train_restriction(self, msg: Message, state: State | None,
                               client: ClientRuntime) -> Callable[[str], bool] | None:
        """The one train option the meta steps honour: ``trainable`` (a combined method's frozen
        entries). Any other option a combined method asks ``client.train`` for would be dropped: refused."""
        options = self.train_options(msg, state, client)
        ignored = sorted(set(options) - {"trainable"})
        if ignored:
            raise ValueError(f"{self.name}: Per-FedAvg's meta steps take no train option but trainable, and a "
                             f"combined method asks for {', '.join(ignored)}; combine Per-FedAvg only with "
                             "methods whose local training needs nothing beyond their loss terms")
        return options.get("trainable")

    def meta_train(self, weights: Arrays, terms: list[LossTerm], client: ClientRuntime,
                   trainable: Callable[[str], bool] | None = None) -> LocalResult:
        """E local epochs of :func:`meta_step` over groups of 2 (FO) or 3 (HF) batches, on the
        trained entries (``trainable``: a combined method's restriction, e.g. FedNH's frozen head)."""
        s = client.settings
        model, data = client.model, client.data
        params, buffers = split_trained(model, weights, trainable)
        group = 2 if self.params.perfedavg_variant == "fo" else 3
        alpha, beta = self.alpha(client), self.beta(client)
        where = f"in round {client.round + 1}, client {client.cid}, algorithm {self.name}"
        n = len(data.train_idx)
        steps = samples = 0
        loss_sum = 0.0
        part_sums: dict[str, float] = {}
        model.train()
        for e in range(s.epochs):
            # One stream an epoch, as train_local's: the batch order, then each batch's dropout masks
            # (none drawn for a model without dropout).
            generator = client.generator("batches", e)
            batches = epoch_batches(n, s.batch_size, s.drop_last, generator)
            if not batches:
                continue
            for i in range(max(1, len(batches) // group)):
                chosen = [data.batch(batches[(i * group + j) % len(batches)]) for j in range(group)]
                masks = [batch_masks(model, b.x, generator) for b in chosen]
                params, loss, parts = meta_step(model, params, buffers, terms, chosen, alpha, beta,
                                                self.params.perfedavg_variant, self.params.perfedavg_hvp,
                                                self.params.perfedavg_delta, masks)
                value = float(loss)
                if not math.isfinite(value):
                    raise NumericalError(
                        f"non-finite loss ({value}) {where} at local epoch {e}, step {steps}. Lower the learning "
                        f"rate or perfedavg_alpha/perfedavg_beta; the run directory keeps every round recorded so far.")
                steps += 1
                samples += sum(len(b.y) for b in chosen)
                loss_sum += value
                for k, v in parts.items():
                    part_sums[k] = part_sums.get(k, 0.0) + float(v)
        out = {k: (params[k] if k in params else buffers[k]) for k in weights}
        check_finite(out, where)
        return LocalResult(out, {}, steps, samples, loss_sum / max(steps, 1),
                           {k: v / max(steps, 1) for k, v in part_sums.items()})

    def adapt(self, msg: Message, state: State | None, client: ClientRuntime) -> tuple[Message, State | None]:
        """One SGD step of size alpha on one batch of the client's training data (evaluation only)."""
        weights = self.with_local_buffers(msg.arrays["eval_model"], state, client)
        n = client.num_samples
        reply = Message("adapted", scalars={"num_samples": n})
        if n == 0:
            return reply, state
        generator = client.generator("perfedavg_adapt")
        batch = client.data.batch(epoch_batches(n, client.settings.batch_size, False, generator)[0])
        adapted = adapt_one_step(client.model, weights, self.data_terms(msg, state, client), batch,
                                 self.alpha(client), self.meta_train_restriction(msg, state, client),
                                 batch_masks(client.model, batch.x, generator))
        return reply, {**(state or {}), ADAPTED: adapted}

    # --- evaluation -----------------------------------------------------------------------
    def client_model(self, cid: int, state: State, client_state: State | None) -> Arrays | None:
        if client_state and ADAPTED in client_state:
            return client_state[ADAPTED]
        return super().client_model(cid, state, client_state)
