"""Local training in phases over the network's two parts: the head with the body frozen, then the
body with the new head frozen (FedRep's, FedPAC's and FedReMa+A&F's local training, and a method of
one's own through ``fedhet.extend``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from fedhet.core.contract import Arrays, ClientRuntime, LocalResult
from fedhet.core.split import is_body, is_head
from fedhet.training.local import concatenate_results
from fedhet.training.objective import LossTerm


def _both(a: Callable[[str], bool], b: Callable[[str], bool] | None) -> Callable[[str], bool]:
    return a if b is None else (lambda name: a(name) and b(name))


def train_head_then_body(client: ClientRuntime, weights: Arrays, head_terms: list[LossTerm],
                         body_terms: list[LossTerm], *, head_epochs: int, body_epochs: int,
                         start_epoch: int = 0, optimizer_state: Arrays | None = None,
                         trainable: Callable[[str], bool] | None = None, **options: Any) -> LocalResult:
    """Alternating local training: ``head_epochs`` epochs on the head with the body frozen, then
    ``body_epochs`` epochs on the body with the (new) head frozen.

    FedRep (Collins et al. 2021, Algorithm 1: tau_h head updates, then tau updates of the
    representation), FedPAC (Xu et al. 2023, Algorithm 1: the classifier for one epoch,
    then the feature extractor with the alignment term) and FedReMa+A&F (``clientReMa
    .train_separately_with_proto``). ``head_terms`` / ``body_terms`` are the objectives of the two
    phases (FedPAC adds :class:`fedhet.algorithms.prototypes.PrototypeAlignment` to the body's).

    * Frozen means exactly that: a phase's frozen parameters come out bitwise unchanged. BatchNorm
      running statistics of the frozen part still update in train mode, as in the references
      (which only switch ``requires_grad``).
    * Batches: the head phase draws absolute epochs ``start_epoch ..``, the body phase the
      following ones, so the two phases see different shuffles.
    * ``optimizer_state`` (momentum carried in): each phase restores the buffers of the parameters
      it trains, i.e. one optimizer over the whole model whose frozen parameters get no step
      (PFLlib's single optimizer). Without it each phase gets the client's default: fresh state
      (FedRep/FedPAC's per-phase optimizers), or under ``train.optimizer_state: keep`` the state
      the client host keeps, which holds both parts. The result carries the union either way.
    * ``trainable`` (from a combined method) further restricts both phases; ``options`` go to
      ``client.train`` (``augment``).

    Returns one :class:`LocalResult`: final weights, summed steps and samples, step-weighted
    mean loss and loss parts, and in ``entry_steps`` the steps of the phase that trained each entry
    (SCAFFOLD's option II divides each entry's drift by its own). Each phase is counted in the
    round's statistics by ``client.train``.
    """
    results: list[LocalResult] = []
    current = weights
    # Given state is carried from phase to phase; without it each call gets the client's default
    # (fresh, or what the client host keeps under train.optimizer_state: keep).
    carried = dict(optimizer_state) if optimizer_state else None
    union = dict(optimizer_state or {})
    epoch = start_epoch
    entry_steps: dict[str, int] = {}
    for epochs, part, terms in ((head_epochs, is_head, head_terms), (body_epochs, is_body, body_terms)):
        phase = _both(part, trainable)
        if epochs <= 0:
            entry_steps.update({name: 0 for name in current if phase(name)})      # a phase left out
            continue
        result = client.train(current, terms, epochs=epochs, start_epoch=epoch,
                              trainable=phase, optimizer_state=carried, **options)
        entry_steps.update({name: result.steps for name in current if phase(name)})
        results.append(result)
        current = result.weights
        union.update(result.optimizer_state)
        if carried is not None:
            carried.update(result.optimizer_state)
        epoch += epochs
    if not results:
        return LocalResult({k: v.detach().clone() for k, v in weights.items()}, union, 0, 0, 0.0)
    return replace(concatenate_results(results, union), entry_steps=entry_steps)
