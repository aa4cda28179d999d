"""Deterministic label-skew partitioners for federated datasets.

Every partitioner has the signature ``fn(labels, num_clients, rng, **params)`` and returns one
sorted ``int64`` array of sample indices per client. It draws randomness only from ``rng`` (a
``np.random.Generator`` that :func:`partition` builds from ``seed``), so a seed fully
determines the split. Impossible requests raise :class:`PartitionError` with a message that says
which parameter to change; rejection-sampling partitioners give up after ``max_tries`` instead
of looping forever.

Most partitions are disjoint across clients. Two are not, by design of the method they mirror:
``classes_per_client`` samples with replacement (FedClassAvg), and ``grouped_dominant`` reuses
samples once a label's pool wraps around (FedPAC/FedReMa). :func:`holdout_split` keeps each
client's own train and test apart; for those two partitions draw local test sets from a
separate pool with :func:`fedhet.data.local_test.sample_like` if no image may appear in any
client's training data.
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable
from typing import Any

import numpy as np

from fedhet.core.errors import PartitionError
from fedhet.core.plugins import describe, is_import_path, load_object

__all__ = [
    "PARTITIONS",
    "partition",
    "class_counts",
    "holdout_split",
    "iid",
    "dirichlet",
    "dirichlet_per_client",
    "classes_per_client",
    "shards",
    "niid2",
    "niid3",
    "grouped_dominant",
    "quantity_skew",
]

# FedPAC's five overlapping groups of three labels (used by FedReMa's `by_s`), for 10 classes.
DEFAULT_GROUPS_10 = [[0, 1, 2], [2, 3, 4], [4, 5, 6], [6, 7, 8], [8, 9, 0]]


# --------------------------------------------------------------------------------------------
# validation helpers


def _check_int(kind: str, name: str, value: Any, minimum: int) -> int:
    # bool is an int subclass; `replace=True` passed as a count is almost surely a mistake.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise PartitionError(f"{kind}: {name} must be an integer >= {minimum}, got {value!r}")
    if value < minimum:
        raise PartitionError(f"{kind}: {name} must be >= {minimum}, got {value!r}")
    return int(value)


def _check_positive(kind: str, name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise PartitionError(f"{kind}: {name} must be a finite number > 0, got {value!r}")
    if value <= 0:
        raise PartitionError(f"{kind}: {name} must be > 0, got {value!r}")
    return float(value)


def _check_bool(kind: str, name: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise PartitionError(f"{kind}: {name} must be true or false, got {value!r}")
    return bool(value)


def _check_labels(labels: Any, what: str = "labels") -> np.ndarray:
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


def _check_common(kind: str, labels: Any, num_clients: Any) -> tuple[np.ndarray, int]:
    arr = _check_labels(labels)
    n = _check_int(kind, "num_clients", num_clients, 1)
    return arr, n


def _by_class(labels: np.ndarray) -> list[np.ndarray]:
    """Indices of each class id 0..max(labels), in ascending order (empty for absent ids)."""
    order = np.argsort(labels, kind="stable")
    bounds = np.searchsorted(labels[order], np.arange(int(labels.max()) + 2))
    return [order[bounds[c] : bounds[c + 1]] for c in range(len(bounds) - 1)]


def _finish(parts: list[list[np.ndarray]] | list[np.ndarray]) -> list[np.ndarray]:
    out = []
    for p in parts:
        arr = np.concatenate(p) if isinstance(p, list) and p else np.asarray(p)
        out.append(np.sort(arr.astype(np.int64, copy=False)))
    return out


def _too_few(kind: str, total: int, num_clients: int, min_size: int) -> PartitionError:
    return PartitionError(
        f"{kind}: {num_clients} clients x min_size {min_size} needs at least "
        f"{num_clients * min_size} samples but there are only {total}; "
        "use fewer clients or a smaller min_size"
    )


# --------------------------------------------------------------------------------------------
# partitioners


def iid(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    samples_per_client: int | None = None,
) -> list[np.ndarray]:
    """IID split: shuffle all indices and cut them into near-equal parts (sizes differ by <= 1).

    With ``samples_per_client`` each client gets exactly that many samples (the rest is unused).
    """
    labels, n = _check_common("iid", labels, num_clients)
    total = labels.size
    if samples_per_client is None:
        if total < n:
            raise PartitionError(
                f"iid: {n} clients but only {total} samples; every client needs at least one"
            )
        return _finish(np.array_split(rng.permutation(total), n))
    spc = _check_int("iid", "samples_per_client", samples_per_client, 1)
    if spc * n > total:
        raise PartitionError(
            f"iid: {n} clients x samples_per_client {spc} = {spc * n} samples needed, "
            f"only {total} available; lower samples_per_client or num_clients"
        )
    return _finish(np.split(rng.permutation(total)[: spc * n], n))


def dirichlet(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    alpha: float,
    min_size: int = 10,
    cap: bool = True,
    max_tries: int = 1000,
) -> list[np.ndarray]:
    """Dirichlet label skew, NIID-Bench ``noniid-labeldir`` (Li et al. 2022, ``utils.py``).

    For each class c (in class-id order): p ~ Dir(alpha * 1_n); with ``cap`` a client that
    already holds >= N/n samples gets p_j = 0; renormalise; split class c's shuffled indices
    at ``int(cumsum(p) * len)[:-1]``. Repeat until every client has >= ``min_size`` samples.
    Gives label and quantity skew. Disjoint, covers every sample.
    """
    labels, n = _check_common("dirichlet", labels, num_clients)
    alpha = _check_positive("dirichlet", "alpha", alpha)
    min_size = _check_int("dirichlet", "min_size", min_size, 0)
    cap = _check_bool("dirichlet", "cap", cap)
    max_tries = _check_int("dirichlet", "max_tries", max_tries, 1)
    total = labels.size
    if total < n * min_size:
        raise _too_few("dirichlet", total, n, min_size)
    groups = [g for g in _by_class(labels) if g.size]
    limit = total / n
    conc = np.full(n, alpha)
    best = -1
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
            if sizes.min() >= min_size:
                parts: list[list[np.ndarray]] = [[] for _ in range(n)]
                for ci, idx in enumerate(groups):
                    pieces = np.split(rng.permutation(idx), np.cumsum(counts[ci])[:-1])
                    for j in range(n):
                        parts[j].append(pieces[j])
                return _finish(parts)
            best = max(best, int(sizes.min()))
    achieved = f"the smallest client size achieved was {best}" if best >= 0 else "no draw completed"
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
    labels, n = _check_common("dirichlet_per_client", labels, num_clients)
    alpha = _check_positive("dirichlet_per_client", "alpha", alpha)
    total = labels.size
    size = total // n if samples_per_client is None else _check_int(
        "dirichlet_per_client", "samples_per_client", samples_per_client, 1)
    if size < 1 or size * n > total:
        raise PartitionError(f"dirichlet_per_client: {n} clients x {max(size, 1)} samples need {n * max(size, 1)}, "
                             f"only {total} available; lower samples_per_client or num_clients")
    pools = [rng.permutation(g) for g in _by_class(labels)]
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
    return _finish(parts)


def classes_per_client(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    k: int = 2,
    samples_per_client: int | None = None,
    replace: bool = True,
) -> list[np.ndarray]:
    """k labels per client, FedClassAvg "skewed" (``noniid-twoclass``, Jang et al. 2022).

    Each client independently draws k distinct labels uniformly from the labels present (so a
    label can be used by several clients or by none) and takes ``samples_per_client / k``
    samples of each (when k does not divide it, the first labels drawn get one extra). The
    reference samples WITH replacement (``np.random.choice`` default), so clients may share or
    repeat samples; ``replace=False`` makes each client's samples distinct (not across
    clients). Default ``samples_per_client`` is N // num_clients.
    """
    labels, n = _check_common("classes_per_client", labels, num_clients)
    groups = [g for g in _by_class(labels) if g.size]
    k = _check_int("classes_per_client", "k", k, 1)
    if k > len(groups):
        raise PartitionError(
            f"classes_per_client: k={k} but the labels contain only {len(groups)} classes"
        )
    spc = labels.size // n if samples_per_client is None else samples_per_client
    spc = _check_int("classes_per_client", "samples_per_client", spc, k)
    replace = _check_bool("classes_per_client", "replace", replace)
    base, extra = divmod(spc, k)
    parts = []
    for _ in range(n):
        chosen = rng.choice(len(groups), size=k, replace=False)
        mine = []
        for pos, ci in enumerate(chosen):
            count = base + (pos < extra)
            pool = groups[ci]
            if not replace and count > pool.size:
                raise PartitionError(
                    f"classes_per_client: a client needs {count} samples of one class without "
                    f"replacement but a class has only {pool.size}; lower samples_per_client, "
                    "raise k or use replace=true"
                )
            mine.append(rng.choice(pool, size=count, replace=replace))
        parts.append(mine)
    return _finish(parts)


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
    labels, n = _check_common("shards", labels, num_clients)
    spc = _check_int("shards", "shards_per_client", shards_per_client, 1)
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
    return _finish([[order[s * size : (s + 1) * size] for s in row] for row in assigned])


def niid2(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    dominant_shards: int = 20,
    shards_per_class: int = 50,
    minor_shards: int = 3,
) -> list[np.ndarray]:
    """One dominant class per client, FedFM NIID-2 (Ye et al. 2023, ``noniid-2`` in the code).

    Each class's shuffled indices are cut into ``shards_per_class`` equal shards (remainder
    unused). Client i owns shards [0, dominant_shards) of class i, and from every class j
    (including i) the ``minor_shards`` shards at positions
    ``shards_per_class - num_clients*minor_shards + minor_shards*i + q``: the last
    num_clients*minor_shards shards of each class are divided among clients. Needs one client
    per class. FMNIST (6000/class, defaults): 6000 per client, 2760 (46%) of its own class.
    Disjoint.

    With more classes than clients (the paper's CIFAR-100 version: C=100, 10 clients) client i
    is dominant in the C/num_clients classes [i*C/n, (i+1)*C/n) (C must be a multiple of n) and
    takes its ``minor_shards`` shards of every class the same way.
    """
    labels, n = _check_common("niid2", labels, num_clients)
    dom = _check_int("niid2", "dominant_shards", dominant_shards, 0)
    spcl = _check_int("niid2", "shards_per_class", shards_per_class, 1)
    minor = _check_int("niid2", "minor_shards", minor_shards, 0)
    groups = _by_class(labels)
    if len(groups) % n:
        raise PartitionError(
            f"niid2: the number of classes ({len(groups)}) must be a multiple of num_clients "
            f"(every client is dominant in the same number of classes), got num_clients={n}"
        )
    per_client = len(groups) // n
    if dom + n * minor > spcl:
        raise PartitionError(
            f"niid2: dominant_shards + num_clients*minor_shards = {dom} + {n}*{minor} = "
            f"{dom + n * minor} exceeds shards_per_class {spcl}; lower dominant_shards or "
            "minor_shards, or raise shards_per_class"
        )
    cut = []
    for c, idx in enumerate(groups):
        if idx.size < spcl:
            raise PartitionError(
                f"niid2: class {c} has {idx.size} samples, fewer than shards_per_class {spcl}"
            )
        size = idx.size // spcl
        cut.append(rng.permutation(idx)[: size * spcl].reshape(spcl, size))
    first_minor = spcl - n * minor
    parts = []
    for i in range(n):
        mine = [cut[c][:dom].ravel() for c in range(i * per_client, (i + 1) * per_client)]
        rows = slice(first_minor + minor * i, first_minor + minor * (i + 1))
        mine += [cut[j][rows].ravel() for j in range(len(groups))]
        parts.append(mine)
    return _finish(parts)


def niid3(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    missing: int,
) -> list[np.ndarray]:
    """Missing classes, FedFM NIID-3 (Ye et al. 2023; not in the FedFM code, defined here).

    With C classes, client i lacks classes {(i + r) mod C : r < missing}; each class's shuffled
    samples are split near-equally (np.array_split) among the clients that have it, so client
    sizes are equal when the class sizes divide evenly. Disjoint, covers every sample.
    """
    labels, n = _check_common("niid3", labels, num_clients)
    groups = _by_class(labels)
    num_classes = len(groups)
    x = _check_int("niid3", "missing", missing, 0)
    if x >= num_classes:
        raise PartitionError(
            f"niid3: missing must be < number of classes ({num_classes}), got {x}"
        )
    # Class c is missed by clients c, c-1, ..., c-x+1 (mod C); it has an owner iff n > x.
    if n <= x:
        raise PartitionError(
            f"niid3: with {n} clients each missing {x} classes some class would belong to no "
            f"client; use more than {x} clients or a smaller missing"
        )
    parts: list[list[np.ndarray]] = [[] for _ in range(n)]
    clients = np.arange(n)
    for c, idx in enumerate(groups):
        owners = clients[(c - clients) % num_classes >= x]
        # Rotate who receives array_split's larger pieces so no client collects every extra.
        owners = np.roll(owners, -c)
        for j, piece in zip(owners, np.array_split(rng.permutation(idx), owners.size)):
            parts[j].append(piece)
    return _finish(parts)


def grouped_dominant(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    samples_per_client: int = 600,
    s: float = 0.2,
    groups: list[list[int]] | None = None,
) -> list[np.ndarray]:
    """Dominant label groups plus an IID share, FedPAC ``*_noniid_s`` / FedReMa ``by_s``.

    Client k uses group ``k * len(groups) // num_clients``. It takes int(npc*s) IID samples
    split evenly over all C labels (the last label gets the remainder), then npc - int(npc*s)
    samples split evenly over its group's labels (the last gets the remainder). Each label's
    indices are shuffled once and consumed in order through a per-label pointer; when a label
    runs out the pointer wraps to its start, so samples repeat (within or across clients) only
    after that label's pool is exhausted. The reference starts pointers at 2000; here they
    start at 0 of the shuffled pool, which is equivalent up to the permutation.
    ``groups`` defaults to FedPAC's [[0,1,2],[2,3,4],[4,5,6],[6,7,8],[8,9,0]] for 10 classes
    and must be given otherwise. FMNIST, npc=600, s=0.2: 12 of each class + 160 of each of the
    3 group labels.
    """
    labels, n = _check_common("grouped_dominant", labels, num_clients)
    pools = [rng.permutation(g) for g in _by_class(labels)]
    num_classes = len(pools)
    npc = _check_int("grouped_dominant", "samples_per_client", samples_per_client, 1)
    if isinstance(s, bool) or not isinstance(s, numbers.Real) or not 0 <= s <= 1:
        raise PartitionError(f"grouped_dominant: s must be a number in [0, 1], got {s!r}")
    if groups is None:
        if num_classes != 10:
            raise PartitionError(
                f"grouped_dominant: the default groups are for 10 classes but the labels have "
                f"{num_classes}; pass groups explicitly (a list of label lists)"
            )
        groups = DEFAULT_GROUPS_10
    if not isinstance(groups, (list, tuple)) or not groups:
        raise PartitionError(f"grouped_dominant: groups must be a non-empty list, got {groups!r}")
    for g in groups:
        if not isinstance(g, (list, tuple)) or not g or not all(
            isinstance(c, numbers.Integral) and not isinstance(c, bool) and 0 <= c < num_classes
            for c in g
        ):
            raise PartitionError(
                f"grouped_dominant: each group must be a non-empty list of class ids in "
                f"[0, {num_classes}), got {g!r}"
            )
    if n < len(groups):
        dominating = {k * len(groups) // n for k in range(n)}
        unused = [list(g) for i, g in enumerate(groups) if i not in dominating]
        raise PartitionError(
            f"grouped_dominant: {len(groups)} label groups but only {n} clients, so groups {unused} would "
            f"dominate no client; use at least {len(groups)} clients, or give fewer groups"
        )
    # +1e-9 so float error (e.g. 100 * 0.29 = 28.999...) does not drop a sample.
    num_iid = int(npc * s + 1e-9)
    num_dom = npc - num_iid
    client_groups = [[int(c) for c in groups[k * len(groups) // n]] for k in range(n)]
    used = set(range(num_classes)) if num_iid else set()
    if num_dom:
        used.update(c for g in client_groups for c in g)
    empty = sorted(c for c in used if pools[c].size == 0)
    if empty:
        raise PartitionError(f"grouped_dominant: classes {empty} are needed but have no samples")
    pointer = [0] * num_classes

    def take(c: int, count: int) -> np.ndarray:
        pool = pools[c]
        picked = pool.take(np.arange(pointer[c], pointer[c] + count), mode="wrap")
        pointer[c] = (pointer[c] + count) % pool.size
        return picked

    def even(count: int, classes: list[int]) -> list[tuple[int, int]]:
        each = count // len(classes)
        last = count - each * (len(classes) - 1)  # the last label takes the remainder
        return [(c, each) for c in classes[:-1]] + [(classes[-1], last)]

    parts = []
    for group in client_groups:
        plan = even(num_iid, list(range(num_classes))) + even(num_dom, group)
        parts.append([take(c, cnt) for c, cnt in plan if cnt])
    return _finish(parts)


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
    labels, n = _check_common("quantity_skew", labels, num_clients)
    alpha = _check_positive("quantity_skew", "alpha", alpha)
    min_size = _check_int("quantity_skew", "min_size", min_size, 0)
    max_tries = _check_int("quantity_skew", "max_tries", max_tries, 1)
    total = labels.size
    if total < n * min_size:
        raise _too_few("quantity_skew", total, n, min_size)
    perm = rng.permutation(total)
    best = -1
    for _ in range(max_tries):
        cuts = (np.cumsum(rng.dirichlet(np.full(n, alpha))) * total).astype(np.int64)[:-1]
        sizes = np.diff(np.concatenate(([0], cuts, [total])))
        if sizes.min() >= min_size:
            return _finish(np.split(perm, cuts))
        best = max(best, int(sizes.min()))
    raise PartitionError(
        f"quantity_skew: no partition with every client >= min_size {min_size} samples in "
        f"{max_tries} tries (the smallest client size achieved was {best}); use a larger "
        "alpha, fewer clients, a smaller min_size or a larger max_tries"
    )


PARTITIONS: dict[str, Callable[..., list[np.ndarray]]] = {
    "iid": iid,
    "dirichlet": dirichlet,
    "dirichlet_per_client": dirichlet_per_client,
    "classes_per_client": classes_per_client,
    "shards": shards,
    "niid2": niid2,
    "niid3": niid3,
    "grouped_dominant": grouped_dominant,
    "quantity_skew": quantity_skew,
}


# --------------------------------------------------------------------------------------------
# public entry points


def partition(
    kind: str, labels: np.ndarray, num_clients: int, seed: int, **params: Any
) -> list[np.ndarray]:
    """Split ``labels``' indices among ``num_clients`` clients with partitioner ``kind``.

    ``params`` are checked against the partitioner's signature before anything runs. Returns
    one sorted int64 index array per client; the same (kind, labels, num_clients, seed,
    params) always gives the same arrays.
    """
    if is_import_path(kind):
        fn = _user_partitioner(kind)
    elif kind not in PARTITIONS:
        raise PartitionError(
            f"unknown partition kind {kind!r}; valid kinds: {', '.join(sorted(PARTITIONS))}; one of your own: "
            "MODULE:FUNCTION (a function (labels, num_clients, rng, **params) -> one index array per client)"
        )
    else:
        fn = PARTITIONS[kind]
    try:
        signature = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        raise PartitionError(f"data.partition.kind {kind!r}: its signature cannot be read (a builtin or C "
                             "callable?); wrap it in a Python function (labels, num_clients, rng, **params)") from None
    if len([p for p in signature if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)]) < 3:
        where = f"data.partition.kind {kind!r}" if is_import_path(kind) else f"partition {kind!r}"
        raise PartitionError(f"{where}: a partition function takes (labels, num_clients, rng, **params); "
                             f"this one's signature is ({', '.join(p.name for p in signature)})")
    # after labels, n, rng: the named parameters (a **params of a user's function takes any others)
    accepted = [p for p in signature[3:] if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    takes_any = any(p.kind == p.VAR_KEYWORD for p in signature)
    names = [p.name for p in accepted]
    listing = ", ".join(names) + (", and any other" if takes_any else "") if names or takes_any else "none"
    unknown = [] if takes_any else sorted(set(params) - set(names))
    if unknown:
        raise PartitionError(
            f"partition {kind!r}: unknown parameter(s) {', '.join(unknown)}; accepted: {listing}"
        )
    missing = [p.name for p in accepted if p.default is p.empty and p.name not in params]
    if missing:
        raise PartitionError(
            f"partition {kind!r}: missing required parameter(s) {', '.join(missing)}; "
            f"accepted: {listing}"
        )
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
        raise PartitionError(f"partition {kind!r}: seed must be an integer >= 0, got {seed!r}")
    rng = np.random.default_rng(int(seed))
    if not is_import_path(kind):
        return fn(labels, num_clients, rng, **params)
    try:       # the call's shape is checked here, so an error raised inside the function keeps its traceback
        inspect.signature(fn).bind(labels, num_clients, rng, **params)
    except TypeError as e:
        raise PartitionError(f"data.partition.kind {kind!r} could not be called as (labels, num_clients, rng, "
                             f"**params): {e}") from None
    parts = fn(labels, num_clients, rng, **params)
    return _checked_parts(kind, parts, len(labels), num_clients)


def _user_partitioner(kind: str) -> Callable[..., list[np.ndarray]]:
    try:
        fn = load_object(kind)
    except ValueError as e:
        raise PartitionError(f"data.partition.kind {kind!r}: {e}") from e.__cause__   # a module that raised on import
    if not callable(fn) or isinstance(fn, type):
        raise PartitionError(f"data.partition.kind {kind!r} is {describe(fn)}, not a partition function "
                             "(labels, num_clients, rng, **params) -> one index array per client")
    return fn


def _checked_parts(kind: str, parts: object, n: int, num_clients: int) -> list[np.ndarray]:
    """A partition function's result as sorted int64 arrays, or a PartitionError saying what is wrong."""
    where = f"data.partition.kind {kind!r}"
    if not isinstance(parts, (list, tuple)) or len(parts) != num_clients:
        got = f"{len(parts)} entries" if isinstance(parts, (list, tuple)) else describe(parts)
        raise PartitionError(f"{where} returned {got}; it must return a list of {num_clients} index arrays, one "
                             "per client")
    out = []
    for cid, idx in enumerate(parts):
        arr = np.asarray(idx)
        if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
            raise PartitionError(f"{where}: client {cid}'s entry is {arr.dtype} {arr.shape}, not a 1-d array of "
                                 "sample indices")
        if arr.size and (arr.min() < 0 or arr.max() >= n):
            raise PartitionError(f"{where}: client {cid} holds index {int(arr.min() if arr.min() < 0 else arr.max())}, "
                                 f"outside the {n} samples of the pool")
        out.append(np.sort(arr.astype(np.int64)))
    return out


def class_counts(parts: list[np.ndarray], labels: np.ndarray, num_classes: int) -> np.ndarray:
    """Per-client label histogram, shape (clients, classes); repeated indices count each time."""
    labels = _check_labels(labels)
    if int(labels.max()) >= num_classes:
        raise PartitionError(
            f"class_counts: label {int(labels.max())} does not fit num_classes={num_classes}"
        )
    out = np.zeros((len(parts), num_classes), dtype=np.int64)
    for j, idx in enumerate(parts):
        out[j] = np.bincount(labels[np.asarray(idx, dtype=np.int64)], minlength=num_classes)
    return out


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

