"""How evaluation's no-grad passes over many rows run on the CPU: cut into chunks, in channels_last.

A CPU forward over a thousand rows spills its activations out of the CPU caches; passes of a few
dozen rows per intra-op thread keep them there, and oneDNN's convolutions and max-pooling run
faster in channels_last (benchmarks/no_grad_passes.py measures both). On other devices the
caller's batch size stands: a GPU wants large passes.

Both change the last bits of the results: channels_last rounds the convolutions differently, and
on the Intel Xeon measured the cut did too, on one thread where it left a short last chunk (3,009
rows at 64 a pass) and on two threads always. So only
passes whose results never feed training use them (evaluation's, and the per-class statistics
evaluation takes); the statistics that training uses (FedACD's probability matrix, the prototypes)
keep their large passes in the default layout, unless the run trains in channels_last
(``run.memory_format``, :func:`fedhet.training.local.trains_in_channels_last`): local training then
takes :func:`channels_last` too, and those statistics evaluation's passes.
"""

from __future__ import annotations

import torch

# Rows per forward pass and intra-op thread on the CPU (benchmarks/engine_speed.py's "evaluate s"
# and benchmarks/no_grad_passes.py measure the choice).
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
