"""FedReMa (Liang et al.): personalized classifiers from the most relevant peers.

Source: Liang et al., "FedReMa: Improving Personalized Federated Learning via Leveraging the Most
Relevant Clients", Sec. 4, Algorithms 1-2, Eq. 5-10; official code ``liangh68/FedReMa``
(``serverReMa.py``, ``clientReMa.py``) for what the paper leaves open.

One round (Algorithm 2), full participation in the paper:

1. Every client trains its personalized model ``w_k = {theta, phi_k}`` (global feature
   extractor + its own classifier) for E epochs and uploads it.
2. The server averages the feature extractors (Eq. 6) and measures relevance: each classifier's
   soft logits on one random probe feature, ``p_k = softmax(phi_k(h~) / M)`` with
   ``h~ ~ U[0,1)^d`` (Sec. 4.1), and ``S[k1, k2] = cos(p_k1, p_k2)`` (Eq. 5).
3. During the critical co-learning period (CCP): for each client, maximum difference
   segmentation (MDS, Algorithm 1, :func:`mds`) of its similarity row gives the relevant set
   ``A_k``; ``phi_k`` becomes the sample-weighted mean of the classifiers in ``A_k`` (Eq. 7); the
   dependency map counts the selections, ``G[k, i] += 1`` for ``i`` in ``A_k``; and the period
   ends for good when the round's mean maximum gap falls below ``delta`` times its running
   maximum (Eq. 8-9, :func:`ccp_continues`).
4. After the CCP: ``phi_k = sum_i G[k, i] phi_i / sum_i G[k, i]`` (Eq. 10).
5. Each client receives ``{theta, phi_k}``; that is also the model it is evaluated with.

Decisions (where the paper and the official code differ or are silent):

* The soft logits ``p_k`` are computed by the client on the classifier it uploads, from a
  probe seed the server sends as a scalar, and uploaded as 10 extra floats. The server's
  arithmetic is exactly the paper's (the same function of the same classifier), and the server
  never has to run a model, which keeps the round engine-agnostic (Flower's server holds no
  model instance).
* One probe ``h~ ~ U[0,1)^d`` per round shared by all clients and ``M`` for every client (the
  paper); the reference draws a new ``h~ = 0.5 * rand`` per row and uses ``M`` only for the
  row's own client.
* MDS follows the code, not Algorithm 1's off-by-one: sort ``s_k`` ascending with the client
  itself last (``s_kk = 1``), take the gaps between neighbours, ignore the last gap (self vs. its
  most similar peer), cut at the largest remaining gap and keep everything above it. So ``A_k``
  always holds ``k`` and its most similar peer, and the gap ``Delta s*_k`` that Eq. 8 averages is
  the largest of the other gaps, never the self-gap (where the self-gap is the largest, the
  paper's text would average it, and the critical period would end at another round). Ties go
  to the lowest gap (the largest set). When no gap is positive (all peers equally similar) or
  there are fewer than three clients, every uploaded client is relevant and the gap is 0.
* ``Delta s_bar`` is the mean over clients (Eq. 8 writes a sum; the ratio test of Eq. 9 is the
  same). While every gap so far is 0 the ratio is undefined and the CCP continues.
* Classifier weights in Eq. 7 are sample sizes (the paper; the code uses uniform weights,
  ``head_weighting: uniform``; identical for equal client sizes as in Table 1).
* Aggregation keys every weight by client id (the reference mixes heads with the wrong
  clients' weights).
* With partial participation only the uploaded clients get new classifiers; a client whose
  dependency row has no weight on this round's uploads keeps its own uploaded classifier.
* Each client's SGD momentum persists across rounds (the reference creates its optimizer once):
  ``keeps_optimizer_state``, so ``train.optimizer_state: auto`` keeps it (the client host carries
  it; ``reset`` gives FedReMa a fresh optimizer every round like the baselines); ``train.clip_grad_norm: 10`` and ``train.drop_last: true`` reproduce the
  rest of its local training (configs/papers/fedrema/).

Variants of Sec. 5 (Table 4 and Table 5):
``ccp: forever`` - MDS in every round (Table 5, "+MDS"); ``feature_alignment: true`` - FedPAC's
prototype alignment on the client (FedReMa+F, Eq. 11: ``CE + lambda * MSE(h, proto[y])``, lambda
``align_weight`` = 1); plus ``alternating: true`` - classifier-then-extractor training
(FedReMa+A&F). As in the official ``clientReMa.train_separately_with_proto``: the classifier
trains E epochs, then the extractor E epochs with the alignment term; clients upload per-class
mean features of their trained model, the server averages them uniformly into the prototypes
sent next round (a class nobody has is not aligned).
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import pydantic
import torch
from torch.func import functional_call

from fedhet.algorithms.aggregate import weighted_average
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
    LocalResult,
    Message,
    Replies,
    RoundContext,
    RoundGenerator,
    State,
)
from fedhet.core.split import BODY, HEAD, select, strip_prefix
from fedhet.training.local import trains_in_channels_last
from fedhet.training.mode import in_mode
from fedhet.training.objective import LossTerm
from fedhet.training.phases import train_head_then_body


# --- relevance (server) --------------------------------------------------------------------
def probe_feature(seed: int, dim: int) -> torch.Tensor:
    """The round's random feature ``h~ ~ U[0,1)^d`` (paper Sec. 4.1), the same on every client."""
    g = torch.Generator()
    g.manual_seed(seed)
    return torch.rand(dim, generator=g)


