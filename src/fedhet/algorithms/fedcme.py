"""FedCME (Nie, Xiao, Yang & Wu): client matching, classifier exchanging and feature alignment.

Source: the FedCME paper (Nie et al., "FedCME: Client Matching and Classifier Exchanging to Handle
Data Heterogeneity in Federated Learning"), Algorithm 1 (ServerExecute) and Algorithm 2
(ClientExecute), Sec. IV. No official code exists; every choice the paper leaves open is listed below.

One round (Algorithm 1 lines 3-8):

1. Matching (Algorithm 1 lines 11-24, :func:`make_matching`). The server keeps the last uploaded
   evaluation vector ``eps[k]`` of every client (per-class accuracy, see 3). With the vectors of
   the sampled clients it forms ``eps_g`` = their mean, sorts the clients by
   ``cos(eps_k, eps_g)`` ascending (least typical first), and repeatedly pops the first client k
   and pairs it with the remaining client j that minimises ``cos(eps_k, eps_j)``.
2. Phase A (Algorithm 2 lines 3-16, epochs ``0 .. floor(E/2)-1``). Every sampled client receives
   the global model, the global per-class features ``zeta`` (array group ``"features"``) and
   its counterpart's id, and trains ``floor(E/2)`` epochs on
   ``CE + mu * L2Loss`` (Eq. 9-10, :class:`FeatureAlignment`) while accumulating detached
   per-class feature sums (the term's statistics, ``LocalResult.statistics``). It replies with the part it will hand over (array group
   ``"exchange"``: the classifier by default).
3. Phase B (Algorithm 2 lines 4-5 and 22-24, epochs ``floor(E/2) .. E-1``). The server forwards
   to each client its counterpart's mid-round part; the client puts it in place of its own,
   trains the remaining ``E - floor(E/2)`` epochs (same batches as an unsplit run), and uploads
   its model (``"model"``), its per-class feature means ``zeta_k`` (Algorithm 2 line 18,
   ``"features"``) and its evaluation vector ``eps_k`` (Eq. 4, Algorithm 2 lines 19-20,
   ``"evaluation"``): per-class accuracy of the final (swapped) model on a random
   ``eval_fraction`` subset of its TRAINING data.
4. Aggregation (Algorithm 1 lines 25-36, :func:`aggregate_features`): FedAvg on the models,
   ``eps[k] <- eps_k``, and the global features with memory (a class a client did not see takes
   the previous global value; unweighted mean over the clients).

Ablations of the paper's Sec. V-B, all selected by ``algorithm.params``:

============  ==========================================================================
variant       params
============  ==========================================================================
FedCME        ``exchange: classifier, matching: one_to_one, mu > 0`` (defaults, mu 0.01)
FedCME-OL     ``exchange: none`` - L2 feature alignment only; one phase of E epochs
FedCME-OE     ``mu: 0`` - classifier exchange only; no features are sent or uploaded
FedCME-MTO    ``matching: many_to_one`` - every client takes the classifier of its most
              dissimilar sampled client; one classifier may go to several clients
FedCME-WM     ``exchange: whole`` - the whole mid-round model is exchanged
FedCME-FE     ``exchange: extractor`` - only the feature extractor (body) is exchanged
============  ==========================================================================

Decisions where the paper is silent or inconsistent:

* The text of Sec. IV-A says "exchange the feature extractor"; Algorithm 2, the title, Fig. 1
  and the FedCME-FE ablation say classifier: the classifier is exchanged.
* Classifier = the model's head (``model.split``; for ``cnn2`` the last Linear, 512 -> C), so
  the features are the head's input.
* A client never sampled before has no evaluation vector (``None``); cosine similarity with
  ``None`` or with a zero vector is 0, and ``eps_g`` treats ``None`` as a zero vector (it is
  the mean over all sampled clients, Algorithm 1 line 15; dividing by the number of known
  vectors instead would only rescale ``eps_g`` and leave every cosine, hence the matching,
  unchanged). In round 0 every similarity is 0,
  so clients pair in sampling order. Ties in the greedy search go to the client that
  comes first in the sorted order.
* Odd number of sampled clients: the last client left has no counterpart and trains all E
  epochs without an exchange (it still takes part in both phases, receiving an empty
  ``"continue"`` message in phase B).
* A client whose counterpart did not answer phase A (dropped out) continues without the swap.
* ``zeta`` starts undefined (a per-class ``defined`` mask); the L2 term skips undefined
  classes and, in aggregation, a class without a previous global value is averaged over the
  clients that saw it, and stays undefined if none did. Algorithm 1 lines 29-33
  are authoritative over the reversed sentence of Sec. IV-B.
* ``zeta_k`` is the running mean of the detached features over all E epochs' batches, with
  the evolving model (Algorithm 2 lines 12 and 18), not an extra pass with the final model as
  Eq. 5 suggests. ``sum/count`` equals line 18's ``/(E*|D_kc|)`` when no batch is
  dropped.
* ``D_eval`` is a random ``round(eval_fraction * n_k)`` (at least 1) subset of the client's
  training split, drawn from the client's ``"eval_subset"`` stream of the round; classes absent
  from it get accuracy 0 (Eq. 4 and the sentence after it).
* Optimizer: each phase starts from fresh SGD state (plain SGD without momentum, the paper's
  setting, has none; with momentum this re-creates it after the swap).
* With ``mu == 0`` (FedCME-OE) there is nothing to align to, so the global features are not
  sent and the local features are not uploaded (the ablation's communication is the
  exchange's only).

Engine contract notes: the client reads the run's number of local epochs E from
``client.settings.epochs``. :class:`FeatureAlignment` is a pure, vmappable loss term: the
per-class feature sums of Algorithm 2 line 12 are its :meth:`FeatureAlignment.statistics`,
which local training (and the vectorized engine, per client) adds up batch by batch in step
order; phase B passes phase A's totals back in (``client.train(..., statistics=...)``), so the
accumulation runs over all E epochs.
"""

