"""Deterministic kernels for a run that asks for them (``run.deterministic``).

On a CPU a run repeats bit for bit at a fixed thread count without this. On CUDA some kernels add
in no fixed order (cuDNN's convolution backward passes, atomics in scatter and index additions),
so a seed run twice can differ in its last bits and, over many rounds, by more. torch has
deterministic versions of most of them, at some speed; this asks for them.
"""

from __future__ import annotations

import os

import torch

from fedhet.core.errors import ConfigError

# The cuBLAS workspace settings under which torch allows deterministic CUDA matrix products
# (":4096:8" about 24 MiB more memory; ":16:8" less memory, possibly slower).
CUBLAS_DETERMINISTIC = (":4096:8", ":16:8")


def use_deterministic_algorithms() -> None:
    """Process-wide, like ``torch.set_num_threads``: torch's deterministic implementations (an
    operation that has none raises torch's error naming it, rather than running nondeterministically),
    cuDNN's deterministic convolution algorithms without autotuning, and ``CUBLAS_WORKSPACE_CONFIG``
    unless the environment has a deterministic value already.

    torch reads that variable once per process, at its first CUDA matrix product, whether or not
    deterministic kernels were asked for then. So where CUDA has already been used in this process
    without it, setting it now would not count, and the first matrix product would fail with a
    message asking for the variable: that case is refused here, with what to do."""
    if os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in CUBLAS_DETERMINISTIC:
        if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            raise ConfigError(
                "run.deterministic: CUDA was used in this process before CUBLAS_WORKSPACE_CONFIG was set, and "
                "torch reads it only once per process; start the run in a new process (the fedhet CLI does "
                "this), or set CUBLAS_WORKSPACE_CONFIG=:4096:8 in the environment before Python starts")
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_DETERMINISTIC[0]
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
