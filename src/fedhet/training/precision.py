"""Which precision a run trains in: ``precision: auto`` and the bf16 hardware check."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

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


@contextlib.contextmanager
def tf32_allowed(allow: bool) -> Iterator[None]:
    """TF32 on or off for cuDNN convolutions and CUDA matrix products in the block, then the
    flags as they were. The flags are the process's. torch >= 2.9 has per-backend
    ``fp32_precision`` flags, and reading the legacy ``allow_tf32`` after someone set the new ones
    raises, so the new ones are used where they exist."""
    conv, matmul = getattr(torch.backends.cudnn, "conv", None), torch.backends.cuda.matmul
    if conv is not None and hasattr(conv, "fp32_precision") and hasattr(matmul, "fp32_precision"):
        value = "tf32" if allow else "ieee"
        flags: list[tuple[Any, str, Any]] = [(conv, "fp32_precision", value), (matmul, "fp32_precision", value)]
    else:
        flags = [(torch.backends.cudnn, "allow_tf32", allow), (matmul, "allow_tf32", allow)]
    before = [getattr(obj, name) for obj, name, _ in flags]
    for obj, name, value in flags:
        setattr(obj, name, value)
    try:
        yield
    finally:
        for (obj, name, _), value in zip(flags, before):
            setattr(obj, name, value)


@contextlib.contextmanager
def strict_fp32(device: torch.device) -> Iterator[None]:
    """TF32 off on CUDA for the block (cuDNN convolutions use it by default on Ampere and newer),
    so fp32 training there computes in fp32 like the CPU reference. A run on CUDA holds it around
    its whole round loop (experiment.runner), and the vectorized engine's thread around its
    training loop, for engines used on their own."""
    if device.type != "cuda":
        yield
        return
    with tf32_allowed(False):
        yield
