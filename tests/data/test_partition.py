"""Tests for fedhet.data.partition: hand-checked counts, not just "it runs"."""

from __future__ import annotations

import numpy as np
import pytest

from fedhet.core.errors import PartitionError
from fedhet.data.local_test import sample_like
from fedhet.data.partition import (
    PARTITIONS,
    class_counts,
    dirichlet,
    holdout_split,
    partition,
)


def balanced(num_classes: int, per_class: int, seed: int = 0) -> np.ndarray:
    """Labels with exactly per_class samples of each class, in shuffled order."""
    return np.random.default_rng(seed).permutation(np.repeat(np.arange(num_classes), per_class))


FMNIST = balanced(10, 6000)  # FMNIST-shaped training labels

# One valid call per kind, used by the generic tests.
CASES = {
    "iid": (10, {}),
    "dirichlet": (10, {"alpha": 0.5}),
    "dirichlet_per_client": (10, {"alpha": 0.5}),
    "classes_per_client": (20, {"k": 2}),
    "shards": (10, {"shards_per_client": 2}),
    "niid2": (10, {}),
    "niid3": (10, {"missing": 2}),
    "grouped_dominant": (20, {}),
    "quantity_skew": (10, {}),
}

DISJOINT = ["iid", "dirichlet", "dirichlet_per_client", "shards", "niid2", "niid3", "quantity_skew"]


def assert_disjoint(parts: list[np.ndarray]) -> np.ndarray:
    everything = np.concatenate(parts)
    assert np.unique(everything).size == everything.size, "a sample is in two places"
    return everything


def test_cases_cover_registry():
    assert set(CASES) == set(PARTITIONS)


@pytest.mark.parametrize("kind", sorted(CASES))
def test_output_format_and_determinism(kind):
    n, params = CASES[kind]
    a = partition(kind, FMNIST, n, 7, **params)
    b = partition(kind, FMNIST, n, 7, **params)
    c = partition(kind, FMNIST, n, 8, **params)
    assert len(a) == n
    for x in a:
        assert x.dtype == np.int64 and x.ndim == 1 and x.size > 0
        assert np.all(np.diff(x) >= 0), "indices must be sorted"
        assert x.min() >= 0 and x.max() < FMNIST.size
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


@pytest.mark.parametrize("kind", DISJOINT)
def test_disjoint_kinds(kind):
    n, params = CASES[kind]
    assert_disjoint(partition(kind, FMNIST, n, 0, **params))


# --- iid ----------------------------------------------------------------------------------


def test_iid_near_equal_and_covering():
    labels = balanced(7, 143)  # 1001 samples over 10 clients -> one client of 101
    parts = partition("iid", labels, 10, 0)
    sizes = [p.size for p in parts]
    assert max(sizes) - min(sizes) <= 1 and sorted(sizes) == [100] * 9 + [101]
    assert np.array_equal(np.sort(assert_disjoint(parts)), np.arange(labels.size))


def test_iid_samples_per_client():
    parts = partition("iid", FMNIST, 10, 0, samples_per_client=500)
    assert [p.size for p in parts] == [500] * 10
    assert_disjoint(parts)
    with pytest.raises(PartitionError, match="samples_per_client"):
        partition("iid", FMNIST, 10, 0, samples_per_client=6001)


# --- dirichlet ----------------------------------------------------------------------------


def test_dirichlet_covers_all_and_min_size():
    for seed in range(3):
        parts = partition("dirichlet", FMNIST, 10, seed, alpha=0.1, min_size=50)
        assert np.array_equal(np.sort(assert_disjoint(parts)), np.arange(FMNIST.size))
        assert min(p.size for p in parts) >= 50


def test_dirichlet_alpha_controls_label_skew():
    def mean_classes(alpha):
        """Mean number of classes making up >= 5% of a client's data."""
        counts = class_counts(partition("dirichlet", FMNIST, 10, 3, alpha=alpha), FMNIST, 10)
        return (counts >= 0.05 * counts.sum(axis=1, keepdims=True)).sum(axis=1).mean()

    low, high = mean_classes(0.1), mean_classes(100.0)
    assert high == 10.0  # near-uniform proportions: every class ~10% on every client
    assert low < 5  # Dir(0.1) concentrates each class on a few clients


