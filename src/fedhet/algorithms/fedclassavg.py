"""FedClassAvg (Jang, Ha, Jung, Yoon; ICPP 2022): classifier averaging across heterogeneous models.

Paper: Jang et al., "FedClassAvg: Local Representation Learning for Personalized Federated Learning
on Heterogeneous Neural Networks" (ICPP 2022). The authors' code hukla/FedClassAvg differs from the
paper in places; each difference is a named parameter here. [C] marks what follows the code, [D]
fedhet's own decision.

Every client keeps its own feature extractor (any architecture with a 512-d feature layer, client
state) and a classifier of a shape all clients share (``head``: ReLU + Linear(512, C)); only the
classifier crosses the wire.

* Server (Sec. 4.1): the new global classifier is the sample-size weighted average of the
  round's trained classifiers. With ``average_body`` (the "+weight" variant of Table 3, for
  homogeneous federations) the feature extractors are averaged too.
* Client (Eq. 4; the code's ``train_cl``): load the global classifier, then train body and head on
  ``L_CL + L_CE + L_R`` over two augmented views of each batch (:class:`fedhet.training.augment.
  SupConViews`):
  - ``L_CL`` - supervised contrastive loss (Khosla et al. 2020) over the 2B features, positives =
    the other samples of the same class including the other view; the code's temperature 100
    with base temperature 0.07 and no L2 normalisation of the features ([C]; the paper gives no temperature);
  - ``L_CE`` - cross-entropy of the classifier on the first view;
  - ``L_R`` - proximal term on the classifier only, the code's form ``(rho/2) sum_p mean((p - p_g)^2)``
    over its weight and bias ([D]; the paper writes ``rho ||w - w_g||``). The code skips
    it on the first batch, where it is exactly zero anyway (the classifier starts at ``p_g``).
  - The optimizer is the run's (``train.optimizer: adam``, ``train.betas: [0.5, 0.999]`` in the
    paper's configs), fresh each round.
* ``pretrain`` ([C], default on; the paper implies no pre-training): a client's first participation starts with one epoch
  of the same objective with its own initial classifier (proximal to that), before it loads the
  global classifier. The code pre-trains every client before round 1; training is the same, but
  with partial participation a client not sampled yet is evaluated with its initial model. Not
  with ``average_body`` (the server's body would replace it at once).
* Differences from the code: every client of one architecture starts from the same initial
  weights (fedhet initialises per architecture; the code per client), and the views are
  normalised with the dataset's mean/std (the code: 0.5/0.5 on Fashion-MNIST).
* Evaluation (Sec. 5; the code): each client with its current model - its feature extractor and the
  classifier it trained last (not the new global one); clients never sampled use their initial model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import Field

from fedhet.algorithms.aggregate import weighted_average
from fedhet.algorithms.base import Algorithm, update_reply
from fedhet.core.contract import (
    Arrays,
    Batch,
    ClientRuntime,
    Forward,
    Message,
    Replies,
    RoundContext,
    State,
)
from fedhet.core.split import BODY, HEAD, select
from fedhet.training.augment import SupConViews
from fedhet.training.objective import LossTerm


def supcon_loss(features: torch.Tensor, labels: torch.Tensor, temperature: float = 100.0,
                base_temperature: float = 0.07) -> torch.Tensor:
    """Supervised contrastive loss, ``contrast_mode='all'``: for each anchor i of the N rows,
    ``-(T / T_base) * mean_{p in P(i)} [s_ip - log sum_{a != i} exp(s_ia)]`` with
    ``s = f f^T / T``, P(i) the other rows with i's label; mean over anchors that have a positive."""
    n = features.shape[0]
    sim = features @ features.T / temperature
    self_mask = torch.eye(n, dtype=torch.bool, device=features.device)
    # the row max is subtracted for stability (it cancels between the two parts)
    sim = sim - sim.masked_fill(self_mask, float("-inf")).max(1, keepdim=True).values.detach()
    log_denominator = torch.logsumexp(sim.masked_fill(self_mask, float("-inf")), dim=1, keepdim=True)
    log_prob = sim - log_denominator
    positives = (labels.unsqueeze(0) == labels.unsqueeze(1)) & ~self_mask
    count = positives.sum(1)
    mean_log_prob = (log_prob * positives).sum(1) / count.clamp(min=1)
    has = (count > 0).to(mean_log_prob.dtype)       # no boolean indexing: vmappable
    return -(temperature / base_temperature) * (mean_log_prob * has).sum() / has.sum().clamp(min=1)


def views(batch: Batch) -> int:
    return int(batch.extras.get("views", 1))


class SupervisedContrastive(LossTerm):
    name = "supcon"
    vectorizable = True

    def __init__(self, temperature: float, base_temperature: float):
        self.temperature = float(temperature)
        self.base_temperature = float(base_temperature)

    def __call__(self, out: Forward, batch: Batch, weights: Arrays) -> torch.Tensor:
        return supcon_loss(out.features, batch.y, self.temperature, self.base_temperature)


