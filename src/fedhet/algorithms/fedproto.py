"""FedProto (Tan, Long, Liu, Zhou, Lu, Jiang & Zhang, AAAI 2022, "FedProto: Federated Prototype
Learning across Heterogeneous Clients").

No model is averaged or sent: each client's whole model lives in its own client state, and only
class prototypes travel. One round (paper Algorithm 1):

1. The server sends the global prototypes ``{C^j}`` (array group ``"prototypes"``: ``mean``
   (C, d) and a ``defined`` mask; nothing in the first round).
2. Each sampled client trains its model (the common initialisation on its first participation)
   for E epochs on ``CE + proto_weight * MSE(h, C^{y})`` (the paper's local objective), the alignment over the samples
   whose class has a global prototype
   (:class:`fedhet.algorithms.prototypes.PrototypeAlignment`); without prototypes, CE only.
3. It uploads its local prototypes (per-class mean features, with their counts).
4. The server's global prototype of class j is the plain mean of the uploaded prototypes of the
   clients that have j (``aggregate_prototypes(..., "uniform")``, the reference
   ``proto_aggregation`` of yuetan031/fedproto and PFLlib; the paper writes a size-weighted form).
   A class no client of the round has is undefined; there is no memory across rounds (as in the
   references).

``proto_weight`` (lambda) defaults to 1, FedReMa's setting for its Table 1 (PFLlib's default;
FedNH uses 0.1).

Evaluation (``proto_eval``). PFLlib's ``clientproto.test_metrics`` classifies a test sample by
the nearest global prototype to the client's feature (its model's classifier is not used; before
any prototype exists it scores 0). fedhet's evaluator only runs ``logits = head(body(x))``, so
``"nearest_prototype"`` (default) builds an exactly equivalent linear head (:func:`nearest_prototype_head`):
``logits_c = 2 <C^c, h> - ||C^c||^2 = ||h||^2 - ||h - C^c||^2``, whose argmax is the nearest
prototype (undefined classes get -1e30 and are never chosen, PFLlib's ``inf`` distance). This
needs the head to be one Linear layer on the features (cnn2's default split ``fc2``, PFLlib's
FedProto split ``head = fc``). The official code's test (``yuetan031/FedProto``
``lib/update.py``, ``test_inference_new_het_lt``) chooses only among the classes the client holds;
fedhet, as PFLlib, among every class with a global prototype. Decisions:

* With a deeper head (e.g. ``split: fc1``), a bias-free Linear, or an activation before the Linear
  (FedClassAvg's ``ReLU + Linear`` heads: set ``model.options.relu_features: true`` there, which
  puts the ReLU at the end of the body, so prototypes are the classifier's inputs as in both
  references), no Linear head ranks the prototypes, and the run is refused when it is built
  (:meth:`FedProto.check_model`) with the fix; ``proto_eval: classifier`` evaluates each client with
  its own classifier instead, on any model. Before any global prototype exists, the client is
  evaluated with its own classifier, and a warning says so once.
* A client never sampled is evaluated with the common initialisation and its classifier.

Decision on local prototypes: computed after training with the final model in eval mode
(:func:`fedhet.algorithms.prototypes.class_means`, PFLlib's ``collect_protos``), i.e. the paper's prototype definition on the
client's trained embedding function. PFLlib's FedProto client instead averages the train-mode
features of every batch of all local epochs (the official code: of the last epoch), i.e. of a
moving model; the two agree as the local model converges.

``augment: supcon_view`` trains on one view of FedClassAvg's augmentation per image, so that
FedClassAvg's tables compare FedProto like for like with methods that see augmented images.
"""

from __future__ import annotations

import warnings
from typing import Any, Literal

import torch
from pydantic import Field

from fedhet.algorithms.base import update_reply
from fedhet.algorithms.fedavg import FedAvg
from fedhet.algorithms.prototypes import (
    GROUP,
    PrototypeAlignment,
    aggregate_prototypes,
    class_means,
    prototype_arrays,
    received_prototypes,
    uploaded_prototypes,
)
from fedhet.core.contract import (
    Arrays,
    ClientRuntime,
    Message,
    Replies,
    RoundContext,
    State,
)
from fedhet.core.errors import ConfigError
from fedhet.core.split import HEAD, linear_classifier, linear_head_names, select
from fedhet.training.local import trains_in_channels_last
from fedhet.training.objective import LossTerm

UNDEFINED_LOGIT = -1e30


def nearest_prototype_head(head: Arrays, prototypes: torch.Tensor, defined: torch.Tensor) -> Arrays | None:
    """Weights for a one-Linear ``head`` whose argmax is the nearest prototype (Euclidean, as
    PFLlib's MSE distance): ``W = 2 P``, ``b_c = -||P_c||^2`` (``-1e30`` for an undefined class).

    ``head`` must hold exactly one ``<prefix>weight`` of shape (C, d) equal to the prototypes' and
    its ``<prefix>bias`` (C,); otherwise (a deeper head, no bias) returns None.
    """
    wk, bk = linear_head_names(head) or (None, None)
    if wk is None or bk is None or tuple(head[wk].shape) != tuple(prototypes.shape):
        return None
    p = prototypes.to(head[wk].dtype)
    bias = torch.where(defined.bool(), -(p.double() ** 2).sum(1), torch.full_like(p[:, 0], UNDEFINED_LOGIT).double())
    weight = torch.where(defined.bool().unsqueeze(1), 2.0 * p, torch.zeros_like(p))
    return {wk: weight, bk: bias.to(head[bk].dtype)}


