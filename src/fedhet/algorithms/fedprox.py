"""FedProx (Li et al., MLSys 2020, "Federated Optimization in Heterogeneous Networks").

Each client minimises its local loss plus a proximal term that keeps it near the model it
received (paper eq. 2):

    h_k(w; w^t) = F_k(w) + (mu/2) * ||w - w^t||^2

over all trained entries (as PFLlib ``clientprox``; BatchNorm statistics are buffers, not
parameters, and get no proximal pull): the network's parameters and any entry of a combined
method's own, such as FedNH's learned logit scale (``fedhet.training.local.trained_names``).
Local solving is the run's ordinary SGD, the server is FedAvg's. With ``mu = 0`` the method is FedAvg exactly (the term adds a zero gradient).

:class:`Proximal` is exported for the other methods that pull towards a reference point
(FedDyn's quadratic, ``fedprox+<method>`` compositions).
"""

from __future__ import annotations

from pydantic import Field

from fedhet.algorithms.fedavg import FedAvg
from fedhet.core.contract import ClientRuntime, Message, State
from fedhet.training.local import trained_names
from fedhet.training.objective import LossTerm
from fedhet.training.terms import Proximal


class FedProx(FedAvg):
    name = "fedprox"

    class Params(FedAvg.Params):
        mu: float = Field(0.01, ge=0)

    def local_terms(self, msg: Message, state: State | None, client: ClientRuntime) -> list[LossTerm]:
        anchor = msg.arrays["model"]
        prox = Proximal(anchor, self.params.mu, trained_names(client.model, anchor))
        return [*super().local_terms(msg, state, client), prox]

    def proximal_pull(self) -> float:
        return super().proximal_pull() + self.params.mu