def cap_violations(parts, labels, num_classes):
    """Clients that received class c although they already held >= N/n before c.

    Classes are processed in id order, so a client's size before class c is the sum of its
    counts of classes < c; with the cap such a client gets p_j = 0 for class c.
    """
    counts = class_counts(parts, labels, num_classes)
    before = np.cumsum(counts, axis=1) - counts
    limit = labels.size / len(parts)
    return int(((counts > 0) & (before >= limit)).sum())


def test_dirichlet_cap_respected():
    labels = balanced(10, 100)
    for seed in range(5):
        capped = partition("dirichlet", labels, 5, seed, alpha=0.05, min_size=1)
        assert cap_violations(capped, labels, 10) == 0
    # Without the cap the same setting breaks that rule for some seed, so the check has teeth.
    uncapped = [
        cap_violations(partition("dirichlet", labels, 5, s, alpha=0.05, min_size=1, cap=False),
                       labels, 10)
        for s in range(5)
    ]
    assert sum(uncapped) > 0


class CountingRng:
    """A seeded generator that counts the draws the Dirichlet partitioner makes: whether it stops, and
    when, is checked by its draws, not by the clock (a busy machine's seconds say nothing)."""

    def __init__(self, seed: int = 0):
        self.rng, self.dirichlet_draws, self.permutations = np.random.default_rng(seed), 0, 0

    def dirichlet(self, alpha):
        self.dirichlet_draws += 1
        return self.rng.dirichlet(alpha)

    def permutation(self, x):
        self.permutations += 1
        return self.rng.permutation(x)


def test_dirichlet_impossible_fails_fast_and_helpfully():
    labels = balanced(5, 10)  # 50 samples
    rng = CountingRng()
    with pytest.raises(PartitionError) as err:
        dirichlet(labels, 100, rng, alpha=0.5, min_size=10)
    assert rng.dirichlet_draws == 0           # refused from the sizes alone, before any draw
    msg = str(err.value)
    assert "min_size" in msg and "fewer clients" in msg


def test_dirichlet_gives_up_after_max_tries():
    rng = CountingRng()
    with pytest.raises(PartitionError) as err:
        dirichlet(FMNIST, 100, rng, alpha=0.1, min_size=500, max_tries=200)
    # at most one draw per class per try (a try ends early when every open client drew 0), none split
    assert 200 <= rng.dirichlet_draws <= 200 * 10 and rng.permutations == 0
    msg = str(err.value)
    assert "200 tries" in msg and "smallest client size achieved was" in msg
    assert "larger alpha" in msg


def test_dirichlet_min_classes_redraws_until_every_client_holds_that_many_classes():
    labels = balanced(10, 600)
    plain = partition("dirichlet", labels, 20, 2, alpha=0.1, min_size=10)
    held = [np.count_nonzero(np.bincount(labels[p], minlength=10)) for p in plain]
    assert min(held) == 1                              # this seed gives a client a single class ...
    # ... which min_classes 2 draws again (FedNH's code base keeps every client at two or more)
    parts = partition("dirichlet", labels, 20, 2, alpha=0.1, min_size=10, min_classes=2)
    assert assert_disjoint(parts).size == labels.size
    assert min(np.count_nonzero(np.bincount(labels[p], minlength=10)) for p in parts) >= 2
    # min_classes 0 (the default) is the draw without the rule, sample for sample
    again = partition("dirichlet", labels, 20, 2, alpha=0.1, min_size=10, min_classes=0)
    assert all(np.array_equal(a, b) for a, b in zip(plain, again))
    with pytest.raises(PartitionError, match="min_classes 11 exceeds the 10 classes the data has"):
        partition("dirichlet", labels, 20, 1, alpha=0.1, min_classes=11)
    with pytest.raises(PartitionError, match=r">= min_classes 10 classes in 5 tries \(the smallest client size "
                                             r"achieved was \d+, the best draw gave every client at least \d classes\)"):
        partition("dirichlet", labels, 20, 1, alpha=0.1, min_classes=10, max_tries=5)


