"""Class prototypes: per-class mean features, their aggregation on the server, and the alignment term.

A client's prototype of class c is the mean body feature of its training samples of class c
(FedProto, Tan et al. AAAI 2022; FedPAC, Xu, Tong & Huang ICLR 2023). The server combines the
uploaded prototypes into global ones (FedProto's and FedPAC's prototype aggregation) and sends them
back; clients then pull their features towards the global prototype of each sample's class.

Used by FedProto (:mod:`fedhet.algorithms.fedproto`), FedPAC (:mod:`fedhet.algorithms.fedpac`)
and FedReMa's +F / +A&F variants. The public API:

* :func:`class_statistics` / :func:`class_means` - one no-grad pass in eval mode over a client's
  training split: per-class counts, means (and mean squared norms, which FedPAC's variance term
  needs).
* :func:`aggregate_prototypes` - ``[(means, counts), ...]`` to ``(prototypes, defined)``: a
  class nobody uploaded is undefined (``defined[c] = False``, its row zeros).
* :class:`PrototypeAlignment` - the loss term ``lam * MSE(h, proto[y])`` over the samples whose
  class has a prototype.
* :func:`prototype_arrays` / :func:`received_prototypes` - the ``"prototypes"`` array group of a
  message and back.

Conventions: prototypes are ``(C, d)`` float32 tensors; counts ``(C,)`` int64; ``defined`` a
``(C,)`` bool mask. Sums are accumulated in float64.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from fedhet.core.contract import Arrays, Batch, ClientData, Forward, Message
from fedhet.training.inference import channels_last, pass_rows
from fedhet.training.local import forward
from fedhet.training.mode import in_mode
from fedhet.training.objective import LossTerm

# The array group that carries prototypes, both ways: down {"mean", "defined"}, up {"mean", "count"}.
GROUP = "prototypes"


@dataclass
class ClassStatistics:
    """Per-class feature statistics of one model on one client's training split."""

    counts: torch.Tensor     # (C,) int64, samples of each class
    means: torch.Tensor      # (C, d) float64, mean feature per class (zeros where the count is 0)
    sq_norms: torch.Tensor   # (C,) float64, mean of ||h||^2 per class (0 where the count is 0)

    @property
    def total(self) -> int:
        return int(self.counts.sum())


@torch.no_grad()
def class_statistics(model: torch.nn.Module, weights: Arrays, data: ClientData, num_classes: int, *,
                     positions: torch.Tensor | None = None, batch_size: int = 1024,
                     of: Callable[[Forward], torch.Tensor] | None = None,
                     fast_passes: bool = False) -> ClassStatistics:
    """Per-class counts, mean features and mean squared feature norms of ``weights`` on the
    client's training split (or on ``positions`` of it), in eval mode and without gradients
    (as PFLlib ``collect_protos`` / ``statistics_extraction`` and FedPAC ``statistics_extraction``).
    ``of`` picks another per-sample vector than the features (FedACD's probability matrix is the
    per-class mean of the softmax). The model's train/eval mode is restored afterwards.

    Passes take ``batch_size`` rows. ``fast_passes`` takes evaluation's faster CPU passes instead:
    a few dozen rows per thread in channels_last (:mod:`fedhet.training.inference`), rounded
    differently in the last bits: for statistics that never feed training, and for those of a
    run that trains in channels_last (``run.memory_format``), whose last bits differ anyway."""
    n = len(data.train_idx)
    positions = torch.arange(n) if positions is None else positions
    sums = sq = None
    counts = torch.zeros(num_classes, dtype=torch.int64, device=data.y.device)
    fast = fast_passes and data.y.device.type == "cpu"
    rows = pass_rows(batch_size, data.y.device) if fast else batch_size
    if fast:
        weights = {k: channels_last(v) for k, v in weights.items()}
    with in_mode(model, training=False):
        for i in range(0, len(positions), rows):
            batch = data.batch(positions[i:i + rows])
            out = forward(model, weights, channels_last(batch.x) if fast else batch.x)
            h = (out.features if of is None else of(out)).double()
            if sums is None:
                sums = torch.zeros(num_classes, h.shape[1], dtype=torch.float64, device=h.device)
                sq = torch.zeros(num_classes, dtype=torch.float64, device=h.device)
            sums.index_add_(0, batch.y, h)
            sq.index_add_(0, batch.y, (h * h).sum(1))
            counts += torch.bincount(batch.y, minlength=num_classes)
    if sums is None:
        raise ValueError("class_statistics needs at least one sample")
    have = counts > 0
    denom = counts.clamp(min=1).double()
    means = torch.where(have.unsqueeze(1), sums / denom.unsqueeze(1), torch.zeros_like(sums))
    return ClassStatistics(counts, means, torch.where(have, sq / denom, torch.zeros_like(sq)))


