"""Grouping: which pending requests train together, and their stacked state.

Requests train in one group when they share the architecture, the settings, the trainable set,
the carried optimizer state, the loss terms' signature, the weight shapes, the data pool and the
augmentation's signature (:func:`group_key`). A group's weights, optimizer state, the terms'
tensor constants and the statistics' totals are stacked along a new client dimension on the
engine's device (:func:`build_group`). With ``keep_graphs``, :class:`KeptGroups` lets a later
group of the same signature train in an earlier group's buffers, whose CUDA graphs read those
addresses.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fedhet.engine.vectorized.baton import TrainRequest
from fedhet.engine.vectorized.graphs import GraphBook
from fedhet.training.augment import Augmentation
from fedhet.training.local import steps_per_epoch, trained_names
from fedhet.training.objective import LossTerm
from fedhet.training.optim import Adam, Optimizer, make_optimizer

# keep_graphs: how many group signatures keep their buffers and graphs (FedCME uses two: phase A
# starts its statistics from zero, phase B from phase A's).
KEPT_GROUPS = 8


def term_layout(term: LossTerm):
    """``(static signature, tensor leaves)`` of a term, or None if it cannot be stacked.

    Tensor leaves are ``((attr, key), tensor)`` for tensor attributes (key None) and for the
    values of dict-of-tensor attributes; everything else must be a plain value or a module and
    becomes part of the signature, so grouped clients' terms differ only in tensor values.
    """
    if not term.vectorizable:
        return None
    static: list[tuple] = []
    leaves: list = []
    for attr, value in sorted(vars(term).items()):
        kind = _attribute_kind(value)
        if kind is None:                      # unstackable() says which attribute, for the reason
            return None
        if kind == "tensor":
            leaves.append(((attr, None), value))
        elif kind == "tensors":
            static.append((attr, "dict", tuple(value)))
            leaves.extend(((attr, k), v) for k, v in value.items())
        elif kind == "plain":
            static.append((attr, value))
        else:
            static.append((attr, "module", id(value)))
    shapes = tuple((path, tuple(t.shape), t.dtype) for path, t in leaves)
    return (type(term), tuple(static), shapes), leaves


def _attribute_kind(value: object) -> str | None:
    """How a term's attribute enters a group: a tensor or a dict of tensors (stacked over clients),
    a plain value or a module (part of the signature), or None: not at all."""
    if isinstance(value, torch.Tensor):
        return "tensor"
    if isinstance(value, dict) and all(isinstance(v, torch.Tensor) for v in value.values()):
        return "tensors"
    if value is None or isinstance(value, (bool, int, float, str)):
        return "plain"
    return "module" if isinstance(value, nn.Module) else None


def unstackable(term: LossTerm) -> str | None:
    """Why the engine cannot stack ``term`` (None: it can), for the fallback's reason and warning."""
    if not term.vectorizable:
        return "not declared vectorizable"
    for attr, value in sorted(vars(term).items()):
        if _attribute_kind(value) is None:
            return (f"its attribute {attr!r} holds a {type(value).__name__}; a vectorizable term's attributes are "
                    "tensors, dicts of tensors, numbers, strings, None or modules")
    return None


def _leaves(term: LossTerm) -> list:
    """The tensor leaves of a term that :func:`group_key` has let into a group (so it has a layout)."""
    layout = term_layout(term)
    assert layout is not None
    return layout[1]


def num_steps(req: TrainRequest) -> int:
    """The optimizer steps ``req`` takes: its epochs times its batches per epoch."""
    s = req.settings
    return s.epochs * steps_per_epoch(len(req.data.train_idx), s.batch_size, s.drop_last)


# The reason of a training call with no step: counted, but not trained on the reference path either.
ZERO_STEPS = "zero steps"
# The reason of a training in a method's own loop (not client.train), which the engine never sees.
OWN_LOOP = "own training loop"


