"""A client's local test set drawn from a pool (the global test set, ``data.local_test.source:
test_set``) with the client's training label proportions: :func:`sample_like` for one client,
:class:`LikeSampler` for many clients drawing from one pool (the same draws). Partitioning the
training pool, and :func:`~fedhet.data.partition.holdout_split` (a client's own data held out),
are :mod:`fedhet.data.partition`'s.
"""

from __future__ import annotations

import numpy as np

from fedhet.core.errors import PartitionError
from fedhet.data.checks import check_int, check_labels

__all__ = ["sample_like", "LikeSampler"]


def sample_like(
    train_labels_of_client: np.ndarray,
    pool_labels: np.ndarray,
    size: int,
    num_classes: int,
    rng: np.random.Generator,
    *,
    exclude: np.ndarray | None = None,
    replace: bool = False,
) -> np.ndarray:
    """Draw ``size`` pool indices without replacement, matching a client's label distribution.

    Class quotas are size * (client's class share), rounded by largest remainder (ties go to
    the lower class id) so they sum to ``size``. Indices in ``exclude`` (e.g. test samples
    already handed to other clients) are never drawn. Returns sorted int64 indices into
    ``pool_labels``. Unlike FedClassAvg's ``get_local_test_indices`` (with replacement,
    re-drawn per evaluation) this yields a fixed, duplicate-free local test set; ``replace=True``
    draws each class's quota with replacement, as that code does (drawn once, not per evaluation),
    so a quota may exceed the class's images in the pool. Many clients drawing from one pool:
    :class:`LikeSampler` (the same draws).
    """
    train = check_labels(train_labels_of_client, "train_labels_of_client")
    pool = check_labels(pool_labels, "pool_labels")
    size = check_int("sample_like", "size", size, 0)
    num_classes = check_int("sample_like", "num_classes", num_classes, 1)
    return LikeSampler(pool, num_classes, exclude=exclude)(train, size, rng, replace=replace)


class LikeSampler:
    """:func:`sample_like` for many clients drawing from one pool: ``sampler(train_labels_of_client,
    size, rng)`` is ``sample_like(train_labels_of_client, pool_labels, size, num_classes, rng,
    exclude=exclude)``, the same indices from the same ``rng``, but the pool is checked once and
    each class's candidates are found once, not once per client (10,000 clients' local test sets
    from a 10,000-image test set: 10 scans of the pool instead of about 15,000). ``exclude`` is read
    at the first draw."""

    def __init__(self, pool_labels: np.ndarray, num_classes: int, *, exclude: np.ndarray | None = None) -> None:
        self.pool = check_labels(pool_labels, "pool_labels")
        self.num_classes = check_int("sample_like", "num_classes", num_classes, 1)
        self._pool_top = int(self.pool.max())
        self._exclude = exclude
        self._allowed: np.ndarray | None = None
        self._candidates: dict[int, np.ndarray] = {}

    def _candidates_of(self, c: int) -> np.ndarray:
        """Pool indices of class ``c`` not excluded, ascending (found once; never changed)."""
        if c not in self._candidates:
            assert self._allowed is not None
            self._candidates[c] = np.flatnonzero((self.pool == c) & self._allowed)
        return self._candidates[c]

    def __call__(self, train_labels_of_client: np.ndarray, size: int, rng: np.random.Generator, *,
                 replace: bool = False) -> np.ndarray:
        train = check_labels(train_labels_of_client, "train_labels_of_client")
        size = check_int("sample_like", "size", size, 0)
        num_classes = self.num_classes
        top = max(int(train.max()), self._pool_top)
        if top >= num_classes:
            raise PartitionError(f"sample_like: label {top} does not fit num_classes={num_classes}")
        ideal = size * np.bincount(train, minlength=num_classes) / train.size
        quota = np.floor(ideal).astype(np.int64)
        short = size - int(quota.sum())
        quota[np.argsort(-(ideal - quota), kind="stable")[:short]] += 1
        if self._allowed is None:
            allowed = np.ones(self.pool.size, dtype=bool)
            if self._exclude is not None:
                allowed[np.asarray(self._exclude, dtype=np.int64)] = False
            self._allowed = allowed
        picked = []
        for c in np.flatnonzero(quota):
            candidates = self._candidates_of(int(c))
            if candidates.size < (1 if replace else quota[c]):
                raise PartitionError(
                    f"sample_like: need {quota[c]} samples of class {c} but the pool has only "
                    f"{candidates.size} available; lower size or use a larger pool"
                )
            picked.append(rng.choice(candidates, size=int(quota[c]), replace=replace))
        return np.sort(np.concatenate(picked)) if picked else np.zeros(0, dtype=np.int64)
