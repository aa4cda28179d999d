"""What fedhet knows about each built-in dataset before reading a file.

Shape, class count and normalisation constants (:data:`_INFO`), the names, the download sources,
how to obtain each dataset by hand, and where its files are looked for (:func:`data_search_dirs`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from fedhet.core.errors import DataError
from fedhet.core.suggest import did_you_mean


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


def how_to_get(name: str) -> str:
    """Where to get dataset ``name`` and where to put it (``fedhet list NAME`` and the errors say it)."""
    _check_name(name)
    return _how_to_get(name)


def _how_to_get(name: str) -> str:
    return _HOW_TO_GET[name] + (" / set data.download: true (--set data.download=true on the command line, {'data.download': True} among fedhet.run's overrides, download=True for load_dataset)" if name in _DOWNLOADS else "")


def _check_name(name: object) -> _Info:
    if name not in _INFO:
        path = Path(str(name))
        if path.suffix == ".npz" or path.is_dir():          # a path given without its npz: or folder: prefix
            prefix = "npz" if path.suffix == ".npz" else "folder"
            raise DataError(f"unknown dataset {name!r}: data of your own is named with its format, {prefix}:{name} "
                            f"({'arrays in an .npz file' if prefix == 'npz' else 'a folder of images per class'}; "
                            "docs/extending.md)")
        raise DataError(f"unknown dataset {name!r}{did_you_mean(str(name).replace('-', '_'), _INFO)}; valid names: "
                        f"{', '.join(DATASET_NAMES)}; data of your own: "
                        "npz:PATH (arrays), folder:PATH (a folder of images per class) or MODULE:FUNCTION "
                        "(a function of yours returning the arrays; docs/extending.md)")
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
