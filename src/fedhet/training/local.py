"""Local training shared by every method: mini-batch SGD (or Adam) on a functional objective.

The model object is only a reusable *function*: weights live in plain dicts and are passed in
with ``torch.func.functional_call``, so one model instance per architecture serves every
client, and a vectorised engine can call the same loss over stacked weights.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable

import torch
from torch.func import functional_call
from torch.nn.utils.stateless import _reparametrize_module

from fedhet.core.contract import (
    Arrays,
    Batch,
    ClientData,
    Forward,
    LocalResult,
    TrainSettings,
)
from fedhet.core.errors import NumericalError
from fedhet.training.dropout import batch_masks, masks_applied
from fedhet.training.inference import channels_last
from fedhet.training.objective import LossTerm, accumulate_statistics, total_loss
from fedhet.training.optim import clip_grad_norm, make_optimizer

# Each model's (parameter names, buffer names), looked up once: forward() runs every step.
_NAMES: weakref.WeakKeyDictionary[torch.nn.Module, tuple[frozenset[str], frozenset[str]]] = \
    weakref.WeakKeyDictionary()


def _names(model: torch.nn.Module) -> tuple[frozenset[str], frozenset[str]]:
    names = _NAMES.get(model)
    if names is None:
        names = (frozenset(n for n, _ in model.named_parameters()), frozenset(n for n, _ in model.named_buffers()))
        _NAMES[model] = names
    return names


def model_entries(model: torch.nn.Module, weights: Arrays) -> Arrays:
    """The entries of ``weights`` that ``model`` has (parameters and buffers): what a forward pass
    binds into it. A method's own entries (FedNH's learned scale) stay outside, for its loss terms."""
    params, buffers = _names(model)
    if all(k in params or k in buffers for k in weights):
        return weights
    return {k: v for k, v in weights.items() if k in params or k in buffers}


def forward(model: torch.nn.Module, weights: Arrays, x: torch.Tensor) -> Forward:
    """Features and logits of ``model`` evaluated with ``weights`` in one pass."""
    features, logits = functional_call(model, model_entries(model, weights), (x,), {"with_features": True},
                                       strict=False)
    return Forward(features, logits)


def epoch_batches(n: int, batch_size: int, drop_last: bool, generator: torch.Generator) -> list[torch.Tensor]:
    """Shuffled position batches for one epoch."""
    order = torch.randperm(n, generator=generator)
    stop = n - n % batch_size if drop_last else n
    return [order[i:i + batch_size] for i in range(0, stop, batch_size)]


def steps_per_epoch(n: int, batch_size: int, drop_last: bool) -> int:
    """How many batches :func:`epoch_batches` yields for ``n`` samples."""
    return n // batch_size if drop_last else -(-n // batch_size)


def trained_names(model: torch.nn.Module, weights: Arrays,
                  trainable: Callable[[str], bool] | None = None) -> list[str]:
    """The entries of ``weights`` a local run trains, in their order: the model's parameters, and
    floating-point entries the model does not have at all - a method's own parameters, such as
    FedNH's learned logit scale, which its loss terms read from the weights and which are averaged
    with the model - each unless ``trainable(name)`` rejects it. The model's buffers (BatchNorm
    statistics) are never trained."""
    params, buffers = _names(model)
    accept = trainable or (lambda name: True)
    return [name for name, t in weights.items()
            if (name in params or (name not in buffers and t.is_floating_point())) and accept(name)]


def non_finite_loss(value: float, where: str, epoch: int, step: int, parts: dict[str, float]) -> NumericalError:
    """The error for a loss that became NaN or infinite, naming where and the loss terms' values."""
    return NumericalError(
        f"non-finite loss ({value}) {where} at local epoch {epoch}, step {step}; "
        f"loss parts: {parts}. Lower the learning rate or "
        f"check the method's hyper-parameters; the run directory keeps every round recorded so far."
    )


