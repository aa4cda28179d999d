"""A module's training mode for the length of a block, and back to what it was afterwards.

Passes that are not the local training itself (statistics of the data, a frozen reference model,
a dummy forward to read shapes, evaluation) choose their mode with :func:`in_mode`, so that the
shared model the client host hands from method to method leaves each pass in the mode it came in.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def in_mode(module: torch.nn.Module, training: bool) -> Iterator[torch.nn.Module]:
    """``module`` in training mode (``training=True``: BatchNorm on batch statistics, updating its
    running ones; dropout on) or eval mode for the block, then in the mode it had before, also when
    the block raises."""
    was_training = module.training
    module.train(training)
    try:
        yield module
    finally:
        module.train(was_training)
