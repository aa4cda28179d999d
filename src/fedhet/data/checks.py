"""Argument checks shared by the partitioners and the local test sampler: each returns the value
in its canonical type or raises :class:`~fedhet.core.errors.PartitionError` naming the argument.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

from fedhet.core.errors import PartitionError


def check_int(kind: str, name: str, value: Any, minimum: int) -> int:
    # bool is an int subclass; `replace=True` passed as a count is almost surely a mistake.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise PartitionError(f"{kind}: {name} must be an integer >= {minimum}, got {value!r}")
    if value < minimum:
        raise PartitionError(f"{kind}: {name} must be >= {minimum}, got {value!r}")
    return int(value)


def check_positive(kind: str, name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise PartitionError(f"{kind}: {name} must be a finite number > 0, got {value!r}")
    if value <= 0:
        raise PartitionError(f"{kind}: {name} must be > 0, got {value!r}")
    return float(value)


def check_bool(kind: str, name: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise PartitionError(f"{kind}: {name} must be true or false, got {value!r}")
    return bool(value)


def check_labels(labels: Any, what: str = "labels") -> np.ndarray:
    arr = np.asarray(labels)
    if arr.ndim != 1:
        raise PartitionError(f"{what} must be a 1-D array, got shape {arr.shape}")
    if arr.size == 0:
        raise PartitionError(f"{what} is empty")
    if not np.issubdtype(arr.dtype, np.integer):
        raise PartitionError(f"{what} must have an integer dtype, got {arr.dtype}")
    if arr.min() < 0:
        raise PartitionError(f"{what} must be non-negative class ids, found {int(arr.min())}")
    return arr.astype(np.int64, copy=False)