# --- classes_per_client -------------------------------------------------------------------


@pytest.mark.parametrize("replace", [True, False])
def test_classes_per_client_exact_k_and_size(replace):
    parts = partition("classes_per_client", FMNIST, 20, 0, k=2, replace=replace)
    counts = class_counts(parts, FMNIST, 10)
    assert np.all((counts > 0).sum(axis=1) == 2)
    assert np.all(counts[counts > 0] == 1500)  # N/(2K) = 60000/40 per label
    assert [p.size for p in parts] == [3000] * 20
    if not replace:
        assert all(np.unique(p).size == p.size for p in parts)


def test_classes_per_client_uneven_split_and_errors():
    parts = partition("classes_per_client", FMNIST, 5, 1, k=3, samples_per_client=100)
    counts = class_counts(parts, FMNIST, 10)
    assert np.all((counts > 0).sum(axis=1) == 3) and np.all(counts.sum(axis=1) == 100)
    assert sorted(counts[0][counts[0] > 0]) == [33, 33, 34]
    with pytest.raises(PartitionError, match="k=11"):
        partition("classes_per_client", FMNIST, 5, 0, k=11)
    with pytest.raises(PartitionError, match="replace"):
        partition("classes_per_client", balanced(10, 50), 5, 0, samples_per_client=200,
                  replace=False)


# --- shards -------------------------------------------------------------------------------


def test_shards_sizes_and_label_purity():
    labels = balanced(10, 100)  # 1000 samples, 20 shards of 50 -> one class per shard
    parts = partition("shards", labels, 10, 0, shards_per_client=2)
    assert [p.size for p in parts] == [100] * 10
    assert_disjoint(parts)
    counts = class_counts(parts, labels, 10)
    assert np.all(np.isin(counts, [0, 50, 100]))  # whole shards only
    assert np.all((counts > 0).sum(axis=1) <= 2)


def test_shards_remainder_unused_and_too_few():
    parts = partition("shards", balanced(3, 7), 2, 0, shards_per_client=2)  # 21 -> 4 x 5
    assert [p.size for p in parts] == [10, 10]
    with pytest.raises(PartitionError, match="shards_per_client"):
        partition("shards", balanced(2, 5), 3, 0, shards_per_client=4)


# --- niid2 --------------------------------------------------------------------------------


def test_niid2_fmnist_counts():
    parts = partition("niid2", FMNIST, 10, 0)
    assert_disjoint(parts)
    assert [p.size for p in parts] == [6000] * 10
    counts = class_counts(parts, FMNIST, 10)
    expected = np.full((10, 10), 360) + np.diag([2400] * 10)  # 20 + 3 shards of 120 / 3 shards
    assert np.array_equal(counts, expected)
    assert np.sort(np.concatenate(parts)).size == FMNIST.size  # every sample used once


def test_niid2_cifar100_ten_dominant_classes_per_client():
    # FedFM's CIFAR-100 NIID-2 (the authors' code): 500 per class -> shards of 10; client i holds 20
    # shards of each of classes 10i..10i+9 and 3 shards of every class.
    labels = balanced(100, 500)
    parts = partition("niid2", labels, 10, 0)
    assert_disjoint(parts)
    counts = class_counts(parts, labels, 100)
    dominant = np.kron(np.eye(10, dtype=int), np.ones((1, 10), dtype=int)) * 200
    assert np.array_equal(counts, dominant + 30)
    assert [p.size for p in parts] == [10 * 200 + 100 * 30] * 10


def test_niid2_cinic10_as_the_authors_code_cuts_it():
    # The FedFM configs' CINIC-10 NIID-2: 9,000 per class in 90 shards of 100; client i holds 40
    # shards of class i and 5 shards of every class: 4,000 + 500 of its own, 500 of each other.
    labels = balanced(10, 9000)
    parts = partition("niid2", labels, 10, 0, shards_per_class=90, dominant_shards=40, minor_shards=5)
    assert_disjoint(parts)
    assert np.array_equal(class_counts(parts, labels, 10), np.full((10, 10), 500) + np.diag([4000] * 10))
    assert [p.size for p in parts] == [9000] * 10 and np.concatenate(parts).size == labels.size