class FedProto(FedAvg):
    """FedProto; see the module docstring."""

    name = "fedproto"
    takes_mixup = False          # prototype alignment pulls each feature to its label's prototype
    personalized = True
    has_global_model = False
    sends_global_model = False         # prototypes only

    class Params(FedAvg.Params):
        proto_weight: float = Field(1.0, ge=0)     # lambda of the local objective (FedReMa Table 1: 1)
        proto_eval: Literal["nearest_prototype", "classifier"] = "nearest_prototype"

    def check_model(self, arch: str, model: torch.nn.Module) -> None:
        super().check_model(arch, model)
        if self.params.proto_eval != "nearest_prototype":
            return
        hint = "; or evaluate each client with its own classifier: algorithm.params.proto_eval: classifier"
        try:
            _, bias = linear_classifier(model, "FedProto's nearest-prototype evaluation", arch)
        except ConfigError as e:
            raise ConfigError(f"{e}{hint}") from None
        if bias is None:
            raise ConfigError(f"FedProto's nearest-prototype evaluation puts -||C_c||^2 in the classifier's bias, and "
                              f"model {arch}'s head has none: use cnn2 (its default split, 'fc2', is PFLlib's "
                              f"FedProto head) or a model of one's own whose head is nn.Linear(..., bias=True){hint}")

    # --- server ---------------------------------------------------------------------------
    def init_server_state(self, init_models: dict[str, Arrays]) -> State:
        # Models never leave the clients, so clients may have different architectures (the
        # paper's setting) as long as their features have one size.
        return {"prototypes": None, "defined": None}

    def train_message(self, state: State, cid: int, ctx: RoundContext) -> Message:
        msg = Message("train")
        if state.get("defined") is not None and bool(state["defined"].any()) and self.params.proto_weight > 0:
            msg.arrays[GROUP] = prototype_arrays(state["prototypes"], state["defined"])
        return msg

    def aggregate(self, state: State, replies: Replies, ctx: RoundContext) -> State:
        uploads = [up for c in sorted(replies) if (up := uploaded_prototypes(replies[c])) is not None]
        agg = aggregate_prototypes(uploads, "uniform")                       # the reference code's plain mean
        if agg is not None:
            state["prototypes"], state["defined"] = agg
        return state

    # --- client ---------------------------------------------------------------------------
    def local_terms(self, msg: Message, state: State | None, client: ClientRuntime) -> list[LossTerm]:
        terms = super().local_terms(msg, state, client)
        received = received_prototypes(msg)
        if received is not None and self.params.proto_weight > 0:
            terms.append(PrototypeAlignment(*received, self.params.proto_weight))     # CE + lambda * MSE
        return terms

    def client_update(self, msg: Message, state: State | None, client: ClientRuntime) -> tuple[Message, State | None]:
        weights = state["model"] if state and "model" in state else client.init_weights()
        terms = [*self.data_terms(msg, state, client), *self.local_terms(msg, state, client)]
        result = client.train(weights, terms, **self.train_options(msg, state, client))
        state = {**(state or {}), "model": result.weights}
        means, counts = class_means(client.model, result.weights, client.data, client.num_classes,   # local prototypes
                                    fast_passes=trains_in_channels_last(client.settings))
        reply = update_reply(result, client, {GROUP: {"mean": means, "count": counts},
                                              **self.uploads(result, msg, state, client)})
        return reply, state

    # --- evaluation -----------------------------------------------------------------------
    def global_model(self, state: State) -> Arrays | None:
        return None

    def client_model(self, cid: int, state: State, client_state: State | None) -> Arrays | None:
        if not client_state or "model" not in client_state:
            return None
        model = client_state["model"]
        if self.params.proto_eval != "nearest_prototype":
            return model
        defined = state.get("defined")
        if defined is None or not bool(defined.any()):
            self._warn("no global prototype exists yet")
            return model
        head = nearest_prototype_head(select(model, HEAD), state["prototypes"], defined)
        if head is None:      # FedProto.check_model refuses such a model when the client host is made
            raise RuntimeError(f"fedproto: client {cid}'s head ({sorted(select(model, HEAD))}) is not one Linear layer "
                               f"with a bias taking the {tuple(state['prototypes'].shape)} prototypes' features, "
                               "which FedProto.check_model should have refused")
        return {**model, **head}

    def round_metrics(self, state: State) -> dict[str, Any]:
        out = dict(super().round_metrics(state))
        if self.params.proto_eval == "nearest_prototype":
            # how many classes have a global prototype; 0: the clients were judged by their own classifiers
            defined = state.get("defined")
            out["fedproto_prototype_classes"] = int(defined.sum()) if defined is not None else 0
        return out

    def _warn(self, why: str) -> None:
        seen = self.__dict__.setdefault("_warned", set())
        if why not in seen:
            seen.add(why)
            warnings.warn(f"fedproto: evaluating with each client's own classifier instead of the nearest "
                          f"prototype because {why}; see fedhet.algorithms.fedproto", stacklevel=3)
