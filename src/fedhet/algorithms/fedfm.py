"""FedFM and FedFM-Lite (Ye et al., IEEE TSP 2023): anchor-based feature matching with
contrastive guiding. Source: Ye et al., "FedFM: Anchor-Based Feature Matching for Data Heterogeneity
in Federated Learning" (Algorithm 1, Eq. 8-11, Sec. IV-C, Sec. VI) and, where the paper is silent,
the authors' code (rui-ye/FedFM).

FedFM, one round t (Algorithm 1):

1. Before the warm-up ends (``t < start_round``, the paper's T_s) the round is FedAvg's, message
   for message: no anchors are computed or sent (Sec. VII-A "We run FedAvg for the first T_s
   rounds").
2. Anchor phase. Every sampled client receives w^t (array group ``"model"``), computes its local
   anchors with it (:func:`local_anchors`: eval mode, no gradient, over its whole training
   split - Eq. 8; the reference code's drop_last loader counted its last rows as zero-feature
   class-0 samples) and uploads the per-class means and counts
   (``"anchors"``). It keeps w^t in its state for the next phase, so the model goes down once.
3. The server aggregates them (:func:`aggregate_anchors`): size-weighted per class (Eq. 9,
   ``anchor_weighting: weighted``, the default) or the plain mean over clients with a missing
   local anchor replaced by the previous global one (``uniform``, Table VIII). A class no
   participant has keeps its previous anchor (the code divides by zero there);
   a class never seen by anyone has no anchor (``defined`` mask).
4. Training phase. Clients receive the global anchors and train E epochs on
   ``CE + lam * L_FM`` (Eq. 10) from the stored w^t, then upload the model; the server averages
   the models as FedAvg does (Eq. 11).

The matching loss :class:`AnchorMatching` (Sec. IV-C; ``loss_f.py`` of the authors' code):

* ``matching: cg`` (contrastive guiding, default): h and the anchors are L2-normalised
  ("the feature is normalized before applying the feature matching loss term", Sec. VII-A),
  s = h_n A_n^T / temperature, L_FM = CE(s, y), the mean over the batch. The paper's
  temperature alpha = 0.1.
* ``matching: l2``: the squared distance between the normalised feature and its normalised
  class anchor, averaged over the batch AND the feature dimensions as the code's ``mse_loss``
  does (the paper's Eq. 3 is a per-sample squared norm: the code's value is that divided by d).

Samples whose class has no anchor yet are left out of L_FM (mean over the others), and
undefined anchors are left out of CG's softmax. Anchors are constants (no gradient).

FedFM-Lite (Sec. VI, :class:`FedFMLite`): one handshake per round. Clients compute their local
anchors AFTER local training with the trained model (an extra eval-mode pass over the training
split, as the paper describes) and send them with the reply; the server aggregates them and
sends the global anchors with the next round's message. Models travel every ``model_every``
(the paper's a) rounds only: counting rounds from T_s (s = t - T_s), the global model goes down
when s % a == 0 and the local models come up when (s + 1) % a == 0 (and in the run's last
round); in between a client continues from its own local model, kept in its state. Warm-up
rounds (t < T_s) are FedAvg's, models both ways every round, as for FedFM (Sec. VII-A). The paper
counts Lite's saving as "roughly a times less" communication than FedAvg over the T rounds (Sec.
VI; Fig. 7: five and ten times less), which holds only if the models keep the schedule through
the warm-up too: ``warmup_models: schedule`` does that, counting s = t from round 0 (T=100, T_s=20,
a=5: 20 model transfers each way, against 36 with the warm-up's every round). A client that did not take part
in the previous round has no current local model, so the server sends it the global model
(counted in the ledger like any other download; with full participation, as in the paper, this
never happens). The global model evaluated between uploads is the last aggregated one.
Anchors are uploaded from round ``start_round - 1`` on so that round ``start_round`` has them.

The anchors go up with the class counts (weighted rule) or only with which classes are present
(``anchor_weighting: uniform``: the paper's reason for the uniform rule is that clients need not
reveal their category distribution, Sec. IV-D.2).

Composition (paper Fig. 8(a)): ``fedprox+fedfm``, ``moon+fedfm``, ``fedfm+fednova``,
``scaffold+fedfm``: the anchor phase is FedFM's own; the training phase rebuilds the ordinary
train message (with the stored model) and hands it to the other methods' hooks.
"""

from __future__ import annotations

from typing import Any, Literal

import pydantic
import torch
import torch.nn.functional as F

