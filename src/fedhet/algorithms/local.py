"""Local training shared by every method: mini-batch SGD on a functional objective.

The model object is only a reusable *function*: weights live in plain dicts and are passed in
with ``torch.func.functional_call``, so one model instance per architecture serves every
client, and a vectorised engine can call the same loss over stacked weights.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.func import functional_call

from fedhet.algorithms.base import Arrays
from fedhet.algorithms.objective import Batch, Forward, LossTerm, total_loss
from fedhet.errors import NumericalError


@dataclass(frozen=True)
class TrainSettings:
    epochs: int
    batch_size: int
    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0
    drop_last: bool = False
    clip_grad_norm: float | None = None
    precision: str = "fp32"            # fp32 | bf16 (autocast; weights stay fp32)


# ``precision: auto`` resolves to bf16 only when this is True AND :func:`bf16_native` holds. The
# bf16 accuracy check passed (FedAvg, FMNIST alpha 0.5, 2 seeds x 15 rounds: final 79.88 in both
# precisions; benchmarks/results/bf16_accuracy_fedavg_fmnist_a0.5_k50_m10_r15.md).
AUTO_BF16 = True


def bf16_native(device: str | torch.device | None = "cpu") -> bool:
    """Whether ``device`` computes bf16 natively (not emulated): CPUs with AVX512-BF16 or AMX,
    CUDA GPUs of compute capability 8.0 or newer. Other devices (ARM CPUs, MPS) answer False."""
    try:
        dev = torch.device(device or "cpu")
    except (RuntimeError, TypeError):
        return False
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            return False
        try:
            return bool(torch.cuda.is_bf16_supported(including_emulation=False))
        except TypeError:
            return torch.cuda.get_device_capability(dev)[0] >= 8
    if dev.type == "cpu":
        checks = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
        return any(bool(check()) for check in checks if check is not None)
    return False


def auto_precision(device: str | torch.device | None = "cpu") -> str:
    """What ``precision: auto`` means on ``device`` (reads :data:`AUTO_BF16` at call time)."""
    return "bf16" if AUTO_BF16 and bf16_native(device) else "fp32"


@dataclass
class LocalResult:
    weights: Arrays                    # trained weights and buffers (detached copies)
    optimizer_state: Arrays            # momentum buffers by parameter name (empty without momentum)
    steps: int
    samples: int                       # sample-steps processed (forward+backward)
    mean_loss: float
    loss_parts: dict[str, float] = field(default_factory=dict)


@dataclass
class ClientData:
    """A client's view of the shared in-memory pools: index tensors, no copies of images."""

    x: torch.Tensor                    # uint8 pool (N, C, H, W) shared by all clients
    y: torch.Tensor                    # int64 pool labels
    train_idx: torch.Tensor            # int64 indices into the pool
    mean: torch.Tensor                 # (1, C, 1, 1) normalisation
    std: torch.Tensor

    def inputs(self, idx: torch.Tensor) -> torch.Tensor:
        return (self.x[idx].float().div_(255.0) - self.mean) / self.std

    def batch(self, positions: torch.Tensor) -> Batch:
        idx = self.train_idx[positions]
        return Batch(self.inputs(idx), self.y[idx], positions)


def forward(model: torch.nn.Module, weights: Arrays, x: torch.Tensor) -> Forward:
    """Features and logits of ``model`` evaluated with ``weights`` in one pass."""
    features, logits = functional_call(model, weights, (x,), {"with_features": True}, strict=False)
    return Forward(features, logits)


