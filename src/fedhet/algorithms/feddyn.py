"""FedDyn (Acar et al., ICLR 2021, "Federated Learning Based on Dynamic Regularization",
Algorithm 1).

Client k keeps ``grad_k`` (its explicit state, initially zero) and minimises (Alg. 1, line 5)

    L_k(theta) - <grad_k, theta> + (alpha/2) * ||theta - theta^{t-1}||^2

(:class:`~fedhet.algorithms.scaffold.Linear` with ``-grad_k`` plus
:class:`~fedhet.algorithms.fedprox.Proximal` with ``mu = alpha``), then updates (line 6)

    grad_k <- grad_k - alpha * (theta_k^t - theta^{t-1}).

The server keeps ``h`` (lines 8-9), with m = all clients and P_t the clients that answered:

    h^t     = h^{t-1} - alpha * (1/m) * sum_{k in P_t} (theta_k^t - theta^{t-1})
    theta^t = (1/|P_t|) * sum_{k in P_t} theta_k^t - (1/alpha) * h^t

``theta^t`` is both the model sent next round and the one evaluated (the paper's server model;
PFLlib and FL-bench evaluate it too, the authors' ``alpemreacar/FedDyn`` tests the plain mean of
the round's models). The average is the paper's uniform mean, not FedAvg's sample-size weighting.
One ``alpha`` for every client, as Algorithm 1 writes it; the authors' code and FL-bench divide it
by each client's data size relative to the mean (their "adaptive alpha"), which pulls small
clients harder where sizes differ. BatchNorm statistics get no ``h`` correction: they are plain
(uniform) averages.
"""

from __future__ import annotations

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
from fedhet.training.local import trained_names
from fedhet.training.objective import LossTerm
from fedhet.training.terms import Linear, Proximal


class FedDyn(FedAvg):
    name = "feddyn"

    class Params(FedAvg.Params):
        alpha: float = Field(0.01, gt=0)

    # --- server ---------------------------------------------------------------------------
    def init_server_state(self, init_models: dict[str, Arrays]) -> State:
        state = super().init_server_state(init_models)
        state["h"] = zeros_for_trainable(state["model"])
        return state

    def check_model(self, arch: str, model: torch.nn.Module) -> None:
        super().check_model(arch, model)
        check_buffers_known_to_server(self.name, arch, model, "its state h (the sum of the clients' drifts)")

    def aggregation_weights(self, replies: Replies, cids: list[int]) -> list[float]:
        """Alg. 1, line 9: the uniform mean over the clients that answered."""
        return [1.0] * len(cids)

    def aggregate(self, state: State, replies: Replies, ctx: RoundContext) -> State:
        alpha, prev = self.params.alpha, state["model"]
        models = [replies[c].arrays["model"] for c in sorted(replies)]
        # The mean (FedAvg's, with the uniform weights above) and the rest of a composition's
        # server side (e.g. SCAFFOLD's control variate) first; then the h correction.
        state = super().aggregate(state, replies, ctx)
        # Only the entries the clients upload (feddyn+fedper: the body) are averaged, so only
        # theirs drift; the others' h stays as it was (zero).
        uploaded = set(models[0]) if models else set()
        h = {k: hk - (alpha / ctx.num_clients) * torch.stack([m[k] - prev[k] for m in models]).sum(0)
             if k in uploaded else hk for k, hk in state["h"].items()}
        state["model"] = {k: v - h[k] / alpha if k in h else v for k, v in state["model"].items()}
        state["h"] = h
        return state

    # --- client ---------------------------------------------------------------------------
    def client_grad(self, msg: Message, state: State | None, client: ClientRuntime) -> Arrays:
        """grad_k from the client's state; zeros before its first round."""
        if state and "dyn_grad" in state:
            return state["dyn_grad"]
        x = msg.arrays["model"]
        return {k: torch.zeros_like(x[k]) for k in trained_names(client.model, x)}

    def local_terms(self, msg: Message, state: State | None, client: ClientRuntime) -> list[LossTerm]:
        grad = self.client_grad(msg, state, client)
        return [*super().local_terms(msg, state, client),
                Linear({k: -g for k, g in grad.items()}, name="dyn_linear"),
                Proximal(msg.arrays["model"], self.params.alpha, list(grad), name="dyn_prox")]

    def proximal_pull(self) -> float:
        return super().proximal_pull() + self.params.alpha

    def after_training(self, result: LocalResult, msg: Message, state: State | None,
                       client: ClientRuntime) -> State | None:
        new_state = super().after_training(result, msg, state, client)
        x, alpha = msg.arrays["model"], self.params.alpha
        grad = {k: g - alpha * (result.weights[k] - x[k]) for k, g in self.client_grad(msg, state, client).items()}
        return {**(new_state or {}), "dyn_grad": grad}
