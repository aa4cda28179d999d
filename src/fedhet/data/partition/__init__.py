"""Deterministic label-skew partitioners for federated datasets: :func:`partition` runs one by name
(a built-in kind of :data:`PARTITIONS` or a ``MODULE:FUNCTION`` of one's own).

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

The built-in kinds: :mod:`.standard` (the FL benchmarks' IID, Dirichlet, shards and quantity
skew) and :mod:`.papers` (those the methods' papers define); :mod:`.holdout` holds a client's own
test share out.
"""

from __future__ import annotations

import inspect
import numbers
from collections.abc import Callable
from typing import Any

import numpy as np

from fedhet.core.errors import PartitionError
from fedhet.core.plugins import describe, is_import_path, load_object
from fedhet.core.suggest import did_you_mean
from fedhet.data.checks import check_labels
from fedhet.data.partition.holdout import holdout_split
from fedhet.data.partition.papers import classes_per_client, grouped_dominant, niid2, niid3
from fedhet.data.partition.standard import dirichlet, dirichlet_per_client, iid, quantity_skew, shards

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


# Where a pool's natural clients (writers) come from, for the errors of a partition that needs them.
WRITERS_SOURCES = ("femnist's writers, or the client ids of data of your own: clients_train in an npz file, "
                   "(x, y, client_ids) from a function (docs/extending.md)")


def partition(
    kind: str, labels: np.ndarray, num_clients: int, seed: int, *, sample_writers: np.ndarray | None = None,
    **params: Any
) -> list[np.ndarray]:
    """Split ``labels``' indices among ``num_clients`` clients with partitioner ``kind``.

    ``params`` are checked against the partitioner's signature before anything runs. A function
    of one's own with a parameter named ``writers`` gets ``sample_writers``, each sample's natural
    client numbered from 0 (FEMNIST's writers, the ``clients_train`` ids of data of one's own
    renumbered), as the built-in ``natural`` partition uses them; it is refused when the data has none. Returns one sorted int64 index array
    per client; the same (kind, labels, num_clients, seed, params) always gives the same arrays.
    """
    if is_import_path(kind):
        fn = _user_partitioner(kind)
    elif kind not in PARTITIONS:
        raise PartitionError(
            f"unknown partition kind {kind!r}{did_you_mean(kind, [*PARTITIONS, 'natural'])}; valid kinds: "
            f"{', '.join(sorted(PARTITIONS))}, natural; one of your own: "
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
    # after labels, n, rng: the named parameters (a **params of a user's function takes any others);
    # ``writers`` is the data's to give, not the config's
    takes_writers = is_import_path(kind) and any(
        p.name == "writers" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) for p in signature[3:])
    if takes_writers and "writers" in params:
        raise PartitionError(f"data.partition.kind {kind!r}: writers is not a parameter to set; fedhet passes each "
                             "sample's natural client (the data's writers or clients_train) there")
    if takes_writers and sample_writers is None:
        raise PartitionError(f"data.partition.kind {kind!r} takes writers, each sample's natural client "
                             f"({WRITERS_SOURCES}), and this pool has none (with data.pool: train+test, both "
                             "splits must have them, and clients_train gives the training split's only)")
    accepted = [p for p in signature[3:] if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
                and not (takes_writers and p.name == "writers")]
    takes_any = any(p.kind == p.VAR_KEYWORD for p in signature)
    names = [p.name for p in accepted]
    listing = ", ".join(names) + (", and any other" if takes_any else "") if names or takes_any else "none"
    unknown = [] if takes_any else sorted(set(params) - set(names))
    if unknown:
        raise PartitionError(
            f"partition {kind!r}: unknown parameter(s) {', '.join(unknown)}; accepted: {listing} (another kind's "
            "parameters stay when only data.partition.kind changes: give the whole section, e.g. --set "
            f"'data.partition={{kind: {kind}, ...}}')"
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
    given = {**params, "writers": sample_writers} if takes_writers else params
    try:       # the call's shape is checked here, so an error raised inside the function keeps its traceback
        inspect.signature(fn).bind(labels, num_clients, rng, **given)
    except TypeError as e:
        raise PartitionError(f"data.partition.kind {kind!r} could not be called as (labels, num_clients, rng, "
                             f"**params): {e}") from None
    parts = fn(labels, num_clients, rng, **given)
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
    labels = check_labels(labels)
    if int(labels.max()) >= num_classes:
        raise PartitionError(
            f"class_counts: label {int(labels.max())} does not fit num_classes={num_classes}"
        )
    out = np.zeros((len(parts), num_classes), dtype=np.int64)
    for j, idx in enumerate(parts):
        out[j] = np.bincount(labels[np.asarray(idx, dtype=np.int64)], minlength=num_classes)
    return out
