"""The partitions of the FL benchmarks every method is compared on: IID, Dirichlet label skew
(NIID-Bench's and the per-client form), label-sorted shards and quantity skew.
"""

from __future__ import annotations

import numpy as np

from fedhet.core.errors import PartitionError
from fedhet.data.checks import check_bool, check_int, check_positive
from fedhet.data.partition._common import by_class, check_common, finish, too_few


def iid(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    samples_per_client: int | None = None,
) -> list[np.ndarray]:
    """IID split: shuffle all indices and cut them into near-equal parts (sizes differ by <= 1).

    With ``samples_per_client`` each client gets exactly that many samples (the rest is unused).
    """
    labels, n = check_common("iid", labels, num_clients)
    total = labels.size
    if samples_per_client is None:
        if total < n:
            raise PartitionError(
                f"iid: {n} clients but only {total} samples; every client needs at least one"
            )
        return finish(np.array_split(rng.permutation(total), n))
    spc = check_int("iid", "samples_per_client", samples_per_client, 1)
    if spc * n > total:
        raise PartitionError(
            f"iid: {n} clients x samples_per_client {spc} = {spc * n} samples needed, "
            f"only {total} available; lower samples_per_client or num_clients"
        )
    return finish(np.split(rng.permutation(total)[: spc * n], n))


def dirichlet(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    alpha: float,
    min_size: int = 10,
    cap: bool = True,
    max_tries: int = 1000,
    min_classes: int = 0,
) -> list[np.ndarray]:
    """Dirichlet label skew, NIID-Bench ``noniid-labeldir`` (Li et al. 2022, ``utils.py``).

    For each class c (in class-id order): p ~ Dir(alpha * 1_n); with ``cap`` a client that
    already holds >= N/n samples gets p_j = 0; renormalise; split class c's shuffled indices
    at ``int(cumsum(p) * len)[:-1]``. Repeat until every client has >= ``min_size`` samples
    and, with ``min_classes`` > 0, samples of at least that many classes (the FedNH code base's
    sampler keeps every client at two or more classes, by swapping shares and redrawing; this
    redraws only). Gives label and quantity skew. Disjoint, covers every sample.
    """
    labels, n = check_common("dirichlet", labels, num_clients)
    alpha = check_positive("dirichlet", "alpha", alpha)
    min_size = check_int("dirichlet", "min_size", min_size, 0)
    cap = check_bool("dirichlet", "cap", cap)
    max_tries = check_int("dirichlet", "max_tries", max_tries, 1)
    min_classes = check_int("dirichlet", "min_classes", min_classes, 0)
    total = labels.size
    if total < n * min_size:
        raise too_few("dirichlet", total, n, min_size)
    groups = [g for g in by_class(labels) if g.size]
    if min_classes > len(groups):
        raise PartitionError(f"dirichlet: min_classes {min_classes} exceeds the {len(groups)} classes the data has")
    limit = total / n
    conc = np.full(n, alpha)
    best, best_classes = -1, -1      # the largest smallest size, the most classes every client held
    # Draw only the per-class chunk sizes while searching; shuffle and split once one works.
    for _ in range(max_tries):
        counts = np.zeros((len(groups), n), dtype=np.int64)
        sizes = np.zeros(n, dtype=np.int64)
        for ci, idx in enumerate(groups):
            p = rng.dirichlet(conc)
            if cap:
                p = p * (sizes < limit)
            mass = p.sum()
            if mass <= 0:  # every open client drew 0 (float underflow at tiny alpha): redraw
                break
            cuts = (np.cumsum(p / mass) * idx.size).astype(np.int64)[:-1]
            counts[ci] = np.diff(np.concatenate(([0], cuts, [idx.size])))
            sizes += counts[ci]
        else:
            classes = int((counts > 0).sum(axis=0).min()) if min_classes else 0
            if sizes.min() >= min_size and classes >= min_classes:
                parts: list[list[np.ndarray]] = [[] for _ in range(n)]
                for ci, idx in enumerate(groups):
                    pieces = np.split(rng.permutation(idx), np.cumsum(counts[ci])[:-1])
                    for j in range(n):
                        parts[j].append(pieces[j])
                return finish(parts)
            best = max(best, int(sizes.min()))
            best_classes = max(best_classes, classes)
    achieved = f"the smallest client size achieved was {best}" if best >= 0 else "no draw completed"
    if min_classes:
        achieved += f", the best draw gave every client at least {best_classes} classes" if best >= 0 else ""
        raise PartitionError(
            f"dirichlet: no partition with every client >= min_size {min_size} samples of >= min_classes "
            f"{min_classes} classes in {max_tries} tries ({achieved}); use a larger alpha, fewer clients, a "
            "smaller min_size or min_classes, or a larger max_tries")
    raise PartitionError(
        f"dirichlet: no partition with every client >= min_size {min_size} samples in "
        f"{max_tries} tries ({achieved}); use a larger alpha, fewer clients, a smaller "
        "min_size or a larger max_tries; for many small clients, kind dirichlet_per_client"
    )


