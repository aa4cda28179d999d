"""Loaders for the image datasets fedhet trains on, read from their official on-disk formats.

Every loader returns an :class:`ImageData`: the whole split as one compact ``uint8`` tensor of
shape ``(N, C, H, W)`` plus ``int64`` labels, so partitioning and batching never touch per-sample
Python objects.  Formats are parsed here with numpy/struct/gzip/pickle/json; the image-folder
datasets (CINIC-10, Tiny-ImageNet) additionally need Pillow to decode PNG/JPEG files.

Where files are looked for (first hit wins, see :func:`data_search_dirs`)::

    <root>/<name>, <root>, $FEDHET_DATA/<name>, ~/.cache/fedhet/data/<name>
    (+ /usr/share/datasets/fashion-mnist for fashion_mnist, Debian's dataset-fashion-mnist)

Expected layout inside such a directory:

=================  ===========================================================================
fashion_mnist,     ``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``,
mnist              ``t10k-images-idx3-ubyte``, ``t10k-labels-idx1-ubyte`` (each raw or ``.gz``)
emnist_letters     ``emnist-letters-{train,test}-{images-idx3,labels-idx1}-ubyte`` (raw or ``.gz``)
cifar10            ``cifar-10-batches-py/{data_batch_1..5,test_batch}`` or
                   ``cifar-10-python.tar.gz`` (extracted next to itself on first use)
cifar100           ``cifar-100-python/{train,test}`` or ``cifar-100-python.tar.gz``
cinic10            ``cinic-10/{train,test}/<class>/*.png``
tiny_imagenet      ``tiny-imagenet-200/train/<wnid>/images/*.JPEG``,
                   ``tiny-imagenet-200/val/images/*.JPEG`` + ``val/val_annotations.txt``
femnist            ``femnist/{train,test}/*.json`` (or ``femnist/data/{train,test}``, LEAF's layout)
=================  ===========================================================================

Integrity: files with a known official checksum are md5-verified (for ``.gz`` files the md5 of the
decompressed content, so a recompressed archive still verifies).  Results are cached by path,
size and mtime in ``~/.cache/fedhet/verified-md5.json`` (and in memory when that is not
writable), so repeated loads do not re-hash.  ``FEDHET_SKIP_CHECKSUM=1`` or ``verify=False``
disables the check.
"""

from __future__ import annotations

import codecs
import gzip
import hashlib
import io
import json
import os
import pickle
import re
import shutil
import struct
import tarfile
import tempfile
import urllib.request
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import numpy as np
import torch

from fedhet.core.errors import DataError
from fedhet.data.user_data import is_user_dataset, load_user_dataset

__all__ = ["DATASET_NAMES", "ImageData", "data_search_dirs", "dataset_info", "load_dataset"]


@dataclass(frozen=True, eq=False)  # eq=False: element-wise tensor comparison has no bool value
class ImageData:
    """One split of an image dataset, held as compact tensors.

    Attributes:
        x: ``uint8`` images, shape ``(N, C, H, W)``, contiguous.
        y: ``int64`` labels in ``[0, num_classes)``, shape ``(N,)``.
        num_classes: number of classes of the dataset (not only those present in ``y``).
        mean, std: per-channel normalisation constants for ``x.float() / 255``.
        writers: FEMNIST only: ``int64`` index of the writer (the natural federated client) of
            each sample; ``None`` for the other datasets.
        name: dataset name as in :data:`DATASET_NAMES`.
    """

    x: torch.Tensor
    y: torch.Tensor
    num_classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    writers: np.ndarray | None = None
    name: str = ""

    def __post_init__(self) -> None:
        if self.x.dtype != torch.uint8 or self.x.dim() != 4:
            raise ValueError(f"ImageData.x must be uint8 (N, C, H, W), got {self.x.dtype} {tuple(self.x.shape)}")
        if self.y.dtype != torch.int64 or self.y.shape != (self.x.shape[0],):
            raise ValueError(f"ImageData.y must be int64 of shape ({self.x.shape[0]},), got {self.y.dtype} {tuple(self.y.shape)}")
        if len(self.mean) != self.x.shape[1] or len(self.std) != self.x.shape[1]:
            raise ValueError("ImageData.mean/std need one value per channel")
        if self.writers is not None and (self.writers.dtype != np.int64 or self.writers.shape != (self.x.shape[0],)):
            raise ValueError("ImageData.writers must be an int64 array with one entry per sample")

    def __len__(self) -> int:
        return int(self.x.shape[0])


