"""Datasets of the user's own, with no loader to write: ``data.dataset`` names a file or a folder.

* ``npz:PATH`` - a NumPy ``.npz`` with ``x_train``, ``y_train``, ``x_test`` and ``y_test``. Images are
  ``uint8`` (or floats in [0, 1]) of shape ``(N, H, W)``, ``(N, H, W, C)`` or ``(N, C, H, W)`` with
  ``C`` 1 or 3 and ``H == W``; labels are whole numbers ``0..C-1``. Optional: ``num_classes`` (a
  scalar; default: the largest label + 1) and ``clients_train`` (one client id per training image:
  data already split by user, used with ``data.partition: {kind: natural}``).
* ``folder:PATH`` - ``PATH/train/<class>/*`` and ``PATH/test/<class>/*`` image files (png, jpg,
  bmp); classes are the folder names in sorted order, images must all have one square size, and
  are read as grayscale when every training image is grayscale, else as RGB.

* ``MODULE:FUNCTION`` - a function of the user's own, called with ``"train"`` or ``"test"``, that
  returns ``(x, y)`` or ``(x, y, client_ids)`` arrays as an ``.npz`` holds them (client ids: train only).
  :func:`load_user_splits` calls it once per split; one split alone calls it for both (the class
  count is the largest label of both splits plus one).

Relative paths are taken from the working directory. Normalisation uses the training split's own
per-channel mean and std. :func:`save_arrays` writes arrays held in memory to an ``.npz`` and
returns its ``npz:PATH`` name, so that every process of a run (engine workers, Flower nodes) can
read them.
"""

from __future__ import annotations

import inspect
import warnings
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedhet.core.errors import DataError
from fedhet.core.plugins import describe, is_import_path, load_object

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp")
PREFIXES = ("npz:", "folder:")
StoredSplit = tuple[np.ndarray, np.ndarray, int, np.ndarray | None]    # images, labels, class count, client of each


def is_user_dataset(name: str) -> bool:
    return name.startswith(PREFIXES) or is_import_path(name)


def load_user_dataset(name: str, train: bool):
    """The train or test split of ``npz:PATH``, ``folder:PATH`` or ``MODULE:FUNCTION`` as an ``ImageData``."""
    split = "train" if train else "test"
    if name.startswith(PREFIXES):
        return _load_stored(name, (split,))[0]
    other = "test" if train else "train"
    arrays = _read_function(name, (split, other))
    x, y, clients = arrays[split]
    return _image_data(name, x, y, _class_count(arrays), clients)


def load_user_splits(name: str):
    """Both splits of a user dataset, ``(train, test)``. A ``MODULE:FUNCTION`` is called once per
    split here (loading the splits one at a time calls it twice for each: the class count needs both),
    and an ``.npz`` is read once."""
    if name.startswith(PREFIXES):
        train, test = _load_stored(name, ("train", "test"))
    else:
        arrays = _read_function(name, ("train", "test"))
        num_classes = _class_count(arrays)
        (x, y, clients), (x_test, y_test, _) = arrays["train"], arrays["test"]
        train, test = _image_data(name, x, y, num_classes, clients), _image_data(name, x_test, y_test, num_classes, None)
    _check_splits(name, train, test)
    return train, test


def _check_splits(name: str, train, test) -> None:
    """What only the two splits together show: a single class (an error), and (warnings) a test
    split that is the training split, class numbers no image has, a constant training channel."""
    where = f"data.dataset {name}"
    if train.num_classes < 2:
        raise DataError(f"{where}: every label is 0, one class; a classifier needs at least two")
    if train.x.shape == test.x.shape and torch.equal(train.y, test.y) and torch.equal(train.x, test.x):
        warnings.warn(f"{where}: the test split is the training split (the same images and labels), so every "
                      "test accuracy is measured on training images; return the test images for 'test'",
                      UserWarning, stacklevel=3)
    if not name.startswith("folder:"):      # a folder's classes are its folders, an empty one included
        # below the largest label only: classes above it are a num_classes given on purpose
        top = int(max(train.y.max(), test.y.max() if len(test.y) else 0)) + 1
        present = torch.zeros(top, dtype=torch.bool)
        present[train.y] = True
        present[test.y] = True
        if not present.all():
            empty = torch.nonzero(~present).flatten().tolist()
            warnings.warn(f"{where}: {len(empty)} of the class numbers 0..{top - 1} (the largest label) have no "
                          f"image in either split ({', '.join(map(str, empty[:5]))}"
                          f"{'...' if len(empty) > 5 else ''}), yet the model gets an output for each and a "
                          "partition counts them; number the classes 0..K-1", UserWarning, stacklevel=3)
    constant = [c for c, s in enumerate(train.std) if s == 1.0 and train.x[:, c].min() == train.x[:, c].max()]
    if constant:
        warnings.warn(f"{where}: channel(s) {constant} of the training images are constant, so they carry "
                      "nothing to learn from (normalised with std 1)", UserWarning, stacklevel=3)