def train_local(
    model: torch.nn.Module,
    weights: Arrays,
    data: ClientData,
    terms: list[LossTerm],
    settings: TrainSettings,
    epoch_generator: Callable[[int], torch.Generator],
    *,
    start_epoch: int = 0,
    trainable: Callable[[str], bool] | None = None,
    optimizer_state: Arrays | None = None,
    augment: Callable[[Batch, torch.Generator], Batch] | None = None,
    statistics: dict[str, torch.Tensor] | None = None,
    where: str = "",
) -> LocalResult:
    """Run ``settings.epochs`` epochs of SGD on ``sum(terms)`` starting from ``weights``.

    ``epoch_generator(e)`` gives the batch-order stream of absolute epoch ``start_epoch + e``,
    so a round split into phases (FedCME) draws the same batches as an unsplit one.
    ``trainable(name)`` freezes the parameters it rejects (FedBABU's head, FedRep's phases); what
    is trained is :func:`trained_names`, which includes a method's own parameters in ``weights``.
    ``optimizer_state`` carries momentum buffers over from an earlier call when a method keeps
    them (FedReMa); by default each call starts with fresh optimizer state like a new
    ``torch.optim.SGD``. The update is :mod:`fedhet.training.optim`'s kernel for
    ``settings.optimizer`` (bit-identical to ``torch.optim.SGD`` / ``Adam`` on the CPU).
    ``statistics``: totals to continue (phase B of FedCME continues phase A's); after every
    step's loss, each term's :meth:`LossTerm.statistics` is added to them, and the totals come
    back in ``LocalResult.statistics``.
    ``augment(batch, generator)`` transforms each batch before the forward pass (FedACD's mixup,
    FedClassAvg's two views) with a per-epoch stream, so augmentation is reproducible too.
    ``where`` names the round/client/algorithm in the error raised on a non-finite loss.
    """
    trained = set(trained_names(model, weights, trainable))
    use_bf16 = settings.precision == "bf16"
    in_channels_last = trains_in_channels_last(settings)
    work = {}
    leaves = {}
    for name, tensor in weights.items():
        t = tensor.detach().clone()
        if in_channels_last:
            t = channels_last(t)
        if name in trained:
            t.requires_grad_(True)
            leaves[name] = t
        work[name] = t
    opt = make_optimizer(settings)
    opt_state = opt.load(optimizer_state, list(leaves))
    totals = {k: v.clone() for k, v in (statistics or {}).items()}
    names = list(leaves)

    model.train()
    n = len(data.train_idx)
    steps = samples = 0
    loss_sum = 0.0
    part_sums: dict[str, float] = {}
    # The working weights are bound into the model once for the whole run - what functional_call
    # does around every single call - so each step calls the model directly: the same tensors and
    # ops (bit-identical), without the per-step swap, which costs most at small batches.
    # A term that runs the model with other weights (MOON's, FedNTD's teachers) nests its own
    # functional_call, which restores these afterwards.
    with _reparametrize_module(model, model_entries(model, work), strict=False):
        for e in range(settings.epochs):
            generator = epoch_generator(start_epoch + e)
            for positions in epoch_batches(n, settings.batch_size, settings.drop_last, generator):
                batch = data.batch(positions)
                if augment is not None:
                    batch = augment(batch, generator)
                # dropout masks from the same stream, after the augmentation's draws (training/dropout.py)
                masks = batch_masks(model, batch.x, generator)
                x = channels_last(batch.x) if in_channels_last else batch.x
                with masks_applied(masks):
                    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=use_bf16):
                        features, logits = model(x, with_features=True)
                    out = Forward(features.float(), logits.float())
                    loss, parts = total_loss(terms, out, batch, work)
                with torch.no_grad():
                    accumulate_statistics(terms, out, batch, totals)
                value = float(loss.detach())
                if not math.isfinite(value):
                    raise non_finite_loss(value, where, start_epoch + e, steps,
                                          {k: float(v) for k, v in parts.items()})
                grads = torch.autograd.grad(loss, [leaves[k] for k in names], allow_unused=True) if names else ()
                if settings.clip_grad_norm is not None:
                    clip_grad_norm([gr for gr in grads if gr is not None], settings.clip_grad_norm)
                opt.step(leaves, dict(zip(names, grads)), opt_state)
                steps += 1
                samples += len(positions)
                loss_sum += value
                for k, v in parts.items():
                    part_sums[k] = part_sums.get(k, 0.0) + float(v)

    new_state = opt.export(opt_state)
    # Results leave in the default layout whatever the training used (a no-op in fp32).
    out_weights = {name: t.detach().contiguous() for name, t in work.items()}
    check_finite(out_weights, where)
    return LocalResult(out_weights, new_state, steps, samples, loss_sum / max(steps, 1),
                       {k: v / max(steps, 1) for k, v in part_sums.items()}, totals)


