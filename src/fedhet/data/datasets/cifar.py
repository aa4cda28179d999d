"""CIFAR-10/100: the official Python pickles, their tarballs, and an unpickler that runs no code."""

from __future__ import annotations

import codecs
import io
import os
import pickle
import shutil
import tarfile
import tempfile
import zlib
from pathlib import Path, PurePosixPath

import numpy as np

from fedhet.core.errors import DataError
from fedhet.data.datasets.catalogue import _INFO
from fedhet.data.datasets.checksums import _read_content, _verify_md5
from fedhet.data.datasets.image_data import ImageData, _check_labels, _make

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


def _expected_cifar(name: str, split: str) -> list[str]:
    folder, archive, files, _ = _CIFAR[name]
    return [f"{folder}/{f}" for f in files[split]] + [f"or the archive {archive}"]


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
        y = np.asarray(labels) if isinstance(labels, (list, tuple, np.ndarray)) else None
        if y is None or y.shape != (len(data),) or not (np.issubdtype(y.dtype, np.integer) or y.size == 0):
            got = "missing" if labels is None else (
                f"{type(labels).__name__}" if y is None else f"{y.dtype} of shape {y.shape}")
            raise DataError(f"{path}: '{label_key}' must be one whole-number label per image ({len(data)}), got "
                            f"{got}")
        y = y.astype(np.int64)
        _check_labels(y, 0, info.num_classes - 1, path)
        xs.append(data.reshape(-1, 3, info.image_size, info.image_size))
        ys.append(y)
    return _make(name, np.concatenate(xs), np.concatenate(ys))