def epoch_batches(n: int, batch_size: int, drop_last: bool, generator: torch.Generator) -> list[torch.Tensor]:
    """Shuffled position batches for one epoch."""
    order = torch.randperm(n, generator=generator)
    stop = n - n % batch_size if drop_last else n
    return [order[i:i + batch_size] for i in range(0, stop, batch_size)]


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
    where: str = "",
) -> LocalResult:
    """Run ``settings.epochs`` epochs of SGD on ``sum(terms)`` starting from ``weights``.

    ``epoch_generator(e)`` gives the batch-order stream of absolute epoch ``start_epoch + e``,
    so a round split into phases (FedCME) draws the same batches as an unsplit one.
    ``trainable(name)`` freezes the parameters it rejects (FedBABU's head, FedRep's phases).
    ``optimizer_state`` carries momentum buffers over from an earlier call when a method keeps
    them (FedReMa); by default each call starts with fresh SGD state like ``torch.optim.SGD``.
    ``augment(batch, generator)`` transforms each batch before the forward pass (FedACD's mixup,
    FedClassAvg's two views) with a per-epoch stream, so augmentation is reproducible too.
    ``where`` names the round/client/algorithm in the error raised on a non-finite loss.
    """
    param_names = {name for name, _ in model.named_parameters()}
    trainable = trainable or (lambda name: True)
    use_bf16 = settings.precision == "bf16"
    # bf16 convolutions run about 1.6x faster in channels_last (oneDNN, measured at batch 32);
    # fp32 keeps the default layout, so its results stay bit-identical to earlier versions.
    channels_last = use_bf16
    work = {}
    leaves = {}
    for name, tensor in weights.items():
        if channels_last and tensor.dim() == 4:
            t = tensor.detach().clone(memory_format=torch.channels_last)
        else:
            t = tensor.detach().clone()
        if name in param_names and trainable(name):
            t.requires_grad_(True)
            leaves[name] = t
        work[name] = t
    opt = torch.optim.SGD(list(leaves.values()), lr=settings.lr, momentum=settings.momentum,
                          weight_decay=settings.weight_decay)
    if optimizer_state and settings.momentum > 0:
        for name, buf in optimizer_state.items():
            if name in leaves:
                opt.state[leaves[name]]["momentum_buffer"] = buf.clone()

    model.train()
    n = len(data.train_idx)
    steps = samples = 0
    loss_sum = 0.0
    part_sums: dict[str, float] = {}
    for e in range(settings.epochs):
        generator = epoch_generator(start_epoch + e)
        for positions in epoch_batches(n, settings.batch_size, settings.drop_last, generator):
            batch = data.batch(positions)
            if augment is not None:
                batch = augment(batch, generator)
            x = batch.x.contiguous(memory_format=torch.channels_last) if channels_last and batch.x.dim() == 4 \
                else batch.x
            with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=use_bf16):
                out = forward(model, work, x)
            out = Forward(out.features.float(), out.logits.float())
            loss, parts = total_loss(terms, out, batch, work)
            value = float(loss.detach())
            if not math.isfinite(value):
                raise NumericalError(
                    f"non-finite loss ({value}) {where} at local epoch {start_epoch + e}, step {steps}; "
                    f"loss parts: { {k: float(v) for k, v in parts.items()} }. Lower the learning rate or "
                    f"check the method's hyper-parameters; the run directory keeps every round recorded so far."
                )
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if settings.clip_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(list(leaves.values()), settings.clip_grad_norm)
            opt.step()
            steps += 1
            samples += len(positions)
            loss_sum += value
            for k, v in parts.items():
                part_sums[k] = part_sums.get(k, 0.0) + float(v)

    new_state = {}
    if settings.momentum > 0:
        for name, leaf in leaves.items():
            buf = opt.state.get(leaf, {}).get("momentum_buffer")
            if buf is not None:
                new_state[name] = buf.detach().clone(memory_format=torch.contiguous_format)
    # Results leave in the default layout whatever the training used (a no-op in fp32).
    out_weights = {name: t.detach().contiguous() for name, t in work.items()}
    for name, t in out_weights.items():
        if not torch.isfinite(t).all():
            raise NumericalError(f"parameter {name!r} became non-finite {where}; lower the learning rate.")
    return LocalResult(out_weights, new_state, steps, samples, loss_sum / max(steps, 1),
                       {k: v / max(steps, 1) for k, v in part_sums.items()})
