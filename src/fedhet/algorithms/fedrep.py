"""FedRep (Collins, Hassani, Mokhtari & Shakkottai, ICML 2021, "Exploiting Shared Representations
for Personalized Federated Learning").

FedPer's split and server (the body, "representation", is averaged by sample size; each client's
head stays local), with alternating local training (paper Algorithm 1): every round a
client first trains its head for ``rep_head_epochs`` epochs with the received body frozen, then
trains the body for the run's ``train.local_epochs`` epochs with the new head frozen, and uploads
the body. Both phases minimise the plain data loss (plus any term of a combined method).

Reference defaults (decisions):

* Head epochs: 10, the official code's setting in every published script
  (``lgcollins/FedRep`` ``scripts/FedRep_*.sh``: ``local_ep - local_rep_ep`` = 15 - 5 or 11 - 1;
  the paper's experiments). PFLlib's ``clientrep`` uses ``plocal_epochs`` = 1; set
  ``rep_head_epochs: 1`` to mirror it.
* Body epochs: the run's ``train.local_epochs`` (``local_rep_ep`` in the official code, PFLlib's
  ``local_epochs``).
* Optimizer: each phase starts from fresh SGD state with the run's settings (PFLlib keeps two
  plain-SGD optimizers; the official code re-creates one SGD, momentum 0.5, per round).
"""

from __future__ import annotations

from pydantic import Field

from fedhet.algorithms.fedper import FedPer
from fedhet.core.contract import Arrays, ClientRuntime, LocalResult, Message, State
from fedhet.training.phases import train_head_then_body


class FedRep(FedPer):
    """FedRep; see the module docstring."""

    name = "fedrep"

    class Params(FedPer.Params):
        rep_head_epochs: int = Field(10, ge=0)    # tau_h: head-only epochs before the body epochs

    def local_training(self, weights: Arrays, msg: Message, state: State | None, client: ClientRuntime) -> LocalResult:
        terms = [*self.data_terms(msg, state, client), *self.local_terms(msg, state, client)]
        return train_head_then_body(client, weights, terms, terms, head_epochs=self.params.rep_head_epochs,
                                    body_epochs=client.settings.epochs, **self.train_options(msg, state, client))
