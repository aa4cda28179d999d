"""fedhet: federated learning under data heterogeneity.

``fedhet.run(config, overrides)`` runs one experiment from Python (:mod:`fedhet.experiment.api`);
it is imported on first use, so ``import fedhet.core`` (a Flower ClientApp) stays light.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["Results", "load", "resume", "run"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from fedhet.experiment import api

        return getattr(api, name)
    raise AttributeError(f"module 'fedhet' has no attribute {name!r}")
