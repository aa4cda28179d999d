"""FedPer (Arivazhagan et al., 2019, "Federated Learning with Personalization Layers").

The model is cut into a shared body (base layers) and a personal head (personalization layers,
``model.split``). Each round the sampled clients receive the global body, train body and head on
their data from (global body, own head), and upload the body; the server averages the bodies by
training-set size (FedAvg on the ``"body.*"`` tensors, BatchNorm buffers included) and never sees
a head. Each client keeps its head in its own client state (``"head"``); on its first
participation it starts from the initial head (the common initialisation, which is also the head
of the server's initial model).

Evaluation (``personalized = True``): client k is tested with the current global body and its
own head; a client never sampled is tested with the global body and the initial head. There is
no meaningful global model (the initial head on the averaged body), so ``global_acc`` is not
reported (``has_global_model = False``), as in PFLlib, whose FedPer evaluates personal models only.

Communication: the body goes down and up (the reference PFLlib ``serverper`` sends the whole
global model but the client copies only the base; fedhet sends what is used).

This class is the base of the head-personalized methods: FedRep (alternating head/body
training) and FedPAC (server-side classifier combination) override ``local_training``
(FedAvg's hook: how one round's local training runs), :meth:`FedPer.personal_head` (where a client's head comes
from) and the server hooks. The alternating local training FedRep, FedPAC and FedReMa's +A&F
variant share is :func:`fedhet.training.phases.train_head_then_body`.
"""

from __future__ import annotations

from typing import ClassVar

from fedhet.algorithms.aggregate import weighted_average
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
from fedhet.core.split import BODY, HEAD, select


class FedPer(FedAvg):
    """FedPer; see the module docstring. Base class of FedRep and FedPAC."""

    name = "fedper"
    personalized = True
    only_body_and_head = True          # own entries beside the network are neither
    has_global_model = False
    # Whether the client keeps its trained head in its state (FedPer, FedRep). FedPAC's heads are
    # computed by the server and sent down, so its clients keep none.
    head_on_client: ClassVar[bool] = True
    clients_own_head = True            # personal heads (FedRep's too; FedPAC's combined by the server)

    class Params(FedAvg.Params):
        """No parameters of its own (a subclass, so that FedPer combines with other methods)."""

    # --- server ---------------------------------------------------------------------------
    def train_message(self, state: State, cid: int, ctx: RoundContext) -> Message:
        msg = Message("train", {"model": select(state["model"], BODY)})
        head = self.server_head(state, cid)
        if head is not None:
            msg.arrays["head"] = head
        return msg

    def server_head(self, state: State, cid: int) -> Arrays | None:
        """A head the server sends to client ``cid`` (FedPAC's combined classifier); FedPer: none."""
        return None

    def aggregate(self, state: State, replies: Replies, ctx: RoundContext) -> State:
        """Sample-size weighted average of the uploaded bodies (``aggregation_weights``); the server's head
        stays the initial one."""
        cids = sorted(replies)
        if not cids:
            return state
        body = weighted_average([select(replies[c].arrays["model"], BODY) for c in cids],
                                self.aggregation_weights(replies, cids))
        state["model"] = {**state["model"], **body}
        return state

    # --- client ---------------------------------------------------------------------------
    def start_weights(self, msg: Message, state: State | None, client: ClientRuntime) -> Arrays:
        """Received body + the head to train from: the one the server sent, else the client's own,
        else the initial head (first participation)."""
        head = msg.arrays.get("head")
        if head is None and state:
            head = state.get("head")
        if head is None:
            head = select(client.init_weights(), HEAD)
        return {**head, **select(msg.arrays["model"], BODY)}

    def uploaded_model(self, weights: Arrays) -> Arrays:
        return select(weights, BODY)

    def after_training(self, result: LocalResult, msg: Message, state: State | None,
                       client: ClientRuntime) -> State | None:
        state = super().after_training(result, msg, state, client)
        if self.head_on_client:
            state = {**(state or {}), "head": select(result.weights, HEAD)}
        return state

    # --- evaluation -----------------------------------------------------------------------
    def personal_head(self, cid: int, state: State, client_state: State | None) -> Arrays | None:
        """Client ``cid``'s current head, or None (never trained: the initial head)."""
        return (client_state or {}).get("head") if self.head_on_client else None

    def global_model(self, state: State) -> Arrays | None:
        return None

    def client_model(self, cid: int, state: State, client_state: State | None) -> Arrays | None:
        head = self.personal_head(cid, state, client_state)
        weights = state["model"] if head is None else {**state["model"], **head}
        if self.params.bn_buffers == "local" and client_state and "buffers" in client_state:
            weights = {**weights, **client_state["buffers"]}
        return weights