@dataclass(frozen=True)
class _Info:
    in_channels: int
    image_size: int
    num_classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]


# The mean/std values are the commonly used training-set statistics; the EMNIST-letters and
# FEMNIST ones are approximate (they vary slightly with the preprocessing used).
_INFO: dict[str, _Info] = {
    "fashion_mnist": _Info(1, 28, 10, (0.2860,), (0.3530,)),
    "mnist": _Info(1, 28, 10, (0.1307,), (0.3081,)),
    "emnist_letters": _Info(1, 28, 26, (0.1722,), (0.3309,)),
    "cifar10": _Info(3, 32, 10, (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": _Info(3, 32, 100, (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "cinic10": _Info(3, 32, 10, (0.4789, 0.4723, 0.4305), (0.2421, 0.2383, 0.2587)),
    "tiny_imagenet": _Info(3, 64, 200, (0.4802, 0.4481, 0.3975), (0.2302, 0.2265, 0.2262)),
    "femnist": _Info(1, 28, 62, (0.9637,), (0.1592,)),
}

DATASET_NAMES: tuple[str, ...] = tuple(_INFO)

# md5 of the file content (decompressed content for .gz), keyed by file name without ".gz".
# Only official values we are sure of; files not listed here are loaded unverified.
_CHECKSUMS: dict[str, dict[str, str]] = {
    "fashion_mnist": {
        "train-images-idx3-ubyte": "f4a8712d7a061bf5bd6d2ca38dc4d50a",
        "train-labels-idx1-ubyte": "9018921c3c673c538a1fc5bad174d6f9",
        "t10k-images-idx3-ubyte": "8181f5470baa50b63fa0f6fddb340f0a",
        "t10k-labels-idx1-ubyte": "15d484375f8d13e6eb1aabb0c3f46965",
    },
    "cifar10": {
        "data_batch_1": "c99cafc152244af753f735de768cd75f",
        "data_batch_2": "d4bba439e000b95fd0a9bffe97cbabec",
        "data_batch_3": "54ebc095f3ab1f0389bbae665268c751",
        "data_batch_4": "634d18415352ddfa80567beed471001a",
        "data_batch_5": "482c414d41f54cd18b22e5b47cb7c3cb",
        "test_batch": "40351d587109b95175f43aff81a1287e",
    },
    "cifar100": {
        "train": "16019d7e3df5f24257cddd939b257f8d",
        "test": "f0ef6b0ae62326f3e7ffdfab6717acfc",
    },
}

# download=True sources: (mirrors tried in order, [(file name, md5 of the downloaded file)]).
_DOWNLOADS: dict[str, tuple[tuple[str, ...], tuple[tuple[str, str], ...]]] = {
    "fashion_mnist": (
        (
            "https://raw.githubusercontent.com/zalandoresearch/fashion-mnist/master/data/fashion/",
            "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
        ),
        (
            ("train-images-idx3-ubyte.gz", "8d4fb7e6c68d591d4c3dfef9ec88bf0d"),
            ("train-labels-idx1-ubyte.gz", "25c81989df183df01b3e8a0aad5dffbe"),
            ("t10k-images-idx3-ubyte.gz", "bef4ecab320f06d8554ea6380940ec79"),
            ("t10k-labels-idx1-ubyte.gz", "bb300cfdad3c16e7a12a480ee83cd310"),
        ),
    ),
    "mnist": (
        # yann.lecun.com is the original host but often refuses downloads; the PyTorch mirror
        # serves byte-identical files (same md5).
        ("https://ossci-datasets.s3.amazonaws.com/mnist/", "http://yann.lecun.com/exdb/mnist/"),
        (
            ("train-images-idx3-ubyte.gz", "f68b3c2dcbeaaa9fbdd348bbdeb94873"),
            ("train-labels-idx1-ubyte.gz", "d53e105ee54ea40749a09fcbcd1e9432"),
            ("t10k-images-idx3-ubyte.gz", "9fb629c4189551a2d022fa330f9573f3"),
            ("t10k-labels-idx1-ubyte.gz", "ec29112dd5afa0611ce80d1b7f02629c"),
        ),
    ),
    "cifar10": (("https://www.cs.toronto.edu/~kriz/",), (("cifar-10-python.tar.gz", "c58f30108f718f92721af3b95e74349a"),)),
    "cifar100": (("https://www.cs.toronto.edu/~kriz/",), (("cifar-100-python.tar.gz", "eb9058c3a382ffc7106e4002c42a8d85"),)),
}
_DOWNLOAD_TIMEOUT_S = 30

_HOW_TO_GET: dict[str, str] = {
    "fashion_mnist": "apt-get install dataset-fashion-mnist (Debian/Ubuntu) or download the four .gz files from "
    "the official Zalando repository https://github.com/zalandoresearch/fashion-mnist (data/fashion/) "
    "into one of the directories above",
    "mnist": "download the four .gz files from http://yann.lecun.com/exdb/mnist/ (mirror: "
    "https://ossci-datasets.s3.amazonaws.com/mnist/) into one of the directories above",
    "emnist_letters": "download gzip.zip from https://www.nist.gov/itl/products-and-services/emnist-dataset "
    "(https://biometrics.nist.gov/cs_links/EMNIST/gzip.zip) and put the emnist-letters-* files into one "
    "of the directories above",
    "cifar10": "download https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz into one of the directories "
    "above (it is extracted on first use)",
    "cifar100": "download https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz into one of the directories "
    "above (it is extracted on first use)",
    "cinic10": "download CINIC-10.tar.gz from https://datashare.ed.ac.uk/handle/10283/3192 (see "
    "https://github.com/BayesWatch/cinic-10) and extract it into a folder named cinic-10 in one of the "
    "directories above",
    "tiny_imagenet": "download http://cs231n.stanford.edu/tiny-imagenet-200.zip and unzip it into one of the "
    "directories above",
    "femnist": "generate it with LEAF (https://github.com/TalwalkarLab/leaf, data/femnist: e.g. "
    "./preprocess.sh -s niid --sf 1.0 -k 0 -t sample) and copy data/train and data/test into a folder "
    "named femnist in one of the directories above",
}

_SYSTEM_DIRS = {"fashion_mnist": Path("/usr/share/datasets/fashion-mnist")}


def _how_to_get(name: str) -> str:
    return _HOW_TO_GET[name] + (" / set data.download: true (download=True in Python)" if name in _DOWNLOADS else "")


# --------------------------------------------------------------------------- public functions


def _check_name(name: object) -> _Info:
    if name not in _INFO:
        raise DataError(f"unknown dataset {name!r}; valid names: {', '.join(DATASET_NAMES)}; data of your own: "
                        "npz:PATH (arrays) or folder:PATH (a folder of images per class)")
    return _INFO[name]  # type: ignore[index]


def dataset_info(name: str) -> dict:
    """Return ``{"in_channels", "image_size", "num_classes"}`` of a dataset without touching files."""
    info = _check_name(name)
    return {"in_channels": info.in_channels, "image_size": info.image_size, "num_classes": info.num_classes}


def data_search_dirs(name: str, root: str | os.PathLike | None) -> list[Path]:
    """Directories searched for ``name``'s files, in priority order (duplicates removed).

    ``root/name`` and ``root`` (if given), ``$FEDHET_DATA/name``, ``~/.cache/fedhet/data/name`` and,
    for fashion_mnist, ``/usr/share/datasets/fashion-mnist``.  The directories need not exist.
    """
    _check_name(name)
    dirs: list[Path] = []
    if root is not None:
        base = Path(root).expanduser()
        dirs += [base / name, base]
    if os.environ.get("FEDHET_DATA"):
        dirs.append(Path(os.environ["FEDHET_DATA"]).expanduser() / name)
    dirs.append(Path.home() / ".cache" / "fedhet" / "data" / name)
    if name in _SYSTEM_DIRS:
        dirs.append(_SYSTEM_DIRS[name])
    return list(dict.fromkeys(dirs))


def load_dataset(
    name: str,
    root: str | os.PathLike | None = None,
    train: bool = True,
    download: bool = False,
    verify: bool = True,
) -> ImageData:
    """Load the train (``train=True``) or test split of dataset ``name``.

    Args:
        name: one of :data:`DATASET_NAMES`, or the user's own data as ``npz:PATH`` or
            ``folder:PATH`` (:mod:`fedhet.data.user_data`).
        root: optional directory searched first (as ``root/name`` and ``root`` itself).
        train: train split if true, else the test split (Tiny-ImageNet: its ``val`` split).
        download: if the files are missing, fetch them from the official source (fashion_mnist,
            mnist, cifar10, cifar100 only) into the first writable search directory.
        verify: md5-check files with a known official checksum.

    Raises:
        DataError: unknown name; files missing (the message lists the expected files, the
            directories searched and how to obtain them); malformed or corrupt files.
    """
    if is_user_dataset(name):
        return load_user_dataset(name, train)
    _check_name(name)
    split = "train" if train else "test"
    dirs = data_search_dirs(name, root)
    verify = verify and os.environ.get("FEDHET_SKIP_CHECKSUM", "").strip().lower() not in ("1", "true", "yes")
    finder, loader = _FORMATS[name]
    for d in dirs:
        found = finder(name, d, split)
        if found is not None:
            return loader(name, found, split, verify)
    if download and name in _DOWNLOADS:
        target = _download(name, root)
        found = finder(name, target, split)
        if found is not None:
            return loader(name, found, split, verify)
    raise _missing_error(name, split, dirs, download)


def _missing_error(name: str, split: str, dirs: list[Path], download: bool) -> DataError:
    expected = "\n".join(f"  {f}" for f in _expected_files(name, split))
    searched = "\n".join(f"  {d}" for d in dirs)
    note = ""
    if download and name not in _DOWNLOADS:
        note = f"\n(download=True is only supported for {', '.join(_DOWNLOADS)}.)"
    return DataError(
        f"{name} ({split} split) not found.\nExpected files:\n{expected}\nSearched directories:\n{searched}\n"
        f"How to get it: {_how_to_get(name)}.\n"
        f"Set data.root in the config (root=... in Python) or FEDHET_DATA to use another directory.{note}"
    )


def _expected_files(name: str, split: str) -> list[str]:
    if name in _IDX_FILES:
        return [f"{f} (or {f}.gz)" for f in _IDX_FILES[name][split]]
    if name in _CIFAR:
        folder, archive, files, _ = _CIFAR[name]
        return [f"{folder}/{f}" for f in files[split]] + [f"or the archive {archive}"]
    if name == "cinic10":
        return [f"cinic-10/{split}/<class>/*.png (10 class folders)"]
    if name == "tiny_imagenet":
        if split == "train":
            return ["tiny-imagenet-200/train/<wnid>/images/*.JPEG (200 class folders)", "tiny-imagenet-200/wnids.txt (optional)"]
        return ["tiny-imagenet-200/val/images/*.JPEG", "tiny-imagenet-200/val/val_annotations.txt"]
    return [f"femnist/{split}/*.json (LEAF format; femnist/data/{split}/*.json also accepted)"]


def _make(name: str, x: np.ndarray, y: np.ndarray, writers: np.ndarray | None = None) -> ImageData:
    info = _INFO[name]
    if len(y) == 0:
        raise DataError(f"{name}: the split contains no samples")
    return ImageData(
        x=torch.from_numpy(np.ascontiguousarray(x)),
        y=torch.from_numpy(y.astype(np.int64, copy=False)),
        num_classes=info.num_classes,
        mean=info.mean,
        std=info.std,
        writers=writers,
        name=name,
    )


def _check_labels(y: np.ndarray, low: int, high: int, source: object) -> None:
    """Raise unless every label lies in ``[low, high]``."""
    if y.size and (int(y.min()) < low or int(y.max()) > high):
        raise DataError(f"{source}: labels must lie in {low}..{high}, found {int(y.min())}..{int(y.max())}")


# --------------------------------------------------------------------------- checksums


def _md5_cache_file() -> Path:
    return Path.home() / ".cache" / "fedhet" / "verified-md5.json"


# path -> (size, mtime_ns, md5); used when the cache file cannot be written.
_MD5_MEMO: dict[str, tuple[int, int, str]] = {}


def _cached_md5(key: str, stat: os.stat_result) -> str | None:
    memo = _MD5_MEMO.get(key)
    if memo is not None and memo[:2] == (stat.st_size, stat.st_mtime_ns):
        return memo[2]
    try:
        entry = json.loads(_md5_cache_file().read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(entry, dict) and entry.get("size") == stat.st_size and entry.get("mtime_ns") == stat.st_mtime_ns:
        md5 = entry.get("md5")
        return md5 if isinstance(md5, str) else None
    return None


def _remember_md5(key: str, stat: os.stat_result, md5: str) -> None:
    _MD5_MEMO[key] = (stat.st_size, stat.st_mtime_ns, md5)
    cache = _md5_cache_file()
    try:
        try:
            entries = json.loads(cache.read_text())
            if not isinstance(entries, dict):
                entries = {}
        except (OSError, ValueError):
            entries = {}
        entries[key] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "md5": md5}
        cache.parent.mkdir(parents=True, exist_ok=True)
        # Write-then-rename so concurrent runs never read a half-written file.
        fd, tmp = tempfile.mkstemp(dir=cache.parent, prefix=".verified-md5-")
        with os.fdopen(fd, "w") as f:
            json.dump(entries, f)
        os.replace(tmp, cache)
    except OSError:
        pass  # read-only home: the in-process memo still avoids re-hashing


def _verify_md5(name: str, path: Path, content: bytes) -> None:
    """Check ``content`` (the file's decompressed bytes) against the known md5 of ``path``."""
    expected = _CHECKSUMS.get(name, {}).get(path.name.removesuffix(".gz"))
    if expected is None:
        return
    stat = path.stat()
    key = str(path.resolve())
    actual = _cached_md5(key, stat)
    if actual is None:
        actual = hashlib.md5(content, usedforsecurity=False).hexdigest()
        _remember_md5(key, stat, actual)
    if actual != expected:
        what = "decompressed content of " if path.suffix == ".gz" else ""
        raise DataError(
            f"checksum mismatch for {path}: md5 of the {what}file is {actual}, expected {expected}. "
            f"The file is corrupt or a different version of {name}; delete it and obtain it again "
            f"({_how_to_get(name)}). Set FEDHET_SKIP_CHECKSUM=1 to skip verification."
        )


def _read_content(path: Path) -> bytes:
    """Read a file, transparently decompressing ``.gz``."""
    try:
        raw = path.read_bytes()
        return gzip.decompress(raw) if path.suffix == ".gz" else raw
    except (OSError, EOFError, zlib.error) as exc:
        raise DataError(f"cannot read {path}: {exc} (the file is truncated or corrupt)") from exc


# --------------------------------------------------------------------------- IDX (MNIST family)

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


# --------------------------------------------------------------------------- CIFAR pickles

# name -> (folder, archive, files per split, label key)
_CIFAR: dict[str, tuple[str, str, dict[str, tuple[str, ...]], str]] = {
    "cifar10": (
        "cifar-10-batches-py",
        "cifar-10-python.tar.gz",
        {"train": tuple(f"data_batch_{i}" for i in range(1, 6)), "test": ("test_batch",)},
        "labels",
    ),
    "cifar100": ("cifar-100-python", "cifar-100-python.tar.gz", {"train": ("train",), "test": ("test",)}, "fine_labels"),
}

# numpy's array-reconstruction function, fetched without importing numpy.core (renamed in numpy 2).
_NP_RECONSTRUCT = np.zeros(0).__reduce__()[0]


class _CifarUnpickler(pickle.Unpickler):
    """Unpickler that only builds what CIFAR batches contain (dicts, lists, numpy arrays).

    Refusing every other global means a malicious file in the data directory cannot run code.
    """

    _ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"): _NP_RECONSTRUCT,
        ("numpy._core.multiarray", "_reconstruct"): _NP_RECONSTRUCT,
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): np.dtype,
        ("_codecs", "encode"): codecs.encode,  # how Python 3 pickles bytes at protocol 2
    }

    def find_class(self, module: str, name: str):
        try:
            return self._ALLOWED[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"unexpected object {module}.{name} in a CIFAR batch") from None


