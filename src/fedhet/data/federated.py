"""A federation: the in-memory data pools and every client's train and local-test indices.

Images stay in one compact uint8 tensor per pool; clients hold index tensors into it, so no
image is copied per client or per round.

Local test splits never share an image with any client's training split: ``holdout`` takes a
fraction of the client's own (unique) indices and then drops any index that some other client
trains on (possible with partitions that sample with replacement); ``test_set`` draws from the
global test set with the client's training label proportions.

A public set (``data.public``, KT-pFL's unlabelled transfer data) never shares an image with any
client's training or local-test split: it is drawn from the pool images that ``pool_fraction``
left out (``unsampled``), carved out of the pool before the partition (``holdout``), or taken from
another dataset of the same image shape (``dataset``).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from fedhet.core.contract import ClientData, normalize_uint8
from fedhet.core.errors import DataError, PartitionError
from fedhet.core.seeding import numpy_rng
from fedhet.data import partition as partitioners
from fedhet.data.datasets import ImageData, load_dataset, load_splits
from fedhet.data.local_test import LikeSampler


class PartitionSpec(Protocol):
    kind: str

    def options(self) -> dict[str, Any]: ...


class LocalTestSpec(Protocol):
    source: str
    fraction: float
    replace: bool                     # test_set: each class's share drawn with replacement


class PublicSpec(Protocol):
    source: str                       # "unsampled" | "holdout" | "dataset"
    size: int
    dataset: str | None
    classes: list[int] | None


class NormalizeSpec(Protocol):
    mean: list[float]
    std: list[float]


class DataSpec(Protocol):
    """What :func:`build_federation` reads (``experiment.config.DataConfig`` has these fields; the
    data layer does not import the config layer above it)."""

    dataset: str
    root: str | None
    download: bool
    verify: bool
    pool: str
    pool_fraction: float
    num_clients: int
    partition: PartitionSpec
    local_test: LocalTestSpec
    public: PublicSpec | None
    normalize: NormalizeSpec | None


@dataclass
class Federation:
    dataset: str
    num_classes: int
    in_channels: int
    image_size: int
    pool: ImageData                   # training pool (train split, or train+test when pooled)
    test: ImageData | None            # balanced global test set (None when pooled)
    train_idx: list[torch.Tensor]     # per client, into pool
    test_idx: list[torch.Tensor]      # per client, into test_source(cid)
    local_test_source: str            # "holdout" (indices into pool) or "test_set"
    mean: torch.Tensor
    std: torch.Tensor
    public: torch.Tensor | None = None   # uint8 unlabelled public images (data.public), or None
    _train_counts: np.ndarray | None = field(default=None, init=False, repr=False)
    _client_sizes: dict[int, int] | None = field(default=None, init=False, repr=False)
    _moments_on: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, init=False, repr=False)

    @property
    def num_clients(self) -> int:
        return len(self.train_idx)

    def client_data(self, cid: int) -> ClientData:
        return ClientData(self.pool.x, self.pool.y, self.train_idx[cid], self.mean, self.std, self.public)

    def local_test(self, cid: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(uint8 images, labels) of client ``cid``'s local test split."""
        src = self.pool if self.local_test_source == "holdout" else self.test
        idx = self.test_idx[cid]
        return src.x[idx], src.y[idx]

    def client_sizes(self) -> dict[int, int]:
        """``{client: training-set size}``, a new dict each call (the round loop hands one to every
        round's context); the sizes are counted once, the splits never change."""
        if self._client_sizes is None:
            self._client_sizes = {c: len(t) for c, t in enumerate(self.train_idx)}
        return dict(self._client_sizes)

    def train_counts(self) -> np.ndarray:
        """(clients, classes) training label counts (computed once; the splits never change)."""
        if self._train_counts is None:
            self._train_counts = partitioners.class_counts([i.numpy() for i in self.train_idx], self.pool.y.numpy(),
                                                           self.num_classes)
        return self._train_counts

    def test_counts(self) -> np.ndarray:
        src = self.pool if self.local_test_source == "holdout" else self.test
        return partitioners.class_counts([i.numpy() for i in self.test_idx], src.y.numpy(), self.num_classes)

    def fingerprint(self) -> dict[str, str]:
        """sha256 digests of what the federation is built from: ``data`` (the pool's, the global test
        set's and the public images and labels, as loaded) and ``partition`` (each client's train and
        local-test indices and their source). Whole numbers and bytes only, so equal on every machine
        and device; a resume compares them with its checkpoint's (a dataset file, a user's data or
        partition function changed since)."""
        import hashlib

        def digest(parts: list[torch.Tensor | None], word: str = "") -> str:
            h = hashlib.sha256(word.encode())
            for t in parts:
                h.update(b"-" if t is None else f"{tuple(t.shape)}{t.dtype}".encode())
                if t is not None:
                    h.update(t.detach().cpu().contiguous().numpy())      # its buffer: no copy of the pool
            return h.hexdigest()

        test = [self.test.x, self.test.y] if self.test is not None else [None, None]
        indices = [i.to(torch.int64) for pair in zip(self.train_idx, self.test_idx) for i in pair]
        return {"data": digest([self.pool.x, self.pool.y, *test, self.public]),
                "partition": digest(indices, self.local_test_source)}

    def normalize(self, x_uint8: torch.Tensor) -> torch.Tensor:
        """Normalised float inputs, computed on ``x_uint8``'s device (evaluation on a GPU)."""
        if x_uint8.device == self.mean.device:
            return normalize_uint8(x_uint8, self.mean, self.std)
        key = str(x_uint8.device)
        if key not in self._moments_on:
            self._moments_on[key] = (self.mean.to(x_uint8.device), self.std.to(x_uint8.device))
        return normalize_uint8(x_uint8, *self._moments_on[key])


