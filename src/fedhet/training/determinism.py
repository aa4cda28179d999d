"""Deterministic kernels for a run that asks for them (``run.deterministic``).

On a CPU a run repeats bit for bit at a fixed thread count without this. On CUDA some kernels add
in no fixed order (cuDNN's convolution backward passes, atomics in scatter and index additions,
cuBLAS's split reductions), so a seed run twice can differ in its last bits and, over many rounds,
by more. torch has deterministic versions of most of them, at some speed; this asks for them.
"""

from __future__ import annotations

import os

import torch

# The cuBLAS workspace setting torch asks for before it allows deterministic CUDA matrix products
# (":16:8" is the other accepted value: less memory, slower).
CUBLAS_WORKSPACE = ":4096:8"


def use_deterministic_algorithms() -> None:
    """Process-wide, like ``torch.set_num_threads``: torch's deterministic implementations (an
    operation that has none raises torch's error naming it, rather than running nondeterministically),
    cuDNN's deterministic convolution algorithms without autotuning, and ``CUBLAS_WORKSPACE_CONFIG``
    unless the environment sets it already (cuBLAS reads it when the process first multiplies
    matrices on CUDA, so it is set before a run trains)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
