"""Local-only training: every client trains its own model and nothing is communicated.

The lower bound of personalized FL tables (FedReMa Table 1 "Local", FedClassAvg Table 2).
Each client starts from the common initialisation of its architecture; its model lives in its
client state. ``augment: supcon_view`` trains on one view of FedClassAvg's augmentation per image
(the like-for-like Local of FedClassAvg's tables, whose methods all see augmented images).
"""

from __future__ import annotations

from fedhet.algorithms.base import Algorithm
from fedhet.core.contract import (
    Arrays,
    ClientRuntime,
    Message,
    RoundContext,
    RoundGenerator,
    State,
)
from fedhet.training.augment import BaselineAugmentation, baseline_augmentation


class LocalOnly(Algorithm):
    name = "local"
    personalized = True
    has_global_model = False

    class Params(Algorithm.Params):
        augment: BaselineAugmentation = "none"

    def init_server_state(self, init_models: dict[str, Arrays]) -> State:
        return {}

    def round(self, state: State, ctx: RoundContext) -> RoundGenerator:
        yield {cid: Message("train") for cid in ctx.clients}
        return state

    def client_update(self, msg: Message, state: State | None, client: ClientRuntime) -> tuple[Message, State | None]:
        weights = state["model"] if state else client.init_weights()
        result = client.train(weights, augment=baseline_augmentation(self.params.augment, client.data))
        return Message("done", scalars={"num_samples": client.num_samples}), {"model": result.weights}

    def client_model(self, cid: int, state: State, client_state: State | None) -> Arrays | None:
        # A client never sampled yet is evaluated with the common initialisation (None -> engine supplies it).
        return client_state["model"] if client_state else None
