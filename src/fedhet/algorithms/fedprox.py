"""FedProx (Li et al., MLSys 2020, "Federated Optimization in Heterogeneous Networks").

Each client minimises its local loss plus a proximal term that keeps it near the model it
received (paper eq. 2):

    h_k(w; w^t) = F_k(w) + (mu/2) * ||w - w^t||^2

over all trainable parameters (as PFLlib ``clientprox``; BatchNorm statistics are buffers, not
parameters, and get no proximal pull). Local solving is the run's ordinary SGD, the server is
FedAvg's. With ``mu = 0`` the method is FedAvg exactly (the term adds a zero gradient).

:class:`Proximal` is exported for the other methods that pull towards a reference point
(FedDyn's quadratic, ``fedprox+<method>`` compositions).
"""

from __future__ import annotations

import torch
from pydantic import Field

from fedhet.algorithms.base import Arrays, ClientRuntime, Message, State
from fedhet.algorithms.fedavg import FedAvg
from fedhet.algorithms.objective import Batch, Forward, LossTerm


def parameter_names(client: ClientRuntime) -> list[str]:
    """Names of the trainable parameters of the client's model (not its buffers)."""
    return [name for name, _ in client.model.named_parameters()]


class Proximal(LossTerm):
    """``(mu/2) * sum_p ||w_p - anchor_p||^2`` over ``names`` (default: every tensor of ``anchor``).

    Its gradient with respect to ``w_p`` is ``mu * (w_p - anchor_p)``. The anchor is detached
    and never modified, so the term can be built from the tensors of a received message.
    """

    name = "prox"

    def __init__(self, anchor: Arrays, mu: float, names: list[str] | None = None, name: str | None = None):
        keys = list(anchor) if names is None else [k for k in names if k in anchor]
        self.anchor = {k: anchor[k].detach() for k in keys}
        self.mu = float(mu)
        if name is not None:
            self.name = name

    def __call__(self, out: Forward, batch: Batch, weights: Arrays) -> torch.Tensor:
        if not self.anchor:
            return out.logits.new_zeros(())
        sq = torch.stack([(weights[k] - a).pow(2).sum() for k, a in self.anchor.items()]).sum()
        return 0.5 * self.mu * sq


class FedProx(FedAvg):
    name = "fedprox"

    class Params(FedAvg.Params):
        mu: float = Field(0.01, ge=0)

    def local_terms(self, msg: Message, state: State | None, client: ClientRuntime) -> list[LossTerm]:
        prox = Proximal(msg.arrays["model"], self.params.mu, parameter_names(client))
        return [*super().local_terms(msg, state, client), prox]