def _find_cifar(name: str, d: Path, split: str) -> Path | None:
    folder_name, archive_name, files, _ = _CIFAR[name]
    folder = d / folder_name
    if all((folder / f).is_file() for f in files[split]):
        return folder
    archive = d / archive_name
    if not archive.is_file():
        return None
    _extract_archive(archive, folder_name)
    missing = [f for f in files[split] if not (folder / f).is_file()]
    if missing:
        raise DataError(f"{archive} does not contain {folder_name}/{', '.join(missing)}; it is not the official archive")
    return folder


def _extract_archive(archive: Path, folder_name: str) -> None:
    """Extract ``folder_name/*`` from a CIFAR tarball into the archive's directory.

    Only flat regular files under ``folder_name`` are written (the official archives hold nothing
    else), which also rules out path traversal.  Files are first written to a temporary directory
    and then moved, so an interrupted extraction never leaves truncated batches behind.
    """
    dest = archive.parent
    try:
        tmp = Path(tempfile.mkdtemp(prefix=".fedhet-extract-", dir=dest))
    except OSError as exc:
        raise DataError(
            f"cannot extract {archive}: {dest} is not writable ({exc}). "
            f"Extract it yourself (tar xzf {archive.name}) or copy it to a writable directory."
        ) from exc
    try:
        with tarfile.open(archive, "r:gz") as tar:
            for member in tar:
                parts = PurePosixPath(member.name).parts
                if member.isfile() and len(parts) == 2 and parts[0] == folder_name and parts[1] != "..":
                    with tar.extractfile(member) as src, open(tmp / parts[1], "wb") as dst:
                        shutil.copyfileobj(src, dst)
        target = dest / folder_name
        target.mkdir(exist_ok=True)
        for f in tmp.iterdir():
            os.replace(f, target / f.name)
    except (tarfile.TarError, EOFError, zlib.error, OSError) as exc:
        raise DataError(f"cannot extract {archive}: {exc} (the archive is truncated or corrupt; download it again)") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _load_cifar(name: str, folder: Path, split: str, verify: bool) -> ImageData:
    info = _INFO[name]
    _, _, files, label_key = _CIFAR[name]
    xs, ys = [], []
    for fname in files[split]:
        path = folder / fname
        content = _read_content(path)
        if verify:
            _verify_md5(name, path, content)
        try:
            # latin1 is what numpy needs to rebuild arrays pickled by Python 2 (the official files).
            batch = _CifarUnpickler(io.BytesIO(content), encoding="latin1").load()
        except Exception as exc:  # unpickling corrupt data can raise almost anything
            raise DataError(f"{path}: not a readable CIFAR batch ({type(exc).__name__}: {exc})") from exc
        if not isinstance(batch, dict):
            raise DataError(f"{path}: not a CIFAR batch (expected a dict, got {type(batch).__name__})")
        # Python 2 pickles load with str keys under latin1, Python 3 ones keep bytes keys.
        batch = {k.decode("latin1") if isinstance(k, bytes) else k: v for k, v in batch.items()}
        data, labels = batch.get("data"), batch.get(label_key)
        pixels = 3 * info.image_size**2
        if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != pixels:
            raise DataError(f"{path}: 'data' must be a uint8 array of shape (N, {pixels})")
        if labels is None or len(labels) != len(data):
            raise DataError(f"{path}: '{label_key}' missing or not one label per image")
        y = np.asarray(labels, dtype=np.int64)
        _check_labels(y, 0, info.num_classes - 1, path)
        xs.append(data.reshape(-1, 3, info.image_size, info.image_size))
        ys.append(y)
    return _make(name, np.concatenate(xs), np.concatenate(ys))


