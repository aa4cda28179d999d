"""Tests for fedhet.data.datasets: every format is written in its real on-disk layout in tmp_path."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import pickle
import struct
import sys
import tarfile
import urllib.error
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import REAL_FMNIST

from fedhet.core.errors import DataError
from fedhet.data import datasets as ds
from fedhet.data.datasets import (
    DATASET_NAMES,
    ImageData,
    data_search_dirs,
    dataset_info,
    load_dataset,
)
from fedhet.data.datasets import catalogue as ds_catalogue
from fedhet.data.datasets import checksums as ds_checksums
from fedhet.data.datasets import download as ds_download


@pytest.fixture(autouse=True)
def isolated_env(tmp_path, monkeypatch):
    """Keep tests away from the user's home, $FEDHET_DATA and the system dataset directory."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("FEDHET_DATA", raising=False)
    monkeypatch.delenv("FEDHET_SKIP_CHECKSUM", raising=False)
    monkeypatch.setattr(ds_catalogue, "_SYSTEM_DIRS", {})
    monkeypatch.setattr(ds_checksums, "_MD5_MEMO", {})


# --------------------------------------------------------------------------- format writers


def write_idx(path: Path, arr: np.ndarray) -> Path:
    """Write ``arr`` (uint8) as an IDX file, gzip-compressed when the name ends in .gz."""
    payload = struct.pack(">I", 0x0800 | arr.ndim) + struct.pack(f">{arr.ndim}I", *arr.shape) + arr.tobytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(payload) if path.suffix == ".gz" else payload)
    return path


def mnist_arrays(n: int, seed: int = 0, num_classes: int = 10) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (n, 28, 28), dtype=np.uint8), rng.integers(0, num_classes, n).astype(np.uint8)


def write_mnist(d: Path, split: str = "train", n: int = 7, gz: bool = False, seed: int = 0):
    prefix = "train" if split == "train" else "t10k"
    x, y = mnist_arrays(n, seed)
    ext = ".gz" if gz else ""
    write_idx(d / f"{prefix}-images-idx3-ubyte{ext}", x)
    write_idx(d / f"{prefix}-labels-idx1-ubyte{ext}", y)
    return x, y


def cifar_batch(n: int, label_key: str, num_classes: int, seed: int) -> dict:
    """A batch dict shaped like the official files: bytes keys, (N, 3072) uint8 array, list labels."""
    rng = np.random.default_rng(seed)
    return {
        b"batch_label": b"testing batch",
        b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
        label_key.encode(): rng.integers(0, num_classes, n).tolist(),
        b"filenames": [f"img_{i}.png".encode() for i in range(n)],
    }


def write_pickle(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pickle.dumps(obj, protocol=2))


def write_cifar10(folder: Path) -> dict[str, dict]:
    batches = {f"data_batch_{i}": cifar_batch(3, "labels", 10, i) for i in range(1, 6)}
    batches["test_batch"] = cifar_batch(4, "labels", 10, 99)
    for fname, batch in batches.items():
        write_pickle(folder / fname, batch)
    return batches


def write_image(path: Path, arr: np.ndarray, mode: str = "RGB") -> None:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(arr, mode=None if mode == "RGB" else mode).save(path)


def leaf_file(path: Path, users: dict[str, tuple[np.ndarray, list[int]]]) -> None:
    """Write a LEAF JSON file; ``users`` maps name -> (x of shape (n, 784) in [0, 1], labels)."""
    doc = {
        "users": list(users),
        "num_samples": [len(y) for _, y in users.values()],
        "user_data": {u: {"x": x.tolist(), "y": y} for u, (x, y) in users.items()},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc))


# --------------------------------------------------------------------------- names and search dirs


def test_dataset_info_covers_every_name_without_files():
    for name in DATASET_NAMES:
        info = dataset_info(name)
        assert set(info) == {"in_channels", "image_size", "num_classes"}
    assert dataset_info("tiny_imagenet") == {"in_channels": 3, "image_size": 64, "num_classes": 200}
    assert dataset_info("femnist")["num_classes"] == 62
    assert dataset_info("emnist_letters")["num_classes"] == 26


@pytest.mark.parametrize("call", [dataset_info, load_dataset, lambda n: data_search_dirs(n, None)])
def test_unknown_name_lists_valid_names(call):
    with pytest.raises(DataError) as err:
        call("imagenet21k")
    assert "imagenet21k" in str(err.value)
    assert all(name in str(err.value) for name in DATASET_NAMES)


