"""How no-grad passes over many rows are cut up: evaluation's and the per-class statistics' passes.

A CPU forward over a thousand rows spills its activations out of the CPU caches; passes of a few
dozen rows per intra-op thread keep them there, so such a pass takes many small chunks rather than
one large one (benchmarks/statistics_pass.py measures it). On other devices the caller's batch
size stands: a GPU wants large passes.

Cutting a pass into chunks changes no per-row result where the kernels compute each row on its own
(fp32 convolutions in the default layout do on the CPUs this project runs on; the statistics
benchmark checks it); sums over rows taken in row order stay in the same order.
``channels_last`` is faster still on the CPU, but oneDNN's convolutions in that layout round
differently (logits ~1e-7 apart), so only passes whose results never feed training use it.
"""

from __future__ import annotations

import torch

# Rows per forward pass and intra-op thread on the CPU (benchmarks/engine_speed.py's "evaluate s"
# and benchmarks/statistics_pass.py measure the choice).
ROWS_PER_THREAD = 64


def pass_rows(batch_size: int, device: str | torch.device = "cpu") -> int:
    """Rows per forward pass of a no-grad pass: at most ``batch_size``, and on the CPU at most
    ``ROWS_PER_THREAD`` per intra-op thread."""
    if torch.device(device).type == "cpu":
        return max(1, min(batch_size, ROWS_PER_THREAD * torch.get_num_threads()))
    return max(1, batch_size)


def channels_last(t: torch.Tensor) -> torch.Tensor:
    """``t`` in channels_last when it is 4-d (images, convolution weights); other tensors as they are.

    ``to``, not ``contiguous``: a tensor of one channel counts as contiguous in both layouts, so
    ``contiguous(memory_format=...)`` returns it with its default strides, and a convolution picks
    its layout from the strides (grayscale images and the first convolution's weights would stay
    in the default layout)."""
    return t.to(memory_format=torch.channels_last) if t.dim() == 4 else t