def test_niid2_errors():
    with pytest.raises(PartitionError, match="must be a multiple of num_clients"):
        partition("niid2", FMNIST, 3, 0)
    with pytest.raises(PartitionError, match="exceeds shards_per_class"):
        partition("niid2", FMNIST, 10, 0, dominant_shards=21)


# --- niid3 --------------------------------------------------------------------------------


@pytest.mark.parametrize("missing", [1, 2, 5])
def test_niid3_missing_classes(missing):
    labels = balanced(10, 600)
    parts = partition("niid3", labels, 10, 0, missing=missing)
    assert np.array_equal(np.sort(assert_disjoint(parts)), np.arange(labels.size))
    counts = class_counts(parts, labels, 10)
    for i in range(10):
        lacks = {(i + r) % 10 for r in range(missing)}
        assert set(np.flatnonzero(counts[i] == 0)) == lacks
    if 600 % (10 - missing) == 0:
        assert np.all(counts[counts > 0] == 600 // (10 - missing))
        assert len({p.size for p in parts}) == 1


def test_niid3_more_clients_than_classes_and_errors():
    labels = balanced(4, 120)
    parts = partition("niid3", labels, 6, 0, missing=1)
    counts = class_counts(parts, labels, 4)
    assert [int(np.flatnonzero(row == 0)[0]) for row in counts] == [0, 1, 2, 3, 0, 1]
    with pytest.raises(PartitionError, match="missing must be < number of classes"):
        partition("niid3", labels, 6, 0, missing=4)
    with pytest.raises(PartitionError, match="no client"):
        partition("niid3", labels, 2, 0, missing=2)


# --- grouped_dominant ---------------------------------------------------------------------


def test_grouped_dominant_fmnist_counts():
    labels = balanced(10, 7000)  # FMNIST train + test pooled, as FedReMa does
    parts = partition("grouped_dominant", labels, 20, 0, samples_per_client=600, s=0.2)
    groups = [[0, 1, 2], [2, 3, 4], [4, 5, 6], [6, 7, 8], [8, 9, 0]]
    counts = class_counts(parts, labels, 10)
    for k in range(20):
        expected = np.full(10, 12)
        expected[groups[k // 4]] += 160
        assert np.array_equal(counts[k], expected), k
    # no label wraps here (at most 8*160 + 20*12 = 1520 of 7000 used), so nothing repeats
    assert_disjoint(parts)


def test_grouped_dominant_wraps_only_when_exhausted():
    labels = balanced(10, 50)
    parts = partition("grouped_dominant", labels, 20, 0, samples_per_client=60, s=0.5)
    taken = np.concatenate(parts)
    for c in range(10):
        drawn = taken[labels[taken] == c]
        assert np.unique(drawn).size == min(drawn.size, 50)
    # A client's 3 + 10 draws of a label are consecutive pointer positions (13 < 50), so even
    # across a wrap no client holds a sample twice.
    assert all(np.unique(p).size == p.size for p in parts)


def test_grouped_dominant_remainders_and_groups():
    labels = balanced(4, 100)
    parts = partition("grouped_dominant", labels, 2, 0, samples_per_client=25, s=0.3,
                      groups=[[0, 1], [2, 3]])
    counts = class_counts(parts, labels, 4)
    # 7 IID -> 1,1,1,4 ; 18 dominant -> 9,9
    assert counts.tolist() == [[10, 10, 1, 4], [1, 1, 10, 13]]
    with pytest.raises(PartitionError, match="pass groups explicitly"):
        partition("grouped_dominant", labels, 2, 0)
    with pytest.raises(PartitionError, match="class ids"):
        partition("grouped_dominant", labels, 2, 0, groups=[[0, 9]])


# --- dirichlet_per_client -----------------------------------------------------------------


def test_dirichlet_per_client_follows_alpha_at_equal_sizes():
    """A huge alpha gives every client the pool's class mix (600 of each class here, up to
    multinomial noise: std 23); a tiny one gives each client (nearly) one class."""
    parts = partition("dirichlet_per_client", FMNIST, 10, 0, alpha=1e6)
    counts = class_counts(parts, FMNIST, 10)
    assert (counts.sum(axis=1) == 6000).all() and np.abs(counts - 600).max() < 150, counts
    skewed = np.repeat([0, 1], [8000, 2000])           # the mix is the pool's (Dir(alpha * p)), not uniform
    counts = class_counts(partition("dirichlet_per_client", skewed, 10, 0, alpha=1e6, samples_per_client=100),
                          skewed, 2)
    assert np.abs(counts[:, 1] - 20).max() <= 15, counts
    parts = partition("dirichlet_per_client", FMNIST, 100, 0, alpha=1e-3, samples_per_client=30)
    counts = class_counts(parts, FMNIST, 10)
    assert (counts.sum(axis=1) == 30).all()
    assert (counts.max(axis=1) >= 27).mean() >= 0.9, counts.max(axis=1)


def test_dirichlet_per_client_takes_what_is_left_when_its_classes_run_out():
    """Two classes of 3 samples, two clients of 3, one class each at a vanishing alpha: the first
    client takes a whole class; whichever class the second one draws, only the other is left."""
    labels = np.array([0, 1, 0, 1, 1, 0])
    for seed in range(8):
        a, b = partition("dirichlet_per_client", labels, 2, seed, alpha=1e-9)
        assert {tuple(labels[a]), tuple(labels[b])} == {(0, 0, 0), (1, 1, 1)}, seed


def test_dirichlet_per_client_serves_ten_thousand_small_clients():
    """Where `dirichlet` finds no partition without empty clients (10,000 clients of a 60,000 pool),
    every client gets its 6 samples, disjoint."""
    parts = partition("dirichlet_per_client", FMNIST, 10_000, 0, alpha=0.1)
    assert {p.size for p in parts} == {6}
    assert_disjoint(parts)
    with pytest.raises(PartitionError, match="dirichlet_per_client: 10001 clients x 6 samples need 60006, only "
                                             "60000 available"):
        partition("dirichlet_per_client", FMNIST, 10_001, 0, alpha=0.1, samples_per_client=6)


# --- quantity_skew ------------------------------------------------------------------------


def test_quantity_skew():
    parts = partition("quantity_skew", FMNIST, 10, 0, alpha=0.5, min_size=100)
    assert np.array_equal(np.sort(assert_disjoint(parts)), np.arange(FMNIST.size))
    sizes = np.array([p.size for p in parts])
    assert sizes.min() >= 100 and sizes.max() > 2 * sizes.min()
    counts = class_counts(parts, FMNIST, 10)
    big = sizes >= 1000
    shares = counts[big] / sizes[big, None]
    assert np.all(np.abs(shares - 0.1) < 0.03)  # labels stay ~uniform on every big client


# --- holdout_split / sample_like ----------------------------------------------------------


def test_holdout_split():
    rng = np.random.default_rng(0)
    idx = np.arange(100, 150)
    train, test = holdout_split(idx, 0.2, rng)
    assert test.size == 10 and train.size == 40
    assert np.intersect1d(train, test).size == 0
    assert np.array_equal(np.sort(np.concatenate([train, test])), idx)
    assert np.all(np.diff(train) > 0) and np.all(np.diff(test) > 0)
    assert holdout_split(np.array([3, 9]), 0.01, rng)[1].size == 1  # at least one
    assert holdout_split(np.array([3, 9]), 0.9, rng)[0].size == 1  # train never empty
    # repeated indices (sampling with replacement) never straddle train and test
    train, test = holdout_split(np.array([1, 1, 2, 3, 3, 3, 4, 5]), 0.4, rng)
    assert np.intersect1d(train, test).size == 0 and train.size + test.size <= 8
    with pytest.raises(PartitionError, match="test_fraction"):
        holdout_split(idx, 1.0, rng)


def test_sample_like_proportions_and_exclusion():
    rng = np.random.default_rng(0)
    pool = balanced(10, 1000, seed=5)  # e.g. the global test set
    train = np.repeat([0, 1, 2], [500, 300, 200])
    drawn = sample_like(train, pool, 100, 10, rng)
    assert drawn.size == 100 and np.unique(drawn).size == 100
    assert np.bincount(pool[drawn], minlength=10).tolist() == [50, 30, 20] + [0] * 7
    # largest remainder: 7 * (1/3, 1/3, 1/3) -> 3, 2, 2 (tie to the lower id)
    three = sample_like(np.array([0, 1, 2]), pool, 7, 10, rng)
    assert np.bincount(pool[three], minlength=3).tolist()[:3] == [3, 2, 2]
    again = sample_like(train, pool, 100, 10, rng, exclude=drawn)
    assert np.intersect1d(again, drawn).size == 0
    with pytest.raises(PartitionError, match="class 0"):
        sample_like(train, pool, 2001, 10, rng)


def test_sample_like_with_replacement_exceeds_a_class_and_leaves_the_default_draws_alone():
    # FedClassAvg's code draws each class's quota with replacement: a client of classes 0 and 1
    # (3:1) asks for 8 images, 6 of class 0, which the pool has only 2 of
    pool = np.array([0, 0, 1, 1, 1, 2])
    train = np.array([0, 0, 0, 1])
    with pytest.raises(PartitionError, match="need 6 samples of class 0 but the pool has only 2"):
        sample_like(train, pool, 8, 3, np.random.default_rng(0))
    drawn = sample_like(train, pool, 8, 3, np.random.default_rng(0), replace=True)
    assert np.bincount(pool[drawn], minlength=3).tolist() == [6, 2, 0]
    assert set(drawn[pool[drawn] == 0]) <= {0, 1} and np.unique(drawn).size < drawn.size
    with pytest.raises(PartitionError, match="need 2 samples of class 2 but the pool has only 0"):
        sample_like(np.array([2, 2]), pool, 2, 3, np.random.default_rng(0), replace=True, exclude=np.array([5]))
    # without replacement the draws are numpy's choice(replace=False), as before the option
    big = balanced(3, 50, seed=1)
    rng_a, rng_b = np.random.default_rng(4), np.random.default_rng(4)
    expected = np.sort(np.concatenate([rng_b.choice(np.flatnonzero(big == c), size=n, replace=False)
                                       for c, n in ((0, 5), (1, 5))]))
    assert np.array_equal(sample_like(np.array([0, 1]), big, 10, 3, rng_a), expected)


# --- dispatch errors ----------------------------------------------------------------------


def test_partition_dispatch_errors():
    with pytest.raises(PartitionError, match="nope") as err:
        partition("nope", FMNIST, 10, 0)
    assert "dirichlet" in str(err.value)  # lists the valid kinds
    with pytest.raises(PartitionError, match="beta") as err:
        partition("dirichlet", FMNIST, 10, 0, alpha=0.5, beta=1)
    assert "alpha" in str(err.value) and "min_size" in str(err.value)
    with pytest.raises(PartitionError, match="missing required parameter.*alpha"):
        partition("dirichlet", FMNIST, 10, 0)
    with pytest.raises(PartitionError, match="dirichlet: alpha must be > 0, got -1"):
        partition("dirichlet", FMNIST, 10, 0, alpha=-1)
    with pytest.raises(PartitionError, match="shards_per_client"):
        partition("shards", FMNIST, 10, 0, shards_per_client=1.5)
    with pytest.raises(PartitionError, match="num_clients"):
        partition("iid", FMNIST, 0, 0)
    with pytest.raises(PartitionError, match="integer dtype"):
        partition("iid", FMNIST.astype(float), 10, 0)


# --- pool_fraction (data.pool_fraction) ----------------------------------------------------


def test_pool_subset_keeps_the_fraction_of_every_class():
    from fedhet.data.federated import pool_subset

    labels = np.concatenate([np.full(1000, 0), np.full(300, 1), np.full(5, 2)])
    kept = pool_subset(labels, 0.2, np.random.default_rng(0))
    assert np.all(np.diff(kept) > 0)
    assert np.bincount(labels[kept]).tolist() == [200, 60, 1]
    again = pool_subset(labels, 0.2, np.random.default_rng(0))
    assert np.array_equal(kept, again)
    assert np.array_equal(pool_subset(labels, 1.0, np.random.default_rng(0)), np.arange(labels.size))