def class_means(model: torch.nn.Module, weights: Arrays, data: ClientData, num_classes: int, *,
                positions: torch.Tensor | None = None, batch_size: int = 1024,
                fast_passes: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """A client's local prototypes: ``(means (C, d) float32, counts (C,) int64)``, zeros for absent
    classes (FedProto's and FedPAC's local prototypes), computed in eval mode over its training split
    (``fast_passes``: :func:`class_statistics`)."""
    stats = class_statistics(model, weights, data, num_classes, positions=positions, batch_size=batch_size,
                             fast_passes=fast_passes)
    return stats.means.float(), stats.counts


def aggregate_prototypes(uploads: Sequence[tuple[torch.Tensor, torch.Tensor]],
                         weighting: Literal["uniform", "counts"] = "uniform",
                         previous: tuple[torch.Tensor | None, torch.Tensor | None] | None = None,
                         ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Global prototypes from the uploaded ``(means (C, d), counts (C,))`` of the clients.

    For each class, over the clients that have it (count > 0):

    * ``"uniform"`` - the plain mean of their prototypes (FedProto's code,
      ``yuetan031/fedproto`` ``proto_aggregation``, copied by PFLlib's FedProto and FedPAC servers
      and by FedReMa's server);
    * ``"counts"`` - weighted by their sample counts of that class (the official FedPAC code,
      ``tools.protos_aggregation``; FedFM's anchors, Ye et al. Eq. 9).

    Returns ``(prototypes (C, d) float32, defined (C,) bool)``; a class nobody has is undefined with
    a zero row. ``None`` when nothing was uploaded. Without ``previous`` there is no memory across
    rounds: as in every prototype reference, the global prototypes are rebuilt from the round's uploads.

    With ``previous = (prototypes, defined)`` of the last round the rule has memory (FedCME's global
    features, Nie et al. Algorithm 1 lines 27-35; FedFM's anchors where fedhet keeps a class's
    previous anchor when no participant has it): under
    ``"uniform"`` a client without class c contributes the previous prototype of c (if defined)
    to the mean, and under either rule a class no client has keeps its previous prototype. With
    nothing uploaded the previous pair is returned.
    """
    prev, prev_defined = previous if previous is not None else (None, None)
    if not uploads:
        return (prev, prev_defined) if prev is not None and prev_defined is not None else None
    if weighting not in ("uniform", "counts"):
        raise ValueError(f"unknown prototype weighting {weighting!r}; use 'uniform' or 'counts'")
    num_classes, dim = uploads[0][0].shape
    if prev is None or prev_defined is None:
        prev = torch.zeros(num_classes, dim)
        prev_defined = torch.zeros(num_classes, dtype=torch.bool)
    total = torch.zeros(num_classes, dim, dtype=torch.float64)
    mass = torch.zeros(num_classes, dtype=torch.float64)
    # Only defined previous rows are ever used; an undefined one stays a zero row.
    kept = torch.where(prev_defined.unsqueeze(1), prev.double(), torch.zeros_like(total))
    for means, counts in uploads:
        if tuple(means.shape) != (num_classes, dim) or tuple(counts.shape) != (num_classes,):
            raise ValueError(f"prototype uploads disagree in shape: {tuple(means.shape)} / {tuple(counts.shape)} "
                             f"vs ({num_classes}, {dim})")
        have = counts > 0
        if weighting == "counts":
            w = torch.where(have, counts.double(), torch.zeros_like(counts, dtype=torch.float64))
            rows = means.double()
        else:
            w = (have | prev_defined).double()          # a class it lacks: the previous prototype, if any
            rows = torch.where(have.unsqueeze(1), means.double(), kept)
        total += w.unsqueeze(1) * rows
        mass += w
    defined = mass > 0
    protos = torch.where(defined.unsqueeze(1), total / mass.clamp(min=1e-300).unsqueeze(1), kept)
    return protos.float(), defined | prev_defined


class PrototypeAlignment(LossTerm):
    """``weight * MSE(h, proto[y])`` over the samples whose class has a global prototype.

    ``value = weight / (B * d) * sum_{i in batch, defined[y_i]} ||h_i - proto[y_i]||^2``

    Normalisation: the references' ``nn.MSELoss()`` (mean over the whole ``(B, d)`` batch) with the
    target row of a sample whose class has no prototype set to that sample's own detached feature,
    so such samples add nothing but still count in ``B`` (PFLlib ``clientproto`` / ``clientpac``,
    FedReMa ``clientReMa.train_*_with_proto``: the regulariser of FedProto's and FedPAC's local
    objectives with the references' mean). The official FedPAC code instead fills a missing class with the client's
    own pre-training prototype; pass such a table as ``prototypes`` with ``defined`` all True to get
    that behaviour. ``prototypes`` is a constant (no gradient).

    Computed with a mask, not by selecting rows, so it has no data-dependent branch and the
    vectorized engine can train it under ``vmap`` (FedPAC's body phase, FedProto).
    """

    name = "proto"
    vectorizable = True

    def __init__(self, prototypes: torch.Tensor, defined: torch.Tensor | None, weight: float):
        self.prototypes = prototypes.detach()
        self.defined = (defined.bool() if defined is not None
                        else torch.ones(prototypes.shape[0], dtype=torch.bool, device=prototypes.device))
        self.weight = float(weight)

    def __call__(self, out: Forward, batch: Batch, weights: Arrays) -> torch.Tensor:
        h = out.features
        use = self.defined.to(h.device)[batch.y]
        # A sample without a prototype aims at its own detached feature (the references' target):
        # it adds 0 and a 0 gradient, whatever that class's row holds (even nan or inf).
        target = torch.where(use.unsqueeze(1), self.prototypes.to(device=h.device, dtype=h.dtype)[batch.y], h.detach())
        return self.weight * (h - target).pow(2).sum() / h.numel()


# --- messages -----------------------------------------------------------------------------------
def prototype_arrays(prototypes: torch.Tensor, defined: torch.Tensor) -> Arrays:
    """The server->client ``"prototypes"`` group: ``{"mean": (C, d), "defined": (C,) bool}``."""
    return {"mean": prototypes, "defined": defined}


def received_prototypes(msg: Message) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(prototypes, defined)`` from a server message, or ``None`` when it carries none or none is defined."""
    group = msg.arrays.get(GROUP)
    if not group or "mean" not in group:
        return None
    defined = group.get("defined")
    defined = defined.bool() if defined is not None else torch.ones(group["mean"].shape[0], dtype=torch.bool,
                                                                        device=group["mean"].device)
    return (group["mean"], defined) if bool(defined.any()) else None


def uploaded_prototypes(msg: Message) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(means, counts)`` from a client's reply, or ``None`` when it uploaded none."""
    group = msg.arrays.get(GROUP)
    if not group or "count" not in group:
        return None
    return group["mean"], group["count"]
