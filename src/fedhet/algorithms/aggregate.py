"""Server-side averaging rules shared by the methods."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from fedhet.core.contract import Arrays
from fedhet.core.errors import ConfigError


def weighted_average(models: Sequence[Arrays], weights: Sequence[float], keys: Sequence[str] | None = None) -> Arrays:
    """sum_k w_k * model_k / sum_k w_k for every tensor name (or only ``keys``).

    Integer tensors (BatchNorm's ``num_batches_tracked``) are averaged in float and rounded
    back, so BatchNorm statistics are averaged like weights (fedhet's stated default).
    """
    if not models:
        raise ValueError("weighted_average needs at least one model")
    w = torch.tensor([float(x) for x in weights], dtype=torch.float64)
    if (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"aggregation weights must be non-negative with a positive sum, got {list(weights)}")
    w = w / w.sum()
    names = list(keys) if keys is not None else list(models[0].keys())
    out = {}
    # One stacked copy per tensor, scaled in place: the same products and the same sum(0) as
    # ``(stacked * coef).sum(0)`` (bit-identical), with one (clients x tensor) buffer instead of
    # two. The stack and the sum are the work, not the Python loop over names (aggregation's
    # seconds per round: the "aggregate s" column of benchmarks/engine_speed.py). A sequential
    # ``out += w_k * m_k`` would round differently.
    for name in names:
        stacked = torch.stack([m[name] for m in models])
        if stacked.is_floating_point():
            coef = w.to(stacked.dtype).view(-1, *([1] * (stacked.dim() - 1)))
            out[name] = stacked.mul_(coef).sum(0)
        else:
            coef = w.view(-1, *([1] * (stacked.dim() - 1)))
            out[name] = torch.round((stacked.double() * coef).sum(0)).to(stacked.dtype)
    return out


BN_STATISTICS = ("running_mean", "running_var", "num_batches_tracked")


def server_trainable(weights: Arrays) -> list[str]:
    """Names the server treats as trainable: floating tensors that are not BatchNorm statistics.

    The server never sees the model object, so buffers are recognised by PyTorch's BatchNorm
    buffer names (fedhet's models have no other buffers).
    """
    return [k for k, v in weights.items()
            if v.is_floating_point() and k.rsplit(".", 1)[-1] not in BN_STATISTICS]


def check_buffers_known_to_server(method: str, arch: str, model: nn.Module, rule: str, prefix: str = "") -> None:
    """Refuse a model with a floating-point buffer (under ``prefix``: the part the rule acts on) the
    server would take for a weight: it tells buffers from weights by BatchNorm's names
    (:func:`server_trainable`), so a server ``rule`` over the weights (FedAvgM's momentum, SCAFFOLD's
    control variates) would act on such a buffer too."""
    kept = set(model.state_dict())           # a non-persistent buffer is not in the weights at all
    unknown = [name for name, buffer in model.named_buffers()
               if name in kept and name.startswith(prefix) and buffer.is_floating_point()
               and name.rsplit(".", 1)[-1] not in BN_STATISTICS]
    if unknown:
        shown = ", ".join(repr(n) for n in unknown[:3]) + (f" and {len(unknown) - 3} more" if len(unknown) > 3 else "")
        raise ConfigError(f"{method} with model {arch}: its server tells a model's buffers from its weights by "
                          f"BatchNorm's buffer names ({', '.join(BN_STATISTICS)}), and the model has the "
                          f"floating-point buffer(s) {shown}, which {rule} would treat as weights. Register a "
                          "constant buffer with register_buffer(name, tensor, persistent=False) (it is then not "
                          "sent at all), or choose a method without that server rule")


def zeros_for_trainable(weights: Arrays) -> Arrays:
    """Zero tensors for the server-trainable entries of ``weights`` (momentum, control variates, FedDyn's h)."""
    return {k: torch.zeros_like(weights[k]) for k in server_trainable(weights)}