# --------------------------------------------------------------------------- image folders


def _pil_image():
    try:
        from PIL import Image
    except ImportError as exc:
        raise DataError(
            "Pillow is needed to decode image-folder datasets (cinic10, tiny_imagenet): pip install pillow"
        ) from exc
    return Image


def _decode_images(paths: list[Path], size: int) -> np.ndarray:
    """Decode image files into one ``(N, 3, size, size)`` uint8 array (grayscale is expanded to RGB)."""
    image_mod = _pil_image()
    out = np.empty((len(paths), size, size, 3), dtype=np.uint8)

    def decode(i: int) -> None:
        try:
            with image_mod.open(paths[i]) as im:
                rgb = im.convert("RGB")
        except (OSError, ValueError, SyntaxError) as exc:  # PIL's errors for broken files
            raise DataError(f"cannot decode image {paths[i]}: {exc}") from exc
        if rgb.size != (size, size):
            raise DataError(f"{paths[i]}: image is {rgb.size[0]}x{rgb.size[1]}, expected {size}x{size}")
        out[i] = np.asarray(rgb)

    # PIL releases the GIL while decoding, so threads speed up loading ~100k small files.
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        list(pool.map(decode, range(len(paths))))
    return out.transpose(0, 3, 1, 2)


def _list_images(folder: Path, suffixes: tuple[str, ...]) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.suffix.lower() in suffixes and p.is_file())


