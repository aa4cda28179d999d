"""SCAFFOLD (Karimireddy et al., ICML 2020, "SCAFFOLD: Stochastic Controlled Averaging for
Federated Learning", Algorithm 1).

Server control variate ``c`` (server state), client control variate ``c_i`` (the client's
explicit state, initially zero). Each local step corrects the client drift:

    y_i <- y_i - eta * (g_i(y_i) + c - c_i)                             (Alg. 1, line 10)

implemented as the :class:`Linear` loss term ``sum_p <c_p - c_i,p, w_p>``, whose gradient is
exactly ``c - c_i``, so the run's SGD needs no special optimizer. After the K local steps:

    option I:  c_i+ = grad f_i(x)   (mean gradient of the data term at the received model x -
                                     the cross-entropy, or a composed method's own, e.g. FedRS's -
                                     one full pass over the client's data; costs that pass)
    option II: c_i+ = c_i - c + (x - y_i) / (K * eta)                   (Alg. 1, line 12)

The client uploads its model and ``delta c_i = c_i+ - c_i`` (message group ``"control"``); the
server sends the model and ``c``, so both directions carry two parameter-sized groups.

Server rule (Alg. 1, lines 16-17), over the set S of clients that answered, N = all clients:

    x <- x + server_lr * (avg(y_i) - x)
    c <- c + (1/N) * sum_{i in S} delta c_i          (= |S|/N * mean delta c_i)

Choice: ``avg`` is FedAvg's sample-size weighted average rather than the paper's uniform mean,
so that ``server_lr = 1`` (the paper's experiments) gives exactly FedAvg's aggregate and SCAFFOLD
differs from FedAvg only by the control variates. BatchNorm statistics are averaged and have no
control variate (they are not trained by gradients).

Option II and the optimizer: the formula assumes plain SGD, where ``x - y_i = eta * sum_k
(g_k + c - c_i)``. Weight decay only adds its own gradient ``wd * w`` to the estimate (the
control then tracks the gradient of the regularised loss, which is what is minimised). SGD
momentum ``rho`` enlarges the displacement by up to ``1/(1 - rho)``, which would inflate ``c_i``
round after round until the loss is non-finite; fedhet therefore divides by the momentum-aware
step count ``eta * sum_{k=1..K} (1 - rho^k)/(1 - rho)`` (the displacement of K heavy-ball steps
under a constant gradient; ``K * eta`` when ``rho = 0``). Gradient clipping is not accounted for.
A client that took no step keeps its control variate. K is the number of steps that trained the
entry: where a combined method trains in phases over different entries (``scaffold+fedrep``: the
head, then the body), each entry's own phase (``LocalResult.entry_steps``), since an entry does
not move in the other's. The step size and momentum are the method's own local step's
(``local_step``: the run's, or Per-FedAvg's plain meta-steps at beta in ``scaffold+perfedavg``).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field

from fedhet.algorithms.aggregate import check_buffers_known_to_server, zeros_for_trainable
from fedhet.algorithms.fedavg import FedAvg
from fedhet.core.contract import (
    Arrays,
    ClientRuntime,
    LocalResult,
    Message,
    Replies,
    RoundContext,
    State,
)
from fedhet.training.dropout import batch_masks, masks_applied
from fedhet.training.local import forward, trained_names
from fedhet.training.mode import in_mode
from fedhet.training.objective import CrossEntropy, LossTerm
from fedhet.training.steps import normalizing_factor
from fedhet.training.terms import Linear


def full_gradient(client: ClientRuntime, weights: Arrays, names: list[str], batch_size: int,
                  terms: list[LossTerm] | None = None) -> Arrays:
    """Mean gradient of the data ``terms`` (default: cross-entropy; in a composition the method's
    own, e.g. FedRS's restricted softmax, the loss its local training minimises) over the client's
    whole training split at ``weights``.

    Batches are weighted by their size, so the result does not depend on ``batch_size`` for
    models without BatchNorm. The model runs in training mode like local training does, its dropout
    masks drawn from the client's stream; the BatchNorm statistics it updates belong to private
    copies and are discarded.
    """
    work = {k: v.detach().clone() for k, v in weights.items()}
    leaves = [k for k in names if k in work]
    for k in leaves:
        work[k].requires_grad_(True)
    grads = {k: torch.zeros_like(work[k]) for k in leaves}
    n = len(client.data.train_idx)
    terms = terms if terms is not None else [CrossEntropy()]
    generator = client.generator("scaffold_full_gradient")          # the batches' dropout masks, if any
    with in_mode(client.model, training=True):
        for start in range(0, n, batch_size):
            positions = torch.arange(start, min(n, start + batch_size))
            batch = client.data.batch(positions)
            with masks_applied(batch_masks(client.model, batch.x, generator)):
                out = forward(client.model, work, batch.x)
                loss = sum(term(out, batch, work) for term in terms) * (len(positions) / n)
            for k, g in zip(leaves, torch.autograd.grad(loss, [work[k] for k in leaves], allow_unused=True)):
                if g is not None:
                    grads[k] += g
    return grads


class Scaffold(FedAvg):
    name = "scaffold"
    reads_one_messages_training = True  # option II: that training's steps and drift
    requires_sgd = True
    # the server's c takes every round's control deltas (c = mean of the c_i): a composition that
    # skips rounds' aggregation (FedFM-Lite between model uploads) would lose them
    aggregates_every_round = True

    class Params(FedAvg.Params):
        option: Literal["I", "II"] = "II"
        server_lr: float = Field(1.0, gt=0)

    # --- server ---------------------------------------------------------------------------
    def init_server_state(self, init_models: dict[str, Arrays]) -> State:
        state = super().init_server_state(init_models)
        state["control"] = zeros_for_trainable(state["model"])
        return state

    def check_model(self, arch: str, model: torch.nn.Module) -> None:
        super().check_model(arch, model)
        check_buffers_known_to_server(self.name, arch, model, "its control variates")

    def train_message(self, state: State, cid: int, ctx: RoundContext) -> Message:
        msg = super().train_message(state, cid, ctx)
        msg.arrays["control"] = state["control"]
        return msg

    def aggregate(self, state: State, replies: Replies, ctx: RoundContext) -> State:
        x = state["model"]
        state = super().aggregate(state, replies, ctx)
        lr = self.params.server_lr
        if lr != 1.0:
            state["model"] = {k: x[k] + lr * (v - x[k]) if k in state["control"] else v
                              for k, v in state["model"].items()}
        cids = sorted(replies)
        state["control"] = {
            k: c + torch.stack([replies[i].arrays["control"][k] for i in cids]).sum(0) / ctx.num_clients
            for k, c in state["control"].items()}
        return state

    # --- client ---------------------------------------------------------------------------
    def client_control(self, msg: Message, state: State | None) -> Arrays:
        """c_i from the client's state; zeros (shaped like ``c``) before its first round."""
        if state and "control" in state:
            return state["control"]
        return {k: torch.zeros_like(v) for k, v in msg.arrays["control"].items()}

    def client_update(self, msg: Message, state: State | None, client: ClientRuntime) -> tuple[Message, State | None]:
        if msg.kind != "train":                     # another component's phase (FedFM's anchors)
            return super().client_update(msg, state, client)
        reply, new_state = super().client_update(msg, state, client)
        old, new = self.client_control(msg, state), new_state["control"]
        reply.arrays["control"] = {k: new[k] - old[k] for k in new}
        return reply, new_state

    def local_terms(self, msg: Message, state: State | None, client: ClientRuntime) -> list[LossTerm]:
        c, ci = msg.arrays["control"], self.client_control(msg, state)
        params = set(trained_names(client.model, msg.arrays["model"]))
        correction = Linear({k: c[k] - ci[k] for k in c if k in params}, name="scaffold")
        return [*super().local_terms(msg, state, client), correction]

    def after_training(self, result: LocalResult, msg: Message, state: State | None,
                       client: ClientRuntime) -> State | None:
        new_state = super().after_training(result, msg, state, client)
        x, c, ci = msg.arrays["model"], msg.arrays["control"], self.client_control(msg, state)
        params = set(trained_names(client.model, x))
        if self.params.option == "I":
            start = self.with_local_buffers(x, state, client)       # the weights training started from
            grads = full_gradient(client, start, [k for k in c if k in params], client.settings.batch_size,
                                  self.data_terms(msg, state, client))
            new_ci = {k: grads[k] if k in grads else ci[k] for k in c}
        else:
            # K: the steps that trained the entry (in phased training, its own phase's: scaffold+fedrep)
            lr, momentum = self.local_step(client)
            steps = {k: result.entry_steps.get(k, result.steps) for k in c if k in params}
            new_ci = {k: ci[k] - c[k] + (x[k] - result.weights[k]) / (lr * normalizing_factor(steps[k], momentum))
                      if steps.get(k, 0) > 0 else ci[k] for k in c}
        return {**(new_state or {}), "control": new_ci}

    def round_metrics(self, state: State) -> dict[str, Any]:
        norm = sum(float(v.pow(2).sum()) for v in state["control"].values()) ** 0.5
        return {**super().round_metrics(state), "scaffold_control_norm": norm}
