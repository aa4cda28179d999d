"""KT-pFL: parameterized knowledge transfer for personalized federated learning.

Zhang, Guo, Ma, Wang, Xu, Wu; NeurIPS 2021 (arXiv 2111.02862), the heterogeneous-model baseline of
FedClassAvg (Jang et al., ICPP 2022, Sec. 5, Tables 2-3). Facts from the paper and two public codes:
the authors' ``cugzj/KT-pFL`` (``src/engine_kt_pfl.py``, ``conf/*.json``) and the runner
FedClassAvg's authors used (``hukla/FedClassAvg`` ``src/KTpFL.py``). Where they differ, each
difference is a named parameter; the defaults follow the authors' code unless noted.

Every client keeps its own model (any architecture with the run's number of classes) in its client
state, starting from the common initialisation of its architecture. No weights ever travel: only
soft predictions on public data (up) and personalised soft targets (down).

One round, two phases (the paper's Algorithm 1 order):

1. ``"train"`` - each sampled client trains its model on its private data with cross-entropy
   (the run's optimizer settings), then uploads its soft predictions ``s_k = softmax(z_k / T)``
   on the round's public batch (computed in eval mode, no gradient): group ``"soft"``, P x C.
2. The server holds the knowledge-coefficient matrix ``C`` (K x K, initialised uniform 1/K, both
   codes). For the clients S that replied, it updates the rows of ``C`` restricted to S by one
   gradient step of, per row k,

       L_k(c_k) = D(s_k, t_k) + rho * mean_j (c_kj - 1/|S|)^2,      t_k = sum_{j in S} c_kj s_j

   with ``D`` = ``c_loss``: ``"mse"`` (both codes: mean over P x C entries of (s_k - t_k)^2; the
   code's comment "L_KL ~= L_MSE when T is large") or ``"kl"`` (the paper's objective: KL(t_k || s_k),
   mean over the P x C entries). The penalty is the codes' ``MSELoss(c_k, 1/N)``, i.e. a mean over
   the row (the paper writes it as rho * ||c - 1/N||^2). The loss of row k depends on row k only,
   so the codes' row-by-row loop equals this per-row update.

   * ``c_step="adaptive"`` (cugzj): the step size of row k is the code's heuristic: start at 1
     with g = sum|grad_k| / |S|; five times: if g > 0.01 divide g and the step by 5, then if
     g < 0.01 multiply both by 5. ``c_step="fixed"`` (hukla): step ``c_lr`` (hukla uses the local
     learning rate, 0.01 for (F/E)MNIST, 0.02 for CIFAR-10).
   * ``c_projection="softmax"`` (cugzj): the updated row becomes ``softmax(c_softmax_scale * c_k)``
     (scale 5.0; not in the paper, which only says the rows are coefficients), so rows stay on the
     probability simplex. ``"none"`` (hukla): the raw gradient step is kept (rows drift off the
     simplex, by little: MSE gradients on T=10 predictions are tiny).

   Then it sends each replying client its personalised target ``t_k`` (with the updated C) in a
   ``"distill"`` message (group ``"target"``, P x C).
3. ``"distill"`` - the client distils its model towards ``t_k`` on the same public batch for
   ``distill_epochs`` epochs (cugzj ``N_logits_matching_round`` = 1, hukla ``--num_distill`` = 1),
   batches of ``distill_batch_size`` (256 in both codes), learning rate ``distill_lr`` (None: the
   run's lr; both codes use their local lr 0.02/0.01), by ``distill_training``: ``"plain_sgd"`` (both
   codes: a fresh ``SGD(lr)``, no momentum or weight decay, every public image, cugzj
   ``engine_kt_pfl.py`` ``collaborative_training``) or ``"run"`` (the run's optimizer settings, e.g.
   the Adam of FedClassAvg's protocol), with ``distill_loss``:
   ``"kl"`` (cugzj and the paper): ``F.kl_div(log_softmax(z / T), t_k, reduction="mean")`` - the
   mean over the B x C entries (= batch-mean KL / C), no T^2 factor; ``"mse"`` (hukla
   ``distill_one_model``): mean squared error between ``softmax(z)`` (temperature 1) and ``t_k``.
   ``distill_weight`` (the paper's lambda; 1 in both codes) scales it.

Partial participation (both codes let every client predict every round; fedhet cannot query a
client that is not sampled): C is kept for all K clients, and a round uses its block on the
replying clients S. With ``c_projection="softmax"`` each row of the block is renormalised to sum 1
over S before use, updated as above (uniform reference 1/|S|), and written back scaled by the
row's former mass on S, so full rows stay on the simplex; with ``"none"`` the raw block is used and
written back. With full participation (FedClassAvg's heterogeneous setting, C = 1) both are the
codes' rule exactly.

Public data. KT-pFL's public data is a separate dataset: MNIST for (F/E)MNIST private data and
CIFAR-100 for CIFAR-10 (cugzj ``data_utils.getdataset``; hukla ``load_public_dataset``: 3000 random
MNIST images / 3000 images of CIFAR-100 classes 0, 2, 20, 63, 71, 82, redrawn every round). In
fedhet it is the run's ``data.public`` set (``fedhet.data.federated``: another dataset as the
codes, ``source: dataset``; or images no client trains or tests on, ``unsampled`` /
``holdout``), seen by every client as ``ClientData.public``. Each round's public batch is
``public_size`` of its images (a public set with fewer is a ConfigError) drawn without replacement
and without labels: every client derives
the same indices from a seed the server draws from its per-round stream (a scalar of the
``"train"`` message, not payload), so everything is fixed by the run seed and round.
``public_resample`` (default True, both codes) draws a new batch every round; False keeps round
0's batch.

Without ``data.public`` the batch is drawn from the whole training pool instead, with a warning:
those images are some clients' private training images (and, with ``local_test.source:
holdout``, possibly local-test images), which the method's premise excludes.

Other decisions:

* Local epochs: both codes ramp them (1, 2, ..., up to the configured number; hukla's comment:
  "not mentioned in the paper"); ``epoch_ramp`` (default True) trains ``min(round + 1,
  train.local_epochs)`` epochs in round ``round`` (0-based). The codes also train every model one
  epoch before the first round; round 0's single epoch (ramp) plays that part.
* Order: the codes run predict -> update C -> distil -> private training each round and evaluate
  right after prediction, i.e. after private training; fedhet runs the paper's order
  (private training -> predict -> update C -> distil) and evaluates after distillation. The
  sequence of steps is the same; only where evaluation looks differs.
* hukla's runner predicts on the round's freshly drawn public set but distils on the set drawn at
  start-up, pairing targets with other images (a bug); fedhet distils on the images predicted.
* Temperature T = 10 (cugzj ``Temp`` in its ``_T10`` confs; hukla ``self.Temp = 10.0``).
* ``rho`` = 0.7: cugzj's ``penalty_ratio`` (the p-sweep confs; 0.7 in its default), hukla's for
  CIFAR-10 (0.6 for the MNIST family).
* ``public_size`` = 3000: hukla ``--public_datasize`` and FedClassAvg Table 5 (cugzj ``N_alignment``
  = 5000, drawn with replacement).
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from fedhet.algorithms.base import Algorithm, update_reply
from fedhet.core.contract import (
    Arrays,
    Batch,
    ClientData,
    ClientRuntime,
    Forward,
    Message,
    RoundContext,
    RoundGenerator,
    State,
)
from fedhet.core.errors import ConfigError
from fedhet.training.local import forward
from fedhet.training.mode import in_mode
from fedhet.training.objective import LossTerm

# --- server-side pieces (pure functions, tested by hand) ------------------------------------


def personalized_targets(coef: torch.Tensor, soft: torch.Tensor) -> torch.Tensor:
    """``t_k = sum_j coef[k, j] * soft[j]``: (n, n) coefficients, (n, P, C) predictions -> (n, P, C)."""
    return torch.einsum("kj,jpc->kpc", coef, soft)


def row_loss(row: torch.Tensor, k: int, soft: torch.Tensor, rho: float, kind: str = "mse") -> torch.Tensor:
    """``D(s_k, t_k) + rho * mean_j (row_j - 1/n)^2`` of row ``k`` (see the module docstring)."""
    n = soft.shape[0]
    target = torch.einsum("j,jpc->pc", row, soft)
    own = soft[k]
    if kind == "mse":
        fit = (own - target).pow(2).mean()
    elif kind == "kl":
        t = target.clamp_min(1e-12)
        fit = (torch.xlogy(t, t) - t * own.clamp_min(1e-12).log()).mean()
    else:
        raise ValueError(f"unknown c_loss {kind!r}; use 'mse' or 'kl'")
    return fit + rho * (row - 1.0 / n).pow(2).mean()


def adaptive_step(grad: torch.Tensor, n: int) -> float:
    """The authors' step-size heuristic for one row's gradient (cugzj ``get_models_logits``)."""
    g = float(grad.abs().sum()) / n
    lr = 1.0
    for _ in range(5):
        if g > 0.01:
            g /= 5.0
            lr /= 5.0
        if g < 0.01:
            g *= 5.0
            lr *= 5.0
    return lr


def update_coefficients(coef: torch.Tensor, soft: torch.Tensor, *, rho: float, c_loss: str = "mse",
                        step: str = "adaptive", lr: float = 0.01, projection: str = "softmax",
                        scale: float = 5.0) -> torch.Tensor:
    """One gradient step on every row of ``coef`` (n, n) given the predictions ``soft`` (n, P, C),
    then the projection; returns the new (n, n) matrix (float64)."""
    coef = coef.double()
    soft = soft.double()
    n = coef.shape[0]
    rows = []
    for k in range(n):
        row = coef[k].clone().requires_grad_(True)
        (grad,) = torch.autograd.grad(row_loss(row, k, soft, rho, c_loss), [row])
        size = adaptive_step(grad, n) if step == "adaptive" else lr
        new = row.detach() - size * grad
        if projection == "softmax":
            new = torch.softmax(scale * new, dim=0)
        rows.append(new)
    return torch.stack(rows)


# --- client-side pieces ----------------------------------------------------------------------


def public_positions(pool_size: int, size: int, seed: int) -> torch.Tensor:
    """The round's public batch: ``size`` pool indices without replacement, the same for every
    client (fixed by ``seed``). A pool smaller than ``size`` is an error, never a smaller batch
    (a run refuses it while it is built: ``KTpFL.check_data``)."""
    if size > pool_size:
        raise ValueError(f"a public batch of {size} images cannot be drawn without replacement from {pool_size}")
    g = torch.Generator().manual_seed(int(seed))
    return torch.randperm(pool_size, generator=g)[:size]


@torch.no_grad()
def soft_predictions(model: torch.nn.Module, weights: Arrays, data: ClientData, temperature: float,
                     batch_size: int = 1024) -> torch.Tensor:
    """``softmax(z / T)`` of ``weights`` on every sample of ``data``'s split, in eval mode
    (both codes' ``predict``); the model's mode is restored afterwards."""
    with in_mode(model, training=False):
        out = []
        n = len(data.train_idx)
        for i in range(0, n, batch_size):
            x = data.inputs(data.train_idx[i:i + batch_size])
            out.append(torch.softmax(forward(model, weights, x).logits.float() / temperature, dim=1))
    return torch.cat(out) if out else torch.zeros(0)


class Distillation(LossTerm):
    """``weight * D(z, t[batch positions])`` on public data (see ``distill_loss``)."""

    name = "distill"
    vectorizable = False      # not declared pure: the vectorized engine trains it per client, counted as such

    def __init__(self, targets: torch.Tensor, temperature: float, kind: str = "kl", weight: float = 1.0):
        if kind not in ("kl", "mse"):
            raise ValueError(f"unknown distill_loss {kind!r}; use 'kl' or 'mse'")
        self.targets = targets
        self.temperature = float(temperature)
        self.kind = kind
        self.weight = float(weight)

    def __call__(self, out: Forward, batch: Batch, weights: Arrays) -> torch.Tensor:
        t = self.targets.to(out.logits.device, out.logits.dtype)[batch.index]
        if self.kind == "kl":
            # F.kl_div(log_softmax(z / T), t, reduction="mean") of the code: a mean over all B x C entries
            value = (torch.xlogy(t, t) - t * F.log_softmax(out.logits / self.temperature, dim=1)).mean()
        else:
            value = F.mse_loss(torch.softmax(out.logits, dim=1), t)
        return self.weight * value


class KTpFL(Algorithm):
    """KT-pFL; see the module docstring for the round, the defaults and every decision."""

    name = "ktpfl"
    personalized = True
    has_global_model = False

    class Params(Algorithm.Params):
        public_size: int = Field(3000, ge=1)                 # hukla --public_datasize; cugzj N_alignment 5000
        public_resample: bool = True                         # a new public batch every round (both codes)
        temperature: float = Field(10.0, gt=0)               # Temp (both codes)
        rho: float = Field(0.7, ge=0)                        # penalty_ratio
        c_loss: Literal["mse", "kl"] = "mse"                 # codes: MSE; paper: KL
        c_step: Literal["adaptive", "fixed"] = "adaptive"    # cugzj heuristic | hukla fixed lr
        c_lr: float = Field(0.01, ge=0)                      # with c_step="fixed"
        c_projection: Literal["softmax", "none"] = "softmax"  # cugzj softmax(5 c) | hukla none
        c_softmax_scale: float = Field(5.0, gt=0)
        distill_epochs: int = Field(1, ge=0)                 # N_logits_matching_round / --num_distill
        distill_batch_size: int = Field(256, ge=1)           # logits_matching_batchsize
        distill_lr: float | None = Field(None, gt=0)         # None: the run's lr
        # both codes distil with a fresh plain SGD (no momentum, no weight decay) over every public
        # image; "run": the run's optimizer settings (its momentum or Adam, weight decay, clipping)
        distill_training: Literal["plain_sgd", "run"] = "plain_sgd"
        distill_loss: Literal["kl", "mse"] = "kl"            # cugzj/paper | hukla
        distill_weight: float = Field(1.0, ge=0)             # the paper's lambda
        epoch_ramp: bool = True                              # local epochs 1, 2, ... (both codes)

    params: Params

    # --- server ---------------------------------------------------------------------------
    def init_server_state(self, init_models: dict[str, Arrays]) -> State:
        # K is known from the first round's context; C is created then (uniform 1/K).
        return {"coef": None, "public_seed": None}

    def round(self, state: State, ctx: RoundContext) -> RoundGenerator:
        state = dict(state)
        if state.get("coef") is None:
            k = ctx.num_clients
            state["coef"] = torch.full((k, k), 1.0 / k, dtype=torch.float64)
        if self.params.public_resample or state.get("public_seed") is None:
            state["public_seed"] = int(ctx.rng.integers(2**62))
        seed = state["public_seed"]
        replies = yield {cid: Message("train", scalars={"public_seed": seed}) for cid in ctx.clients}
        got = sorted(c for c in replies if "soft" in replies[c].arrays)
        if not got:
            return state
        targets, state["coef"] = self.transfer(state["coef"], got,
                                               torch.stack([replies[c].arrays["soft"]["probs"] for c in got]))
        yield {c: Message("distill", {"target": {"probs": targets[i]}}, {"public_seed": seed})
               for i, c in enumerate(got)}
        return state

    def transfer(self, coef: torch.Tensor, clients: list[int], soft: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(personalised targets (n, P, C) float32 in ``clients`` order, new K x K matrix) from the
        replying clients' predictions ``soft`` (n, P, C)."""
        p = self.params
        idx = torch.as_tensor(clients, dtype=torch.long)
        block = coef[idx][:, idx].double()
        mass = None
        if p.c_projection == "softmax":
            mass = block.sum(1, keepdim=True)
            block = block / mass.clamp_min(1e-300)
        new_block = update_coefficients(block, soft, rho=p.rho, c_loss=p.c_loss, step=p.c_step, lr=p.c_lr,
                                        projection=p.c_projection, scale=p.c_softmax_scale)
        targets = personalized_targets(new_block, soft.double()).float()
        new = coef.clone().double()
        new[idx.unsqueeze(1), idx.unsqueeze(0)] = new_block * mass if mass is not None else new_block
        return targets, new

    def check_data(self, data: ClientData) -> None:
        if data.public is not None and data.public.shape[0] < self.params.public_size:
            raise ConfigError(f"ktpfl: algorithm.params.public_size is {self.params.public_size} but the public set "
                              f"(data.public) has {data.public.shape[0]} images; lower public_size or raise "
                              f"data.public.size")
        if data.public is None and data.x.shape[0] < self.params.public_size:
            raise ConfigError(f"ktpfl: algorithm.params.public_size is {self.params.public_size} but without a "
                              f"data.public set the public batch comes from the training pool, which has "
                              f"{data.x.shape[0]} images; lower public_size or set data.public")
        if data.public is None:      # once, as the run is built (not in each engine worker)
            warnings.warn("ktpfl: the run has no data.public set, so the public batch is drawn from the "
                          "training pool (other clients' private images); set data.public (e.g. "
                          "{source: dataset, dataset: mnist} as KT-pFL, or {source: holdout, size: 3000})",
                          stacklevel=2)

    # --- client ---------------------------------------------------------------------------
    def public_data(self, msg: Message, client: ClientRuntime) -> ClientData:
        """The round's public batch as a data view over ``data.public`` (labels never used), or
        over the shared training pool when the run has no public set."""
        d = client.data
        seed = msg.scalars["public_seed"]
        if d.public is None:
            return ClientData(d.x, d.y, public_positions(d.x.shape[0], self.params.public_size, seed), d.mean, d.std)
        unlabelled = torch.zeros(d.public.shape[0], dtype=torch.long, device=d.public.device)
        return ClientData(d.public, unlabelled, public_positions(d.public.shape[0], self.params.public_size, seed),
                          d.mean, d.std)

    def client_update(self, msg: Message, state: State | None, client: ClientRuntime) -> tuple[Message, State | None]:
        weights = state["model"] if state and "model" in state else client.init_weights()
        if msg.kind == "train":
            epochs = client.settings.epochs
            if self.params.epoch_ramp:
                epochs = min(client.round + 1, epochs)
            result = client.train(weights, epochs=epochs)
            probs = soft_predictions(client.model, result.weights, self.public_data(msg, client),
                                     self.params.temperature)
            reply = update_reply(result, client, {"soft": {"probs": probs}})
            return reply, {**(state or {}), "model": result.weights}
        if msg.kind == "distill":
            p = self.params
            settings = client.settings
            lr = p.distill_lr if p.distill_lr is not None else settings.lr
            s = replace(settings, epochs=p.distill_epochs, batch_size=p.distill_batch_size, lr=lr)
            if p.distill_training == "plain_sgd":
                s = replace(s, optimizer="sgd", momentum=0.0, weight_decay=0.0, clip_grad_norm=None, drop_last=False)
            term = Distillation(msg.arrays["target"]["probs"], p.temperature, p.distill_loss, p.distill_weight)
            # Apart from the client's own training: its own optimizer, stream and data.
            result = client.train(weights, [term], data=self.public_data(msg, client), settings=s, stream="distill",
                                  carry_optimizer_state=False)
            return Message("done", scalars={"steps": result.steps, "loss": result.mean_loss}), \
                {**(state or {}), "model": result.weights}
        raise ValueError(f"ktpfl: unexpected message kind {msg.kind!r}")

    # --- evaluation -----------------------------------------------------------------------
    def client_model(self, cid: int, state: State, client_state: State | None) -> Arrays | None:
        return client_state["model"] if client_state and "model" in client_state else None

    def client_view(self, state: State, cid: int) -> State:
        return {}          # client_model reads the client's own state only

    def round_metrics(self, state: State) -> dict:
        return {**super().round_metrics(state), **coefficient_metrics(state.get("coef"))}


def coefficient_metrics(coef: torch.Tensor | None) -> dict:
    """The coefficient matrix's mean self-weight and its largest departure from uniform (none before C exists)."""
    if coef is None:
        return {}
    k = coef.shape[0]
    return {"ktpfl_c_self": float(coef.diagonal().mean()), "ktpfl_c_max_dev": float((coef - 1.0 / k).abs().max())}
