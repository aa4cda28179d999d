"""Registry of federated methods by config name."""

from __future__ import annotations

from fedhet.algorithms.base import Algorithm
from fedhet.algorithms.fedavg import FedAvg
from fedhet.algorithms.local_only import LocalOnly

ALGORITHMS: dict[str, type[Algorithm]] = {cls.name: cls for cls in (FedAvg, LocalOnly)}


def algorithm_class(name: str) -> type[Algorithm]:
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise KeyError(f"unknown algorithm {name!r}; available: {', '.join(sorted(ALGORITHMS))}") from None