def _concat(a: ImageData, b: ImageData) -> ImageData:
    # writers number the union of both splits' writers (the loaders that give them do), so they carry over
    writers = None if a.writers is None or b.writers is None else np.concatenate([a.writers, b.writers])
    return ImageData(torch.cat([a.x, b.x]), torch.cat([a.y, b.y]), a.num_classes, a.mean, a.std, writers, a.name)


def _subset(data: ImageData, idx: np.ndarray) -> ImageData:
    at = torch.as_tensor(idx, dtype=torch.long)
    return ImageData(data.x[at], data.y[at], data.num_classes, data.mean, data.std,
                     None if data.writers is None else data.writers[idx], data.name)


def build_federation(cfg: DataSpec, seed: int) -> Federation:
    root = Path(cfg.root).expanduser() if cfg.root is not None else None
    if root is not None and (root.is_file() or (not root.exists() and not cfg.download)):
        raise DataError(f"data.root {cfg.root} is not a folder (working directory {Path.cwd()}): fix the path, "
                        "drop data.root to search $FEDHET_DATA, ~/.cache/fedhet/data and the system's dataset folders, "
                        "or set data.download: true to download into it")
    train, test = load_splits(cfg.dataset, cfg.root, download=cfg.download, verify=cfg.verify)
    if tuple(test.x.shape[1:]) != tuple(train.x.shape[1:]):
        raise DataError(f"data.dataset {cfg.dataset}: the test images are {tuple(test.x.shape[1:])} (channels, height, "
                        f"width), the training images {tuple(train.x.shape[1:])}; give both splits one shape")
    pool, global_test = (train, test) if cfg.pool == "train" else (_concat(train, test), None)
    labels = pool.y.numpy()
    k = cfg.num_clients

    options = cfg.partition.options()
    public_spec = getattr(cfg, "public", None)
    public: torch.Tensor | None = None
    if cfg.partition.kind == "natural":
        if cfg.pool_fraction < 1:
            raise PartitionError("data.pool_fraction < 1 would split writers of the natural partition; use 1")
        if public_spec is not None and public_spec.source != "dataset":
            raise PartitionError("data.public.source must be 'dataset' with the natural partition (carving images "
                                 "out of the pool would split writers)")
        if pool.writers is None:
            fix = ("use data.pool: train (the test split has no writers, so train+test has none)"
                   if train.writers is not None else "give the data them, or choose another data.partition.kind")
            raise PartitionError(f"partition 'natural' needs data with natural clients ({partitioners.WRITERS_SOURCES}), "
                                 f"and {pool.name} has none in this pool: {fix}")
        test_writers = _natural_options(options)
        among = np.unique(pool.writers)
        if test_writers:
            held = _held_out_writers(among, test_writers)
            global_test = _subset(pool, np.flatnonzero(np.isin(pool.writers, held)))
            among = np.setdiff1d(among, held)
        parts = _natural_partition(pool, k, numpy_rng(seed, "partition"), among)
        seen = len(labels)               # the images the partition split (for the errors below)
    else:
        available = np.arange(len(labels))
        if public_spec is not None and public_spec.source == "holdout":
            held = stratified_draw(labels, available, public_spec.size, numpy_rng(seed, "public"), "holdout")
            public = pool.x[torch.as_tensor(held)]
            available = np.setdiff1d(available, held)
        kept = available[pool_subset(labels[available], cfg.pool_fraction, numpy_rng(seed, "pool_subset"))]
        if public_spec is not None and public_spec.source == "unsampled":
            left_out = np.setdiff1d(available, kept)
            held = stratified_draw(labels, left_out, public_spec.size, numpy_rng(seed, "public"), "unsampled")
            public = pool.x[torch.as_tensor(held)]
        partition_seed = int(numpy_rng(seed, "partition").integers(2**31))

        def writers_of(idx: np.ndarray) -> np.ndarray | None:
            return None if pool.writers is None else pool.writers[idx]

        try:
            parts = partitioners.partition(cfg.partition.kind, labels[kept], k, seed=partition_seed,
                                           sample_writers=writers_of(kept), **options)
        except PartitionError as e:
            # name data.pool_fraction only where it is the cause: the whole pool would partition
            hint = ""
            if cfg.pool_fraction < 1:
                try:
                    partitioners.partition(cfg.partition.kind, labels[available], k, seed=partition_seed,
                                           sample_writers=writers_of(available), **options)
                    hint = _pool_hint(cfg, len(kept), k)
                except PartitionError:
                    pass
            raise PartitionError(f"{e}{hint}") from None
        parts = [kept[p] for p in parts]
        seen = len(kept)

    rng = numpy_rng(seed, "local_test")
    train_idx, test_idx, held_out = [], [], []
    if cfg.local_test.source == "holdout":
        # Membership through pool-sized masks, not np.isin per client: linear in the clients' sizes,
        # so 10,000 clients cost a few passes over their indices, not 10,000 sorts of the pool.
        in_train = np.zeros(len(labels), dtype=bool)
        for part in parts:
            tr, te = partitioners.holdout_split(np.unique(part), cfg.local_test.fraction, rng)
            in_train[tr] = True
            train_idx.append(part[in_train[part]])  # duplicates drawn with replacement stay with their image's side
            in_train[tr] = False
            test_idx.append(te)
        trained = np.zeros(len(labels), dtype=bool)
        trained[np.concatenate(train_idx)] = True
        held_out = [len(te) for te in test_idx]
        test_idx = [te[~trained[te]] for te in test_idx]      # never an image some client trains on
    else:
        test_labels = global_test.y.numpy()
        like: LikeSampler | None = None      # sample_like, the test set split by class once
        for cid, part in enumerate(parts):
            if len(part) == 0:
                raise PartitionError(f"client {cid} received no training samples from partition "
                                     f"{cfg.partition.kind!r}; use fewer clients or another partition (for "
                                     f"dirichlet, a min_size of at least 1){_pool_hint(cfg, seen, k)}")
            size = max(1, round(cfg.local_test.fraction * len(part)))
            try:
                if like is None:
                    like = LikeSampler(test_labels, train.num_classes)
                test_idx.append(like(labels[part], size, rng, replace=cfg.local_test.replace))
            except PartitionError as e:
                raise PartitionError(
                    f"data.local_test (source test_set, fraction {cfg.local_test.fraction}): client {cid}'s local "
                    f"test split of {size} images with its label proportions cannot be drawn from the global "
                    f"test set ({str(e).removeprefix('sample_like: ')}); lower data.local_test.fraction, "
                    + ("" if cfg.local_test.replace else "draw with replacement as FedClassAvg's code does "
                       "(data.local_test.replace: true), ")
                    + f"or use data.local_test.source: holdout{_pool_hint(cfg, seen, k)}") from None
            train_idx.append(part)
    for cid, (tr, te) in enumerate(zip(train_idx, test_idx)):
        if len(tr) == 0:
            why = "from partition" if not len(parts[cid]) else "once its local test images were held out, of"
            raise PartitionError(f"client {cid} received no training samples {why} {cfg.partition.kind!r}; use "
                                 f"fewer clients or another partition{_pool_hint(cfg, seen, k)}")
        if len(te) == 0 and cfg.local_test.source == "holdout" and held_out[cid]:
            given = sum(len(p) for p in parts)
            over = (f"; the partition gave the {k} clients {given:,} images of a pool of {seen:,}, so most of its "
                    "images went to several clients: use fewer clients, or fewer images a client"
                    if given > seen else "")
            raise PartitionError(f"client {cid} has an empty local test split: the {held_out[cid]} image(s) held out "
                                 "of its data are all in other clients' training data (this partition gives images "
                                 "to more than one client), and a test image is never one some client trains on; "
                                 "give clients images of their own, or use data.local_test.source: test_set" + over)
        if len(te) == 0:
            raise PartitionError(f"client {cid} has an empty local test split (fraction {cfg.local_test.fraction} "
                                 f"of {len(tr)} samples); raise data.local_test.fraction or give clients more data"
                                 f"{_pool_hint(cfg, len(np.unique(np.concatenate(parts))), k)}")
    if held_out and sum(held_out) > 2 * sum(len(te) for te in test_idx):
        # most held-out images are also other clients' training images (a partition that shares
        # images, or draws with replacement): the personal metrics rest on the few left
        sizes = [len(te) for te in test_idx]
        warnings.warn(f"data.local_test (holdout, fraction {cfg.local_test.fraction}): {sum(held_out) - sum(sizes)} "
                      f"of the {sum(held_out)} images held out for the clients' local tests are images other "
                      f"clients train on, so they were left out; the local tests hold {sum(sizes)} images (median "
                      f"{int(np.median(sizes))} a client), and personal metrics rest on them. Give clients images of "
                      "their own (e.g. a smaller samples_per_client), or use data.local_test.source: test_set",
                      UserWarning, stacklevel=2)

    c = train.x.shape[1]
    mean, std = train.mean, train.std
    if cfg.normalize is not None:
        mean, std = tuple(cfg.normalize.mean), tuple(cfg.normalize.std)
        if len(mean) != c or len(std) != c:
            raise DataError(f"data.normalize gives {len(mean)} mean and {len(std)} std values for {c} channel(s) "
                            f"of {cfg.dataset}: give one value per channel")
    if public_spec is not None and public_spec.source == "dataset":
        public = _public_from_dataset(public_spec, cfg, train, seed)
    return Federation(
        dataset=cfg.dataset, num_classes=train.num_classes, in_channels=c, image_size=train.x.shape[-1],
        pool=pool, test=global_test,
        train_idx=[torch.as_tensor(np.sort(t), dtype=torch.long) for t in train_idx],
        test_idx=[torch.as_tensor(np.sort(t), dtype=torch.long) for t in test_idx],
        local_test_source=cfg.local_test.source,
        mean=torch.tensor(mean, dtype=torch.float32).view(1, c, 1, 1),
        std=torch.tensor(std, dtype=torch.float32).view(1, c, 1, 1),
        public=public,
    )