def _find_cinic(name: str, d: Path, split: str) -> Path | None:
    folder = d / "cinic-10" / split
    return folder if folder.is_dir() else None


def _load_cinic(name: str, folder: Path, split: str, verify: bool) -> ImageData:
    info = _INFO[name]
    classes = sorted(p.name for p in folder.iterdir() if p.is_dir())
    if len(classes) != info.num_classes:
        raise DataError(f"{folder}: expected {info.num_classes} class folders, found {len(classes)}: {classes}")
    paths, labels = [], []
    for label, cls in enumerate(classes):
        files = _list_images(folder / cls, (".png",))
        paths += files
        labels += [label] * len(files)
    return _make(name, _decode_images(paths, info.image_size), np.asarray(labels, dtype=np.int64))


def _find_tiny(name: str, d: Path, split: str) -> Path | None:
    root = d / "tiny-imagenet-200"
    if split == "train":
        return root if (root / "train").is_dir() else None
    ok = (root / "val" / "images").is_dir() and (root / "val" / "val_annotations.txt").is_file()
    return root if ok else None


def _tiny_classes(root: Path) -> list[str]:
    """The 200 wnids, sorted: from wnids.txt if present, else the train class folders."""
    wnids_file = root / "wnids.txt"
    if wnids_file.is_file():
        wnids = {line.strip() for line in wnids_file.read_text().splitlines() if line.strip()}
        source: object = wnids_file
    elif (root / "train").is_dir():
        wnids = {p.name for p in (root / "train").iterdir() if p.is_dir()}
        source = root / "train"
    else:
        raise DataError(f"{root}: need wnids.txt or the train folder to number the Tiny-ImageNet classes")
    if len(wnids) != 200:
        raise DataError(f"{source}: expected 200 classes (wnids), found {len(wnids)}")
    return sorted(wnids)