from fedhet.algorithms.base import update_reply
from fedhet.algorithms.fedavg import FedAvg
from fedhet.algorithms.prototypes import aggregate_prototypes, class_means
from fedhet.core.contract import (
    Arrays,
    Batch,
    ClientData,
    ClientRuntime,
    Forward,
    Message,
    Replies,
    RoundContext,
    RoundGenerator,
    State,
)
from fedhet.core.errors import ConfigError
from fedhet.training.local import trains_in_channels_last
from fedhet.training.objective import LossTerm

# Client-state key of the global model received in the anchor phase (FedFM) or of the client's
# own local model between model uploads (FedFM-Lite).
RECEIVED = "fedfm_received"
LOCAL = "fedfm_local"


# --- the matching term (client) ----------------------------------------------------------
class AnchorMatching(LossTerm):
    """``lam * L_FM`` with contrastive guiding (``kind="cg"``) or the l2 variant (module docstring).

    ``anchors`` (C, d) are the global anchors as aggregated (unnormalised); ``defined`` (C,)
    marks the classes that have one. Pure and vmappable: classes are masked with ``torch.where``.
    """

    name = "fm"
    vectorizable = True

    def __init__(self, anchors: torch.Tensor, defined: torch.Tensor, lam: float,
                 kind: Literal["cg", "l2"] = "cg", temperature: float = 0.1):
        if kind not in ("cg", "l2"):
            raise ValueError(f"unknown feature-matching loss {kind!r}; use 'cg' or 'l2'")
        self.anchors = anchors
        self.defined = defined.bool()
        self.lam = float(lam)
        self.kind = kind
        self.temperature = float(temperature)

    def __call__(self, out: Forward, batch: Batch, weights: Arrays) -> torch.Tensor:
        h = F.normalize(out.features.float(), dim=1)
        a = F.normalize(self.anchors.to(h.device, torch.float32), dim=1)
        defined = self.defined.to(h.device)
        y = batch.y
        # Samples of a class without anchor contribute nothing; their label is replaced by a
        # defined class only so that every value stays finite before it is masked out.
        valid = defined[y].to(h.dtype)
        fallback = torch.argmax(defined.to(torch.int64))
        y_safe = torch.where(defined[y], y, fallback)
        if self.kind == "cg":
            s = h @ a.T / self.temperature
            s = torch.where(defined.unsqueeze(0), s, torch.full_like(s, -1e9))
            per_sample = F.cross_entropy(s, y_safe, reduction="none")
        else:
            per_sample = ((h - a[y_safe]) ** 2).mean(dim=1)
        return self.lam * (per_sample * valid).sum() / valid.sum().clamp(min=1.0)