def soft_logits(model: torch.nn.Module, head: Arrays, probe: torch.Tensor, temperature: float) -> torch.Tensor:
    """``softmax(phi(h~) / M)`` of a classifier (paper Sec. 4.1), in eval mode: a measurement of the
    classifier, so a head with dropout or BatchNorm gives it for its one probe without noise."""
    weights = strip_prefix(head, HEAD)
    with torch.no_grad(), in_mode(model.head, training=False):
        probe = probe.to(next(iter(weights.values())).device) if weights else probe
        logits = functional_call(model.head, weights, (probe.unsqueeze(0),), strict=False)
    return torch.softmax(logits.double() / temperature, dim=1).squeeze(0)


def similarity_matrix(p: torch.Tensor) -> np.ndarray:
    """Cosine similarity of the rows of ``p`` (Eq. 5), diagonal exactly 1."""
    p = p.double()
    unit = p / p.norm(dim=1, keepdim=True).clamp_min(1e-300)
    s = (unit @ unit.T).numpy()
    np.fill_diagonal(s, 1.0)
    return s


def mds(similarity: np.ndarray, self_pos: int) -> tuple[list[int], float]:
    """Maximum difference segmentation (Algorithm 1, as in the official code).

    ``similarity`` is one client's row over the uploaded clients, ``self_pos`` its own position.
    Returns the positions of the relevant set and the maximum gap ``Delta s*``.
    """
    n = len(similarity)
    # Ascending, the client itself last even if a peer ties with it.
    order = sorted(range(n), key=lambda i: (float(similarity[i]), i == self_pos))
    gaps = np.diff(np.asarray([similarity[i] for i in order], dtype=np.float64))[:-1]
    if gaps.size == 0 or gaps.max() <= 0:
        return list(range(n)), 0.0
    m = int(np.argmax(gaps))                 # first maximum: the lowest cut, the largest set
    return sorted(order[m + 1:]), float(gaps[m])


def ccp_continues(gap_history: list[float], delta: float) -> bool:
    """Eq. 9: the period goes on while the latest mean gap is more than ``delta`` of the largest so far."""
    peak = max(gap_history)
    if peak <= 0:
        return True
    return gap_history[-1] / peak > delta


