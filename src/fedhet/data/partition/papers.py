"""The partitions defined by the methods' papers: FedClassAvg's k classes per client, FedFM's
NIID-2 and NIID-3, and FedPAC's / FedReMa's dominant label groups.
"""

from __future__ import annotations

import numbers

import numpy as np

from fedhet.core.errors import PartitionError
from fedhet.data.checks import check_bool, check_int
from fedhet.data.partition._common import by_class, check_common, finish

# FedPAC's five overlapping groups of three labels (used by FedReMa's `by_s`), for 10 classes.
DEFAULT_GROUPS_10 = [[0, 1, 2], [2, 3, 4], [4, 5, 6], [6, 7, 8], [8, 9, 0]]


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
    labels, n = check_common("classes_per_client", labels, num_clients)
    groups = [g for g in by_class(labels) if g.size]
    k = check_int("classes_per_client", "k", k, 1)
    if k > len(groups):
        raise PartitionError(
            f"classes_per_client: k={k} but the labels contain only {len(groups)} classes"
        )
    spc = labels.size // n if samples_per_client is None else samples_per_client
    spc = check_int("classes_per_client", "samples_per_client", spc, k)
    replace = check_bool("classes_per_client", "replace", replace)
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
    return finish(parts)


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
    per class. FMNIST (6000/class, defaults): 6000 per client, 2760 (46%) of its own class. The
    code's CINIC-10 version (shards of 100, 5 minor shards): ``shards_per_class=90,
    dominant_shards=40, minor_shards=5``, 4500 (50%) of each client's 9000 its own class.
    Disjoint.

    With more classes than clients (the paper's CIFAR-100 version: C=100, 10 clients) client i
    is dominant in the C/num_clients classes [i*C/n, (i+1)*C/n) (C must be a multiple of n) and
    takes its ``minor_shards`` shards of every class the same way.
    """
    labels, n = check_common("niid2", labels, num_clients)
    dom = check_int("niid2", "dominant_shards", dominant_shards, 0)
    spcl = check_int("niid2", "shards_per_class", shards_per_class, 1)
    minor = check_int("niid2", "minor_shards", minor_shards, 0)
    groups = by_class(labels)
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
    return finish(parts)


def niid3(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    missing: int,
) -> list[np.ndarray]:
    """Missing classes, FedFM NIID-3 (Ye et al. 2023, ``noniid-3-m`` in the code, CIFAR-10 only).

    With C classes, client i lacks classes {(i + r) mod C : r < missing}; each class's shuffled
    samples are split near-equally (np.array_split) among the clients that have it, so client
    sizes are equal when the class sizes divide evenly. Disjoint, covers every sample. The
    authors' code gives client i the classes (i + j) mod C for j < C - missing (the same sets,
    rotated) and draws floor(N_c / (C - missing)) samples of each, leaving a class's remainder
    unused.
    """
    labels, n = check_common("niid3", labels, num_clients)
    groups = by_class(labels)
    num_classes = len(groups)
    x = check_int("niid3", "missing", missing, 0)
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
    return finish(parts)


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
    labels, n = check_common("grouped_dominant", labels, num_clients)
    pools = [rng.permutation(g) for g in by_class(labels)]
    num_classes = len(pools)
    npc = check_int("grouped_dominant", "samples_per_client", samples_per_client, 1)
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
    return finish(parts)