def test_search_dir_order(tmp_path, monkeypatch):
    monkeypatch.setattr(ds_catalogue, "_SYSTEM_DIRS", {"fashion_mnist": Path("/usr/share/datasets/fashion-mnist")})
    monkeypatch.setenv("FEDHET_DATA", str(tmp_path / "env"))
    home = tmp_path / "home"
    assert data_search_dirs("fashion_mnist", tmp_path / "r") == [
        tmp_path / "r" / "fashion_mnist",
        tmp_path / "r",
        tmp_path / "env" / "fashion_mnist",
        home / ".cache" / "fedhet" / "data" / "fashion_mnist",
        Path("/usr/share/datasets/fashion-mnist"),
    ]
    monkeypatch.delenv("FEDHET_DATA")
    assert data_search_dirs("mnist", None) == [home / ".cache" / "fedhet" / "data" / "mnist"]


def test_root_name_subdir_takes_priority(tmp_path):
    x_sub, _ = write_mnist(tmp_path / "mnist", seed=1)
    write_mnist(tmp_path, seed=2)
    assert torch.equal(load_dataset("mnist", tmp_path).x[:, 0], torch.from_numpy(x_sub))


def test_fedhet_data_env_and_home_cache_are_searched(tmp_path, monkeypatch):
    x_home, _ = write_mnist(tmp_path / "home" / ".cache" / "fedhet" / "data" / "mnist", seed=3)
    assert torch.equal(load_dataset("mnist").x[:, 0], torch.from_numpy(x_home))
    x_env, _ = write_mnist(tmp_path / "env" / "mnist", seed=4)
    monkeypatch.setenv("FEDHET_DATA", str(tmp_path / "env"))
    assert torch.equal(load_dataset("mnist").x[:, 0], torch.from_numpy(x_env))


