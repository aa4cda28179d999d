"""The MNIST family (fashion_mnist, mnist, emnist_letters): IDX files, raw or ``.gz``."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from fedhet.core.errors import DataError
from fedhet.data.datasets.catalogue import _INFO
from fedhet.data.datasets.checksums import _read_content, _verify_md5
from fedhet.data.datasets.image_data import ImageData, _check_labels, _make

_IDX_FILES: dict[str, dict[str, tuple[str, str]]] = {
    "fashion_mnist": {
        "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
        "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
    },
    "emnist_letters": {
        "train": ("emnist-letters-train-images-idx3-ubyte", "emnist-letters-train-labels-idx1-ubyte"),
        "test": ("emnist-letters-test-images-idx3-ubyte", "emnist-letters-test-labels-idx1-ubyte"),
    },
}
_IDX_FILES["mnist"] = _IDX_FILES["fashion_mnist"]

_IDX_IMAGES, _IDX_LABELS = 2051, 2049  # magic: 0x08 (ubyte) << 8 | number of dimensions


def _find_idx(name: str, d: Path, split: str) -> tuple[Path, Path] | None:
    found = []
    for base in _IDX_FILES[name][split]:
        # The raw file is preferred: it needs no decompression.
        path = next((p for p in (d / base, d / f"{base}.gz") if p.is_file()), None)
        if path is None:
            return None
        found.append(path)
    return found[0], found[1]


def _expected_idx(name: str, split: str) -> list[str]:
    return [f"{f} (or {f}.gz)" for f in _IDX_FILES[name][split]]


def _parse_idx(content: bytes, path: Path, magic: int) -> np.ndarray:
    ndim = magic & 0xFF
    header = 4 + 4 * ndim
    kind = "images" if magic == _IDX_IMAGES else "labels"
    if len(content) < header:
        raise DataError(f"{path}: truncated IDX file ({len(content)} bytes, header alone needs {header})")
    found = struct.unpack_from(">I", content)[0]
    if found != magic:
        raise DataError(f"{path}: not an IDX {kind} file (magic number {found}, expected {magic})")
    dims = struct.unpack_from(f">{ndim}I", content, 4)
    size = header + int(np.prod(dims, dtype=np.int64))
    if len(content) != size:
        problem = "truncated" if len(content) < size else "has trailing bytes"
        raise DataError(f"{path}: IDX file {problem}: header {dims} needs {size} bytes, file has {len(content)}")
    return np.frombuffer(content, dtype=np.uint8, offset=header).reshape(dims)


def _load_idx(name: str, paths: tuple[Path, Path], split: str, verify: bool) -> ImageData:
    info = _INFO[name]
    image_path, label_path = paths
    arrays = []
    for path, magic in ((image_path, _IDX_IMAGES), (label_path, _IDX_LABELS)):
        content = _read_content(path)
        if verify:
            _verify_md5(name, path, content)
        arrays.append(_parse_idx(content, path, magic))
    x, y = arrays
    if x.shape[1:] != (info.image_size, info.image_size):
        raise DataError(f"{image_path}: images are {x.shape[1]}x{x.shape[2]}, expected {info.image_size}x{info.image_size}")
    if len(x) != len(y):
        raise DataError(f"{image_path} has {len(x)} images but {label_path} has {len(y)} labels")
    y = y.astype(np.int64)
    if name == "emnist_letters":
        x = x.transpose(0, 2, 1)  # EMNIST stores images column-major; transpose to upright
        _check_labels(y, 1, info.num_classes, label_path)
        y -= 1  # letters are labelled 1..26
    else:
        _check_labels(y, 0, info.num_classes - 1, label_path)
    # The copy makes the array writable and owned (frombuffer views read-only bytes).
    return _make(name, x[:, None].copy(), y)