def _pool_hint(cfg: DataSpec, pool_size: int, clients: int) -> str:
    """The cause to name when a split cannot be made from a pool that data.pool_fraction cut down."""
    if cfg.pool_fraction >= 1:
        return ""
    return (f"; data.pool_fraction {cfg.pool_fraction} keeps {pool_size} images for {clients} clients "
            f"(about {pool_size // max(clients, 1)} each): raise it, or use fewer clients")


def stratified_draw(labels: np.ndarray, among: np.ndarray, size: int, rng: np.random.Generator, source: str) -> np.ndarray:
    """Sorted ``size`` indices drawn without replacement from ``among``, keeping the label
    proportions of ``among`` (largest remainders get the leftover slots)."""
    if size > len(among):
        hint = ("lower data.pool_fraction (the public set is drawn from the images it leaves out)"
                if source == "unsampled" else "the pool is too small")
        raise PartitionError(f"data.public.size={size} but only {len(among)} images are available for source "
                             f"{source!r}; lower data.public.size or {hint}")
    classes, counts = np.unique(labels[among], return_counts=True)
    exact = counts * size / len(among)
    quota = np.floor(exact).astype(int)
    for i in np.argsort(-(exact - quota), kind="stable")[: size - int(quota.sum())]:
        quota[i] += 1
    drawn = [rng.choice(among[labels[among] == c], size=q, replace=False) for c, q in zip(classes, quota) if q]
    return np.sort(np.concatenate(drawn)) if drawn else np.zeros(0, dtype=np.int64)


