"""CINIC-10 (PNG) and Tiny-ImageNet (JPEG): folders of image files, decoded with Pillow."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from fedhet.core.errors import DataError
from fedhet.data.datasets.catalogue import _INFO
from fedhet.data.datasets.image_data import ImageData, _make


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


def _expected_cinic(name: str, split: str) -> list[str]:
    return [f"cinic-10/{split}/<class>/*.png (10 class folders)"]


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


def _expected_tiny(name: str, split: str) -> list[str]:
    if split == "train":
        return ["tiny-imagenet-200/train/<wnid>/images/*.JPEG (200 class folders)", "tiny-imagenet-200/wnids.txt (optional)"]
    return ["tiny-imagenet-200/val/images/*.JPEG", "tiny-imagenet-200/val/val_annotations.txt"]


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
