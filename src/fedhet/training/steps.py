"""Step counts of local SGD that server rules need (FedNova's normaliser, SCAFFOLD's option II)."""

from __future__ import annotations


def normalizing_factor(tau: int, rho: float) -> float:
    """a_i = ||a||_1 of the local coefficient vector for ``tau`` SGD steps with momentum ``rho``:
    the displacement of ``tau`` heavy-ball steps under a constant gradient, in units of lr * g
    (also SCAFFOLD's momentum-aware step count)."""
    if rho == 0:
        return float(tau)
    return (tau - rho * (1.0 - rho ** tau) / (1.0 - rho)) / (1.0 - rho)