def _load_stored(name: str, splits: tuple[str, ...]) -> list:
    """The ``splits`` of ``npz:PATH`` or ``folder:PATH``; an ``.npz`` is read, and a folder's colour mode
    found, once for all of them."""
    kind, _, path = name.partition(":")
    if not path:
        raise DataError(f"data.dataset: {name!r} names no path; write {kind}:PATH, e.g. {kind}:data/mine"
                        f"{'.npz' if kind == 'npz' else ''}")
    if kind == "npz":
        stored = _read_npz(Path(path))
        parts = [_npz_split(Path(path), stored, split) for split in splits]
    else:
        parts = _read_folder(Path(path), splits)
    return [_image_data(name, x, y, num_classes, clients) for x, y, num_classes, clients in parts]


def save_arrays(path: str | Path, x_train: np.ndarray, y_train: np.ndarray, x_test: np.ndarray, y_test: np.ndarray,
                clients_train: np.ndarray | None = None, num_classes: int | None = None) -> str:
    """Write arrays held in memory as a dataset file (its folder made where missing); returns
    ``"npz:PATH"`` for ``data.dataset``, PATH absolute, so that the run (and its resume, from any
    working directory) finds the file."""
    extra: dict[str, np.ndarray] = {}
    if clients_train is not None:
        extra["clients_train"] = np.asarray(clients_train)
    if num_classes is not None:
        extra["num_classes"] = np.asarray(num_classes)
    path = Path(path).expanduser().absolute()
    if path.suffix != ".npz":              # numpy.savez adds it anyway: name the file it writes
        path = path.with_name(path.name + ".npz")
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, x_train=np.asarray(x_train), y_train=np.asarray(y_train), x_test=np.asarray(x_test),
             y_test=np.asarray(y_test), **extra)
    name = f"npz:{path}"
    train, test = load_user_splits(name)   # checked here
    if tuple(train.x.shape[1:]) != tuple(test.x.shape[1:]):
        raise DataError(f"save_arrays: the test images are {tuple(test.x.shape[1:])} (channels, height, width), the "
                        f"training images {tuple(train.x.shape[1:])}; give both splits one shape")
    return name


# ---------------------------------------------------------------------------------- function


def _read_function(spec: str, splits: tuple[str, ...]) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray | None]]:
    """``split -> (x, y, client ids or None)`` of the user's function, called once for each of ``splits``."""
    where = f"data.dataset {spec}"
    try:
        fn = load_object(spec)
    except ValueError as e:
        raise DataError(f"{where}: {e}") from e.__cause__     # a module that raised on import: its traceback
    if not callable(fn) or isinstance(fn, type):
        raise DataError(f"{where} is {describe(fn)}, not a function (split) -> (x, y) or (x, y, client_ids)")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):          # a builtin or C callable: no signature to read
        signature = None
    if signature is not None:
        try:
            signature.bind("train")
        except TypeError:
            raise DataError(f"{where} must take one argument, the split ('train' or 'test'); its signature is "
                            f"{signature}") from None
    arrays = {}
    for split in splits:
        out = fn(split)
        if not isinstance(out, tuple) or len(out) not in (2, 3):
            raise DataError(f"{where}({split!r}) returned {describe(out)}; it must return (x, y) or "
                            "(x, y, client_ids)")
        x = _images(_stacked(out[0], f"{where}: x of {split}"), f"{where}: x of {split}")
        y = _labels(np.asarray(out[1]), len(x), f"{where}: y of {split}")
        clients = None
        if split == "train" and len(out) == 3:
            ids = np.asarray(out[2])
            if ids.shape != (len(x),) or not np.issubdtype(ids.dtype, np.integer):
                raise DataError(f"{where}: client ids must be one whole number per training image ({len(x)}), got "
                                f"{ids.dtype} {ids.shape}")
            clients = np.unique(ids, return_inverse=True)[1].astype(np.int64)
        arrays[split] = (x, y, clients)
    return arrays