def _load_tiny(name: str, root: Path, split: str, verify: bool) -> ImageData:
    classes = _tiny_classes(root)
    index = {wnid: i for i, wnid in enumerate(classes)}
    paths: list[Path] = []
    labels: list[int] = []
    if split == "train":
        for wnid in classes:
            folder = root / "train" / wnid / "images"
            if not folder.is_dir():
                raise DataError(f"{folder} is missing; the Tiny-ImageNet train split is incomplete")
            files = _list_images(folder, (".jpeg", ".jpg"))
            paths += files
            labels += [index[wnid]] * len(files)
    else:
        ann = root / "val" / "val_annotations.txt"
        mapping: dict[str, int] = {}
        for lineno, line in enumerate(ann.read_text().splitlines(), 1):
            if not line.strip():
                continue
            fields = line.split("\t")
            if len(fields) < 2 or fields[1] not in index:
                raise DataError(f"{ann}:{lineno}: expected 'filename<TAB>wnid<TAB>...' with a known wnid, got {line!r}")
            mapping[fields[0]] = index[fields[1]]
        for fname in sorted(mapping):
            path = root / "val" / "images" / fname
            if not path.is_file():
                raise DataError(f"{ann} lists {fname}, but {path} does not exist")
            paths.append(path)
            labels.append(mapping[fname])
    return _make(name, _decode_images(paths, _INFO[name].image_size), np.asarray(labels, dtype=np.int64))


