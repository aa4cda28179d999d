"""FedPAC (Xu, Tong & Huang, ICLR 2023, "Personalized Federated Learning with Feature Alignment and
Classifier Collaboration").

FedPer's split (shared body = feature extractor, personal head = classifier) with two additions:
feature alignment to global class prototypes on the client, and a per-client combination of the
uploaded classifiers on the server. One round (paper Algorithm 1; official code
``JianXu95/FedPAC`` ``methods/fedpac.py``, ``running.py:train_round_fedpac``, ``tools.py``):

Client k (receives the global body, its combined head from the last round - the initial head on
its first participation - and the global prototypes):

1. Feature statistics of the received model, BEFORE training (official
   ``statistics_extraction`` is called before ``local_training``; PFLlib computes them when the
   global body arrives): with ``p_c = n_c / n`` its label distribution, ``mu_c`` its class-mean
   features and ``E_c||h||^2`` the class-mean squared feature norm (:func:`feature_statistics`),

       V_k = sum_c [ p_c * E_c||h||^2 - p_c^2 * ||mu_c||^2 ] / n,     H_k[c] = p_c * mu_c.

2. Alternating training (Algorithm 1; :func:`fedhet.training.phases.train_head_then_body`):
   ``pac_head_epochs`` (1) epoch(s) on the classifier with the body frozen, on CE; then E epochs
   (``train.local_epochs``) on the body with the new classifier frozen, on
   ``CE + pac_proto_weight * MSE(h, proto[y])`` (:meth:`FedPAC.alignment_terms`).
3. Uploads the body (``"model"``), the head (``"head"``), its local prototypes after training
   (``"prototypes"``, eval mode) and ``(V_k, H_k)`` (``"statistics"``).

Server:

4. Body: FedAvg by sample size. Global prototypes: class-count weighted mean of the
   uploaded prototypes (official ``protos_aggregation``), rebuilt each round.
5. Classifier collaboration (the paper's combination-weight problem): for every client i that
   answered, the weights ``alpha_i`` on the simplex over the answering clients minimise

       alpha^T P_i alpha,   P_i[j, j'] = V_j [j = j'] + <H_i - H_j, H_i - H_j'>

   (:func:`head_objective`; the official ``get_head_agg_weight``). It is solved exactly
   (:func:`simplex_qp`), weights at or below ``pac_min_weight`` (1e-3) are zeroed and the rest
   renormalised (official ``alpha * (alpha > eps)`` and ``agg_classifier_weighted_p``), and client
   i's next head is ``sum_j alpha_ij phi_j`` (:func:`combine_heads`). It is sent to i with its next
   training message and is the head it is evaluated with.

Decisions where the references disagree or are silent:

* Prototype weighting: class counts (official code); PFLlib's ``serverpac`` uses a plain mean,
  which FedReMa's code base (a copy of PFLlib) runs too: ``pac_proto_weighting: uniform``.
* Alignment for a class without a global prototype: no pull, normalised over the whole batch
  (PFLlib, :class:`fedhet.algorithms.prototypes.PrototypeAlignment`); the official code pulls such
  samples to the client's own pre-training prototype. The two agree whenever every class of the
  client has a global prototype (FedReMa's full-participation setting).
* QP: the official code calls cvxpy on ``P`` (after clipping tiny eigenvalues when it is not
  PSD); ``P`` is PSD by construction here (a Gram matrix plus a non-negative diagonal), and
  Wolfe's minimum-norm-point algorithm solves the simplex QP exactly in finitely many steps,
  deterministically, with numpy only.
* Optimizer: the run's settings, fresh SGD state per phase. The official code uses SGD momentum
  0.5, weight decay 5e-4 and lr 0.1 for the classifier phase; PFLlib (FedReMa's code base) one
  optimizer with the run's lr for both. Set ``train.momentum`` / ``train.weight_decay`` in the
  config to mirror either.
* Local prototypes after training in eval mode (PFLlib ``collect_protos``; the official code's
  ``get_local_protos`` runs in train mode, which differs only with BatchNorm or dropout).

Reusable pieces (FedReMa's +F / +A&F variants): :func:`fedhet.training.phases.train_head_then_body`,
:class:`fedhet.algorithms.prototypes.PrototypeAlignment` and the prototype helpers,
:func:`feature_statistics`, :func:`head_objective`, :func:`simplex_qp`,
:func:`classifier_weights`, :func:`combine_heads`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field

from fedhet.algorithms.aggregate import weighted_average
from fedhet.algorithms.fedper import FedPer
from fedhet.algorithms.prototypes import (
    GROUP,
    ClassStatistics,
    PrototypeAlignment,
    aggregate_prototypes,
    class_means,
    class_statistics,
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
    State,
)
from fedhet.core.errors import NumericalError
from fedhet.core.split import HEAD, select
from fedhet.training.local import trains_in_channels_last
from fedhet.training.objective import LossTerm
from fedhet.training.phases import train_head_then_body

__all__ = ["FedPAC", "feature_statistics", "head_objective", "simplex_qp", "classifier_weights",
           "combine_heads"]


# --- client statistics ----------------------------------------------------------------------
def feature_statistics(stats: ClassStatistics) -> tuple[float, torch.Tensor]:
    """FedPAC's ``(V_k, H_k)`` from a client's class statistics (official ``statistics_extraction``):
    ``V_k = sum_c [p_c E_c||h||^2 - p_c^2 ||mu_c||^2] / n`` and ``H_k[c] = p_c mu_c`` with
    ``p_c = n_c / n``. ``H_k`` is (C, d) float32; absent classes contribute nothing."""
    n = stats.total
    p = stats.counts.double() / n
    v = float(((p * stats.sq_norms) - (p * p) * (stats.means ** 2).sum(1)).sum()) / n
    return v, (p.unsqueeze(1) * stats.means).float()


# --- server: classifier collaboration --------------------------------------------------------
def head_objective(variances: Sequence[float], h: torch.Tensor, i: int) -> np.ndarray:
    """``P_i`` of the QP for client at position ``i`` (official ``get_head_agg_weight``):
    ``P_i[j, j'] = V_j [j = j'] + <H_i - H_j, H_i - H_j'>`` (Frobenius inner product over (C, d)).

    ``h`` stacks the clients' ``H`` as (K, C, d); ``variances`` holds their ``V``.
    """
    flat = h.reshape(h.shape[0], -1).double()
    gram = (flat @ flat.T).numpy()
    row = gram[i]
    dist = gram[i, i] - row[:, None] - row[None, :] + gram
    return np.diag(np.asarray(variances, dtype=np.float64)) + dist


def _affine_minimizer(q: np.ndarray, support: list[int]) -> np.ndarray:
    """Coefficients (summing to 1) of the minimum-norm point of the affine hull of ``support``:
    the solution of ``[[Q_SS, 1], [1^T, 0]] [v; -lam] = [0; 1]`` (least squares if singular)."""
    m = len(support)
    kkt = np.zeros((m + 1, m + 1))
    kkt[:m, :m] = q[np.ix_(support, support)]
    kkt[:m, m] = 1.0
    kkt[m, :m] = 1.0
    rhs = np.zeros(m + 1)
    rhs[m] = 1.0
    sol = np.linalg.lstsq(kkt, rhs, rcond=None)[0]
    return sol[:m]


def simplex_qp(p: np.ndarray, tol: float = 1e-12, max_iter: int = 10_000) -> np.ndarray:
    """``argmin alpha^T P alpha`` s.t. ``alpha >= 0, sum(alpha) = 1`` for a symmetric PSD ``P``.

    Wolfe's minimum-norm-point algorithm (Wolfe 1976): with ``P = Z^T Z`` the objective is
    ``||Z alpha||^2``, the squared norm of a point of the convex hull of Z's columns, and the
    algorithm walks corrals (affinely independent supports) using only inner products, i.e. ``P``.
    It terminates in finitely many steps with the exact minimiser (up to floating point);
    deterministic, ties go to the lowest index. ``P`` is scaled to max |entry| 1 internally; an
    all-zero ``P`` (every point optimal) gives uniform weights.
    """
    p = np.asarray(p, dtype=np.float64)
    k = p.shape[0]
    if p.shape != (k, k) or k == 0:
        raise ValueError(f"simplex_qp needs a square non-empty matrix, got shape {p.shape}")
    if not np.isfinite(p).all():
        raise NumericalError("FedPAC's classifier combination (simplex QP) got non-finite feature statistics: "
                             "local training diverged; lower train.lr")
    scale = float(np.abs(p).max())
    if k == 1 or scale == 0.0:
        return np.full(k, 1.0 / k)
    q = (p + p.T) / (2.0 * scale)
    first = int(np.argmin(np.diag(q)))
    x = np.zeros(k)
    x[first] = 1.0
    support = [first]
    for _ in range(max_iter):
        g = q @ x                                  # <z_j, current point>
        norm2 = float(x @ g)                       # ||current point||^2
        j = int(np.argmin(g))
        if g[j] >= norm2 - tol or j in support:   # every z_j lies beyond the supporting plane at x: optimal
            break
        support.append(j)
        while True:                                # minor cycle: move inside the corral
            v = _affine_minimizer(q, support)
            if np.all(v > tol):
                x[:] = 0.0
                x[support] = v
                break
            w = x[support]
            theta = min((w[a] / (w[a] - v[a]) for a in range(len(support)) if v[a] <= tol and w[a] - v[a] > 0),
                        default=0.0)
            new = theta * v + (1.0 - theta) * w
            keep = new > tol
            if keep.all():
                keep[int(np.argmin(new))] = False
            if theta == 0.0 and not keep[-1] and keep[:-1].all():
                # The entering point would leave at once: no progress is possible, x is optimal.
                return _normalised(x)
            support = [s for s, kk in zip(support, keep) if kk]
            x[:] = 0.0
            x[support] = new[keep] / new[keep].sum()
    return _normalised(x)


def _normalised(x: np.ndarray) -> np.ndarray:
    x = np.clip(x, 0.0, None)
    return x / x.sum()


def classifier_weights(variances: Sequence[float], h: torch.Tensor, min_weight: float = 1e-3) -> np.ndarray:
    """Row i: the combination weights of client i over the K clients, each row the
    :func:`simplex_qp` solution with entries ``<= min_weight`` zeroed and renormalised (official
    ``alpha * (alpha > eps)``, eps = 1e-3, then division by the sum in ``agg_classifier_weighted_p``)."""
    k = len(variances)
    out = np.zeros((k, k))
    for i in range(k):
        alpha = simplex_qp(head_objective(variances, h, i))
        alpha = np.where(alpha > min_weight, alpha, 0.0)
        if alpha.sum() <= 0:                       # cannot happen for min_weight < 1/K; stay local
            alpha = np.eye(k)[i]
        out[i] = alpha / alpha.sum()
    return out


def combine_heads(heads: Sequence[Arrays], weights: Sequence[float]) -> Arrays:
    """``sum_j w_j phi_j / sum_j w_j`` over the heads with a positive weight."""
    use = [j for j, w in enumerate(weights) if w > 0]
    return weighted_average([heads[j] for j in use], [float(weights[j]) for j in use])


# --- the method ------------------------------------------------------------------------------
class FedPAC(FedPer):
    """FedPAC; see the module docstring."""

    name = "fedpac"
    takes_mixup = False          # prototype alignment pulls each feature to its label's prototype
    head_on_client = False

    class Params(FedPer.Params):
        pac_proto_weight: float = Field(1.0, ge=0)        # lambda of the alignment term (FedReMa Table 1: 1)
        pac_head_epochs: int = Field(1, ge=0)             # classifier epochs before the body's (paper: 1)
        pac_min_weight: float = Field(1e-3, ge=0, lt=1)   # combination weights at or below are zeroed (official eps)
        # global prototypes: by class counts (official code) or the plain mean (PFLlib's serverpac,
        # which FedReMa's baselines run)
        pac_proto_weighting: Literal["counts", "uniform"] = "counts"

    # --- server ---------------------------------------------------------------------------
    def init_server_state(self, init_models: dict[str, Arrays]) -> State:
        state = super().init_server_state(init_models)
        state.update({"heads": {}, "prototypes": None, "defined": None, "head_weights": {}})
        return state

    def server_head(self, state: State, cid: int) -> Arrays | None:
        return state["heads"].get(cid)

    def train_message(self, state: State, cid: int, ctx: RoundContext) -> Message:
        msg = super().train_message(state, cid, ctx)
        if self.params.pac_proto_weight > 0 and state.get("defined") is not None and bool(state["defined"].any()):
            msg.arrays[GROUP] = prototype_arrays(state["prototypes"], state["defined"])
        return msg

    def aggregate(self, state: State, replies: Replies, ctx: RoundContext) -> State:
        state = super().aggregate(state, replies, ctx)                        # body: FedAvg
        cids = sorted(replies)
        if not cids:
            return state
        uploads = [up for c in cids if (up := uploaded_prototypes(replies[c])) is not None]
        agg = aggregate_prototypes(uploads, self.params.pac_proto_weighting)  # official protos_aggregation: counts
        if agg is not None:
            state["prototypes"], state["defined"] = agg
        variances = [float(replies[c].arrays["statistics"]["variance"].double().sum()) for c in cids]
        h = torch.stack([replies[c].arrays["statistics"]["h"] for c in cids])
        alpha = classifier_weights(variances, h, self.params.pac_min_weight)  # official get_head_agg_weight
        heads = [replies[c].arrays["head"] for c in cids]
        new_heads = dict(state["heads"])
        for pos, c in enumerate(cids):
            new_heads[c] = combine_heads(heads, alpha[pos])
        state["heads"] = new_heads
        state["head_weights"] = {c: {cids[j]: float(alpha[pos, j]) for j in np.flatnonzero(alpha[pos])}
                                 for pos, c in enumerate(cids)}
        return state

    def round_metrics(self, state: State) -> dict[str, Any]:
        return {**super().round_metrics(state),
                "fedpac_head_weights": {str(c): {str(j): round(a, 4) for j, a in row.items()}
                                        for c, row in sorted(state.get("head_weights", {}).items())}}

    # --- client ---------------------------------------------------------------------------
    def alignment_terms(self, msg: Message, state: State | None, client: ClientRuntime) -> list[LossTerm]:
        """The body phase's extra term: ``pac_proto_weight * MSE(h, proto[y])``, if prototypes came."""
        received = received_prototypes(msg)
        if received is None or self.params.pac_proto_weight == 0:
            return []
        return [PrototypeAlignment(*received, self.params.pac_proto_weight)]

    def local_training(self, weights: Arrays, msg: Message, state: State | None, client: ClientRuntime) -> LocalResult:
        terms = [*self.data_terms(msg, state, client), *self.local_terms(msg, state, client)]
        return train_head_then_body(client, weights, terms, [*terms, *self.alignment_terms(msg, state, client)],
                                    head_epochs=self.params.pac_head_epochs, body_epochs=client.settings.epochs,
                                    **self.train_options(msg, state, client))

    def uploads(self, result: LocalResult, msg: Message, state: State | None, client: ClientRuntime) -> dict[str, Arrays]:
        up = super().uploads(result, msg, state, client)
        # Step 1: statistics of the model the client received (msg["model"] is its start model).
        fast = trains_in_channels_last(client.settings)
        v, h = feature_statistics(class_statistics(client.model, msg.arrays["model"], client.data, client.num_classes,
                                                   fast_passes=fast))
        up["statistics"] = {"variance": torch.tensor([v], dtype=torch.float64), "h": h}
        up["head"] = select(result.weights, HEAD)
        if self.params.pac_proto_weight > 0:
            means, counts = class_means(client.model, result.weights, client.data, client.num_classes,
                                        fast_passes=fast)   # local prototypes
            up[GROUP] = {"mean": means, "count": counts}
        return up

    # --- evaluation -----------------------------------------------------------------------
    def personal_head(self, cid: int, state: State, client_state: State | None) -> Arrays | None:
        return state["heads"].get(cid)

    def client_view(self, state: State, cid: int) -> State:
        return {"model": state["model"], "heads": {cid: state["heads"][cid]} if cid in state["heads"] else {}}

