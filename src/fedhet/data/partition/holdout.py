"""A client's own data split into its training and local test parts.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

from fedhet.core.errors import PartitionError


def holdout_split(
    indices: np.ndarray, test_fraction: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Split one client's indices into (train, test), both sorted int64.

    The split is over distinct indices, so a sample listed twice (partitions that sample with
    replacement) lands wholly in train or wholly in test, never both. test has
    round-half-up(distinct * test_fraction) distinct samples, at least 1 when there are >= 2
    distinct samples and test_fraction > 0, and at most distinct - 1 so train is never empty.
    Mirrors FedFM's per-client 80/20 split and FedReMa's per-client train_test_split.
    """
    if (
        isinstance(test_fraction, bool)
        or not isinstance(test_fraction, numbers.Real)
        or not 0 <= test_fraction < 1
    ):
        raise PartitionError(
            f"holdout_split: test_fraction must be in [0, 1), got {test_fraction!r}"
        )
    idx = np.asarray(indices, dtype=np.int64)
    distinct, copies = np.unique(idx, return_counts=True)
    m = distinct.size
    n_test = math.floor(m * test_fraction + 0.5)
    if m >= 2 and test_fraction > 0:
        n_test = min(max(n_test, 1), m - 1)
    elif m < 2:
        n_test = 0
    order = rng.permutation(m)
    test_pos, train_pos = np.sort(order[:n_test]), np.sort(order[n_test:])
    train = np.repeat(distinct[train_pos], copies[train_pos])
    return train, distinct[test_pos]
