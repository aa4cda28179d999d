"""Loaders for the image datasets fedhet trains on, read from their official on-disk formats.

Every loader returns an :class:`ImageData`: the whole split as one compact ``uint8`` tensor of
shape ``(N, C, H, W)`` plus ``int64`` labels, so partitioning and batching never touch per-sample
Python objects.  Formats are parsed with numpy/struct/gzip/pickle/json; the image-folder
datasets (CINIC-10, Tiny-ImageNet) additionally need Pillow to decode PNG/JPEG files.

This package owns the built-in datasets: this module is the public API (:func:`load_dataset`,
:func:`dataset_info`, :func:`data_search_dirs`, :data:`DATASET_NAMES`, :class:`ImageData`) and
picks the format of each name; the rest lives in one module per concept:

=================  ===========================================================================
catalogue          names, shapes, mean/std, download sources, how to get each dataset, where
                   files are looked for
image_data         :class:`ImageData` and how the parsers build it
checksums          reading a file's content (``.gz`` transparently), md5 verification and its cache
idx                fashion_mnist, mnist, emnist_letters (IDX)
cifar              cifar10, cifar100 (pickles, tarball extraction, the restricted unpickler)
image_folders      cinic10, tiny_imagenet (PNG/JPEG folders, Pillow decoding)
femnist            femnist (LEAF JSON)
download           ``download=True``: fetching the official files
=================  ===========================================================================

Where files are looked for (first hit wins, see :func:`data_search_dirs`)::

    <root>/<name>, <root>, $FEDHET_DATA/<name>, ~/.cache/fedhet/data/<name>
    (+ /usr/share/datasets/fashion-mnist for fashion_mnist, Debian's dataset-fashion-mnist)

:func:`load_splits` (a run's) takes the test split from the folder that holds the training split,
and refuses one that lacks it, rather than mixing two copies.

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

Integrity: files with a known official checksum are md5-verified, the result cached
(:mod:`~fedhet.data.datasets.checksums`).  ``FEDHET_SKIP_CHECKSUM=1`` or ``verify=False``
disables the check.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

from fedhet.core.errors import DataError
from fedhet.data.datasets.catalogue import (
    _DOWNLOADS,
    DATASET_NAMES,
    _check_name,
    _how_to_get,
    data_search_dirs,
    dataset_info,
    how_to_get,
)
from fedhet.data.datasets.cifar import _expected_cifar, _find_cifar, _load_cifar
from fedhet.data.datasets.download import _download
from fedhet.data.datasets.femnist import _expected_femnist, _find_femnist, _load_femnist
from fedhet.data.datasets.idx import _expected_idx, _find_idx, _load_idx
from fedhet.data.datasets.image_data import ImageData
from fedhet.data.datasets.image_folders import (
    _expected_cinic,
    _expected_tiny,
    _find_cinic,
    _find_tiny,
    _load_cinic,
    _load_tiny,
)
from fedhet.data.user_data import is_user_dataset, load_user_dataset, load_user_splits

__all__ = ["DATASET_NAMES", "ImageData", "data_search_dirs", "dataset_info", "how_to_get", "load_dataset",
           "load_splits"]

# name -> (finder(name, dir, split) -> location or None, loader(name, location, split, verify),
#          expected(name, split) -> the files a "not found" message lists)
_FORMATS = {
    "fashion_mnist": (_find_idx, _load_idx, _expected_idx),
    "mnist": (_find_idx, _load_idx, _expected_idx),
    "emnist_letters": (_find_idx, _load_idx, _expected_idx),
    "cifar10": (_find_cifar, _load_cifar, _expected_cifar),
    "cifar100": (_find_cifar, _load_cifar, _expected_cifar),
    "cinic10": (_find_cinic, _load_cinic, _expected_cinic),
    "tiny_imagenet": (_find_tiny, _load_tiny, _expected_tiny),
    "femnist": (_find_femnist, _load_femnist, _expected_femnist),
}


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
    split = "train" if train else "test"
    return _load_found(name, split, _find(name, split, root, download)[0], verify)


def _find(name: str, split: str, root: str | os.PathLike | None, download: bool) -> tuple[Any, Path]:
    """(what the format's finder found, the search directory it is in): the first directory that
    has ``split``'s files (downloading them there where allowed)."""
    _check_name(name)
    dirs = data_search_dirs(name, root)
    finder = _FORMATS[name][0]
    if (env := os.environ.get("FEDHET_DATA")) and not Path(env).expanduser().is_dir():
        warnings.warn(f"FEDHET_DATA={env} is not a folder, so nothing is found there: point it at the folder that "
                      "holds your datasets' folders, or unset it", RuntimeWarning, stacklevel=3)
    for d in dirs:
        found = finder(name, d, split)
        if found is not None:
            if root is not None and not d.is_relative_to(Path(root).expanduser()):
                # a root given and passed over: said, since the run's config records that root
                warnings.warn(f"data.root {root} holds no {name} ({split} split) files, in it or in its {name}/ "
                              f"folder: they were loaded from {d}, the next place searched. Point data.root at "
                              "the folder that holds them, or drop data.root to search the usual places",
                              RuntimeWarning, stacklevel=3)
            return found, d
    if download and name in _DOWNLOADS:
        target = _download(name, root)
        found = finder(name, target, split)
        if found is not None:
            return found, target
    raise _missing_error(name, split, dirs, download)


def _load_found(name: str, split: str, found: Any, verify: bool) -> ImageData:
    verify = verify and os.environ.get("FEDHET_SKIP_CHECKSUM", "").strip().lower() not in ("1", "true", "yes")
    return _FORMATS[name][1](name, found, split, verify)


def load_splits(
    name: str,
    root: str | os.PathLike | None = None,
    download: bool = False,
    verify: bool = True,
) -> tuple[ImageData, ImageData]:
    """``(train, test)`` of dataset ``name``, as two :func:`load_dataset` calls give them; a user's
    ``MODULE:FUNCTION`` dataset is called once per split."""
    if is_user_dataset(name):
        return load_user_splits(name)
    found, where = _find(name, "train", root, download)
    test = _FORMATS[name][0](name, where, "test")       # from the same folder: never two copies mixed
    if test is None:
        expected = ", ".join(_FORMATS[name][2](name, "test"))
        raise DataError(f"{name}: {where} holds its training files but not its test files ({expected}); a run "
                        "takes both splits from one folder, so that they are of one copy: put the test files "
                        "beside the training files")
    return _load_found(name, "train", found, verify), _load_found(name, "test", test, verify)


def _missing_error(name: str, split: str, dirs: list[Path], download: bool) -> DataError:
    expected = "\n".join(f"  {f}" for f in _FORMATS[name][2](name, split))
    searched = "\n".join(f"  {d}" for d in dirs)
    note = ""
    if download and name not in _DOWNLOADS:
        note = f"\n(download=True is only supported for {', '.join(_DOWNLOADS)}.)"
    return DataError(
        f"{name} ({split} split) not found.\nExpected files:\n{expected}\nSearched directories:\n{searched}\n"
        f"How to get it: {_how_to_get(name)}.\n"
        f"Set data.root in the config ({{\"data.root\": ...}} among fedhet.run's overrides, root=... for "
        f"load_dataset) or FEDHET_DATA to use another directory.{note}"
    )