from __future__ import annotations

from typing import Any, Literal

import pydantic
import torch

from fedhet.algorithms.base import update_reply
from fedhet.algorithms.fedavg import FedAvg
from fedhet.algorithms.prototypes import aggregate_prototypes
from fedhet.core.contract import (
    Arrays,
    Batch,
    ClientData,
    ClientRuntime,
    Forward,
    LocalResult,
    Message,
    Replies,
    RoundContext,
    RoundGenerator,
    State,
)
from fedhet.core.errors import ConfigError
from fedhet.core.split import BODY, HEAD, select
from fedhet.training.local import forward
from fedhet.training.mode import in_mode
from fedhet.training.objective import LossTerm

Vectors = dict[int, "torch.Tensor | None"]

# Client-state key of what survives between a client's phase A and phase B.
MID = "fedcme_mid"


# --- matching (server) -------------------------------------------------------------------
def cosine(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    """Cosine similarity; 0 when either vector is missing (``None``) or zero."""
    if a is None or b is None:
        return 0.0
    a = a.double().flatten()
    b = b.double().flatten()
    na, nb = float(a.norm()), float(b.norm())
    if na == 0.0 or nb == 0.0:
        return 0.0
    return float(a @ b) / (na * nb)


def _typicality_order(vectors: Vectors, clients: list[int]) -> list[int]:
    """Clients sorted by cos(eps_k, eps_g) ascending (FedCME paper (Nie et al.), Algorithm 1
    lines 13-17). eps_g is the mean over ALL sampled clients with a missing vector counted as
    zeros. The sort is stable: equal similarities keep sampling order."""
    present = [vectors.get(k) for k in clients if vectors.get(k) is not None]
    if present:
        g = torch.stack([v.double().flatten() for v in present]).sum(0) / len(clients)
    else:
        g = None
    return sorted(clients, key=lambda k: cosine(vectors.get(k), g))


def make_matching(vectors: Vectors, clients: list[int]) -> dict[int, int | None]:
    """One-to-one counterparts (FedCME paper (Nie et al.), Algorithm 1 lines 11-24).

    ``vectors[k]`` is client k's last evaluation vector or ``None`` (never seen). Returns
    ``{k: j}`` with ``j``'s classifier going to ``k`` and vice versa; with an odd number of
    clients the last one left maps to ``None`` (no exchange).
    """
    remaining = _typicality_order(vectors, clients)
    match: dict[int, int | None] = {}
    while remaining:
        k = remaining.pop(0)                                   # Algorithm 1 line 19
        if not remaining:
            match[k] = None                                    # odd count: unpaired
            break
        # Algorithm 1 line 20; min() keeps the first minimum: ties go to the earliest in sorted order.
        j = min(remaining, key=lambda c: cosine(vectors.get(k), vectors.get(c)))
        remaining.remove(j)                                    # Algorithm 1 line 22
        match[k], match[j] = j, k                              # Algorithm 1 line 21
    return {k: match[k] for k in clients}


def make_many_to_one(vectors: Vectors, clients: list[int]) -> dict[int, int | None]:
    """FedCME-MTO (paper Sec. V-B, Fig. 4): client k takes the classifier of its most dissimilar
    other sampled client; several clients may take the same one (and some classifiers go unused).
    Ties go to the earliest client in the typicality order of :func:`make_matching`; a client
    alone in its round maps to ``None``."""
    order = _typicality_order(vectors, clients)
    out: dict[int, int | None] = {}
    for k in clients:
        others = [j for j in order if j != k]
        out[k] = min(others, key=lambda c: cosine(vectors.get(k), vectors.get(c))) if others else None
    return out


def matching_pairs(match: dict[int, int | None], clients: list[int]) -> list[list[int | None]]:
    """A one-to-one matching as a list of ``[k, j]`` pairs (each pair once, ``[k, None]`` unpaired)."""
    seen: set[int] = set()
    pairs = []
    for k in clients:
        if k in seen:
            continue
        j = match[k]
        seen.add(k)
        if j is not None:
            seen.add(j)
        pairs.append([k, j])
    return pairs


# --- feature alignment (client) ----------------------------------------------------------
class FeatureAlignment(LossTerm):
    """``mu * L2Loss`` of Eq. 9-10; its statistics are the per-class feature sums of Algorithm 2.

    L2Loss = sum over classes c present in the batch whose global feature ``zeta[c]`` is
    defined of ``|| mean_{i in B, y_i = c} h_i - zeta[c] ||_2^2`` (squared L2 summed over
    feature dimensions and classes; ``zeta`` is a constant). FedCME paper (Nie et al.),
    Algorithm 2 lines 8-13.

    The call is pure (no state, no data-dependent Python branching; classes are masked with
    ``torch.where``), so the vectorized engine runs it under ``vmap``. :meth:`statistics`
    gives the batch's detached per-class feature sums (``"sums"``, (C, d) float64) and counts
    (``"counts"``, (C,) int64) (Algorithm 2 line 12); local training accumulates them as
    ``"l2.sums"`` / ``"l2.counts"`` of ``LocalResult.statistics``, starting from the totals
    passed in (phase B continues phase A's accumulation). With ``zeta is None`` (nothing
    defined yet) or ``mu == 0`` the loss is 0 and only the statistics are collected.
    """

    name = "l2"
    vectorizable = True

    def __init__(self, mu: float, num_classes: int, zeta: torch.Tensor | None = None,
                 defined: torch.Tensor | None = None):
        self.mu = float(mu)
        self.num_classes = num_classes
        self.zeta = zeta
        self.defined = defined.bool() if defined is not None else None
        if zeta is not None and self.defined is None:
            self.defined = torch.ones(num_classes, dtype=torch.bool, device=zeta.device)

    def _onehot(self, y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # == F.one_hot(y, C), written as a comparison so it is vmappable
        return (y.unsqueeze(1) == torch.arange(self.num_classes, device=y.device)).to(dtype)   # (B, C)

    def __call__(self, out: Forward, batch: Batch, weights: Arrays) -> torch.Tensor:
        h = out.features
        if self.zeta is None or self.mu == 0.0:
            return h.sum() * 0.0
        onehot = self._onehot(batch.y, h.dtype)
        class_sums = onehot.T @ h                                                      # (C, d)
        class_counts = onehot.sum(0)                                                   # (C,)
        use = ((class_counts > 0) & self.defined.to(h.device)).unsqueeze(1)          # (C, 1)
        means = class_sums / class_counts.clamp(min=1).unsqueeze(1)                   # Algorithm 2 line 13
        diff = torch.where(use, means - self.zeta.to(h.device, h.dtype), torch.zeros_like(means))
        return self.mu * (diff ** 2).sum()

    def statistics(self, out: Forward, batch: Batch) -> dict[str, torch.Tensor]:
        """Algorithm 2 line 12: the batch's detached per-class feature sums and counts."""
        h = out.features.detach()
        onehot = self._onehot(batch.y, h.dtype)
        return {"sums": (onehot.T @ h).double(), "counts": onehot.sum(0).round().long()}


def local_features(statistics: dict[str, torch.Tensor],
                   name: str = FeatureAlignment.name) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(zeta_k, counts)`` from a result's statistics: per-class means (zeros where the count is
    0) and counts (Algorithm 2 line 18), or None if no batch was seen."""
    sums, counts = statistics.get(f"{name}.sums"), statistics.get(f"{name}.counts")
    if sums is None:
        return None
    cnt = counts.clamp(min=1).double().unsqueeze(1)
    means = torch.where(counts.unsqueeze(1) > 0, sums / cnt, torch.zeros_like(sums))
    return means.float(), counts.clone()


def aggregate_features(prev: torch.Tensor | None, prev_defined: torch.Tensor | None,
                       uploads: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Global features with memory (FedCME paper (Nie et al.), Algorithm 1 lines 27-35).

    ``uploads`` holds each replying client's ``(zeta_k (C, d), counts (C,))``. For class c, a
    client that did not see c (count 0) contributes the previous global ``zeta[c]``
    (lines 30-31); the new value is the unweighted mean over the clients (line 35). A class with
    no previous value is averaged over the clients that saw it, and stays undefined if none did.
    Returns ``(zeta, defined)``, or the previous pair if nothing was uploaded.
    """
    return aggregate_prototypes(uploads, "uniform", previous=(prev, prev_defined))


# --- evaluation vector (client) ----------------------------------------------------------
def eval_subset(n: int, fraction: float, generator: torch.Generator) -> torch.Tensor:
    """Positions of a random ``round(fraction * n)`` (at least 1) subset of a training split."""
    if n == 0:
        return torch.zeros(0, dtype=torch.long)
    m = min(n, max(1, int(round(fraction * n))))
    return torch.randperm(n, generator=generator)[:m]


@torch.no_grad()
def evaluation_vector(model: torch.nn.Module, weights: Arrays, data: ClientData, num_classes: int,
                      positions: torch.Tensor, batch_size: int = 1024) -> torch.Tensor:
    """Per-class accuracy of ``weights`` on the training positions given, 0 for absent classes
    (FedCME paper (Nie et al.), Eq. 4 and Algorithm 2 line 20)."""
    correct = torch.zeros(num_classes, dtype=torch.float64, device=data.y.device)
    total = torch.zeros(num_classes, dtype=torch.float64, device=data.y.device)
    positions = positions.to(data.train_idx.device)
    with in_mode(model, training=False):
        # Counts by index_add_, not bincount or a boolean mask: on a device those wait for it.
        for i in range(0, len(positions), batch_size):
            idx = data.train_idx[positions[i:i + batch_size]]
            y = data.y[idx]
            pred = forward(model, weights, data.inputs(idx)).logits.argmax(1)
            total.index_add_(0, y, torch.ones_like(y, dtype=torch.float64))
            correct.index_add_(0, y, (pred == y).double())
    return torch.where(total > 0, correct / total.clamp(min=1), torch.zeros_like(total)).float()


class FedCME(FedAvg):
    """FedCME and its ablations (OL, OE, MTO, WM, FE); see the module docstring for the round,
    the ablation table and every decision."""

    name = "fedcme"
    trains_over_two_messages = True    # before and after the classifier exchange
    takes_mixup = False          # the feature alignment pulls each feature to its label's global feature

    class Params(FedAvg.Params):
        mu: float = pydantic.Field(0.01, ge=0)          # feature-alignment weight (paper: 0.1 or 0.01)
        exchange: Literal["classifier", "whole", "extractor", "none"] = "classifier"
        matching: Literal["one_to_one", "many_to_one"] = "one_to_one"
        eval_fraction: float = pydantic.Field(0.2, gt=0, le=1)

    def check_schedule(self, rounds: int, local_epochs: int) -> None:
        super().check_schedule(rounds, local_epochs)      # a composed method checks every part
        if self.params.exchange != "none" and local_epochs < 2:
            raise ConfigError(
                f"algorithm {self.name}: the exchange ({self.params.exchange}) happens after floor(E/2) local "
                f"epochs, and train.local_epochs is {local_epochs}, so the first phase would train no epoch and "
                "the exchange would swap untrained parts; set train.local_epochs to 2 or more (the paper: 6), "
                "or algorithm.params.exchange: none (FedCME-OL)")

    def check_round_size(self, clients_per_round: int) -> None:
        super().check_round_size(clients_per_round)
        if self.params.exchange != "none" and clients_per_round < 2:
            raise ConfigError(
                f"algorithm {self.name}: train.clients_per_round is {clients_per_round}, so no client has a partner "
                f"to exchange its {self.params.exchange} with and the run would be FedCME-OL (alignment only) under "
                "FedCME's name; "
                "sample 2 or more clients a round (the paper: 10 of 50), or set algorithm.params.exchange: none "
                "(FedCME-OL)")

    # --- server ---------------------------------------------------------------------------
    def init_server_state(self, init_models: dict[str, Arrays]) -> State:
        state = super().init_server_state(init_models)
        # eps: last evaluation vector per client; zeta/defined: global per-class features.
        state.update({"eval": {}, "features": None, "defined": None, "matching": []})
        return state

    def match(self, state: State, ctx: RoundContext) -> dict[int, int | None]:
        """``{k: client whose mid-round part k receives}`` for this round (None: no exchange)."""
        if self.params.exchange == "none":
            return {k: None for k in ctx.clients}
        vectors = {k: state["eval"].get(k) for k in ctx.clients}
        if self.params.matching == "many_to_one":
            return make_many_to_one(vectors, ctx.clients)
        return make_matching(vectors, ctx.clients)

    def round(self, state: State, ctx: RoundContext) -> RoundGenerator:
        match = self.match(state, ctx)                                          # Algorithm 1 line 4
        needed = {j for j in match.values() if j is not None}
        phase = {}
        for k in ctx.clients:
            msg = self.train_message(state, k, ctx)
            msg.scalars["partner"] = match[k]
            msg.scalars["share"] = k in needed
            phase[k] = msg
        replies = yield phase                                                   # phase A (or the only phase)
        if self.params.exchange != "none":
            phase_b = {}
            for k in ctx.clients:
                if k not in replies:
                    continue                                                    # dropped in phase A
                j = match[k]
                part = replies[j].arrays.get("exchange") if j is not None and j in replies else None
                phase_b[k] = (Message("exchange", {"exchange": part}, {"partner": j}) if part is not None
                              else Message("continue"))
            replies = yield phase_b                                             # phase B
        state = self.aggregate(dict(state), replies, ctx)                       # Algorithm 1 line 8
        if self.params.exchange == "none":
            state["matching"] = []
        elif self.params.matching == "many_to_one":
            state["matching"] = [[k, match[k]] for k in ctx.clients]
        else:
            state["matching"] = matching_pairs(match, ctx.clients)
        return state

    def train_message(self, state: State, cid: int, ctx: RoundContext) -> Message:
        msg = super().train_message(state, cid, ctx)
        zeta, defined = state.get("features"), state.get("defined")
        if self.params.mu > 0 and zeta is not None and bool(defined.any()):
            msg.arrays["features"] = {"mean": zeta, "defined": defined}
        return msg

    def aggregate(self, state: State, replies: Replies, ctx: RoundContext) -> State:
        state = super().aggregate(state, replies, ctx)                          # Algorithm 1 line 26
        cids = sorted(replies)
        evals = dict(state.get("eval") or {})
        for c in cids:                                                          # Algorithm 1 line 28
            if "evaluation" in replies[c].arrays:
                evals[c] = replies[c].arrays["evaluation"]["accuracy"]
        state["eval"] = evals
        uploads = [(replies[c].arrays["features"]["mean"], replies[c].arrays["features"]["count"])
                   for c in cids if "features" in replies[c].arrays]
        agg = aggregate_features(state.get("features"), state.get("defined"), uploads)  # lines 27-35
        if agg is not None:
            state["features"], state["defined"] = agg
        return state

    def round_metrics(self, state: State) -> dict[str, Any]:
        key = "fedcme_sources" if self.params.matching == "many_to_one" else "fedcme_pairs"
        return {**super().round_metrics(state), key: state.get("matching", [])}

    # --- client ---------------------------------------------------------------------------
    def exchange_part(self, weights: Arrays) -> Arrays:
        """The mid-round part handed to the counterpart (Algorithm 2 lines 22-24)."""
        if self.params.exchange == "classifier":
            return select(weights, HEAD)
        if self.params.exchange == "extractor":
            return select(weights, BODY)
        return dict(weights)

    def local_terms(self, msg: Message, state: State | None, client: ClientRuntime) -> list[LossTerm]:
        terms = super().local_terms(msg, state, client)
        if self.params.mu > 0:
            g = msg.arrays.get("features")
            terms.append(FeatureAlignment(self.params.mu, client.num_classes,
                                          g["mean"] if g else None, g["defined"] if g else None))
        return terms

    def client_update(self, msg: Message, state: State | None, client: ClientRuntime) -> tuple[Message, State | None]:
        if msg.kind == "train":
            return self.train_before_exchange(msg, state, client)
        if msg.kind in ("exchange", "continue"):
            return self.train_after_exchange(msg, state, client)
        raise ValueError(f"fedcme client got an unknown message kind {msg.kind!r}")

    def train_before_exchange(self, msg: Message, state: State | None,
                              client: ClientRuntime) -> tuple[Message, State | None]:
        """Phase A (Algorithm 2 lines 3-16): floor(E/2) epochs from the global model, then the part
        handed over to the counterpart. FedCME-OL's single phase trains all E epochs and uploads."""
        E = client.settings.epochs
        two_phase = self.params.exchange != "none"
        # Phase A (or the single phase of FedCME-OL): start from the global model.
        base = {k: v for k, v in (state or {}).items() if k != MID} or None
        weights = self.with_local_buffers(msg.arrays["model"], base, client)
        result, stats = self.train_phase(weights, msg, base, client, E // 2 if two_phase else E, 0)
        if not two_phase:
            return self.final_update(result, stats, msg, base, client)
        # End of phase A: keep the mid-round model and the accumulators; hand over our part.
        share = msg.scalars.get("share", msg.scalars.get("partner") is not None)
        new_state = {**(base or {}), MID: {"weights": result.weights, "arrays": msg.arrays,
                                           "scalars": dict(msg.scalars), "acc": stats or None,
                                           "steps": result.steps, "loss": result.mean_loss}}
        reply = Message("mid", {"exchange": self.exchange_part(result.weights)} if share else {},
                        {"num_samples": client.num_samples, "steps": result.steps, "loss": result.mean_loss})
        return reply, new_state

    def train_after_exchange(self, msg: Message, state: State | None,
                             client: ClientRuntime) -> tuple[Message, State | None]:
        """Phase B (Algorithm 2 lines 4-5 and 22-24): the counterpart's part in place of the
        client's own, the remaining E - floor(E/2) epochs, then the upload. A ``"continue"``
        message (no counterpart) carries no part."""
        E = client.settings.epochs
        mid = (state or {}).get(MID)
        if mid is None:
            raise RuntimeError(f"fedcme client {client.cid} got a {msg.kind!r} message without a phase-A state")
        base = {k: v for k, v in state.items() if k != MID} or None
        train_msg = Message("train", mid["arrays"], mid["scalars"])
        part = msg.arrays.get("exchange", {})
        unknown = sorted(set(part) - set(mid["weights"]))
        if unknown:
            raise ValueError(f"fedcme exchange carries tensors the model does not have: {unknown[:3]}")
        # Algorithm 2 lines 4-5, 24: continue with (theta_k, phi_j).
        weights = {**mid["weights"], **part}
        # acc: phase A's feature totals: phase B continues them
        result, stats = self.train_phase(weights, train_msg, state, client, E - E // 2, E // 2, mid.get("acc"))
        return self.final_update(result, stats, train_msg, base, client, mid["steps"], mid["loss"])

    def train_phase(self, weights: Arrays, msg: Message, state: State | None, client: ClientRuntime,
                    epochs: int, start_epoch: int,
                    acc: dict[str, torch.Tensor] | None = None) -> tuple[LocalResult, dict[str, torch.Tensor]]:
        """``epochs`` epochs from ``start_epoch`` on the terms the hooks build from the round's train
        message, and the alignment term's feature totals (added to ``acc``, phase A's)."""
        terms = [*self.data_terms(msg, state, client), *self.local_terms(msg, state, client)]
        options = self.train_options(msg, state, client)
        if acc:
            options["statistics"] = acc
        result = client.train(weights, terms, epochs=epochs, start_epoch=start_epoch, **options)
        align = next((t for t in terms if isinstance(t, FeatureAlignment)), None)
        stats = ({k: v for k, v in result.statistics.items() if k.startswith(f"{align.name}.")}
                 if align is not None else {})
        return result, stats

    def final_update(self, result: LocalResult, stats: dict[str, torch.Tensor], msg: Message, state: State | None,
                     client: ClientRuntime, earlier_steps: int = 0,
                     earlier_loss: float = 0.0) -> tuple[Message, State | None]:
        """The upload after the last phase; its steps and mean loss cover phase A's too."""
        steps = earlier_steps + result.steps
        loss = (earlier_loss * earlier_steps + result.mean_loss * result.steps) / max(steps, 1)
        # End of local training: zeta_k (Algorithm 2 line 18) and eps_k (lines 19-20).
        new_state = self.after_training(result, msg, state, client)
        arrays = {"model": result.weights, **self.uploads(result, msg, new_state, client)}
        features = local_features(stats)
        if features is not None:
            means, counts = features
            arrays["features"] = {"mean": means, "count": counts}
        positions = eval_subset(client.num_samples, self.params.eval_fraction, client.generator("eval_subset"))
        arrays["evaluation"] = {"accuracy": evaluation_vector(client.model, result.weights, client.data,
                                                              client.num_classes, positions)}
        return update_reply(result, client, arrays, steps=steps, loss=loss), new_state
