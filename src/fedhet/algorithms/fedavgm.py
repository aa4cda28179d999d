"""FedAvgM (Hsu, Qi & Brown, 2019, "Measuring the Effects of Non-Identical Data Distribution
for Federated Visual Classification", Sec. 3): FedAvg with server momentum.

The averaged client update is treated as a pseudo-gradient and applied with heavy-ball momentum:

    d_t     = w_t - avg_k(w_k)            (avg: FedAvg's sample-size weighted average)
    v_t     = beta * v_{t-1} + d_t        (v_0 = 0)
    w_{t+1} = w_t - server_lr * v_t

With ``beta = 0`` and ``server_lr = 1`` it is FedAvg (up to float rounding of ``w - (w - avg)``).
The velocity lives in the server state. BatchNorm statistics (running mean/var, the integer
``num_batches_tracked``) are not optimised by gradients, so they simply take the average: a
momentum step on a running variance could overshoot below zero.
"""

from __future__ import annotations

from pydantic import Field
from torch import nn

from fedhet.algorithms.aggregate import check_buffers_known_to_server, zeros_for_trainable
from fedhet.algorithms.fedavg import FedAvg
from fedhet.core.contract import Arrays, Replies, RoundContext, State


class FedAvgM(FedAvg):
    name = "fedavgm"

    class Params(FedAvg.Params):
        server_momentum: float = Field(0.9, ge=0, lt=1)
        server_lr: float = Field(1.0, gt=0)

    def check_model(self, arch: str, model: nn.Module) -> None:
        super().check_model(arch, model)
        check_buffers_known_to_server(self.name, arch, model, "its server momentum")

    def init_server_state(self, init_models: dict[str, Arrays]) -> State:
        state = super().init_server_state(init_models)
        state["velocity"] = zeros_for_trainable(state["model"])
        return state

    def aggregate(self, state: State, replies: Replies, ctx: RoundContext) -> State:
        old = state["model"]
        state = super().aggregate(state, replies, ctx)
        avg = state["model"]
        beta, lr = self.params.server_momentum, self.params.server_lr
        velocity, model = {}, dict(avg)
        for k, v_prev in state["velocity"].items():
            if k not in avg:             # not uploaded (fedbabu+fedavgm: the head), so not averaged
                velocity[k] = v_prev
                continue
            v = beta * v_prev + (old[k] - avg[k])
            velocity[k] = v
            model[k] = old[k] - lr * v
        state["model"], state["velocity"] = model, velocity
        return state
