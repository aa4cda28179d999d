"""FedAvg (McMahan et al., 2017): sample-size weighted averaging of locally trained models.

Every other generic method in fedhet is written as a delta from this file.

BatchNorm statistics (policy ``bn_buffers``):
  * ``average`` (default) - running mean/var are averaged like weights, so the global model
    carries population statistics and evaluates correctly on the global test set;
  * ``local`` - each client keeps its own running statistics across rounds (FedBN-style) and
    trains/evaluates with them; the server still averages the uploaded copies so that the
    global model has statistics to evaluate with.
"""

from __future__ import annotations

from typing import Literal

from fedhet.algorithms.aggregate import weighted_average
from fedhet.algorithms.base import Algorithm, Arrays, ClientRuntime, Message, RoundContext, RoundGenerator, State


class FedAvg(Algorithm):
    name = "fedavg"

    class Params(Algorithm.Params):
        bn_buffers: Literal["average", "local"] = "average"

    def init_server_state(self, init_models: dict[str, Arrays]) -> State:
        if len(init_models) != 1:
            raise ValueError(f"{self.name} averages whole models, so every client needs the same architecture; "
                             f"got {sorted(init_models)}")
        (weights,) = init_models.values()
        return {"model": weights}

    def round(self, state: State, ctx: RoundContext) -> RoundGenerator:
        replies = yield {cid: Message("train", {"model": state["model"]}) for cid in ctx.clients}
        state = dict(state)
        state["model"] = self.aggregate(replies)
        return state

    def aggregate(self, replies: dict[int, Message]) -> Arrays:
        cids = sorted(replies)  # a fixed order keeps float sums identical across engines
        return weighted_average([replies[c].arrays["model"] for c in cids],
                                [replies[c].scalars["num_samples"] for c in cids])

    def client_update(self, msg: Message, state: State | None, client: ClientRuntime) -> tuple[Message, State | None]:
        weights = self.with_local_buffers(msg.arrays["model"], state, client)
        result = client.train(weights)
        state = self.keep_local_buffers(result.weights, state, client)
        reply = Message("update", {"model": result.weights},
                        {"num_samples": client.num_samples, "loss": result.mean_loss})
        return reply, state

    # --- BatchNorm policy ---------------------------------------------------------------
    def with_local_buffers(self, weights: Arrays, state: State | None, client: ClientRuntime) -> Arrays:
        if self.params.bn_buffers == "local" and state and "buffers" in state:
            weights = {**weights, **state["buffers"]}
        return weights

    def keep_local_buffers(self, weights: Arrays, state: State | None, client: ClientRuntime) -> State | None:
        if self.params.bn_buffers != "local":
            return state
        buffers = {k: weights[k] for k in client.buffer_names}
        return {**(state or {}), "buffers": buffers} if buffers else state

    # --- evaluation ---------------------------------------------------------------------
    def global_model(self, state: State) -> Arrays | None:
        return state["model"]

    def client_model(self, cid: int, state: State, client_state: State | None) -> Arrays | None:
        if self.params.bn_buffers == "local" and client_state and "buffers" in client_state:
            return {**state["model"], **client_state["buffers"]}
        return state["model"]