# --------------------------------------------------------------------------- FEMNIST (LEAF JSON)


def _find_femnist(name: str, d: Path, split: str) -> Path | None:
    for base in (d / "femnist", d / "femnist" / "data"):
        if (base / split).is_dir() and any((base / split).glob("*.json")):
            return base / split
    return None


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
                y = np.asarray(record["y"], dtype=np.int64)
                if x.ndim != 2 or x.shape[1] != 28 * 28 or y.shape != (len(x),):
                    raise DataError(f"{path}: user {user!r}: expected x of shape (n, 784) and n labels")
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


# --------------------------------------------------------------------------- download


def _download(name: str, root: str | os.PathLike | None) -> Path:
    """Download ``name``'s official files into the first writable directory; return it."""
    mirrors, files = _DOWNLOADS[name]
    candidates = [d for d in data_search_dirs(name, root) if d != _SYSTEM_DIRS.get(name)]
    if root is not None:
        candidates.remove(Path(root).expanduser())  # never scatter files directly into root
    target = None
    for d in candidates:
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(d, os.W_OK):
            target = d
            break
    if target is None:
        raise DataError(f"cannot download {name}: none of {', '.join(map(str, candidates))} is writable")
    for fname, md5 in files:
        dest = target / fname
        if dest.is_file() and _file_md5(dest) == md5:
            continue
        failures = []
        for base in mirrors:
            try:
                _fetch(base + fname, dest, md5)
                break
            except (OSError, ValueError) as exc:  # URLError, timeouts and HTTP errors are OSErrors
                failures.append(f"  {base}{fname}: {exc}")
        else:
            raise DataError(
                f"could not download {name} (is a network connection available?):\n" + "\n".join(failures) + "\n"
                f"Get the files manually: {_HOW_TO_GET[name]}; "
                f"for example into {target}."
            )
    return target


def _file_md5(path: Path) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _fetch(url: str, dest: Path, md5: str) -> None:
    """Stream ``url`` to ``dest`` via a temporary file, keeping it only if its md5 matches."""
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.")
    try:
        digest = hashlib.md5(usedforsecurity=False)
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=_DOWNLOAD_TIMEOUT_S) as response:
            for chunk in iter(lambda: response.read(1 << 20), b""):
                digest.update(chunk)
                out.write(chunk)
        if digest.hexdigest() != md5:
            raise ValueError(f"downloaded file has md5 {digest.hexdigest()}, expected {md5}")
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


# name -> (finder(name, dir, split) -> location or None, loader(name, location, split, verify))
_FORMATS = {
    "fashion_mnist": (_find_idx, _load_idx),
    "mnist": (_find_idx, _load_idx),
    "emnist_letters": (_find_idx, _load_idx),
    "cifar10": (_find_cifar, _load_cifar),
    "cifar100": (_find_cifar, _load_cifar),
    "cinic10": (_find_cinic, _load_cinic),
    "tiny_imagenet": (_find_tiny, _load_tiny),
    "femnist": (_find_femnist, _load_femnist),
}