def _stacked(images: Any, where: str) -> np.ndarray:
    """``images`` (an array, or a list of one array per image) as one array."""
    try:
        return np.asarray(images)
    except ValueError:           # numpy's "inhomogeneous shape": images of several sizes
        shapes = sorted({np.shape(im) for im in images}, key=str)
        raise DataError(f"{where}: the images have {len(shapes)} shapes ({', '.join(map(str, shapes[:3]))}"
                        f"{'...' if len(shapes) > 3 else ''}); they must all have one, resize them first") from None


def _class_count(arrays: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray | None]]) -> int:
    """Classes of a function's dataset: its largest label over both splits, plus one."""
    return int(max(y.max(initial=0) for _, y, _ in arrays.values())) + 1


def channel_mean_std(x: np.ndarray, rows: int = 4096) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and (population) std of uint8 images ``x`` (N, C, H, W) scaled to [0, 1],
    in float64 over ``rows`` images at a time: two passes (the mean, then the squared deviations),
    so that memory beyond ``x`` stays that of one chunk in float64, not 8x the whole pool. (The
    mean is the exact integer sum over 255 and the count, which may differ from numpy's mean of
    ``x / 255`` in the last float64 bit; inputs are normalised in float32.) A constant channel's std
    is 1."""
    channels, count = x.shape[1], x.shape[0] * x.shape[2] * x.shape[3]
    sums = np.zeros(channels)
    for i in range(0, len(x), rows):
        sums += x[i:i + rows].sum(axis=(0, 2, 3), dtype=np.float64)
    mean = sums / 255.0 / max(count, 1)
    squares = np.zeros(channels)
    for i in range(0, len(x), rows):
        deviation = x[i:i + rows].astype(np.float64) / 255.0 - mean.reshape(1, -1, 1, 1)
        squares += np.square(deviation).sum(axis=(0, 2, 3))
    std = np.sqrt(squares / max(count, 1))
    # a constant channel carries nothing: std 1 leaves it centred and keeps another split's (the
    # test images') deviations from it at their own scale, where a tiny floor would blow them up
    return tuple(float(m) for m in mean), tuple(float(s) if s >= 1e-6 else 1.0 for s in std)


def _image_data(name: str, x: np.ndarray, y: np.ndarray, num_classes: int, clients: np.ndarray | None):
    from fedhet.data.datasets import ImageData

    mean, std = channel_mean_std(x)
    return ImageData(torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(y.astype(np.int64)), num_classes,
                     mean, std, writers=clients, name=name)


# --------------------------------------------------------------------------------------- npz


def _read_npz(path: Path) -> dict[str, np.ndarray]:
    """Every array of the file, checked for the four it needs."""
    where = f"data.dataset npz:{path}"
    if not path.is_file():
        with_suffix = path.with_name(path.name + ".npz")
        if path.suffix != ".npz" and with_suffix.is_file():      # numpy.savez and save_arrays add .npz
            raise DataError(f"{where}: no such file, and {with_suffix} is one (numpy.savez and save_arrays add "
                            f"the .npz to the name): did you mean npz:{with_suffix}?")
        raise DataError(f"{where}: no such file (working directory {Path.cwd()}); write the arrays with "
                        "numpy.savez(PATH, x_train=..., y_train=..., x_test=..., y_test=...)")
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise DataError(f"{where}: not a readable .npz file ({type(e).__name__}: {e}); write it again with "
                        "numpy.savez") from None
    except (TypeError, AttributeError):      # np.load gave one array: a .npy file named .npz
        raise DataError(f"{where}: holds one array (a .npy file?), not the arrays of a .npz; write it with "
                        "numpy.savez(PATH, x_train=..., y_train=..., x_test=..., y_test=...)") from None
    missing = [k for k in ("x_train", "y_train", "x_test", "y_test") if k not in arrays]
    if missing:
        raise DataError(f"{where}: missing arrays {missing} (it has {sorted(arrays)}); it needs x_train, y_train, "
                        "x_test and y_test")
    return arrays


def _npz_split(path: Path, arrays: dict[str, np.ndarray], split: str) -> StoredSplit:
    where = f"data.dataset npz:{path}"
    x = _images(arrays[f"x_{split}"], f"{where}: x_{split}")
    y = _labels(arrays[f"y_{split}"], len(x), f"{where}: y_{split}")
    top = int(max(arrays["y_train"].max(initial=0), arrays["y_test"].max(initial=0))) + 1
    num_classes = top
    if "num_classes" in arrays:
        given = arrays["num_classes"]
        numeric = given.size == 1 and (np.issubdtype(given.dtype, np.integer) or np.issubdtype(given.dtype, np.floating))
        whole = numeric and bool(np.isfinite(given.item())) and float(given.item()).is_integer()
        if not whole:                      # 10, [10] and 10.0 are ten classes
            raise DataError(f"{where}: num_classes must be one whole number, got {given.dtype} {given.shape} "
                            f"({given.tolist()!r:.40})")
        num_classes = int(given.item())
        if num_classes < top:
            raise DataError(f"{where}: num_classes is {num_classes} but a label is {top - 1}; labels must be "
                            f"0..num_classes-1")
    clients = None
    if split == "train" and "clients_train" in arrays:
        ids = arrays["clients_train"]
        if ids.shape != (len(x),) or not np.issubdtype(ids.dtype, np.integer):
            raise DataError(f"{where}: clients_train must hold one whole-number client id per training image "
                            f"({len(x)}), got {ids.dtype} {ids.shape}")
        clients = np.unique(ids, return_inverse=True)[1].astype(np.int64)
    return x, y, num_classes, clients


def _images(x: np.ndarray, where: str) -> np.ndarray:
    given = x.shape
    if x.ndim == 3:
        x = x[:, None]
    elif x.ndim == 4 and x.shape[3] in (1, 3) and x.shape[1] == x.shape[2] and x.shape[1] not in (1, 3):
        x = x.transpose(0, 3, 1, 2)
    if x.ndim != 4 or x.shape[1] not in (1, 3) or x.shape[2] != x.shape[3] or len(x) == 0:
        square = " (height and width differ: fedhet's models take square images; crop or pad them)" if (
            x.ndim == 4 and x.shape[1] in (1, 3) and x.shape[2] != x.shape[3]) else ""
        raise DataError(f"{where}: images must be (N, H, W), (N, H, W, C) or (N, C, H, W) with C 1 or 3, square "
                        f"and at least one; got shape {given}{square}")
    if np.issubdtype(x.dtype, np.floating):
        if not np.isfinite(x).all():
            raise DataError(f"{where}: float images hold {int((~np.isfinite(x)).sum())} NaN or infinite values; "
                            "they must lie in [0, 1] (or give uint8 pixels 0..255)")
        if x.min() < 0 or x.max() > 1:
            raise DataError(f"{where}: float images must lie in [0, 1] (got {x.min()}..{x.max()}); or give uint8 "
                            "pixels 0..255")
        return np.round(x * 255).astype(np.uint8)
    if x.dtype != np.uint8:
        raise DataError(f"{where}: images must be uint8 pixels 0..255 or floats in [0, 1], got {x.dtype}")
    return x


def _labels(y: np.ndarray, n: int, where: str) -> np.ndarray:
    if y.shape != (n,) or not (np.issubdtype(y.dtype, np.integer) or np.issubdtype(y.dtype, np.bool_)):
        raise DataError(f"{where}: labels must be one whole number per image ({n}), got {y.dtype} {y.shape}")
    if len(y) and y.min() < 0:
        raise DataError(f"{where}: labels must be 0..num_classes-1, found {int(y.min())}")
    return y.astype(np.int64)


# ------------------------------------------------------------------------------------ folder


def _read_folder(root: Path, splits: tuple[str, ...]) -> list[StoredSplit]:
    where = f"data.dataset folder:{root}"
    if not (root / "train").is_dir() or not (root / "test").is_dir():
        raise DataError(f"{where}: needs {root / 'train'} and {root / 'test'}, each with one folder of images per "
                        f"class (working directory {Path.cwd()})")
    classes = sorted({p.name for s in ("train", "test") for p in (root / s).iterdir() if p.is_dir()})
    if not classes:
        raise DataError(f"{where}: no class folders under train/ and test/")
    # Both splits decode to the train split's colour mode, so a model sees one channel count.
    grayscale, wide_scale = _scan_train(sorted((root / "train").rglob("*")), where)
    parts: list[StoredSplit] = []
    for split in splits:
        paths, labels = [], []
        for label, cls in enumerate(classes):
            folder = root / split / cls
            files = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES) if folder.is_dir() else []
            paths += files
            labels += [label] * len(files)
        if not paths:
            raise DataError(f"{where}: no images ({', '.join(IMAGE_SUFFIXES)}) under {root / split}")
        parts.append((_decode(paths, grayscale, wide_scale, where), np.asarray(labels, dtype=np.int64), len(classes),
                      None))
    return parts


def _pil():
    try:
        from PIL import Image
    except ImportError as exc:
        raise DataError("Pillow is needed to read a folder of images: pip install pillow") from exc
    return Image


def _scan_train(paths: list[Path], where: str) -> tuple[bool, int]:
    """(whether every training image is grayscale, what 16-bit grayscale pixels are divided by):
    257 (65535 -> 255) where a training image's 16-bit pixels exceed 255, else 1 (16-bit files that
    hold 8-bit values). One rule for both splits, so that a pixel value means one brightness."""
    image = _pil()
    modes = set()
    wide_max = 0
    for p in paths:
        if p.suffix.lower() in IMAGE_SUFFIXES:
            try:
                with image.open(p) as im:
                    modes.add(im.mode)
                    if im.mode in WIDE_MODES:
                        wide_max = max(wide_max, int(np.asarray(im, dtype=np.int64).max(initial=0)))
            except (OSError, ValueError, SyntaxError) as e:
                raise DataError(f"{where}: cannot read image {p} ({e})") from None
    return bool(modes) and modes <= GRAYSCALE_MODES, 257 if wide_max > 255 else 1


# grayscale modes of Pillow: 1- and 8-bit, and 16-bit (a PNG's) read as I;16* or I
GRAYSCALE_MODES = {"1", "L", "I", "I;16", "I;16B", "I;16L"}
WIDE_MODES = {"I", "I;16", "I;16B", "I;16L"}


def _pixels(im: Any, grayscale: bool, wide_scale: int, path: Path, where: str) -> np.ndarray:
    """8-bit pixels of one image: 16-bit grayscale divided by ``wide_scale`` (:func:`_scan_train`),
    where Pillow's convert("L") would clip it, turning nearly every pixel white."""
    if grayscale and im.mode in WIDE_MODES:
        wide = np.round(np.asarray(im, dtype=np.int64) / wide_scale)
        if wide.size and (wide.min() < 0 or wide.max() > 255):
            raise DataError(f"{where}: {path} holds {im.mode} pixels beyond what the training images' range "
                            f"maps to 0..255 (here {int(wide.min())}..{int(wide.max())} after dividing by "
                            f"{wide_scale}); save every image as 8- or 16-bit grayscale of one range")
        return wide.astype(np.uint8)
    return np.asarray(im.convert("L" if grayscale else "RGB"))


def _decode(paths: list[Path], grayscale: bool, wide_scale: int, where: str) -> np.ndarray:
    image = _pil()
    out = []
    size = None
    for p in paths:
        try:
            with image.open(p) as im:
                pixels = _pixels(im, grayscale, wide_scale, p, where)
        except (OSError, ValueError, SyntaxError) as e:
            raise DataError(f"{where}: cannot read image {p} ({e})") from None
        size = size or pixels.shape[:2]
        if pixels.shape[:2] != size or size[0] != size[1]:
            first = f"the first, {paths[0].name}, is {size[1]}x{size[0]}"
            raise DataError(f"{where}: {p} is {pixels.shape[1]}x{pixels.shape[0]} (width x height), but the images "
                            f"must all be one square size ({first}); resize them first")
        out.append(pixels)
    x = np.stack(out)
    return x[:, None] if grayscale else x.transpose(0, 3, 1, 2)