def group_key(req: TrainRequest) -> tuple | str:
    """The group ``req`` trains in, or why it cannot be vmapped (the reason it is counted under)."""
    if req.augment is not None and not isinstance(req.augment, Augmentation):
        return "augmentation"
    if num_steps(req) == 0:
        return ZERO_STEPS
    if req.settings.optimizer not in ("sgd", "adam"):
        return f"optimizer {req.settings.optimizer}"
    if req.settings.optimizer == "adam" and req.optimizer_state:
        return "optimizer adam with carried state"
    layouts = [term_layout(t) for t in req.terms]
    impure = [t for t, lay in zip(req.terms, layouts) if lay is None]
    if impure:
        return f"loss term {impure[0].name} ({unstackable(impure[0])})"
    c = req.client
    leaves = tuple(trained_names(c.model, req.weights, req.trainable))
    carried: tuple = ()
    if req.optimizer_state and req.settings.momentum > 0:
        carried = tuple(n for n in leaves if n in req.optimizer_state)
    shapes = tuple((n, tuple(t.shape), t.dtype) for n, t in req.weights.items())
    data = req.data
    augmentation = req.augment.signature() if req.augment is not None else None
    return (c.arch, req.settings, leaves, carried, shapes, tuple(lay[0] for lay in layouts),
            id(data.x), id(data.y), id(data.mean), id(data.std), augmentation)


@dataclass
class Group:
    """Stacked state of one group of requests trained together."""

    requests: list[TrainRequest]
    model: nn.Module
    names: list[str]                      # every weight name, in the first request's order
    leaves: list[str]                     # trainable parameters, in that order
    weights: dict[str, torch.Tensor]      # name -> (C, ...) on the device
    momentum: dict[str, torch.Tensor] = field(default_factory=dict)
    has_momentum: dict[str, torch.Tensor] = field(default_factory=dict)   # name -> (C,) bool
    templates: list[LossTerm] = field(default_factory=list)
    batched_paths: list[tuple[int, tuple]] = field(default_factory=list)  # (term index, (attr, key))
    batched_consts: list[torch.Tensor] = field(default_factory=list)      # (C, ...) each
    shared_consts: dict[tuple[int, tuple], torch.Tensor] = field(default_factory=dict)
    records: list = field(default_factory=list)     # (client of each row or None, batch size, losses, parts) per step
    optimizer: Optimizer | None = None              # the update kernel (fedhet.training.optim)
    # Adam (fresh state each call): per-client moments, the leaves that have had a gradient, and
    # this step's (lr / bias correction 1, sqrt(bias correction 2)) - a device tensor that the
    # loop fills before each step, so a replayed CUDA graph reads the current step's values.
    adam_m: dict[str, torch.Tensor] = field(default_factory=dict)
    adam_v: dict[str, torch.Tensor] = field(default_factory=dict)
    adam_vmax: dict[str, torch.Tensor] = field(default_factory=dict)
    adam_seen: set[str] = field(default_factory=set)
    adam_now: torch.Tensor | None = None
    # Per client running totals of the terms' statistics ("<term>.<key>" -> (C, ...)), added in
    # each client's step order like train_local, and which clients have a value for each key.
    stat_totals: dict[str, torch.Tensor] = field(default_factory=dict)
    stat_seen: dict[str, torch.Tensor] = field(default_factory=dict)
    # The group's augmentation (one signature: group_key) with its constants on the device, moved
    # here once: a copy from the host inside a step would break its CUDA graph capture.
    augment: Augmentation | None = None
    # The model's buffers among ``names`` (what a forward pass may change: BatchNorm statistics).
    buffers: list[str] = field(default_factory=list)
    # The group's CUDA graphs, or with ``keep_graphs`` those of every group that trained in these
    # buffers before it (KeptGroups).
    graphs: GraphBook = field(default_factory=GraphBook)


