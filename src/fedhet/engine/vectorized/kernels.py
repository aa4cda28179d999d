"""The optimizer on stacked tensors: local training's SGD and Adam kernels
(:mod:`fedhet.training.optim`, the rules of ``torch.optim.SGD`` and ``torch.optim.Adam``) applied
per client to a group's (C, ...) weights, with per-client ``clip_grad_norm``.

SGD: weight decay, momentum with dampening / Nesterov; a client's first step starts its buffer
from the gradient, like torch. Adam: L2 weight decay, amsgrad, from a fresh state; every client of
a step takes the step number the schedule gives it (each client with steps left takes exactly one
per iteration), with the bias corrections computed in double on the host for the whole loop and
read from the device.

A step may be for some rows only: ``idx`` (a narrow step's members, None when all step) or
``active`` (a wide step's mask: the other rows keep their weights and optimizer state).
"""

from __future__ import annotations

import torch

from fedhet.core.contract import TrainSettings
from fedhet.engine.vectorized.grouping import Group
from fedhet.training.optim import SGD, Adam, clip_coefficient


def rows(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A (C,) per-client mask shaped to broadcast over ``like``'s (C, ...) rows."""
    return mask.view(-1, *[1] * (like.dim() - 1))


def only(active: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``t`` with the rows of the clients outside a wide step set to zero (an update or a sum they skip)."""
    return torch.where(rows(active, t), t, 0)


def keep(active: torch.Tensor, dst: torch.Tensor, new: torch.Tensor) -> None:
    """``dst`` takes ``new`` in the rows of the step's clients and keeps its own elsewhere."""
    dst.copy_(torch.where(rows(active, new), new, dst))


def adam_table(g: Group, iterations: int, device: torch.device) -> torch.Tensor | None:
    """Adam's (lr / (1 - beta1^k), sqrt(1 - beta2^k)) for steps k = 1..iterations, computed in
    double like ``torch.optim.Adam``'s Python scalars and sent to the device once (None for SGD)."""
    opt = g.optimizer
    if not isinstance(opt, Adam):
        return None
    table = [opt.corrections(k) for k in range(1, iterations + 1)]
    return torch.tensor(table, dtype=torch.float32).to(device)


def clipped(g: Group, grads, s: TrainSettings) -> list[tuple[str, torch.Tensor]]:
    """(name, gradient) of the leaves that have one (torch skips a None gradient), each
    client's scaled by its own ``clip_grad_norm`` factor when the settings clip."""
    pairs = [(n, gr) for n, gr in zip(g.leaves, grads) if gr is not None]
    if pairs and s.clip_grad_norm is not None:
        m = pairs[0][1].shape[0]
        norms = torch.stack([torch.linalg.vector_norm(gr.reshape(m, -1), dim=1) for _, gr in pairs])
        coef = clip_coefficient(norms, s.clip_grad_norm)
        pairs = [(n, gr * coef.view(m, *[1] * (gr.dim() - 1))) for n, gr in pairs]
    return pairs


def adam_step(g: Group, w: dict, grads, idx, s: TrainSettings, active: torch.Tensor | None = None) -> None:
    """The Adam kernel of local training (:class:`fedhet.training.optim.Adam`: L2 weight decay,
    optional amsgrad) + ``clip_grad_norm``, per client, on stacked tensors, from a fresh state.
    Every member of a step takes its step number ``it + 1`` (one step per client per
    iteration), whose bias corrections are in ``g.adam_now``."""
    pairs = clipped(g, grads, s)
    if not pairs:
        return
    opt = g.optimizer
    assert isinstance(opt, Adam) and g.adam_now is not None
    step_size, bias2_sqrt = g.adam_now[0], g.adam_now[1]
    full = idx is None
    for n, gr in pairs:
        p = w[n]
        slots = [g.adam_m, g.adam_v] + ([g.adam_vmax] if opt.amsgrad else [])
        # moments() updates them in place: a wide step works on copies and keeps the active rows
        exp_avg, exp_avg_sq, *vmax = [d[n].clone() if active is not None else d[n] if full
                                      else d[n].index_select(0, idx) for d in slots]
        denom = opt.moments(p, gr, exp_avg, exp_avg_sq, vmax[0] if vmax else None, bias2_sqrt)
        update = exp_avg.mul(step_size).div_(denom)
        p.sub_(update if active is None else only(active, update))     # addcdiv_(exp_avg, denom, value=-step_size)
        if active is not None:
            for d, t in zip(slots, [exp_avg, exp_avg_sq, *vmax]):
                keep(active, d[n], t)
        elif not full:
            for d, t in zip(slots, [exp_avg, exp_avg_sq, *vmax]):
                d[n].index_copy_(0, idx, t)
        g.adam_seen.add(n)


def sgd_step(g: Group, w: dict, grads, idx, s: TrainSettings, active: torch.Tensor | None = None) -> None:
    """The SGD kernel of local training (:class:`fedhet.training.optim.SGD`: weight decay,
    momentum with dampening / Nesterov) + its ``clip_grad_norm``, per client, on stacked tensors.

    Only the first-step rule is per client: a client without a buffer yet starts it from
    its gradient (``had`` mask), as ``torch.optim.SGD`` does."""
    pairs = clipped(g, grads, s)
    if not pairs:
        return
    opt = g.optimizer
    assert isinstance(opt, SGD)
    for n, gr in pairs:
        p = w[n]
        if s.momentum > 0:
            full = idx is None
            buf = g.momentum[n] if full else g.momentum[n].index_select(0, idx)
            had = g.has_momentum[n] if full else g.has_momentum[n].index_select(0, idx)
            d, new_buf = opt.direction(p, gr, buf, had.view(gr.shape[0], *[1] * (gr.dim() - 1)))
            assert new_buf is not None
            if active is not None:      # direction() leaves the old buffer as it was
                keep(active, g.momentum[n], new_buf)
                g.has_momentum[n] |= active
            elif full:
                g.momentum[n].copy_(new_buf)
                g.has_momentum[n].fill_(True)
            else:
                g.momentum[n].index_copy_(0, idx, new_buf)
                g.has_momentum[n].index_fill_(0, idx, True)
        else:
            d, _ = opt.direction(p, gr, None)
        p.add_(d if active is None else only(active, d), alpha=-opt.lr)
