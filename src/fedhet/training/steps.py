"""Step counts of local SGD that server rules need (FedNova's normaliser, SCAFFOLD's option II)."""

from __future__ import annotations


def normalizing_factor(tau: int, rho: float, prox: float = 0.0) -> float:
    """a_i = ||a||_1 of the local coefficient vector for ``tau`` SGD steps with momentum ``rho``:
    the displacement of ``tau`` heavy-ball steps under a constant gradient, in units of lr * g
    (also SCAFFOLD's momentum-aware step count). ``prox`` = lr * mu of a proximal term
    (mu/2)||w - w_0||^2 in the loss, whose gradient pulls each step back towards the start: the
    displacement u then follows v <- rho v + 1 - prox u, u <- u + v (FedNova, Wang et al. 2020,
    Sec. 4: for FedProx without momentum a_i = (1 - (1 - prox)^tau) / prox; with both, this
    recursion, which is linear in the gradients as FedNova's analysis needs)."""
    if prox == 0:
        if rho == 0:
            return float(tau)
        return (tau - rho * (1.0 - rho ** tau) / (1.0 - rho)) / (1.0 - rho)
    velocity = displacement = 0.0
    for _ in range(tau):
        velocity = rho * velocity + 1.0 - prox * displacement
        displacement += velocity
    return displacement