def test_a_root_that_holds_no_files_is_said_when_they_are_found_elsewhere(tmp_path, monkeypatch):
    """A run's config records its data.root: loading from another place without a word would leave
    the record wrong. Found in the root, or in a folder under it, nothing is said."""
    import warnings

    x_env, _ = write_mnist(tmp_path / "env" / "mnist", seed=4)
    monkeypatch.setenv("FEDHET_DATA", str(tmp_path / "env"))
    (tmp_path / "empty").mkdir()
    with pytest.warns(RuntimeWarning, match=f"data.root {tmp_path / 'empty'} holds no mnist \\(train split\\) "
                                            f"files, in it or in its mnist/ folder: they were loaded from "
                                            f"{tmp_path / 'env' / 'mnist'}, the next place searched"):
        assert torch.equal(load_dataset("mnist", tmp_path / "empty").x[:, 0], torch.from_numpy(x_env))
    monkeypatch.setenv("FEDHET_DATA", str(tmp_path / "nowhere"))
    with pytest.warns(RuntimeWarning, match=f"FEDHET_DATA={tmp_path / 'nowhere'} is not a folder, so nothing is "
                                            "found there"):
        load_dataset("mnist", tmp_path / "env")
    monkeypatch.setenv("FEDHET_DATA", str(tmp_path / "env"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_dataset("mnist", tmp_path / "env")            # under the root: its mnist/ folder
        load_dataset("mnist", tmp_path / "env" / "mnist")  # the root itself
        load_dataset("mnist")                              # no root given


def test_both_splits_come_from_the_folder_that_holds_the_training_files(tmp_path, monkeypatch):
    """A copy of the training files in FEDHET_DATA and the test files elsewhere (the system's): a
    run must not train on one copy and test on another, so the split is refused, naming the folder."""
    from fedhet.data.datasets import load_splits

    x_tr, _ = write_mnist(tmp_path / "env" / "mnist", "train", seed=5)
    write_mnist(tmp_path / "home" / ".cache" / "fedhet" / "data" / "mnist", "train", seed=6)
    x_te, _ = write_mnist(tmp_path / "home" / ".cache" / "fedhet" / "data" / "mnist", "test", n=5, seed=7)
    monkeypatch.setenv("FEDHET_DATA", str(tmp_path / "env"))
    with pytest.raises(DataError, match=r"mnist: .*env/mnist holds its training files but not its test files "
                                        r"\(t10k-images-idx3-ubyte \(or t10k-images-idx3-ubyte.gz\)"):
        load_splits("mnist")
    write_mnist(tmp_path / "env" / "mnist", "test", n=5, seed=8)
    train, test = load_splits("mnist")
    assert torch.equal(train.x[:, 0], torch.from_numpy(x_tr)) and len(test) == 5
    assert not torch.equal(test.x[:, 0], torch.from_numpy(x_te))                 # the env copy's own


# --------------------------------------------------------------------------- IDX


@pytest.mark.parametrize("gz", [False, True])
def test_mnist_round_trip(tmp_path, gz):
    x_tr, y_tr = write_mnist(tmp_path, "train", n=7, gz=gz, seed=0)
    x_te, y_te = write_mnist(tmp_path, "test", n=5, gz=gz, seed=1)
    train = load_dataset("mnist", tmp_path)
    test = load_dataset("mnist", tmp_path, train=False)
    assert isinstance(train, ImageData) and train.name == "mnist" and len(train) == 7 and len(test) == 5
    assert train.x.dtype == torch.uint8 and train.x.shape == (7, 1, 28, 28) and train.x.is_contiguous()
    assert train.y.dtype == torch.int64 and train.y.shape == (7,)
    assert np.array_equal(train.x[:, 0].numpy(), x_tr) and np.array_equal(train.y.numpy(), y_tr)
    assert np.array_equal(test.x[:, 0].numpy(), x_te) and np.array_equal(test.y.numpy(), y_te)
    assert train.num_classes == 10 and train.mean == (0.1307,) and train.std == (0.3081,)
    assert train.writers is None


def test_emnist_letters_transposed_and_labels_shifted(tmp_path):
    rng = np.random.default_rng(5)
    stored = rng.integers(0, 256, (4, 28, 28), dtype=np.uint8)
    labels = np.array([1, 26, 13, 2], dtype=np.uint8)
    write_idx(tmp_path / "emnist-letters-test-images-idx3-ubyte.gz", stored)
    write_idx(tmp_path / "emnist-letters-test-labels-idx1-ubyte.gz", labels)
    data = load_dataset("emnist_letters", tmp_path, train=False)
    assert np.array_equal(data.x[:, 0].numpy(), stored.transpose(0, 2, 1))
    assert data.x.is_contiguous()
    assert data.y.tolist() == [0, 25, 12, 1] and data.num_classes == 26


def test_emnist_label_zero_rejected(tmp_path):
    write_idx(tmp_path / "emnist-letters-train-images-idx3-ubyte", np.zeros((2, 28, 28), np.uint8))
    write_idx(tmp_path / "emnist-letters-train-labels-idx1-ubyte", np.array([0, 3], np.uint8))
    with pytest.raises(DataError, match="1..26"):
        load_dataset("emnist_letters", tmp_path)


def test_bad_magic_names_file(tmp_path):
    write_mnist(tmp_path)
    labels = tmp_path / "train-labels-idx1-ubyte"
    images = tmp_path / "train-images-idx3-ubyte"
    labels.write_bytes(images.read_bytes())  # an images file where labels belong
    with pytest.raises(DataError) as err:
        load_dataset("mnist", tmp_path)
    assert str(labels) in str(err.value) and "magic" in str(err.value) and "2049" in str(err.value)


@pytest.mark.parametrize("cut", [10, 200])  # inside the header, inside the pixels
def test_truncated_idx(tmp_path, cut):
    write_mnist(tmp_path)
    images = tmp_path / "train-images-idx3-ubyte"
    images.write_bytes(images.read_bytes()[:cut])
    with pytest.raises(DataError, match="truncated") as err:
        load_dataset("mnist", tmp_path)
    assert str(images) in str(err.value)


def test_truncated_gzip(tmp_path):
    write_mnist(tmp_path, gz=True)
    images = tmp_path / "train-images-idx3-ubyte.gz"
    images.write_bytes(images.read_bytes()[:-20])
    with pytest.raises(DataError, match="truncated or corrupt") as err:
        load_dataset("mnist", tmp_path)
    assert str(images) in str(err.value)


def test_image_label_count_mismatch(tmp_path):
    write_mnist(tmp_path, n=7)
    write_idx(tmp_path / "train-labels-idx1-ubyte", np.zeros(6, np.uint8))
    with pytest.raises(DataError, match="7 images but .* 6 labels"):
        load_dataset("mnist", tmp_path)


def test_wrong_image_size_and_label_range(tmp_path):
    write_idx(tmp_path / "train-images-idx3-ubyte", np.zeros((2, 32, 32), np.uint8))
    write_idx(tmp_path / "train-labels-idx1-ubyte", np.zeros(2, np.uint8))
    with pytest.raises(DataError, match="32x32, expected 28x28"):
        load_dataset("mnist", tmp_path)
    write_idx(tmp_path / "train-images-idx3-ubyte", np.zeros((2, 28, 28), np.uint8))
    write_idx(tmp_path / "train-labels-idx1-ubyte", np.array([3, 10], np.uint8))
    with pytest.raises(DataError, match="0..9"):
        load_dataset("mnist", tmp_path)


# --------------------------------------------------------------------------- checksums


def content_md5(path: Path) -> str:
    raw = path.read_bytes()
    return hashlib.md5(gzip.decompress(raw) if path.suffix == ".gz" else raw).hexdigest()


def test_checksum_mismatch_and_skip(tmp_path, monkeypatch):
    write_mnist(tmp_path, gz=True)
    labels = tmp_path / "train-labels-idx1-ubyte.gz"
    monkeypatch.setitem(ds_checksums._CHECKSUMS, "mnist", {"train-labels-idx1-ubyte": "0" * 32})
    with pytest.raises(DataError) as err:
        load_dataset("mnist", tmp_path)
    msg = str(err.value)
    assert str(labels) in msg and "0" * 32 in msg and content_md5(labels) in msg
    assert "corrupt or a different version" in msg and "FEDHET_SKIP_CHECKSUM=1" in msg and "yann.lecun.com" in msg
    assert len(load_dataset("mnist", tmp_path, verify=False)) == 7
    monkeypatch.setenv("FEDHET_SKIP_CHECKSUM", "1")
    assert len(load_dataset("mnist", tmp_path)) == 7


def test_checksum_is_of_decompressed_content(tmp_path, monkeypatch):
    """A raw file and any gzip of it verify against the same md5."""
    write_mnist(tmp_path / "raw")
    write_mnist(tmp_path / "gz", gz=True)
    expected = content_md5(tmp_path / "raw" / "train-images-idx3-ubyte")
    monkeypatch.setitem(ds_checksums._CHECKSUMS, "mnist", {"train-images-idx3-ubyte": expected})
    assert len(load_dataset("mnist", tmp_path / "raw")) == 7
    assert len(load_dataset("mnist", tmp_path / "gz")) == 7


def test_verification_is_cached_by_size_and_mtime(tmp_path, monkeypatch):
    write_mnist(tmp_path)
    images = tmp_path / "train-images-idx3-ubyte"
    monkeypatch.setitem(ds_checksums._CHECKSUMS, "mnist", {"train-images-idx3-ubyte": content_md5(images)})
    load_dataset("mnist", tmp_path)
    assert str(images.resolve()) in json.loads(ds_checksums._md5_cache_file().read_text())

    def no_hashing(*args, **kwargs):
        raise AssertionError("file was re-hashed")

    monkeypatch.setattr(ds_checksums.hashlib, "md5", no_hashing)
    load_dataset("mnist", tmp_path)  # in-process memo
    ds_checksums._MD5_MEMO.clear()
    load_dataset("mnist", tmp_path)  # cache file
    os.utime(images, ns=(1, 1))  # a changed file must be hashed again
    with pytest.raises(AssertionError, match="re-hashed"):
        load_dataset("mnist", tmp_path)


def test_unwritable_cache_falls_back_to_memo(tmp_path, monkeypatch):
    write_mnist(tmp_path)
    images = tmp_path / "train-images-idx3-ubyte"
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setattr(ds_checksums, "_md5_cache_file", lambda: blocker / "verified-md5.json")
    monkeypatch.setitem(ds_checksums._CHECKSUMS, "mnist", {"train-images-idx3-ubyte": content_md5(images)})
    monkeypatch.setattr(ds_checksums, "_MD5_MEMO", {})
    first = load_dataset("mnist", tmp_path)
    assert [md5 for _, _, md5 in ds_checksums._MD5_MEMO.values()] == [content_md5(images)]   # hashed once, kept
    monkeypatch.setattr(ds_checksums.hashlib, "md5", None)  # any hashing attempt would now fail
    again = load_dataset("mnist", tmp_path)
    assert torch.equal(again.x, first.x) and torch.equal(again.y, first.y)


# --------------------------------------------------------------------------- missing files / download


def test_missing_files_message(tmp_path, monkeypatch):
    monkeypatch.setattr(ds_catalogue, "_SYSTEM_DIRS", {"fashion_mnist": tmp_path / "system"})
    monkeypatch.setenv("FEDHET_DATA", str(tmp_path / "env"))
    with pytest.raises(DataError) as err:
        load_dataset("fashion_mnist", tmp_path / "r", train=False)
    msg = str(err.value)
    assert "t10k-images-idx3-ubyte" in msg and "t10k-labels-idx1-ubyte" in msg
    for d in data_search_dirs("fashion_mnist", tmp_path / "r"):
        assert str(d) in msg
    assert "apt-get install dataset-fashion-mnist" in msg and "zalandoresearch" in msg and "download=True" in msg


@pytest.mark.parametrize(
    "name, hint",
    [
        ("cifar100", "cifar-100-python.tar.gz"),
        ("cinic10", "cinic-10/train"),
        ("tiny_imagenet", "tiny-imagenet-200.zip"),
        ("femnist", "TalwalkarLab/leaf"),
        ("emnist_letters", "emnist-letters-train-images-idx3-ubyte"),
    ],
)
def test_missing_files_hints(tmp_path, name, hint):
    with pytest.raises(DataError, match="not found") as err:
        load_dataset(name, tmp_path)
    assert hint in str(err.value) and str(tmp_path) in str(err.value)


def test_download_without_network_is_clean_error(tmp_path, monkeypatch):
    def offline(*args, **kwargs):
        raise urllib.error.URLError("Temporary failure in name resolution")

    monkeypatch.setattr(ds_download.urllib.request, "urlopen", offline)
    with pytest.raises(DataError) as err:
        load_dataset("cifar10", tmp_path, download=True)
    msg = str(err.value)
    assert "network" in msg and "cifar-10-python.tar.gz" in msg and "name resolution" in msg
    assert not list((tmp_path / "cifar10").iterdir())  # no partial files left behind


def test_download_saves_verified_files(tmp_path, monkeypatch):
    payloads = {}
    for stem, arr in (("train-images-idx3-ubyte", mnist_arrays(3)[0]), ("train-labels-idx1-ubyte", mnist_arrays(3)[1])):
        write_idx(tmp_path / "src" / f"{stem}.gz", arr)
        payloads[f"{stem}.gz"] = (tmp_path / "src" / f"{stem}.gz").read_bytes()
    files = tuple((f, hashlib.md5(b).hexdigest()) for f, b in payloads.items())
    monkeypatch.setitem(ds._DOWNLOADS, "mnist", (("https://bad.invalid/", "https://good.invalid/"), files))
    requested = []

    def fake_urlopen(url, timeout):
        requested.append(url)
        body = payloads[url.rsplit("/", 1)[1]]
        return io.BytesIO(body if url.startswith("https://good") else body[:5])  # first mirror: corrupt

    monkeypatch.setattr(ds_download.urllib.request, "urlopen", fake_urlopen)
    data = load_dataset("mnist", tmp_path / "data", download=True)
    assert len(data) == 3 and np.array_equal(data.x[:, 0].numpy(), mnist_arrays(3)[0])
    assert sorted(p.name for p in (tmp_path / "data" / "mnist").iterdir()) == sorted(payloads)
    assert len(requested) == 4


def test_download_unsupported_dataset_says_so(tmp_path):
    with pytest.raises(DataError, match="download=True is only supported"):
        load_dataset("cinic10", tmp_path, download=True)


# --------------------------------------------------------------------------- CIFAR
# Synthetic batches cannot match the official md5s, so these tests load with verify=False.


def test_cifar10_folder_round_trip(tmp_path):
    batches = write_cifar10(tmp_path / "cifar-10-batches-py")
    train = load_dataset("cifar10", tmp_path, verify=False)
    test = load_dataset("cifar10", tmp_path, train=False, verify=False)
    assert train.x.shape == (15, 3, 32, 32) and train.x.dtype == torch.uint8 and train.x.is_contiguous()
    expected = np.concatenate([batches[f"data_batch_{i}"][b"data"] for i in range(1, 6)]).reshape(-1, 3, 32, 32)
    assert np.array_equal(train.x.numpy(), expected)
    assert train.y.tolist() == sum((batches[f"data_batch_{i}"][b"labels"] for i in range(1, 6)), [])
    assert test.y.tolist() == batches["test_batch"][b"labels"] and len(test) == 4
    assert train.mean == (0.4914, 0.4822, 0.4465) and train.num_classes == 10


def test_cifar100_uses_fine_labels(tmp_path):
    batch = cifar_batch(6, "fine_labels", 100, 7)
    batch[b"coarse_labels"] = [0] * 6
    write_pickle(tmp_path / "cifar100" / "cifar-100-python" / "test", batch)
    data = load_dataset("cifar100", tmp_path, train=False, verify=False)
    assert data.y.tolist() == batch[b"fine_labels"] and data.num_classes == 100
    assert np.array_equal(data.x.numpy().reshape(6, -1), batch[b"data"])


def test_cifar_archive_extracted_once(tmp_path):
    staging = tmp_path / "staging"
    batches = write_cifar10(staging / "cifar-10-batches-py")
    archive = tmp_path / "cifar-10-python.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(staging / "cifar-10-batches-py", arcname="cifar-10-batches-py")
    test = load_dataset("cifar10", tmp_path, train=False, verify=False)
    assert test.y.tolist() == batches["test_batch"][b"labels"]
    assert (tmp_path / "cifar-10-batches-py" / "data_batch_5").is_file()
    assert not list(tmp_path.glob(".fedhet-extract-*"))
    archive.unlink()  # the extracted folder is now used directly
    assert len(load_dataset("cifar10", tmp_path, verify=False)) == 15


def test_corrupt_cifar_archive(tmp_path):
    (tmp_path / "cifar-10-python.tar.gz").write_bytes(b"\x1f\x8b not really gzip")
    with pytest.raises(DataError, match="cannot extract"):
        load_dataset("cifar10", tmp_path, verify=False)


def test_cifar_pickle_cannot_run_code(tmp_path):
    class Exploit:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    write_pickle(tmp_path / "cifar-100-python" / "train", {b"data": Exploit()})
    with pytest.raises(DataError, match="not a readable CIFAR batch"):
        load_dataset("cifar100", tmp_path, verify=False)


def test_cifar_wrong_shape(tmp_path):
    write_pickle(tmp_path / "cifar-100-python" / "test", {b"data": np.zeros((2, 100), np.uint8), b"fine_labels": [0, 1]})
    with pytest.raises(DataError, match=r"\(N, 3072\)"):
        load_dataset("cifar100", tmp_path, train=False, verify=False)


@pytest.mark.parametrize(("labels", "got"), [([0.0, 1.7], r"float64 of shape \(2,\)"),
                                             ([[0], [1]], r"int64 of shape \(2, 1\)"),
                                             (["cat", "dog"], r"<U3 of shape \(2,\)"), (3, "int"),
                                             (None, "missing")])
def test_cifar_labels_that_are_not_one_whole_number_per_image_are_named(tmp_path, labels, got):
    """Unchecked (verify=False), float labels would be cut to whole numbers, other shapes a numpy error."""
    write_pickle(tmp_path / "cifar-100-python" / "test", {b"data": np.zeros((2, 3072), np.uint8),
                                                          **({} if labels is None else {b"fine_labels": labels})})
    with pytest.raises(DataError, match=r"cifar-100-python/test: 'fine_labels' must be one whole-number label per "
                                        rf"image \(2\), got {got}"):
        load_dataset("cifar100", tmp_path, train=False, verify=False)


def test_cifar_checksum_table_used(tmp_path):
    write_cifar10(tmp_path / "cifar-10-batches-py")
    with pytest.raises(DataError, match="40351d587109b95175f43aff81a1287e"):  # the official test_batch md5
        load_dataset("cifar10", tmp_path, train=False)


# --------------------------------------------------------------------------- image folders


def test_cinic10_png_folders(tmp_path):
    pytest.importorskip("PIL")
    classes = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    rng = np.random.default_rng(0)
    expected = {}
    for label, cls in enumerate(classes):
        for i in range(2 if label == 0 else 1):
            arr = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
            write_image(tmp_path / "cinic-10" / "test" / cls / f"img{i}.png", arr)
            expected.setdefault(label, []).append(arr)
    gray = rng.integers(0, 256, (32, 32), dtype=np.uint8)  # CINIC contains some grayscale images
    write_image(tmp_path / "cinic-10" / "test" / "truck" / "z_gray.png", gray, mode="L")
    data = load_dataset("cinic10", tmp_path, train=False)
    assert data.x.shape == (12, 3, 32, 32) and data.x.dtype == torch.uint8 and data.x.is_contiguous()
    assert data.y.tolist() == [0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 9]
    assert np.array_equal(data.x[0].permute(1, 2, 0).numpy(), expected[0][0])  # PNG is lossless
    assert all(np.array_equal(data.x[11, c].numpy(), gray) for c in range(3))


def test_cinic10_wrong_class_count(tmp_path):
    pytest.importorskip("PIL")
    write_image(tmp_path / "cinic-10" / "train" / "cat" / "a.png", np.zeros((32, 32, 3), np.uint8))
    with pytest.raises(DataError, match="expected 10 class folders, found 1"):
        load_dataset("cinic10", tmp_path)


def test_image_folders_need_pillow(tmp_path, monkeypatch):
    for i in range(10):
        (tmp_path / "cinic-10" / "train" / f"class{i}").mkdir(parents=True)
    monkeypatch.setitem(sys.modules, "PIL", None)  # makes `import PIL` fail
    with pytest.raises(DataError, match="pip install pillow"):
        load_dataset("cinic10", tmp_path)


def class_colour(c: int) -> np.ndarray:
    """A flat 64x64 image whose red and green levels spell class ``c`` (< 256) in base 16, 16 levels
    apart: JPEG's rounding moves a flat colour by a few levels, far less than the 8 that would make
    one class read as its neighbour."""
    return np.full((64, 64, 3), (16 * (c // 16) + 8, 16 * (c % 16) + 8, 128), np.uint8)


def class_of_colour(x: torch.Tensor) -> list[int]:
    """The class each image of ``x`` (N, 3, H, W) spells, read back from its mean red and green."""
    red, green = ((x.float().mean(dim=(2, 3))[:, :2] - 8) / 16).round().long().unbind(1)
    return (16 * red + green).tolist()


def make_tiny(root: Path, with_wnids: bool) -> list[str]:
    wnids = [f"n{i:08d}" for i in range(200)]
    for i, wnid in enumerate(reversed(wnids)):  # creation order must not matter
        value = 200 - 1 - i
        write_image(root / "train" / wnid / "images" / f"{wnid}_0.JPEG", class_colour(value))
    if with_wnids:
        (root / "wnids.txt").write_text("\n".join(reversed(wnids)) + "\n")
    val = {"val_1.JPEG": wnids[7], "val_0.JPEG": wnids[3], "val_2.JPEG": wnids[199]}
    for fname, wnid in val.items():
        write_image(root / "val" / "images" / fname, class_colour(wnids.index(wnid)))
    (root / "val" / "val_annotations.txt").write_text(
        "".join(f"{f}\t{w}\t0\t0\t63\t63\n" for f, w in val.items())
    )
    return wnids


@pytest.mark.parametrize("with_wnids", [True, False])
def test_tiny_imagenet_train_and_val(tmp_path, with_wnids):
    pytest.importorskip("PIL")
    make_tiny(tmp_path / "tiny-imagenet-200", with_wnids)
    train = load_dataset("tiny_imagenet", tmp_path)
    assert train.x.shape == (200, 3, 64, 64) and train.y.tolist() == list(range(200))
    assert class_of_colour(train.x) == train.y.tolist()   # each image is its own class's colour
    val = load_dataset("tiny_imagenet", tmp_path, train=False)
    assert val.y.tolist() == [3, 7, 199]  # sorted by file name: val_0, val_1, val_2
    assert class_of_colour(val.x) == val.y.tolist()
    assert val.num_classes == 200 and val.mean == (0.4802, 0.4481, 0.3975)


def test_tiny_imagenet_bad_annotation(tmp_path):
    pytest.importorskip("PIL")
    root = tmp_path / "tiny-imagenet-200"
    make_tiny(root, with_wnids=True)
    (root / "val" / "val_annotations.txt").write_text("val_0.JPEG\tn99999999\t0\t0\t1\t1\n")
    with pytest.raises(DataError, match=r"val_annotations.txt:1"):
        load_dataset("tiny_imagenet", tmp_path, train=False)


def test_undecodable_image_names_file(tmp_path):
    pytest.importorskip("PIL")
    for i in range(10):
        write_image(tmp_path / "cinic-10" / "train" / f"c{i}" / "a.png", np.zeros((32, 32, 3), np.uint8))
    bad = tmp_path / "cinic-10" / "train" / "c3" / "b.png"
    bad.write_bytes(b"not a png")
    with pytest.raises(DataError, match="cannot decode") as err:
        load_dataset("cinic10", tmp_path)
    assert str(bad) in str(err.value)


# --------------------------------------------------------------------------- FEMNIST


def leaf_user(n: int, labels: list[int], seed: int) -> tuple[np.ndarray, list[int]]:
    return np.random.default_rng(seed).integers(0, 256, (n, 784)) / 255.0, labels


def test_femnist_leaf_json(tmp_path):
    base = tmp_path / "femnist"
    users_train = {"f0002_11": leaf_user(2, [0, 61], 1), "f0000_14": leaf_user(3, [5, 5, 36], 2)}
    leaf_file(base / "train" / "all_data_0_niid_train.json", {"f0002_11": users_train["f0002_11"]})
    leaf_file(base / "train" / "all_data_1_niid_train.json", {"f0000_14": users_train["f0000_14"]})
    # Test has one user absent from train: indices still come from the union, so they agree.
    leaf_file(base / "test" / "all_data_0_niid_test.json", {"f0001_01": leaf_user(1, [9], 3), "f0002_11": leaf_user(1, [1], 4)})
    train = load_dataset("femnist", tmp_path)
    test = load_dataset("femnist", tmp_path, train=False)
    assert train.x.shape == (5, 1, 28, 28) and train.x.dtype == torch.uint8
    assert train.y.tolist() == [0, 61, 5, 5, 36] and train.num_classes == 62
    # union sorted: f0000_14 -> 0, f0001_01 -> 1, f0002_11 -> 2
    assert train.writers.dtype == np.int64 and train.writers.tolist() == [2, 2, 0, 0, 0]
    assert test.writers.tolist() == [1, 2] and test.y.tolist() == [9, 1]
    x0 = users_train["f0002_11"][0]
    assert np.array_equal(train.x[:2].reshape(2, 784).numpy(), np.rint(x0 * 255).astype(np.uint8))


def test_femnist_leaf_data_subfolder_and_single_split(tmp_path):
    leaf_file(tmp_path / "femnist" / "data" / "test" / "t.json", {"u1": leaf_user(2, [3, 4], 0)})
    data = load_dataset("femnist", tmp_path, train=False)
    assert data.writers.tolist() == [0, 0] and data.y.tolist() == [3, 4]


def test_femnist_malformed(tmp_path):
    path = tmp_path / "femnist" / "train" / "bad.json"
    leaf_file(path, {"u1": (np.zeros((1, 100)), [0])})
    with pytest.raises(DataError, match="784") as err:
        load_dataset("femnist", tmp_path)
    assert str(path) in str(err.value)
    path.write_text('{"users": ["u1"], "user_data": {}}')
    with pytest.raises(DataError, match="not a valid LEAF FEMNIST file"):
        load_dataset("femnist", tmp_path)
    nan = np.full((1, 784), 0.5)
    nan[0, 3] = np.nan
    for user, message in [((np.zeros((1, 784)), [1.5]), "user 'u1': labels must be whole numbers, got float64"),
                          ((nan, [1]), "user 'u1': 1 pixel values are NaN or infinite")]:
        leaf_file(path, {"u1": user})
        with pytest.raises(DataError, match=message):
            load_dataset("femnist", tmp_path)


def test_femnist_files_are_parsed_once_and_read_from_their_cache_until_they_change(tmp_path, monkeypatch):
    from fedhet.data.datasets import femnist

    path = tmp_path / "femnist" / "train" / "a.json"
    leaf_file(path, {"u1": leaf_user(3, [4, 5, 6], 0), "u0": leaf_user(2, [7, 8], 1)})
    assert not femnist._cache_path(path).exists()
    first = load_dataset("femnist", tmp_path)
    assert femnist._cache_path(path).is_file()

    def no_parsing(p):
        raise AssertionError(f"{p} parsed again")

    parse = femnist._parse_leaf_file
    monkeypatch.setattr(femnist, "_parse_leaf_file", no_parsing)
    again = load_dataset("femnist", tmp_path)
    assert torch.equal(again.x, first.x) and torch.equal(again.y, first.y)
    assert again.writers.tolist() == first.writers.tolist() == [1, 1, 1, 0, 0]
    monkeypatch.setattr(femnist, "_parse_leaf_file", parse)
    # the file changed: parsed again, not read from the cache
    leaf_file(path, {"u1": leaf_user(1, [9], 2)})
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 1_000_000))
    assert load_dataset("femnist", tmp_path).y.tolist() == [9]
    # a damaged cache is parsed again and replaced
    cache = femnist._cache_path(path)
    whole = cache.read_bytes()
    for damaged in (b"not an npz", whole[:len(whole) // 2]):        # a foreign file, a zip cut short
        cache.write_bytes(damaged)
        assert load_dataset("femnist", tmp_path).y.tolist() == [9]
        assert femnist._cached(cache, path.stat()) is not None
    # the other split's writers, for their numbers: read from the cache without its pixels
    users = femnist.read_leaf_file(path, users_only=True)
    assert users.users == ["u1"] and users.pixels.shape == (0, 784)


def test_a_femnist_cache_that_cannot_be_written_is_said_and_the_data_still_loads(tmp_path, monkeypatch):
    from fedhet.data.datasets import femnist

    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the cache folder would be")
    monkeypatch.setattr(femnist, "_leaf_cache_dir", lambda: blocker / "leaf")
    leaf_file(tmp_path / "femnist" / "test" / "t.json", {"u1": leaf_user(2, [3, 4], 0)})
    with pytest.warns(UserWarning, match=r"t.json could not be kept parsed in .*blocker/leaf .*parsed again at every "
                                         r"load"):
        data = load_dataset("femnist", tmp_path, train=False)
    assert data.y.tolist() == [3, 4]


# --------------------------------------------------------------------------- ImageData


def test_image_data_validates_shapes():
    x = torch.zeros(2, 1, 28, 28, dtype=torch.uint8)
    with pytest.raises(ValueError):
        ImageData(x=x, y=torch.zeros(3, dtype=torch.int64), num_classes=10, mean=(0.5,), std=(0.5,))
    with pytest.raises(ValueError):
        ImageData(x=x.float(), y=torch.zeros(2, dtype=torch.int64), num_classes=10, mean=(0.5,), std=(0.5,))
    assert len(ImageData(x=x, y=torch.zeros(2, dtype=torch.int64), num_classes=10, mean=(0.5,), std=(0.5,))) == 2


# --------------------------------------------------------------------------- real data


@pytest.mark.skipif(not REAL_FMNIST.is_dir(), reason="Debian's dataset-fashion-mnist is not installed")
def test_real_fashion_mnist(monkeypatch):
    monkeypatch.setattr(ds_catalogue, "_SYSTEM_DIRS", {"fashion_mnist": REAL_FMNIST})
    train = load_dataset("fashion_mnist", verify=True)
    test = load_dataset("fashion_mnist", train=False, verify=True)
    assert train.x.shape == (60000, 1, 28, 28) and test.x.shape == (10000, 1, 28, 28)
    assert torch.bincount(train.y).tolist() == [6000] * 10
    assert torch.bincount(test.y).tolist() == [1000] * 10
    mean = train.x.float().div(255).mean().item()
    assert abs(mean - train.mean[0]) < 1e-3