# --- anchors ------------------------------------------------------------------------------
def local_anchors(model: torch.nn.Module, weights: Arrays, data: ClientData, num_classes: int,
                  batch_size: int = 512, fast_passes: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(means (C, d), counts (C,))``: the class-wise mean feature of ``weights`` over every
    training sample of the client (Eq. 8), in eval mode; zero rows for absent classes. These are
    the clients' prototypes of FedProto/FedPAC (:func:`fedhet.algorithms.prototypes.class_means`)."""
    return class_means(model, weights, data, num_classes, batch_size=batch_size, fast_passes=fast_passes)


def aggregate_anchors(prev: torch.Tensor | None, prev_defined: torch.Tensor | None,
                      uploads: list[tuple[torch.Tensor, torch.Tensor]],
                      weighting: Literal["weighted", "uniform"] = "weighted") -> tuple[torch.Tensor, torch.Tensor] | None:
    """Global anchors from the clients' ``(means (C, d), counts (C,))``; ``(anchors, defined)``.

    ``weighted`` (Eq. 9): a_c = sum_k n_kc a_kc / sum_k n_kc. ``uniform`` (Table VIII): the plain
    mean over the uploading clients, a client without class c contributing the previous global
    anchor (and nothing if there is none). Either way a class no client has keeps its previous
    anchor, and stays undefined if it never had one (prototype aggregation with memory,
    :func:`fedhet.algorithms.prototypes.aggregate_prototypes`). Returns the previous pair when
    nothing was uploaded (None if there was none).
    """
    return aggregate_prototypes(uploads, "counts" if weighting == "weighted" else "uniform",
                                previous=(prev, prev_defined))


class FedFM(FedAvg):
    """FedFM (CG or l2 matching); see the module docstring for the round and every decision."""

    name = "fedfm"
    takes_mixup = False          # anchor matching pulls each feature to its label's anchor

    class Params(FedAvg.Params):
        lam: float = pydantic.Field(50.0, ge=0)                 # lambda, weight of L_FM
        temperature: float = pydantic.Field(0.1, gt=0)          # alpha of the CG loss
        matching: Literal["cg", "l2"] = "cg"
        anchor_weighting: Literal["weighted", "uniform"] = "weighted"
        start_round: int = pydantic.Field(20, ge=0)             # T_s: FedAvg before it

    def check_schedule(self, rounds: int, local_epochs: int) -> None:
        super().check_schedule(rounds, local_epochs)      # a composed method checks every part
        if self.params.start_round >= rounds:
            raise ConfigError(
                f"algorithm {self.name}: start_round ({self.params.start_round}, the FedAvg warm-up T_s) is not "
                f"below train.rounds ({rounds}), so no round would match features and the run would be FedAvg; "
                f"set algorithm.params.start_round below {rounds} (the paper: 20 of 100 rounds)")

    # --- server ---------------------------------------------------------------------------
    def init_server_state(self, init_models: dict[str, Arrays]) -> State:
        state = super().init_server_state(init_models)
        state.update({"anchors": None, "anchors_defined": None})
        return state

    def matching_active(self, rnd: int) -> bool:
        return rnd >= self.params.start_round

    def round(self, state: State, ctx: RoundContext) -> RoundGenerator:
        if not self.matching_active(ctx.round):
            return (yield from super().round(state, ctx))                 # warm-up: FedAvg
        replies = yield {cid: Message("anchors", {"model": state["model"]}) for cid in ctx.clients}
        state = self.update_anchors(dict(state), replies)                  # Eq. 9
        phase = {}
        for cid in ctx.clients:
            if cid not in replies:
                continue                                                   # dropped in the anchor phase
            msg = self.train_message(state, cid, ctx)
            msg.arrays.pop("model")                                        # the client has it already
            phase[cid] = msg
        replies = yield phase
        return self.aggregate(state, replies, ctx)                         # Eq. 11

    def update_anchors(self, state: State, replies: Replies) -> State:
        uploads = []
        for c in sorted(replies):
            up = replies[c].arrays.get("anchors")
            if up is not None:
                counts = up["count"] if "count" in up else up["present"].long()
                uploads.append((up["mean"], counts))
        agg = aggregate_anchors(state.get("anchors"), state.get("anchors_defined"), uploads,
                                self.params.anchor_weighting)
        if agg is not None:
            state["anchors"], state["anchors_defined"] = agg
        return state

    def train_message(self, state: State, cid: int, ctx: RoundContext) -> Message:
        msg = super().train_message(state, cid, ctx)
        if self.matching_active(ctx.round) and state.get("anchors") is not None:
            msg.arrays["anchors"] = {"mean": state["anchors"], "defined": state["anchors_defined"]}
        return msg

    def round_metrics(self, state: State) -> dict:
        defined = state.get("anchors_defined")
        return {**super().round_metrics(state),
                "fedfm_anchor_classes": None if defined is None else int(defined.sum())}

    # --- client ---------------------------------------------------------------------------
    def local_terms(self, msg: Message, state: State | None, client: ClientRuntime) -> list[LossTerm]:
        terms = super().local_terms(msg, state, client)
        anchors = msg.arrays.get("anchors")
        if anchors is not None and self.params.lam > 0:
            terms.append(AnchorMatching(anchors["mean"], anchors["defined"], self.params.lam,
                                        self.params.matching, self.params.temperature))
        return terms

    def anchor_upload(self, weights: Arrays, client: ClientRuntime) -> Arrays:
        """The local anchors (Eq. 8) and what aggregation needs besides: the class counts for the
        weighted rule, only which classes are present for the uniform one (Sec. IV-D.2: uniform
        averaging spares clients from uploading their category distribution)."""
        means, counts = local_anchors(client.model, weights, client.data, client.num_classes,
                                      fast_passes=trains_in_channels_last(client.settings))
        if self.params.anchor_weighting == "uniform":
            return {"mean": means, "present": counts > 0}
        return {"mean": means, "count": counts}

    def client_update(self, msg: Message, state: State | None, client: ClientRuntime) -> tuple[Message, State | None]:
        base = {k: v for k, v in (state or {}).items() if k != RECEIVED} or None
        if msg.kind == "anchors":                                          # Eq. 8 with w^t
            weights = self.with_local_buffers(msg.arrays["model"], base, client)
            reply = Message("anchors", {"anchors": self.anchor_upload(weights, client)},
                            {"num_samples": client.num_samples})
            return reply, {**(base or {}), RECEIVED: msg.arrays["model"]}
        if msg.kind == "train" and "model" not in msg.arrays:
            received = (state or {}).get(RECEIVED)
            if received is None:
                raise RuntimeError(f"fedfm client {client.cid} got a training message without a model and "
                                   "has no model from this round's anchor phase")
            msg = msg.with_model(received)
        return super().client_update(msg, base, client)


class FedFMLite(FedFM):
    """FedFM-Lite: anchors from the trained local model, one handshake per round, models every
    ``model_every`` rounds (module docstring)."""

    name = "fedfm_lite"

    class Params(FedFM.Params):
        model_every: int = pydantic.Field(1, ge=1)               # a: rounds between model transfers
        # every_round: the warm-up (t < T_s) is FedAvg's; schedule: models every a rounds from round 0
        warmup_models: Literal["every_round", "schedule"] = "every_round"

    def __init__(self, params: Any = None) -> None:
        super().__init__(params)
        every = [c.name for c in type(self).__mro__ if vars(c).get("aggregates_every_round")]
        if every and self.params.model_every > 1:
            raise ConfigError(f"algorithm.params.model_every {self.params.model_every}: {self.name} aggregates only in the "
                              f"rounds whose models come up, and {every[0]}'s server state takes every round's "
                              "uploads (SCAFFOLD: the control deltas), which the other rounds would lose; use "
                              f"model_every 1, or fedfm_lite without {every[0]}")

    def init_server_state(self, init_models: dict[str, Arrays]) -> State:
        state = super().init_server_state(init_models)
        state["lite_participants"] = []                          # who trained in the previous round
        return state

    def _schedule_start(self) -> int:
        """The round from which models travel every a rounds (counted from it)."""
        return 0 if self.params.warmup_models == "schedule" else self.params.start_round

    def model_down(self, rnd: int) -> bool:
        """Warm-up rounds are FedAvg's (unless ``warmup_models: schedule``); then every a-th round."""
        start = self._schedule_start()
        return rnd < start or (rnd - start) % self.params.model_every == 0

    def model_up(self, rnd: int, num_rounds: int | None) -> bool:
        last = num_rounds is not None and rnd == num_rounds - 1
        start = self._schedule_start()
        return rnd < start or (rnd - start + 1) % self.params.model_every == 0 or last

    def extension_problem(self, done_rounds: int, rounds: int) -> str | None:
        last = done_rounds - 1
        if done_rounds < rounds and self.model_up(last, done_rounds) and not self.model_up(last, None):
            return (f"fedfm_lite (model_every {self.params.model_every}, start_round {self.params.start_round}): "
                    f"round {done_rounds} uploaded and averaged the models only because it was the last, which a run "
                    f"of {rounds} rounds does not, so the extended run would train another model; start a new run "
                    f"of {rounds} rounds")
        return None

    def round(self, state: State, ctx: RoundContext) -> RoundGenerator:
        previous = set(state.get("lite_participants", []))
        upload = self.model_up(ctx.round, ctx.num_rounds)
        anchors_up = ctx.round + 1 >= self.params.start_round
        phase = {}
        for cid in ctx.clients:
            msg = self.train_message(state, cid, ctx)
            if not self.model_down(ctx.round) and cid in previous:
                msg.arrays.pop("model")                          # it continues from its own model
            msg.scalars.update({"upload_model": upload, "upload_anchors": anchors_up})
            phase[cid] = msg
        replies = yield phase
        state = dict(state)
        if upload:
            state = self.aggregate(state, {c: r for c, r in replies.items() if "model" in r.arrays}, ctx)
        state = self.update_anchors(state, replies)
        state["lite_participants"] = [] if upload else sorted(replies)
        return state

    def client_update(self, msg: Message, state: State | None, client: ClientRuntime) -> tuple[Message, State | None]:
        base = {k: v for k, v in (state or {}).items() if k != LOCAL} or None
        if "model" in msg.arrays:
            start = self.start_weights(msg, base, client)
            if start is not msg.arrays["model"]:
                msg = msg.with_model(start)
            weights = self.with_local_buffers(start, base, client)
        else:
            weights = (state or {}).get(LOCAL)
            if weights is None:
                raise RuntimeError(f"fedfm_lite client {client.cid} got no model and keeps none of its own")
            msg = msg.with_model(weights)
        result = self.local_training(weights, msg, base, client)
        self.refuse_training_without_mixup(result, client)
        new_state = self.after_training(result, msg, base, client)
        arrays: dict[str, Arrays] = {}
        if msg.scalars.get("upload_anchors", True):                       # Sec. VI: from the trained model
            arrays["anchors"] = self.anchor_upload(result.weights, client)
        if msg.scalars.get("upload_model", True):
            arrays["model"] = self.uploaded_model(result.weights)
            arrays.update(self.uploads(result, msg, new_state, client))
        else:
            new_state = {**(new_state or {}), LOCAL: result.weights}
        return update_reply(result, client, arrays, **self.upload_scalars(result, msg, new_state, client)), new_state
