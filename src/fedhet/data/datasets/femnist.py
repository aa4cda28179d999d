"""FEMNIST as LEAF writes it: JSON files of per-writer samples, the writer kept per sample."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from fedhet.core.errors import DataError
from fedhet.data.datasets.catalogue import _INFO
from fedhet.data.datasets.image_data import ImageData, _check_labels, _make


def _find_femnist(name: str, d: Path, split: str) -> Path | None:
    for base in (d / "femnist", d / "femnist" / "data"):
        if (base / split).is_dir() and any((base / split).glob("*.json")):
            return base / split
    return None


def _expected_femnist(name: str, split: str) -> list[str]:
    return [f"femnist/{split}/*.json (LEAF format; femnist/data/{split}/*.json also accepted)"]


def _leaf_user_names(path: Path) -> list[str]:
    """Read only the ``"users"`` list of a LEAF file, skipping the (large) pixel data."""
    text = path.read_text(encoding="utf-8")
    match = re.search(r'"users"\s*:\s*', text)
    try:
        users = json.JSONDecoder().raw_decode(text, match.end())[0] if match else None
    except ValueError:
        users = None
    if not isinstance(users, list) or not all(isinstance(u, str) for u in users):
        raise DataError(f"{path}: not a LEAF file (no \"users\" list of names)")
    return users


def _load_femnist(name: str, folder: Path, split: str, verify: bool) -> ImageData:
    """Load a LEAF FEMNIST split.

    Writer indices number the sorted union of the user names in this split's files and, if it
    sits next to it, the other split's files; so a writer has the same index in train and test.
    """
    files = sorted(folder.glob("*.json"))
    other = folder.parent / ("test" if split == "train" else "train")
    users: set[str] = set()
    for path in sorted(other.glob("*.json")) if other.is_dir() else []:
        users.update(_leaf_user_names(path))
    xs, ys, owners = [], [], []
    for path in files:
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
                y = y.astype(np.int64)
                xs.append(x)
                ys.append(y)
                owners.append((user, len(y)))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise DataError(f"{path}: not a valid LEAF FEMNIST file ({type(exc).__name__}: {exc})") from exc
    users.update(user for user, _ in owners)
    writer_index = {user: i for i, user in enumerate(sorted(users))}
    x = np.concatenate(xs) if xs else np.zeros((0, 784), np.float32)
    if x.size and (x.min() < -1e-6 or x.max() > 1 + 1e-6):
        raise DataError(f"{folder}: FEMNIST pixel values must lie in [0, 1], found {x.min()}..{x.max()}")
    y = np.concatenate(ys) if ys else np.zeros(0, np.int64)
    _check_labels(y, 0, _INFO[name].num_classes - 1, folder)
    writers = np.repeat(np.array([writer_index[u] for u, _ in owners], dtype=np.int64), [n for _, n in owners])
    pixels = np.rint(np.clip(x, 0.0, 1.0) * 255).astype(np.uint8).reshape(-1, 1, 28, 28)
    return _make(name, pixels, y, writers)
