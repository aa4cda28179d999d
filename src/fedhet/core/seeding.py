"""Random streams keyed by (seed, purpose, round, client, ...).

Every random choice in a run (partition, client sampling, weight init, batch order,
augmentation) draws from a stream derived from the run seed and the coordinates of the choice,
never from a global generator. Results therefore do not depend on the engine, on the order in
which clients are processed, or on whether the run was resumed from a checkpoint.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch


def derive_seed(seed: int, *keys: int | str) -> int:
    """A 63-bit seed that is a fixed function of ``seed`` and ``keys``."""
    text = "/".join([str(seed), *map(str, keys)]).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


def numpy_rng(seed: int, *keys: int | str) -> np.random.Generator:
    return np.random.default_rng(derive_seed(seed, *keys))


def torch_generator(seed: int, *keys: int | str) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(derive_seed(seed, *keys))
    return g