class FirstViewCrossEntropy(LossTerm):
    """CE of the classifier on the first of the stacked views (all rows without views)."""

    name = "ce"
    vectorizable = True

    def __call__(self, out: Forward, batch: Batch, weights: Arrays) -> torch.Tensor:
        b = out.logits.shape[0] // views(batch)
        return F.cross_entropy(out.logits[:b], batch.y[:b])


class HeadProximal(LossTerm):
    """``(rho/2) * sum_p mean((p - p_g)^2)`` over the head's tensors (the authors' MSELoss form)."""

    name = "prox"
    vectorizable = True

    def __init__(self, anchor: Arrays, rho: float):
        self.anchor = {k: v.detach() for k, v in anchor.items()}
        self.rho = float(rho)

    def __call__(self, out: Forward, batch: Batch, weights: Arrays) -> torch.Tensor:
        sq = torch.stack([(weights[k] - a).pow(2).mean() for k, a in self.anchor.items()]).sum()
        return 0.5 * self.rho * sq


class FedClassAvg(Algorithm):
    name = "fedclassavg"
    personalized = True
    has_global_model = False

    class Params(Algorithm.Params):
        rho: float = Field(0.4662, ge=0)                 # proximal weight (paper Table 1, Fashion-MNIST)
        temperature: float = Field(100.0, gt=0)          # SupCon temperature of the code [C]
        base_temperature: float = Field(0.07, gt=0)
        contrastive: bool = True                         # L_CL (Table 4 ablation: CA, +PR, +CL)
        proximal: bool = True                            # L_R
        pretrain: bool = True                            # one epoch before the first participation [C]
        average_body: bool = False                       # "+weight" (Table 3, homogeneous models)

    # --- server ---------------------------------------------------------------------------
    def init_server_state(self, init_models: dict[str, Arrays]) -> State:
        heads = {arch: select(w, HEAD) for arch, w in init_models.items()}
        shapes = {arch: {k: tuple(v.shape) for k, v in h.items()} for arch, h in heads.items()}
        if len({tuple(sorted(s.items())) for s in shapes.values()}) != 1:
            raise ValueError(f"FedClassAvg averages classifiers: every architecture needs the same head; got {shapes}")
        first = next(iter(init_models))
        state: State = {"head": {k: v.clone() for k, v in heads[first].items()}}
        if self.params.average_body:
            if len(init_models) != 1:
                raise ValueError("average_body ('+weight') averages feature extractors: every client needs the same "
                                 f"architecture; got {sorted(init_models)}")
            state["body"] = {k: v.clone() for k, v in select(init_models[first], BODY).items()}
        return state

    def train_message(self, state: State, cid: int, ctx: RoundContext) -> Message:
        arrays = {"head": state["head"]}
        if self.params.average_body:
            arrays["body"] = state["body"]
        return Message("train", arrays)

    def aggregate(self, state: State, replies: Replies, ctx: RoundContext) -> State:
        cids = sorted(replies)
        if not cids:
            return state
        sizes = [float(replies[c].scalars["num_samples"]) for c in cids]
        state["head"] = weighted_average([replies[c].arrays["head"] for c in cids], sizes)
        if self.params.average_body:
            # BatchNorm statistics travel with the body and are averaged like weights (fedhet's default)
            state["body"] = weighted_average([replies[c].arrays["body"] for c in cids], sizes)
        return state

    # --- client ---------------------------------------------------------------------------
    def terms(self, anchor: Arrays) -> list[LossTerm]:
        p = self.params
        out: list[LossTerm] = [FirstViewCrossEntropy()]
        if p.contrastive:
            out.insert(0, SupervisedContrastive(p.temperature, p.base_temperature))
        if p.proximal:
            out.append(HeadProximal(anchor, p.rho))
        return out

    def client_update(self, msg: Message, state: State | None, client: ClientRuntime) -> tuple[Message, State | None]:
        first_time = not (state and "model" in state)
        weights = client.init_weights() if first_time or state is None else state["model"]
        # two views in every variant (the ablations change the loss, not the data pipeline)
        augment = SupConViews(client.data.mean, client.data.std)
        # With average_body the server's body and head replace everything right after: no pre-training
        # (the authors' +weight script has none either).
        if first_time and self.params.pretrain and not self.params.average_body:
            # its own batch-order stream: the epochs after the round's (as FedBABU's fine-tuning)
            pre = client.train(weights, self.terms(select(weights, HEAD)), epochs=1, augment=augment,
                               start_epoch=client.settings.epochs)
            weights = pre.weights
        weights = {**weights, **msg.arrays["head"], **(msg.arrays.get("body") or {})}
        result = client.train(weights, self.terms(msg.arrays["head"]), augment=augment)
        uploads = {"head": select(result.weights, HEAD)}
        if self.params.average_body:
            uploads["body"] = select(result.weights, BODY)
        return update_reply(result, client, uploads), {"model": result.weights}

    # --- evaluation -----------------------------------------------------------------------
    def client_model(self, cid: int, state: State, client_state: State | None) -> Arrays | None:
        return client_state["model"] if client_state and "model" in client_state else None