def _public_from_dataset(spec: PublicSpec, cfg: DataSpec, train: ImageData, seed: int) -> torch.Tensor:
    """``spec.size`` random train-split images of dataset ``spec.dataset`` (of ``spec.classes``
    only when given), which must have the private data's image shape."""
    if not spec.dataset:
        raise PartitionError("data.public.source 'dataset' needs data.public.dataset (e.g. mnist for the MNIST "
                             "family, cifar100 for CIFAR-10, as KT-pFL)")
    if spec.dataset == cfg.dataset:
        # its train split is the clients' pool: the public set would share their images
        raise PartitionError(f"data.public.dataset is the private dataset {cfg.dataset}, whose train split the "
                             f"clients hold; use data.public.source 'unsampled' (images the pool leaves out) or "
                             f"another dataset")
    other = load_dataset(spec.dataset, cfg.root, train=True, download=cfg.download, verify=cfg.verify)
    if tuple(other.x.shape[1:]) != tuple(train.x.shape[1:]):
        raise PartitionError(f"data.public.dataset {spec.dataset} has images of shape {tuple(other.x.shape[1:])}, "
                             f"the private data {cfg.dataset} {tuple(train.x.shape[1:])}; choose a dataset of the "
                             f"same shape")
    labels = other.y.numpy()
    among = np.arange(len(labels))
    if spec.classes is not None:
        bad = sorted(set(spec.classes) - set(range(other.num_classes)))
        if bad:
            raise PartitionError(f"data.public.classes {bad} are not classes of {spec.dataset} "
                                 f"(0..{other.num_classes - 1})")
        among = np.flatnonzero(np.isin(labels, spec.classes))
    if spec.size > len(among):
        raise PartitionError(f"data.public.size={spec.size} but {spec.dataset} has only {len(among)} such images; "
                             f"lower data.public.size")
    chosen = np.sort(numpy_rng(seed, "public").choice(among, size=spec.size, replace=False))
    return other.x[torch.as_tensor(chosen)]