def dependency_average(heads: dict[int, Arrays], row: dict[int, float]) -> Arrays | None:
    """Eq. 10: classifiers weighted by the dependency counts ``row[i] = G[k, i]`` (uploaded ``i`` only)."""
    cids = [i for i in sorted(heads) if row.get(i, 0) > 0]
    if not cids:
        return None
    return weighted_average([heads[i] for i in cids], [row[i] for i in cids])


class FedReMa(FedAvg):
    """FedReMa; see the module docstring for the round, the decisions and the variants."""

    name = "fedrema"
    personalized = True
    has_global_model = False
    keeps_optimizer_state = True

    class Params(FedAvg.Params):
        delta: float = pydantic.Field(0.5, gt=0, lt=1)          # CCP threshold (Eq. 9), paper 0.5
        temperature: float = pydantic.Field(0.5, gt=0)          # M of the soft logits, paper 0.5
        ccp: Literal["adaptive", "forever"] = "adaptive"        # forever: MDS every round (Table 5 "+MDS")
        head_weighting: Literal["samples", "uniform"] = "samples"   # Eq. 7 weights (code: uniform)
        feature_alignment: bool = False                         # FedReMa+F (Table 4)
        alternating: bool = False                               # with feature_alignment: FedReMa+A&F
        align_weight: float = pydantic.Field(1.0, ge=0)         # lambda of Eq. 11

        @pydantic.model_validator(mode="after")
        def _alternating_needs_alignment(self):
            if self.alternating and not self.feature_alignment:
                raise ValueError("alternating: true is the +A&F variant and needs feature_alignment: true")
            return self

    @property
    def takes_mixup(self) -> bool:  # type: ignore[override]
        # the +F variant's feature alignment pulls each feature to its label's prototype
        return not self.params.feature_alignment

    # --- server ---------------------------------------------------------------------------
    def init_server_state(self, init_models: dict[str, Arrays]) -> State:
        state = super().init_server_state(init_models)
        # heads: personalized classifiers by client id; G: dependency counts {k: {i: count}}.
        state.update({"heads": {}, "G": {}, "ccp": True, "ccp_end_round": None, "gaps": [],
                      "relevant": {}, "mean_gap": None, "prototypes": None, "defined": None})
        return state

    def personal_model(self, state: State, cid: int) -> Arrays:
        head = state["heads"].get(cid)
        return {**state["model"], **head} if head is not None else state["model"]

    def train_message(self, state: State, cid: int, ctx: RoundContext) -> Message:
        msg = Message("train", {"model": self.personal_model(state, cid)})
        msg.scalars["probe_seed"] = state["probe_seed"]
        if self.params.feature_alignment and state["defined"] is not None and bool(state["defined"].any()):
            msg.arrays[GROUP] = prototype_arrays(state["prototypes"], state["defined"])
        return msg

    def round(self, state: State, ctx: RoundContext) -> RoundGenerator:
        state = dict(state)
        state["probe_seed"] = int(ctx.rng.integers(2**62))
        replies = yield {cid: self.train_message(state, cid, ctx) for cid in ctx.clients}
        return self.aggregate(state, replies, ctx)

    def aggregate(self, state: State, replies: Replies, ctx: RoundContext) -> State:
        cids = sorted(replies)
        if not cids:
            return state
        sizes = {c: float(replies[c].scalars["num_samples"]) for c in cids}
        models = {c: replies[c].arrays["model"] for c in cids}
        body = weighted_average([select(models[c], BODY) for c in cids],
                                self.aggregation_weights(replies, cids))     # Eq. 6: FedAvg's, the sample sizes
        state["model"] = {**state["model"], **body}
        heads = {c: select(models[c], HEAD) for c in cids}
        sim = similarity_matrix(torch.stack([replies[c].arrays["relevance"]["soft_logits"] for c in cids]))

        new_heads = dict(state["heads"])
        G = {k: dict(row) for k, row in state["G"].items()}
        relevant: dict[int, list[int]] = {}
        if state["ccp"]:
            gaps = []
            for pos, k in enumerate(cids):
                members, gap = mds(sim[pos], pos)
                A = [cids[i] for i in members]
                relevant[k] = A
                gaps.append(gap)
                w = [sizes[i] if self.params.head_weighting == "samples" else 1.0 for i in A]
                new_heads[k] = weighted_average([heads[i] for i in A], w)                         # Eq. 7
                row = G.setdefault(k, {})
                for i in A:
                    row[i] = row.get(i, 0) + 1
            state["mean_gap"] = float(np.mean(gaps))                                             # Eq. 8 (mean)
            state["gaps"] = [*state["gaps"], state["mean_gap"]]
            if self.params.ccp == "adaptive" and not ccp_continues(state["gaps"], self.params.delta):   # Eq. 9
                state["ccp"] = False
                state["ccp_end_round"] = ctx.round + 1
        else:
            for k in cids:
                avg = dependency_average(heads, G.get(k, {}))                                    # Eq. 10
                new_heads[k] = avg if avg is not None else heads[k]
            state["mean_gap"] = None
        state["heads"], state["G"], state["relevant"] = new_heads, G, relevant
        if self.params.feature_alignment:
            uploads = [up for c in cids if (up := uploaded_prototypes(replies[c])) is not None]
            agg = aggregate_prototypes(uploads, "uniform")
            if agg is not None:
                state["prototypes"], state["defined"] = agg
        return state

    def round_metrics(self, state: State) -> dict[str, Any]:
        # The round's relevant sets only: the dependency map G is their count over the CCP rounds
        # so far (G[k][i]: the rows whose fedrema_relevant[k] holds i), which a row does not repeat
        # (up to K x K entries in every row of a long run)
        return {**super().round_metrics(state), "fedrema_ccp": state["ccp"], "fedrema_ccp_end_round": state["ccp_end_round"],
                "fedrema_mean_gap": state["mean_gap"],
                "fedrema_relevant": {str(k): v for k, v in state["relevant"].items()}}

    # --- client ---------------------------------------------------------------------------
    def local_terms(self, msg: Message, state: State | None, client: ClientRuntime) -> list[LossTerm]:
        terms = super().local_terms(msg, state, client)
        received = received_prototypes(msg)
        if self.params.feature_alignment and not self.params.alternating and received is not None:
            terms.append(PrototypeAlignment(*received, self.params.align_weight))
        return terms

    def local_training(self, weights: Arrays, msg: Message, state: State | None, client: ClientRuntime) -> LocalResult:
        if not self.params.alternating:
            return super().local_training(weights, msg, state, client)
        terms = [*self.data_terms(msg, state, client), *self.local_terms(msg, state, client)]
        received = received_prototypes(msg)
        body_terms = terms + ([PrototypeAlignment(*received, self.params.align_weight)] if received else [])
        E = client.settings.epochs
        return train_head_then_body(client, weights, terms, body_terms, head_epochs=E, body_epochs=E,
                                    **self.train_options(msg, state, client))

    def uploads(self, result, msg: Message, state: State | None, client: ClientRuntime) -> dict[str, Arrays]:
        up = super().uploads(result, msg, state, client)
        probe = probe_feature(int(msg.scalars["probe_seed"]), client.model.feature_dim)
        p = soft_logits(client.model, select(result.weights, HEAD), probe, self.params.temperature)
        up["relevance"] = {"soft_logits": p.float()}
        if self.params.feature_alignment:
            means, counts = class_means(client.model, result.weights, client.data, client.num_classes,
                                        fast_passes=trains_in_channels_last(client.settings))
            up[GROUP] = {"mean": means, "count": counts}
        return up

    # --- evaluation -----------------------------------------------------------------------
    def global_model(self, state: State) -> Arrays | None:
        return None

    def client_model(self, cid: int, state: State, client_state: State | None) -> Arrays | None:
        return self.personal_model(state, cid)

    def client_view(self, state: State, cid: int) -> State:
        return {"model": state["model"], "heads": {cid: state["heads"][cid]} if cid in state["heads"] else {}}