def trains_in_channels_last(settings: TrainSettings) -> bool:
    """Whether local training runs its images and convolution weights in channels_last
    (``run.memory_format``; in the reference and parallel engines: the vectorized engine's vmapped
    groups train in the default layout). oneDNN's convolutions and max-pooling are faster there on the CPU
    (benchmarks/memory_format.py), but they round differently in the last bits, so "auto" keeps
    fp32 in the default layout, whose rounding earlier fp32 results rest on, and takes
    channels_last in bf16. The no-grad statistics passes that feed training follow it
    (``fast_passes`` of :func:`fedhet.algorithms.prototypes.class_statistics`)."""
    if settings.memory_format == "auto":
        return settings.precision == "bf16"
    return settings.memory_format == "channels_last"


def all_finite(t: torch.Tensor) -> bool:
    """``torch.isfinite(t).all()`` without its boolean copy of ``t``: aminmax propagates NaN, and
    an infinity is the minimum or the maximum, so both are finite exactly when every element is.
    One reduction pass instead of an elementwise copy and a reduction (benchmarks/results/finite_check.md)."""
    if t.is_complex():
        t = torch.view_as_real(t)
    if not t.is_floating_point() or t.numel() == 0:        # integers are finite; aminmax refuses empty
        return True
    low, high = torch.aminmax(t)
    return bool(torch.isfinite(low) & torch.isfinite(high))


def check_finite(weights: Arrays, where: str = "") -> None:
    """Raise a NumericalError naming the first tensor of ``weights`` with a NaN or an infinity
    (the end of every local run; ``where`` names the round, client and algorithm)."""
    bad = next((name for name, t in weights.items() if not all_finite(t)), None)
    if bad is not None:
        raise NumericalError(f"parameter {bad!r} became non-finite {where}; lower the learning rate.")


def concatenate_results(results: list[LocalResult], optimizer_state: Arrays | None = None) -> LocalResult:
    """One result for consecutive ``train_local`` calls of a round (FedRep's head-then-body
    phases, FedACD's epochs with a fresh probability matrix each): the last weights, summed
    steps, samples and statistics, step-weighted mean loss and loss parts. ``optimizer_state``
    replaces the last call's (FedRep keeps the union over its phases)."""
    if not results:
        raise ValueError("concatenate_results needs at least one result")
    steps = sum(r.steps for r in results)
    parts: dict[str, float] = {}
    for r in results:
        for k, v in r.loss_parts.items():
            parts[k] = parts.get(k, 0.0) + v * r.steps / max(steps, 1)
    statistics: dict[str, torch.Tensor] = {}
    for r in results:
        for key, total in r.statistics.items():
            statistics[key] = total.clone() if key not in statistics else statistics[key] + total
    last = results[-1]
    return LocalResult(last.weights, last.optimizer_state if optimizer_state is None else optimizer_state, steps,
                       sum(r.samples for r in results), sum(r.mean_loss * r.steps for r in results) / max(steps, 1),
                       parts, statistics)