def pool_subset(labels: np.ndarray, fraction: float, rng: np.random.Generator) -> np.ndarray:
    """Sorted pool indices keeping ``round(fraction * n_c)`` (at least 1) random samples of every
    class c; all indices when ``fraction`` is 1."""
    if fraction >= 1:
        return np.arange(len(labels))
    keep = []
    for c in np.unique(labels):
        idx = np.flatnonzero(labels == c)
        keep.append(rng.choice(idx, size=max(1, round(fraction * len(idx))), replace=False))
    return np.sort(np.concatenate(keep))


NATURAL_OPTIONS = {"test_writers": "the fraction of the pool's writers whose images are the global test set, "
                                   "e.g. 0.1, in place of the dataset's test split (data.pool: train+test puts "
                                   "both splits' images into the pool)"}


def _natural_options(options: dict[str, Any]) -> float:
    """``test_writers`` of a natural partition's options (0 when not given); anything else is refused."""
    unknown = sorted(set(options) - set(NATURAL_OPTIONS))
    if unknown:
        raise PartitionError(f"data.partition.kind 'natural' takes no option {', '.join(map(repr, unknown))}; its "
                             "options: " + "; ".join(f"{k} ({v})" for k, v in NATURAL_OPTIONS.items()))
    fraction = options.get("test_writers", 0)
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction < 1:
        raise PartitionError(f"data.partition.test_writers must be a fraction in [0, 1) of the writers to hold out "
                             f"as the global test set, got {fraction!r}")
    return float(fraction)


def _held_out_writers(writers: np.ndarray, fraction: float) -> np.ndarray:
    """``round(fraction * len(writers))`` writers (at least one), a draw of their own seed: the
    same writers whatever the run's seed, as a dataset's fixed test split is."""
    count = max(1, round(fraction * len(writers)))
    if count >= len(writers):
        raise PartitionError(f"data.partition.test_writers={fraction} holds out {count} of the data's {len(writers)} "
                             "writers and leaves none to train: lower it")
    return np.sort(numpy_rng(0, "test_writers").choice(writers, size=count, replace=False))


def _natural_partition(pool: ImageData, k: int, rng: np.random.Generator,
                       writers: np.ndarray | None = None) -> list[np.ndarray]:
    """One client per writer (FEMNIST) among ``writers`` (default: all of the pool's); ``k``
    writers chosen at random when there are more."""
    assert pool.writers is not None             # build_federation says how to give data its writers
    writers = np.unique(pool.writers) if writers is None else writers
    if k > len(writers):
        raise PartitionError(f"partition 'natural': {k} clients requested but the data has {len(writers)} writers "
                             "(its natural clients: FEMNIST's writers, or the client ids of data of one's own)"
                             + (" once data.partition.test_writers are held out" if len(writers) < len(
                                 np.unique(pool.writers)) else "") + "; lower data.num_clients")
    chosen = np.sort(rng.choice(writers, size=k, replace=False))
    # One stable sort, not a scan of the pool per writer: each writer's indices, increasing.
    order = np.argsort(pool.writers, kind="stable")
    by_writer = pool.writers[order]
    starts, ends = np.searchsorted(by_writer, chosen, "left"), np.searchsorted(by_writer, chosen, "right")
    return [order[s:e] for s, e in zip(starts, ends)]