def dirichlet_per_client(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    alpha: float,
    samples_per_client: int | None = None,
) -> list[np.ndarray]:
    """Per-client Dirichlet label skew at equal sizes (Hsu, Qi and Brown 2019, "Measuring the Effects
    of Non-Identical Data Distribution for Federated Visual Classification", Sec. 3): each client's
    class proportions q ~ Dir(alpha * p), p the pool's class frequencies, and its
    ``samples_per_client`` samples (default: the pool's size // num_clients) drawn by class from q,
    without replacement. Clients are filled in id order; a class that runs out leaves the later
    clients' q, renormalised over the classes left. Where ``dirichlet`` (which splits each class
    among all clients) leaves clients empty, e.g. 10,000 clients of 6 samples, this one does not:
    it is the cross-device form. Disjoint; covers the pool when the sizes add up to it.
    """
    labels, n = check_common("dirichlet_per_client", labels, num_clients)
    alpha = check_positive("dirichlet_per_client", "alpha", alpha)
    total = labels.size
    size = total // n if samples_per_client is None else check_int(
        "dirichlet_per_client", "samples_per_client", samples_per_client, 1)
    if size < 1 or size * n > total:
        raise PartitionError(f"dirichlet_per_client: {n} clients x {max(size, 1)} samples need {n * max(size, 1)}, "
                             f"only {total} available; lower samples_per_client or num_clients")
    pools = [rng.permutation(g) for g in by_class(labels)]
    left = np.array([g.size for g in pools], dtype=np.int64)
    taken = np.zeros_like(left)
    prior = left / total
    classes = np.flatnonzero(prior)
    parts: list[list[np.ndarray]] = []
    for _ in range(n):
        q = np.zeros(prior.size)
        q[classes] = rng.dirichlet(alpha * prior[classes])
        if not np.isfinite(q).all() or q.sum() <= 0:   # underflow at tiny alpha: Dir's limit, one class
            q = np.zeros(prior.size)
            q[rng.choice(prior.size, p=prior)] = 1.0
        counts = np.zeros(prior.size, dtype=np.int64)
        while (need := size - int(counts.sum())) > 0:
            room = left - counts
            weight = q * (room > 0)
            if weight.sum() <= 0:                      # q's classes ran out: the rest as the pool now is
                weight = room.astype(np.float64)
            counts += np.minimum(rng.multinomial(need, weight / weight.sum()), room)
        parts.append([pools[c][taken[c]:taken[c] + counts[c]] for c in np.flatnonzero(counts)])
        taken += counts
        left -= counts
    return finish(parts)


def shards(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    shards_per_client: int = 2,
) -> list[np.ndarray]:
    """Label-sorted shards, McMahan et al. 2017 (FedAvg pathological non-IID).

    Sort indices by label, cut them into num_clients * shards_per_client shards of
    N // num_shards samples (the remainder is unused) and give each client shards_per_client
    random shards. Disjoint.
    """
    labels, n = check_common("shards", labels, num_clients)
    spc = check_int("shards", "shards_per_client", shards_per_client, 1)
    num_shards = n * spc
    total = labels.size
    if total < num_shards:
        raise PartitionError(
            f"shards: {num_shards} shards ({n} clients x {spc}) need at least {num_shards} "
            f"samples, only {total}; lower shards_per_client or num_clients"
        )
    # Shuffle before the stable sort so a shard's samples within a class are random.
    perm = rng.permutation(total)
    order = perm[np.argsort(labels[perm], kind="stable")]
    size = total // num_shards
    assigned = rng.permutation(num_shards).reshape(n, spc)
    return finish([[order[s * size : (s + 1) * size] for s in row] for row in assigned])


def quantity_skew(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    alpha: float = 0.5,
    min_size: int = 10,
    max_tries: int = 1000,
) -> list[np.ndarray]:
    """Quantity skew with IID labels, NIID-Bench ``iid-diff-quantity``.

    Shuffle all indices; client sizes follow p ~ Dir(alpha * 1_n) (split at
    ``int(cumsum(p) * N)[:-1]``); redraw p until every client has >= ``min_size`` samples.
    Disjoint, covers every sample.
    """
    labels, n = check_common("quantity_skew", labels, num_clients)
    alpha = check_positive("quantity_skew", "alpha", alpha)
    min_size = check_int("quantity_skew", "min_size", min_size, 0)
    max_tries = check_int("quantity_skew", "max_tries", max_tries, 1)
    total = labels.size
    if total < n * min_size:
        raise too_few("quantity_skew", total, n, min_size)
    perm = rng.permutation(total)
    best = -1
    for _ in range(max_tries):
        cuts = (np.cumsum(rng.dirichlet(np.full(n, alpha))) * total).astype(np.int64)[:-1]
        sizes = np.diff(np.concatenate(([0], cuts, [total])))
        if sizes.min() >= min_size:
            return finish(np.split(perm, cuts))
        best = max(best, int(sizes.min()))
    raise PartitionError(
        f"quantity_skew: no partition with every client >= min_size {min_size} samples in "
        f"{max_tries} tries (the smallest client size achieved was {best}); use a larger "
        "alpha, fewer clients, a smaller min_size or a larger max_tries"
    )
