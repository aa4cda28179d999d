"""The vmapped step: one SGD or Adam step for some clients of a group, all at one batch size.

The step runs ``vmap`` over the clients of ``functional_call`` + the clients' loss terms (the
per-client term objects are rebuilt inside the vmapped function from their stacked tensor
constants), then ordinary autograd on the *sum* of the per-client losses, which gives every client
exactly the gradient of its own loss (the clients share no tensor). The terms' statistics
(``LossTerm.statistics``, FedCME's per-class feature sums) are computed under the same ``vmap``
and added up per client in its step order, like ``train_local``. An augmentation's draws are
applied per client under ``vmap`` before the forward pass. BatchNorm runs in training mode with
per-client stacked running statistics, which the vmapped forward updates in place with the
reference's rule.
"""

from __future__ import annotations

import copy

import torch

from fedhet.core.contract import Batch, Forward, normalize_uint8
from fedhet.engine.vectorized.grouping import Group
from fedhet.engine.vectorized.kernels import adam_step, only, rows, sgd_step
from fedhet.training.dropout import masks_applied, split_draws
from fedhet.training.local import forward
from fedhet.training.objective import accumulate_statistics
from fedhet.training.optim import Adam

Pool = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]   # (x, y, mean, std) on the device


def vmapped_step(g: Group, pool: Pool, device: torch.device, idx: torch.Tensor | None, pool_idx: torch.Tensor,
                 pos: torch.Tensor, active: torch.Tensor | None = None,
                 draws: dict[str, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of the group's clients (``idx``: their rows on the device, None when all step;
    ``pool_idx`` / ``pos``: (clients, batch size) pool indices and positions of their batches, on
    the device). ``active``: a full-width step's (C,) mask of the clients it is for; the others'
    rows are computed and discarded, their state left as it was. ``draws``: the members'
    augmentation draws, (members, ...) each, applied per client with the group's augmentation
    before the forward pass, as ``train_local`` applies them. Returns the step's per-client losses
    and loss parts (on the device)."""
    s = g.requests[0].settings
    # What the forward pass may change in place (BatchNorm's running statistics), for the rows
    # outside a wide step to get back.
    kept = {n: g.weights[n].clone() for n in g.buffers} if active is not None else {}

    def take(t: torch.Tensor) -> torch.Tensor:
        return t if idx is None else t.index_select(0, idx)

    w = {}
    for n in g.names:
        t = take(g.weights[n])
        w[n] = t.detach().requires_grad_(True) if n in g.leaves else t
    consts = [take(t) for t in g.batched_consts]

    x_pool, y_pool, mean, std = pool
    x = normalize_uint8(x_pool[pool_idx], mean, std)      # ClientData.inputs, per client
    y = y_pool[pool_idx]

    model, templates, paths, shared = g.model, g.templates, g.batched_paths, g.shared_consts
    augment = g.augment
    use_bf16 = s.precision == "bf16"

    def client_loss(w, x, y, index, consts, draws):
        batch = Batch(x, y, index)
        draws, masks = split_draws(draws)
        if augment is not None:
            batch = augment.apply(batch, draws)
        with masks_applied(masks):
            return client_objective(w, batch, consts)

    def client_objective(w, batch, consts):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16):
            out = forward(model, w, batch.x)
        out = Forward(out.features.float(), out.logits.float())
        values: dict = {}
        for (j, (attr, key)), value in [*zip(paths, consts), *shared.items()]:
            values.setdefault(j, {})
            if key is None:
                values[j][attr] = value
            else:
                values[j].setdefault(attr, {})[key] = value
        loss, parts, stats = None, [], {}
        seen = Forward(out.features.detach(), out.logits.detach())
        for j, template in enumerate(templates):
            term = copy.copy(template)
            for attr, value in values.get(j, {}).items():
                # dict attributes keep the template's key order (terms may iterate them)
                setattr(term, attr, {k: value[k] for k in getattr(template, attr)} if isinstance(value, dict)
                        else value)
            v = term(out, batch, w)
            parts.append(v.detach().float())
            loss = v if loss is None else loss + v
            accumulate_statistics([term], seen, batch, stats)
        return loss, torch.stack(parts), stats

    losses, parts, stats = torch.func.vmap(client_loss)(w, x, y, pos, consts, draws or {})
    leaves = [w[n] for n in g.leaves]
    grads = torch.autograd.grad(losses.sum(), leaves, allow_unused=True) if leaves else []
    with torch.no_grad():
        if isinstance(g.optimizer, Adam):
            adam_step(g, w, grads, idx, s, active)
        else:
            sgd_step(g, w, grads, idx, s, active)
        if idx is not None:   # the bucket worked on copies: write back weights and BatchNorm statistics
            for n in g.names:
                g.weights[n].index_copy_(0, idx, w[n].detach())
        for n, before in kept.items():
            g.weights[n].copy_(torch.where(rows(active, before), g.weights[n], before))  # type: ignore[arg-type]  # kept only for an active mask
        accumulate(g, stats, idx, active)
    return losses.detach(), parts


def accumulate(g: Group, stats: dict[str, torch.Tensor], idx, active: torch.Tensor | None = None) -> None:
    """Add one step's statistics (rows: the step's members, or the rows ``active`` marks of a
    full-width step) to the group's per-client totals."""
    C = len(g.requests)
    for key, value in stats.items():
        value = value.detach()
        if key not in g.stat_totals:
            g.stat_totals[key] = value.new_zeros((C, *value.shape[1:]))
            g.stat_seen[key] = torch.zeros(C, dtype=torch.bool, device=value.device)
        if active is not None:
            g.stat_totals[key] += only(active, value)
            g.stat_seen[key] |= active
        elif idx is None:
            g.stat_totals[key] += value
            g.stat_seen[key].fill_(True)
        else:
            g.stat_totals[key].index_add_(0, idx, value)
            g.stat_seen[key].index_fill_(0, idx, True)
