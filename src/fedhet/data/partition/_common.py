"""What the partitioners share: the common argument check, indices by class, the result's form
(sorted int64 arrays) and the too-few-samples error.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fedhet.core.errors import PartitionError
from fedhet.data.checks import check_int, check_labels


def check_common(kind: str, labels: Any, num_clients: Any) -> tuple[np.ndarray, int]:
    arr = check_labels(labels)
    n = check_int(kind, "num_clients", num_clients, 1)
    return arr, n


def by_class(labels: np.ndarray) -> list[np.ndarray]:
    """Indices of each class id 0..max(labels), in ascending order (empty for absent ids)."""
    order = np.argsort(labels, kind="stable")
    bounds = np.searchsorted(labels[order], np.arange(int(labels.max()) + 2))
    return [order[bounds[c] : bounds[c + 1]] for c in range(len(bounds) - 1)]


def finish(parts: list[list[np.ndarray]] | list[np.ndarray]) -> list[np.ndarray]:
    out = []
    for p in parts:
        arr = np.concatenate(p) if isinstance(p, list) and p else np.asarray(p)
        out.append(np.sort(arr.astype(np.int64, copy=False)))
    return out


def too_few(kind: str, total: int, num_clients: int, min_size: int) -> PartitionError:
    return PartitionError(
        f"{kind}: {num_clients} clients x min_size {min_size} needs at least "
        f"{num_clients * min_size} samples but there are only {total}; "
        "use fewer clients or a smaller min_size"
    )
