"""Unstacking: a trained group back into one ``LocalResult`` per request, accounted like
``train_local`` (mean loss and loss parts over the client's steps, samples, optimizer state in
torch's layout, statistics), with a non-finite loss or weight reported as the reference reports it.
"""

from __future__ import annotations

import math

import torch

from fedhet.core.contract import LocalResult
from fedhet.core.errors import NumericalError
from fedhet.engine.vectorized.grouping import Group
from fedhet.training.local import check_finite, non_finite_loss, steps_per_epoch


def unstack(g: Group, device: torch.device) -> None:
    """Set each of the group's requests' ``result`` (or ``error``) from the group's state."""
    C = len(g.requests)
    per_client: list[list[tuple[float, list[float], int]]] = [[] for _ in range(C)]   # per client: (loss, parts, batch size) per step
    if g.records:   # one device->host copy for the whole loop, not a sync per step
        all_losses = torch.cat([r[2] for r in g.records]).cpu().tolist()
        all_parts = torch.cat([r[3] for r in g.records]).cpu().tolist()
        flat = 0
        for row_clients, size, _, _ in g.records:
            for i in row_clients:
                if i is not None:           # None: a stand-in row of a wide step
                    per_client[i].append((all_losses[flat], all_parts[flat], size))
                flat += 1
    names = [t.name for t in g.templates]
    # Which clients' weights are all finite, for the whole group in one reduction and one copy to
    # the host (check_finite per client would wait for the device once per tensor and client).
    finite = torch.ones(C, dtype=torch.bool, device=device)
    for t in g.weights.values():
        if t.is_floating_point() and t.numel():
            low, high = torch.aminmax(t.detach().reshape(C, -1), dim=1)
            finite &= torch.isfinite(low) & torch.isfinite(high)
    finite_on_host = finite.cpu().tolist()
    # Results go where the clients' code runs: the host's device (the CPU, or this device).
    dest = g.requests[0].client.host.device
    out = {n: t.detach().to(dest) for n, t in g.weights.items()}
    moms = {n: (t.detach().to(dest), g.has_momentum[n].cpu()) for n, t in g.momentum.items()}
    adam_slots = [("exp_avg", g.adam_m), ("exp_avg_sq", g.adam_v)] + \
        ([("max_exp_avg_sq", g.adam_vmax)] if g.adam_vmax else [])
    adam = {n: [(slot, d[n].detach().to(dest)) for slot, d in adam_slots] for n in g.leaves if n in g.adam_seen}
    stats = {k: (t.detach().to(dest), g.stat_seen[k].cpu()) for k, t in g.stat_totals.items()}
    for i, req in enumerate(g.requests):
        where = req.client.where(req.stream)
        s = req.settings
        per_epoch = steps_per_epoch(len(req.data.train_idx), s.batch_size, s.drop_last)
        loss_sum, samples = 0.0, 0
        part_sums: dict[str, float] = {}
        for step, (value, parts, size) in enumerate(per_client[i]):
            named = dict(zip(names, parts))           # a repeated name keeps the last term, as total_loss
            if not math.isfinite(value):
                req.error = non_finite_loss(value, where, req.start_epoch + step // per_epoch, step, named)
                break
            loss_sum += value
            samples += size
            for k, v in named.items():
                part_sums[k] = part_sums.get(k, 0.0) + v
        if req.error is not None:
            continue
        steps = len(per_client[i])
        weights = {name: out[name][i].clone() for name in g.names}
        if not finite_on_host[i]:
            try:
                check_finite(weights, where)        # names the first non-finite tensor
            except NumericalError as e:
                req.error = e
                continue
        opt_state = {name: buf[i].clone() for name, (buf, has) in moms.items() if bool(has[i])}
        for name, slots in adam.items():     # torch.optim.Adam's slots, in its order (optim.Adam.export)
            opt_state[f"{name}/step"] = torch.tensor(float(steps), dtype=torch.float32)
            for slot, t in slots:
                opt_state[f"{name}/{slot}"] = t[i].clone()
        statistics = {k: t[i].clone() for k, (t, seen) in stats.items() if bool(seen[i])}
        req.result = LocalResult(weights, opt_state, steps, samples, loss_sum / max(steps, 1),
                                 {k: v / max(steps, 1) for k, v in part_sums.items()}, statistics)
