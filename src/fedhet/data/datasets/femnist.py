"""FEMNIST as LEAF writes it: JSON files of per-writer samples, the writer kept per sample.

LEAF stores every pixel as a JSON float, so parsing is slow and holds each file's pixels as
Python floats (``benchmarks/results/leaf_loading.md``: 120,000 images, 754 MB of JSON, 26 s
to parse, 1.05 s from the cache). Each file is therefore parsed once into ``uint8`` pixels,
labels and its writers, and kept under ``~/.cache/fedhet/leaf/`` as an uncompressed ``.npz``
(785 bytes an image); later loads read that, as long as the JSON file's size and modification
time are those it was made from. A cache that cannot be written is said in a warning, and the
data is parsed again on the next load.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedhet.core.errors import DataError
from fedhet.data.datasets.catalogue import _INFO
from fedhet.data.datasets.image_data import ImageData, _check_labels, _make

_CACHE_FORMAT = 1          # raise when what a cache file holds changes: older ones are parsed again


def _find_femnist(name: str, d: Path, split: str) -> Path | None:
    for base in (d / "femnist", d / "femnist" / "data"):
        if (base / split).is_dir() and any((base / split).glob("*.json")):
            return base / split
    return None


def _expected_femnist(name: str, split: str) -> list[str]:
    return [f"femnist/{split}/*.json (LEAF format; femnist/data/{split}/*.json also accepted)"]


@dataclass(frozen=True)
class LeafFile:
    """One LEAF file: its writers in file order, how many images each holds, and those images'
    pixels (``uint8``, ``(n, 784)``) and labels (``int64``), writer after writer."""

    users: list[str]
    counts: np.ndarray
    pixels: np.ndarray
    labels: np.ndarray


def _leaf_cache_dir() -> Path:
    return Path.home() / ".cache" / "fedhet" / "leaf"


def _parse_leaf_file(path: Path) -> LeafFile:
    users, counts, pixels, labels = [], [], [], []
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        for user in doc["users"]:
            record = doc["user_data"][user]
            x = np.asarray(record["x"], dtype=np.float32)
            y = np.asarray(record["y"])
            if x.ndim != 2 or x.shape[1] != 28 * 28 or y.shape != (len(x),):
                raise DataError(f"{path}: user {user!r}: expected x of shape (n, 784) and n labels")
            if len(y) and not np.issubdtype(y.dtype, np.integer):
                raise DataError(f"{path}: user {user!r}: labels must be whole numbers, got {y.dtype}")
            if not np.isfinite(x).all():
                raise DataError(f"{path}: user {user!r}: {int((~np.isfinite(x)).sum())} pixel values are "
                                "NaN or infinite; they must lie in [0, 1]")
            if x.size and (x.min() < -1e-6 or x.max() > 1 + 1e-6):
                raise DataError(f"{path}: user {user!r}: FEMNIST pixel values must lie in [0, 1], found "
                                f"{x.min()}..{x.max()}")
            users.append(str(user))
            counts.append(len(y))
            pixels.append(np.rint(np.clip(x, 0.0, 1.0) * 255).astype(np.uint8))
            labels.append(y.astype(np.int64))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DataError(f"{path}: not a valid LEAF FEMNIST file ({type(exc).__name__}: {exc})") from exc
    return LeafFile(users, np.asarray(counts, dtype=np.int64),
                    np.concatenate(pixels) if pixels else np.zeros((0, 784), np.uint8),
                    np.concatenate(labels) if labels else np.zeros(0, np.int64))


def _cache_path(path: Path) -> Path:
    return _leaf_cache_dir() / f"{hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:32]}.npz"


def _cached(cache: Path, stat: os.stat_result, users_only: bool = False) -> LeafFile | None:
    """The cache's content while it was made from the file as it is now, else None; with
    ``users_only`` its writers alone (an .npz reads an array only when asked for it)."""
    try:
        with np.load(cache, allow_pickle=False) as z:
            if (int(z["format"]), int(z["size"]), int(z["mtime_ns"])) != (_CACHE_FORMAT, stat.st_size,
                                                                          stat.st_mtime_ns):
                return None
            users = [str(u) for u in z["users"]]
            if users_only:
                return LeafFile(users, np.zeros(0, np.int64), np.zeros((0, 784), np.uint8), np.zeros(0, np.int64))
            return LeafFile(users, z["counts"], z["pixels"], z["labels"])
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):   # none yet, or damaged: parse again
        return None


def _store(cache: Path, stat: os.stat_result, leaf: LeafFile, source: Path) -> None:
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache.parent, prefix=".leaf-", suffix=".npz")
        with os.fdopen(fd, "wb") as f:
            np.savez(f, format=_CACHE_FORMAT, size=stat.st_size, mtime_ns=stat.st_mtime_ns,
                     users=np.asarray(leaf.users, dtype=str), counts=leaf.counts, pixels=leaf.pixels,
                     labels=leaf.labels)
        os.replace(tmp, cache)     # write-then-rename: a concurrent run never reads half a file
    except OSError as exc:
        warnings.warn(f"{source} could not be kept parsed in {cache.parent} ({exc}); it is parsed again at "
                      "every load (make the folder writable, or set HOME to a writable folder)",
                      UserWarning, stacklevel=2)


def read_leaf_file(path: Path, users_only: bool = False) -> LeafFile:
    """``path`` parsed, from its cache when the file has not changed since (module docstring);
    with ``users_only``, read from a cache, its writers alone (the other split's, for their numbers)."""
    stat = path.stat()
    cache = _cache_path(path)
    leaf = _cached(cache, stat, users_only)
    if leaf is None:
        leaf = _parse_leaf_file(path)
        _store(cache, stat, leaf, path)
    return leaf


def _load_femnist(name: str, folder: Path, split: str, verify: bool) -> ImageData:
    """Load a LEAF FEMNIST split.

    Writer indices number the sorted union of the user names in this split's files and, if it
    sits next to it, the other split's files; so a writer has the same index in train and test.
    """
    files = [read_leaf_file(p) for p in sorted(folder.glob("*.json"))]
    other = folder.parent / ("test" if split == "train" else "train")
    users: set[str] = set()
    for path in sorted(other.glob("*.json")) if other.is_dir() else []:
        users.update(read_leaf_file(path, users_only=True).users)
    for leaf in files:
        users.update(leaf.users)
    writer_index = {user: i for i, user in enumerate(sorted(users))}
    y = np.concatenate([leaf.labels for leaf in files]) if files else np.zeros(0, np.int64)
    _check_labels(y, 0, _INFO[name].num_classes - 1, folder)
    writers = np.concatenate([np.repeat(np.array([writer_index[u] for u in leaf.users], dtype=np.int64), leaf.counts)
                              for leaf in files]) if files else np.zeros(0, np.int64)
    pixels = np.concatenate([leaf.pixels for leaf in files]) if files else np.zeros((0, 784), np.uint8)
    return _make(name, pixels.reshape(-1, 1, 28, 28), y, writers)
