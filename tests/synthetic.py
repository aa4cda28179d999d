"""A small learnable dataset written in the real Fashion-MNIST IDX format, for end-to-end tests.

Class c lights up a distinct 7x7 block of the 28x28 image (plus noise), so a CNN learns it in a
few steps; the files go through fedhet's real IDX parser.
"""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np


def _images(labels: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    x = rng.integers(0, 60, size=(len(labels), 28, 28), dtype=np.uint8)
    for i, c in enumerate(labels):
        r, col = divmod(int(c), 4)
        x[i, r * 7:(r + 1) * 7, col * 7:(col + 1) * 7] = 200
    return x


def _write_idx(path: Path, array: np.ndarray) -> None:
    magic = 2051 if array.ndim == 3 else 2049
    header = struct.pack(">I", magic) + b"".join(struct.pack(">I", d) for d in array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


def write_fashion_mnist(root: Path, n_train: int = 1200, n_test: int = 300, seed: int = 0) -> Path:
    """Write train/t10k IDX .gz files under root/fashion_mnist; returns root."""
    rng = np.random.default_rng(seed)
    d = Path(root) / "fashion_mnist"
    d.mkdir(parents=True, exist_ok=True)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        y = np.arange(n) % 10
        rng.shuffle(y)
        _write_idx(d / f"{prefix}-images-idx3-ubyte.gz", _images(y, rng))
        _write_idx(d / f"{prefix}-labels-idx1-ubyte.gz", y)
    return Path(root)
