"""A metric over seeds: mean and sample standard deviation, and how tables print them."""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def mean_std(values: Sequence[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation of ``values`` (a metric over seeds); the std is None for
    a single value."""
    if not values:
        raise ValueError("mean_std of no values")
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else None)


def format_value(value: float | None, scale: float = 100, spec: str = ".2f") -> str:
    """``value`` times ``scale`` (100: a fraction as a percentage) in ``spec``; - when missing."""
    return "-" if value is None else format(scale * value, spec)


def format_mean_std(values: Sequence[float | None], scale: float = 100, spec: str = ".2f") -> str:
    """``mean ± std`` (sample std) of ``values`` times ``scale``, each in ``spec``: a metric over
    seeds, as a percentage by default. One value: itself; no value, or any missing: -."""
    if not values or any(v is None for v in values):
        return "-"
    mean, std = mean_std([scale * v for v in values if v is not None])
    return format(mean, spec) if std is None else f"{format(mean, spec)} ± {format(std, spec)}"