def _stack(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    return torch.stack([t.detach() for t in tensors]).to(device)


def build_group(reqs: list[TrainRequest], device: torch.device) -> Group:
    """A new group of ``reqs`` with their state stacked on ``device``."""
    first = reqs[0]
    model = first.client.model
    names = list(first.weights)
    leaves = trained_names(model, first.weights, first.trainable)
    g = Group(reqs, model, names, leaves, {n: _stack([r.weights[n] for r in reqs], device) for n in names})
    buffers = {n for n, _ in model.named_buffers()}
    g.buffers = [n for n in names if n in buffers]
    s = first.settings
    g.optimizer = make_optimizer(s)
    g.augment = first.augment.to(device) if isinstance(first.augment, Augmentation) else None
    # Statistics totals start from each request's own (phase B continues phase A's).
    keys = list(dict.fromkeys(k for r in reqs for k in (r.statistics or {})))
    for key in keys:
        proto = next(r.statistics[key] for r in reqs if r.statistics and key in r.statistics)
        g.stat_totals[key] = _stack([(r.statistics or {}).get(key, torch.zeros_like(proto)) for r in reqs], device)
        g.stat_seen[key] = torch.tensor([r.statistics is not None and key in r.statistics for r in reqs],
                                        device=device)
    if isinstance(g.optimizer, Adam):
        for n in leaves:
            g.adam_m[n] = torch.zeros_like(g.weights[n])
            g.adam_v[n] = torch.zeros_like(g.weights[n])
            if g.optimizer.amsgrad:
                g.adam_vmax[n] = torch.zeros_like(g.weights[n])
        g.adam_now = torch.zeros(2, dtype=torch.float32, device=device)
    elif s.momentum > 0:
        for n in leaves:
            carried = first.optimizer_state is not None and n in first.optimizer_state
            g.momentum[n] = (_stack([r.optimizer_state[n] for r in reqs], device) if carried  # type: ignore[index]
                             else torch.zeros_like(g.weights[n]))
            g.has_momentum[n] = torch.full((len(reqs),), carried, dtype=torch.bool, device=device)
    # Loss terms: the first client's objects are templates; their tensor constants are
    # stacked (or shared, when every client holds the very same tensor).
    layouts = [[_leaves(t) for t in r.terms] for r in reqs]
    g.templates = list(first.terms)
    for j in range(len(first.terms)):
        for li, (path, tensor) in enumerate(layouts[0][j]):
            values = [lay[j][li][1] for lay in layouts]
            if all(v is tensor for v in values):
                g.shared_consts[(j, path)] = tensor.detach().to(device)
            else:
                g.batched_paths.append((j, path))
                g.batched_consts.append(_stack(values, device))
    return g


class KeptGroups(OrderedDict[tuple, Group]):
    """``keep_graphs``: groups of one signature train in the same stacked buffers and keep one set
    of CUDA graphs, for at most ``limit`` signatures, the least recent dropped (signature -> group).
    Costs: each group is still built before its values are copied in (twice a group's memory at
    that moment), and groups that differ in their number of clients keep separate buffers."""

    def __init__(self, limit: int = KEPT_GROUPS):
        super().__init__()
        self.limit = limit

    def forget(self, reqs: list[TrainRequest]) -> None:
        """Drop the kept groups that ``reqs`` trained in (a failed group may have left them half-written)."""
        for sig in [k for k, kept in self.items() if any(r is q for q in kept.requests for r in reqs)]:
            del self[sig]

    def group_for(self, fresh: Group) -> Group:
        """The group ``fresh``'s requests train in: ``fresh`` itself, kept for later groups of its
        signature, or the kept group of that signature with ``fresh``'s weights, optimizer state,
        statistics and term constants copied into its buffers (in place: its CUDA graphs read those
        addresses)."""
        reqs = fresh.requests
        signature = (group_key(reqs[0]), len(reqs), tuple(fresh.batched_paths), tuple(fresh.shared_consts),
                     tuple(sorted(fresh.momentum)), tuple(sorted(fresh.stat_totals)))
        kept = self.get(signature)
        if kept is None:
            # Shared constants may be the caller's own tensors (to() hands back one already on the
            # device): later groups copy into these buffers, so they must be the group's own.
            fresh.shared_consts = {k: t.clone() for k, t in fresh.shared_consts.items()}
            self[signature] = fresh
            while len(self) > self.limit:
                self.popitem(last=False)
            return fresh
        self.move_to_end(signature)
        with torch.no_grad():
            pairs: list[tuple[dict[Any, torch.Tensor], dict[Any, torch.Tensor]]] = [
                (kept.weights, fresh.weights), (kept.momentum, fresh.momentum),
                (kept.has_momentum, fresh.has_momentum), (kept.adam_m, fresh.adam_m),
                (kept.adam_v, fresh.adam_v), (kept.adam_vmax, fresh.adam_vmax),
                (kept.shared_consts, fresh.shared_consts)]
            for mine, theirs in pairs:
                for name, t in theirs.items():
                    mine[name].copy_(t)
            for mine_t, t in zip(kept.batched_consts, fresh.batched_consts):
                mine_t.copy_(t)
            # statistics: the requests' own (phase B continues phase A's), zero where they have none
            for key, total in kept.stat_totals.items():
                if key in fresh.stat_totals:
                    total.copy_(fresh.stat_totals[key])
                    kept.stat_seen[key].copy_(fresh.stat_seen[key])
                else:
                    total.zero_()
                    kept.stat_seen[key].fill_(False)
        kept.requests, kept.records = reqs, []
        return kept
