"""Data of the user's own without a loader: arrays in an .npz file and a folder of images per class,
with every partition, and data already split by user as the natural partition."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import fedhet
from fedhet.core.errors import DataError
from fedhet.data.datasets import load_dataset
from fedhet.data.federated import build_federation
from fedhet.experiment.config import load_config


def arrays(n_train=120, n_test=40, classes=4, layout="nhw", seed=0, side=12):
    rng = np.random.default_rng(seed)
    shape = {"nhw": (side, side), "nhwc": (side, side, 3), "nchw": (3, side, side)}[layout]
    x_train = rng.integers(0, 256, (n_train, *shape), dtype=np.uint8)
    x_test = rng.integers(0, 256, (n_test, *shape), dtype=np.uint8)
    return {"x_train": x_train, "y_train": np.arange(n_train) % classes, "x_test": x_test,
            "y_test": np.arange(n_test) % classes}


def write_npz(tmp_path, name="mine.npz", **arrs):
    path = tmp_path / name
    np.savez(path, **arrs)
    return f"npz:{path}"


@pytest.mark.parametrize("layout", ["nhw", "nhwc", "nchw"])
def test_npz_arrays_load_in_any_channel_layout(tmp_path, layout):
    arrs = arrays(layout=layout)
    name = write_npz(tmp_path, **arrs)
    train, test = load_dataset(name, train=True), load_dataset(name, train=False)
    channels = 1 if layout == "nhw" else 3
    assert tuple(train.x.shape) == (120, channels, 12, 12) and tuple(test.x.shape) == (40, channels, 12, 12)
    assert train.num_classes == test.num_classes == 4
    expected = arrs["x_train"][:, None] if layout == "nhw" else (
        arrs["x_train"].transpose(0, 3, 1, 2) if layout == "nhwc" else arrs["x_train"])
    assert torch.equal(train.x, torch.from_numpy(expected))
    assert train.y.tolist() == arrs["y_train"].tolist()
    # normalised with the training split's own moments, per channel
    torch.testing.assert_close(torch.tensor(train.mean, dtype=torch.float64),
                               torch.from_numpy(expected / 255.0).mean(dim=(0, 2, 3)))


def test_float_images_in_unit_range_and_an_explicit_class_count(tmp_path):
    arrs = arrays()
    arrs["x_train"] = arrs["x_train"] / 255.0
    name = write_npz(tmp_path, **arrs, num_classes=np.array(7))
    data = load_dataset(name)
    assert data.x.dtype == torch.uint8 and data.num_classes == 7
    for seven in (np.array([7]), np.array(7.0)):        # as numpy may have saved a count: still seven classes
        assert load_dataset(write_npz(tmp_path, "other.npz", **arrs, num_classes=seven)).num_classes == 7
    assert torch.equal(data.x, torch.from_numpy(arrays()["x_train"][:, None]))


def test_clients_train_is_the_natural_partition(small_config, tmp_path):
    arrs = arrays()
    users = np.repeat([30, 10, 20], 40)                 # three users' images, ids as the data has them
    name = write_npz(tmp_path, **arrs, clients_train=users)
    raw = copy.deepcopy(small_config)
    raw["data"] = {"dataset": name, "num_clients": 3, "partition": {"kind": "natural"},
                   "local_test": {"source": "test_set", "fraction": 0.2}}
    fed = build_federation(load_config(raw=raw).data, seed=0)
    got = sorted(tuple(idx.tolist()) for idx in fed.train_idx)
    assert got == sorted(tuple(np.flatnonzero(users == u).tolist()) for u in (10, 20, 30))


def test_the_natural_partition_says_how_to_give_data_its_clients(small_config, tmp_path):
    from fedhet.core.errors import PartitionError

    raw = copy.deepcopy(small_config)
    raw["data"] = {"dataset": write_npz(tmp_path, **arrays(), clients_train=np.repeat([0, 1, 2], 40)),
                   "num_clients": 3, "partition": {"kind": "natural"}, "pool": "train+test",
                   "local_test": {"source": "holdout", "fraction": 0.2}}
    with pytest.raises(PartitionError, match=r"has none in this pool: use data.pool: train \(the test split"):
        build_federation(load_config(raw=raw).data, seed=0)
    raw["data"].update(dataset=write_npz(tmp_path, "no_ids.npz", **arrays()), pool="train")
    with pytest.raises(PartitionError, match=r"natural clients \(femnist's writers, or the client ids of data of your "
                                             r"own: clients_train in an npz file.*has none in this pool: give the "
                                             r"data them, or choose another data.partition.kind"):
        build_federation(load_config(raw=raw).data, seed=0)


def test_a_run_on_npz_data_with_a_dirichlet_partition(small_config, tmp_path):
    raw = copy.deepcopy(small_config)
    raw["data"] = {"dataset": write_npz(tmp_path, **arrays(n_train=300, n_test=100, layout="nhwc", side=16)), "num_clients": 4,
                   "partition": {"kind": "dirichlet", "alpha": 1.0, "min_size": 10},
                   "local_test": {"source": "holdout", "fraction": 0.2}}
    raw["model"] = {"arch": "cnn2"}
    raw["train"]["rounds"] = 1
    res = fedhet.run(raw, out=tmp_path / "run", progress=False)
    assert res.summary["status"] == "completed"
    assert [r["round"] for r in res.rows] == [1] and len(res.metric("global_acc")) == 1
    # what the run trained on: the NHWC arrays read as NCHW, four clients of at least min_size
    # samples before the 20% holdout, the whole training split among them once
    fed = build_federation(load_config(raw=raw).data, seed=raw["seed"])
    assert fed.num_clients == 4 and tuple(fed.pool.x.shape) == (300, 3, 16, 16)
    sizes = [len(fed.train_idx[c]) + len(fed.test_idx[c]) for c in range(4)]
    assert min(sizes) >= 10 and sum(sizes) == 300
    assert sorted(torch.cat([*fed.train_idx, *fed.test_idx]).tolist()) == list(range(300))


@pytest.mark.parametrize(("change", "message"), [
    (lambda a: a.pop("y_test"), r"missing arrays \['y_test'\]"),
    (lambda a: a.update(x_train=np.zeros((5, 12, 10), np.uint8)), "must be .* square"),
    (lambda a: a.update(x_train=np.full((120, 12, 12), 2.0)), r"float images must lie in \[0, 1\]"),
    (lambda a: a.update(x_train=np.zeros((120, 12, 12), np.int32)), "must be uint8 pixels"),
    (lambda a: a.update(y_train=-np.ones(120, np.int64)), "labels must be 0..num_classes-1, found -1"),
    (lambda a: a.update(y_train=np.zeros(7, np.int64)), r"one whole number per image \(120\)"),
    (lambda a: a.update(num_classes=np.array(2)), "num_classes is 2 but a label is 3"),
    (lambda a: a.update(clients_train=np.zeros(3, np.int64)), r"one whole-number client id per training image \(120\)"),
    (lambda a: a.update(num_classes=np.array(4.7)), r"num_classes must be one whole number, got float64 \(\)"),
    (lambda a: a.update(num_classes=np.array([4, 5])), r"num_classes must be one whole number, got int64 \(2,\)"),
    (lambda a: a.update(num_classes=np.array(np.nan)), r"num_classes must be one whole number, got float64 \(\)"),
    (lambda a: a.update(x_train=np.where(np.arange(120)[:, None, None] == 5, np.nan, a["x_train"] / 255.0)),
     r"float images hold 144 NaN or infinite values; they must lie in \[0, 1\]"),      # one 12x12 image
])
def test_bad_arrays_are_clear_errors(tmp_path, change, message):
    arrs = arrays()
    change(arrs)
    name = write_npz(tmp_path, **arrs)
    with pytest.raises(DataError, match=f"data.dataset npz:{tmp_path}/mine.npz: .*{message}"):
        load_dataset(name)


def test_missing_files_and_paths_say_what_to_write(tmp_path):
    with pytest.raises(DataError, match="no such file .*numpy.savez"):
        load_dataset(f"npz:{tmp_path}/none.npz")
    (tmp_path / "bad.npz").write_text("not numpy")
    with pytest.raises(DataError, match="not a readable .npz file"):
        load_dataset(f"npz:{tmp_path}/bad.npz")
    whole = (tmp_path / write_npz(tmp_path, **arrays()).removeprefix(f"npz:{tmp_path}/")).read_bytes()
    for damaged in (b"", whole[: len(whole) // 2]):              # an empty file, a copy cut in half
        (tmp_path / "cut.npz").write_bytes(damaged)
        with pytest.raises(DataError, match=r"cut.npz: not a readable .npz file \((EOFError|BadZipFile)"):
            load_dataset(f"npz:{tmp_path}/cut.npz")
    np.save(tmp_path / "one.npy", np.zeros(3))
    (tmp_path / "one.npy").rename(tmp_path / "one.npz")
    with pytest.raises(DataError, match=r"one.npz: holds one array \(a .npy file\?\), not the arrays of a .npz"):
        load_dataset(f"npz:{tmp_path}/one.npz")
    with pytest.raises(DataError, match="names no path; write npz:PATH"):
        load_dataset("npz:")
    with pytest.raises(DataError, match="data of your own: npz:PATH .*, folder:PATH .* or MODULE:FUNCTION"):
        load_dataset("my_images")


def write_folder(root, classes=("cat", "dog"), per_class=(3, 2), mode="L", size=(10, 10)):
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, count in zip(("train", "test"), per_class):
        for cls in classes:
            (root / split / cls).mkdir(parents=True, exist_ok=True)
            for i in range(count):
                shape = size[::-1] if mode == "L" else (*size[::-1], 3)
                Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode).save(root / split / cls / f"{i}.png")


@pytest.mark.parametrize(("mode", "channels"), [("L", 1), ("RGB", 3)])
def test_a_folder_of_images_per_class(tmp_path, mode, channels):
    from PIL import Image

    write_folder(tmp_path, mode=mode)
    train = load_dataset(f"folder:{tmp_path}")
    test = load_dataset(f"folder:{tmp_path}", train=False)
    assert tuple(train.x.shape) == (6, channels, 10, 10) and tuple(test.x.shape) == (4, channels, 10, 10)
    assert train.y.tolist() == [0, 0, 0, 1, 1, 1] and train.num_classes == 2       # cat, dog: sorted names
    with Image.open(tmp_path / "train" / "dog" / "1.png") as im:
        pixels = np.array(im)
    expected = pixels[None] if mode == "L" else pixels.transpose(2, 0, 1)
    assert torch.equal(train.x[4], torch.from_numpy(expected))


def test_a_folder_with_mixed_sizes_or_no_test_split_is_a_clear_error(tmp_path):
    from PIL import Image

    write_folder(tmp_path)
    Image.fromarray(np.zeros((8, 8), np.uint8), "L").save(tmp_path / "train" / "cat" / "odd.png")
    with pytest.raises(DataError, match=r"odd.png is 8x8 \(width x height\), but the images must all be one square "
                                        r"size \(the first, 0.png, is 10x10\)"):
        load_dataset(f"folder:{tmp_path}")
    with pytest.raises(DataError, match="needs .*train and .*test, each with one folder of images per class"):
        load_dataset(f"folder:{tmp_path / 'train'}")


def test_a_folders_16_bit_grayscale_images_are_scaled_to_8_bits_and_a_broken_one_is_named(tmp_path):
    """Pillow's convert("L") clips 16-bit pixels (65535 -> 255, 300 -> 255): nearly all white."""
    from PIL import Image

    write_folder(tmp_path)
    wide = np.array([[0, 257, 300], [65535, 32896, 1000], [514, 0, 0]], dtype=np.uint16)
    for cls in ("cat", "dog"):
        for i, path in enumerate(sorted((tmp_path / "train" / cls).glob("*.png"))):
            Image.fromarray(wide if i == 0 else np.full((3, 3), 771, np.uint16)).save(path)
        for path in (tmp_path / "test" / cls).glob("*.png"):
            Image.fromarray(np.full((3, 3), 65535, np.uint16)).save(path)
    with Image.open(tmp_path / "train" / "cat" / "0.png") as im:
        assert im.mode.startswith("I")                       # Pillow reads it as 16-bit, not L
    train = load_dataset(f"folder:{tmp_path}")
    assert train.x[0, 0].tolist() == [[0, 1, 1], [255, 128, 4], [2, 0, 0]]        # round(v / 257)
    assert train.x[1, 0].tolist() == [[3] * 3] * 3
    for path in (tmp_path / "test").rglob("*.png"):             # beyond the training images' range
        Image.fromarray(np.full((3, 3), 65535, np.uint16)).save(path)
    # 16-bit files that hold 8-bit values (a uint16 array of 0..255 saved as is): kept as they are
    for path in (tmp_path / "train").rglob("*.png"):
        Image.fromarray(np.full((3, 3), 200, np.uint16)).save(path)
    with pytest.raises(DataError, match=r"test/.*png holds I.* pixels beyond what the training images' range maps "
                                        r"to 0..255 \(here 65535..65535 after dividing by 1\)"):
        load_dataset(f"folder:{tmp_path}", train=False)
    for path in (tmp_path / "test").rglob("*.png"):
        Image.fromarray(np.full((3, 3), 100, np.uint16)).save(path)
    assert load_dataset(f"folder:{tmp_path}", train=False).x.flatten().tolist() == [100] * 36
    (tmp_path / "train" / "dog" / "broken.png").write_bytes(b"\x89PNG\r\n")
    with pytest.raises(DataError, match=r"folder:.*: cannot read image .*broken.png"):
        load_dataset(f"folder:{tmp_path}")


PLUGIN = '''
import numpy as np

CALLS = []

def data(split):
    CALLS.append(split)
    rng = np.random.default_rng(0 if split == "train" else 1)
    n = 60 if split == "train" else 20
    x = rng.integers(0, 256, (n, 16, 16), dtype=np.uint8)
    y = np.arange(n) % 3
    return (x, y, np.arange(n) // 20) if split == "train" else (x, y)

def halves(labels, num_clients, rng, shift=0):
    order = np.argsort(labels, kind="stable")
    return [np.sort(part) for part in np.array_split(np.roll(order, shift), num_clients)]

def writers_in_turn(labels, num_clients, rng, writers, per_client=1):
    # client c gets the images of writers c*per_client .. (c+1)*per_client - 1, in id order
    ids = np.unique(writers)
    return [np.flatnonzero(np.isin(writers, ids[c * per_client:(c + 1) * per_client])) for c in range(num_clients)]

def any_params(labels, num_clients, rng, **params):
    return [np.sort(p) for p in np.array_split(np.arange(len(labels)), num_clients)]

def two_args(labels, num_clients):
    return []

def too_few(labels, num_clients, rng):
    return [np.arange(len(labels))]

def out_of_range(labels, num_clients, rng):
    return [np.array([0, len(labels)])] * num_clients

def shared(labels, num_clients, rng):
    return [np.arange(len(labels))] * num_clients

def ragged(split):
    return [np.zeros((16, 16), np.uint8)] * 3 + [np.zeros((18, 18), np.uint8)], [0, 1, 0, 1]

def not_a_tuple(split):
    return {"x": 1}

def no_split():
    return None

def buggy_data(split):
    return (np.zeros((4, 8, 8)), None + 1)          # a bug of its own: TypeError inside

class Opaque:                 # a callable whose signature inspect cannot read
    __signature__ = "not a signature"

    def __call__(self, labels, num_clients, rng):
        return [np.arange(len(labels))]

opaque = Opaque()

def buggy_body(labels, num_clients, rng):
    return [np.arange(len(labels))[: num_clients + "1"]]    # a bug of its own: TypeError inside
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "userdata.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "userdata"
    import sys
    sys.modules.pop("userdata", None)


def test_a_dataset_function_and_a_partition_function_of_ones_own(small_config, user_module):
    raw = copy.deepcopy(small_config)
    raw["data"] = {"dataset": "userdata:data", "num_clients": 3,
                   "partition": {"kind": "userdata:halves", "shift": 5},
                   "local_test": {"source": "test_set", "fraction": 0.2}}
    fed = build_federation(load_config(raw=raw).data, seed=0)
    assert fed.num_classes == 3 and fed.in_channels == 1 and fed.image_size == 16
    labels = fed.pool.y.numpy()
    order = np.roll(np.argsort(labels, kind="stable"), 5)
    assert [idx.tolist() for idx in fed.train_idx] == [sorted(p.tolist()) for p in np.array_split(order, 3)]
    # the third returned array is the natural partition's client ids
    raw["data"]["partition"] = {"kind": "natural"}
    natural = build_federation(load_config(raw=raw).data, seed=0)
    assert sorted(idx.tolist() for idx in natural.train_idx) == [list(range(0, 20)), list(range(20, 40)),
                                                                 list(range(40, 60))]


def test_clients_that_share_every_image_have_no_held_out_test_images_and_are_told_why(small_config, user_module):
    """Clients may share images (as classes_per_client's draws with replacement do), but a local test
    image is never one some client trains on: where sharing leaves a client none, the error says so."""
    from fedhet.core.errors import PartitionError

    raw = copy.deepcopy(small_config)
    raw["data"] = {"dataset": "userdata:data", "num_clients": 6, "partition": {"kind": "userdata:shared"},
                   "local_test": {"source": "holdout", "fraction": 0.2}}
    with pytest.raises(PartitionError, match=r"client 0 has an empty local test split: the 12 image\(s\) held out of "
                                             r"its data are all in other clients' training data .*use "
                                             r"data.local_test.source: test_set; the partition gave the 6 clients "
                                             r"360 images of a pool of 60, so most of its images went to several "
                                             r"clients"):
        build_federation(load_config(raw=raw).data, seed=0)
    raw["data"]["local_test"] = {"source": "test_set", "fraction": 0.2}
    fed = build_federation(load_config(raw=raw).data, seed=0)
    assert [len(idx) for idx in fed.train_idx] == [60] * 6


@pytest.mark.parametrize(("kind", "message"), [
    ("userdata:too_few", "returned 1 entries; it must return a list of 3 index arrays"),
    ("userdata:out_of_range", "client 0 holds index 60, outside the 60 samples of the pool"),
    ("userdata:halves_typo", "module 'userdata' .* has no 'halves_typo'; it defines: .*halves"),
    ("userdata:PLUGIN_MISSING", "has no 'PLUGIN_MISSING'"),
    ("no_such_parts:fn", "no module 'no_such_parts' can be imported here"),
    ("userdata:two_args", "takes \\(labels, num_clients, rng, \\*\\*params\\); this one's signature is \\(labels, num_clients\\)"),
    ("userdata:opaque", "its signature cannot be read .* wrap it in a Python function"),
])
def test_a_partition_function_that_cannot_be_used_is_a_clear_error(small_config, user_module, kind, message):
    from fedhet.core.errors import PartitionError

    raw = copy.deepcopy(small_config)
    raw["data"] = {"dataset": "userdata:data", "num_clients": 3, "partition": {"kind": kind},
                   "local_test": {"source": "test_set", "fraction": 0.2}}
    with pytest.raises(PartitionError, match=f"data.partition.kind '{kind}'.*{message}"):
        build_federation(load_config(raw=raw).data, seed=0)


def test_an_error_inside_a_partition_function_keeps_its_own_traceback(small_config, user_module):
    raw = copy.deepcopy(small_config)
    raw["data"] = {"dataset": "userdata:data", "num_clients": 3, "partition": {"kind": "userdata:buggy_body"},
                   "local_test": {"source": "test_set", "fraction": 0.2}}
    with pytest.raises(TypeError, match="unsupported operand") as info:
        build_federation(load_config(raw=raw).data, seed=0)
    assert info.traceback[-1].name == "buggy_body"        # the user's line, not a re-worded call error


def test_a_partition_function_of_ones_own_gets_the_writers_it_asks_for(small_config, user_module):
    """A partition function with a ``writers`` parameter gets each pooled image's natural client, as
    the built-in natural partition does (userdata:data's 60 training images: writers 0, 1, 2 of 20 each);
    data without writers, and a config that sets writers itself, are refused with the fix."""
    from fedhet.core.errors import PartitionError

    raw = copy.deepcopy(small_config)
    raw["train"]["clients_per_round"] = 1
    raw["data"] = {"dataset": "userdata:data", "num_clients": 1, "pool": "train",
                   "partition": {"kind": "userdata:writers_in_turn", "per_client": 2},
                   "local_test": {"source": "test_set", "fraction": 0.2}}
    fed = build_federation(load_config(raw=raw).data, seed=0)
    assert [idx.tolist() for idx in fed.train_idx] == [list(range(0, 40))]          # writers 0 and 1
    raw["data"]["partition"] = {"kind": "userdata:writers_in_turn", "writers": [0]}
    with pytest.raises(PartitionError, match="writers is not a parameter to set"):
        build_federation(load_config(raw=raw).data, seed=0)
    raw["data"]["partition"] = {"kind": "userdata:writers_in_turn"}
    raw["data"].update(pool="train+test", local_test={"source": "holdout", "fraction": 0.2})
    with pytest.raises(PartitionError, match=r"takes writers, each sample's natural client \(femnist's writers, .*\), "
                                             r"and this pool has none \(with data.pool: train\+test, both splits "
                                             r"must have them, and clients_train gives the training split's only\)"):
        build_federation(load_config(raw=raw).data, seed=0)


def test_a_partition_function_with_a_params_catch_all_takes_any_parameter(small_config, user_module):
    raw = copy.deepcopy(small_config)
    raw["data"] = {"dataset": "userdata:data", "num_clients": 3, "partition": {"kind": "userdata:any_params",
                                                                               "regions": 4},
                   "local_test": {"source": "test_set", "fraction": 0.2}}
    fed = build_federation(load_config(raw=raw).data, seed=0)
    assert [len(i) for i in fed.train_idx] == [20, 20, 20]


def test_a_run_calls_the_dataset_function_once_per_split(small_config, user_module):
    import importlib

    calls = importlib.import_module(user_module).CALLS
    raw = copy.deepcopy(small_config)
    raw["data"] = {"dataset": "userdata:data", "num_clients": 3, "partition": {"kind": "natural"},
                   "local_test": {"source": "test_set", "fraction": 0.2}}
    fed = build_federation(load_config(raw=raw).data, seed=0)
    assert sorted(calls) == ["test", "train"]
    assert fed.num_classes == 3
    # one split alone still needs the other's labels for the class count
    calls.clear()
    assert load_dataset("userdata:data", train=False).num_classes == 3
    assert sorted(calls) == ["test", "train"]


def test_a_run_reads_an_npz_file_once(tmp_path, small_config, monkeypatch):
    from fedhet.data import user_data

    reads = []
    real_load = np.load
    monkeypatch.setattr(user_data.np, "load", lambda *a, **k: reads.append(a[0]) or real_load(*a, **k))
    name = write_npz(tmp_path, **arrays())
    raw = copy.deepcopy(small_config)
    raw["data"] = {"dataset": name, "num_clients": 3, "partition": {"kind": "iid"},
                   "local_test": {"source": "test_set", "fraction": 0.2}}
    fed = build_federation(load_config(raw=raw).data, seed=0)
    assert len(reads) == 1
    assert fed.num_classes == 4 and sum(len(i) for i in fed.train_idx) == 120


def test_a_run_scans_a_folder_for_its_colour_mode_once(tmp_path, small_config, monkeypatch):
    from fedhet.data import user_data

    scans = []
    real_scan = user_data._scan_train
    monkeypatch.setattr(user_data, "_scan_train", lambda paths, where: scans.append(len(paths)) or real_scan(paths, where))
    write_folder(tmp_path, per_class=(6, 2))
    raw = copy.deepcopy(small_config)
    raw["data"] = {"dataset": f"folder:{tmp_path}", "num_clients": 3, "partition": {"kind": "iid"},
                   "local_test": {"source": "test_set", "fraction": 0.5}}
    fed = build_federation(load_config(raw=raw).data, seed=0)
    assert len(scans) == 1
    assert fed.num_classes == 2 and sum(len(i) for i in fed.train_idx) == 12


def test_a_dataset_function_returning_the_wrong_thing_is_a_clear_error(user_module):
    with pytest.raises(DataError, match=r"userdata:not_a_tuple\('train'\) returned a dict .*must return \(x, y\)"):
        load_dataset("userdata:not_a_tuple")
    with pytest.raises(DataError, match=r"userdata:no_split must take one argument, the split \('train' or "
                                        r"'test'\); its signature is \(\)"):
        load_dataset("userdata:no_split")
    with pytest.raises(DataError, match=r"userdata:ragged: x of train: the images have 2 shapes \(\(16, 16\), "
                                        r"\(18, 18\)\); they must all have one"):
        load_dataset("userdata:ragged")
    with pytest.raises(TypeError) as info:               # the user's own bug keeps its traceback
        load_dataset("userdata:buggy_data")
    assert info.traceback[-1].name == "buggy_data"


def test_arrays_in_memory_are_saved_once_and_named(tmp_path):
    from fedhet.extend import save_arrays

    arrs = arrays()
    name = save_arrays(tmp_path / "mem.npz", **arrs, clients_train=np.arange(120) % 4)
    assert name == f"npz:{tmp_path / 'mem.npz'}"
    data = load_dataset(name)
    assert torch.equal(data.x, torch.from_numpy(arrs["x_train"][:, None])) and data.writers is not None
    with pytest.raises(DataError, match="labels must be 0..num_classes-1"):
        save_arrays(tmp_path / "bad.npz", arrs["x_train"], -arrs["y_train"] - 1, arrs["x_test"], arrs["y_test"])
    with pytest.raises(DataError, match="y_test: labels must be 0..num_classes-1"):      # the test split too
        save_arrays(tmp_path / "bad2.npz", arrs["x_train"], arrs["y_train"], arrs["x_test"], -arrs["y_test"] - 1)
    assert save_arrays(tmp_path / "plain", **arrs) == f"npz:{tmp_path / 'plain.npz'}"   # numpy's own suffix


def test_arrays_saved_under_a_relative_path_are_named_by_an_absolute_one_in_a_folder_made_for_them(tmp_path,
                                                                                                  monkeypatch):
    """A run's config.yaml records the name, and its resume may start in another working directory."""
    from fedhet.extend import save_arrays

    monkeypatch.chdir(tmp_path)
    name = save_arrays("data/mine", **arrays())
    assert name == f"npz:{tmp_path / 'data' / 'mine.npz'}" and (tmp_path / "data" / "mine.npz").is_file()
    monkeypatch.chdir(tmp_path.parent)
    assert load_dataset(name).x.shape[0] == 120


def test_channel_mean_and_std_are_numpys_computed_a_chunk_at_a_time():
    """Two channels by hand: [0, 255] -> mean 0.5, std 0.5; [51, 51] -> mean 0.2, std 0, taken as 1. Then a
    larger pool in chunks that do not divide it, against numpy's whole-pool float64 result."""
    from fedhet.data.user_data import channel_mean_std

    x = np.array([[[[0]], [[51]]], [[[255]], [[51]]]], dtype=np.uint8)        # (2, 2, 1, 1)
    mean, std = channel_mean_std(x, rows=1)
    assert mean == pytest.approx((0.5, 0.2), abs=1e-15) and std == (0.5, 1.0)      # constant: std 1
    pool = np.random.default_rng(3).integers(0, 256, (1001, 3, 5, 4), dtype=np.uint8)
    mean, std = channel_mean_std(pool, rows=64)
    scaled = pool.astype(np.float64) / 255.0
    assert mean == pytest.approx(tuple(scaled.mean(axis=(0, 2, 3))), rel=1e-12)
    assert std == pytest.approx(tuple(scaled.std(axis=(0, 2, 3))), rel=1e-12)


@pytest.mark.parametrize("writers", [[3, 1, 3, 2, 1, 3], ["b", "a", "b", "c", "a", "b"]])
def test_the_natural_partition_gives_each_chosen_writer_its_samples_in_order(writers):
    """By hand: writer 1 (or "a") holds samples 1 and 4, 2 ("c") sample 3, 3 ("b") samples 0, 2, 5;
    all three writers chosen, each client gets its writer's samples in increasing order."""
    from types import SimpleNamespace

    from fedhet.data.federated import _natural_partition

    pool = SimpleNamespace(writers=np.array(writers))
    parts = _natural_partition(pool, 3, np.random.default_rng(0))
    expected = {3: [0, 2, 5], 1: [1, 4], 2: [3], "b": [0, 2, 5], "a": [1, 4], "c": [3]}
    got = {writers[int(p[0])]: p.tolist() for p in parts}
    assert got == {w: expected[w] for w in set(writers)}


def test_what_only_both_splits_show_a_single_class_an_error_a_test_split_that_is_training_gaps_and_a_flat_channel(
        tmp_path):
    from fedhet.data.datasets import load_splits

    arrs = arrays(layout="nchw")
    with pytest.raises(DataError, match="every label is 0, one class; a classifier needs at least two"):
        load_splits(write_npz(tmp_path, "one.npz", **{**arrs, "y_train": 0 * arrs["y_train"],
                                                      "y_test": 0 * arrs["y_test"]}))
    with pytest.warns(UserWarning, match="the test split is the training split"):
        load_splits(write_npz(tmp_path, "same.npz", **{**arrs, "x_test": arrs["x_train"], "y_test": arrs["y_train"]}))
    with pytest.warns(UserWarning, match=r"2 of the class numbers 0..4 \(the largest label\) have no image in "
                                         r"either split \(1, 3\)"):
        load_splits(write_npz(tmp_path, "gaps.npz", **{**arrs, "y_train": (arrs["y_train"] % 2) * 4,
                                                       "y_test": arrs["y_test"] % 2 * 2}))
    flat = arrs["x_train"].copy()
    flat[:, 1] = 7
    with pytest.warns(UserWarning, match=r"channel\(s\) \[1\] of the training images are constant"):
        train, test = load_splits(write_npz(tmp_path, "flat.npz", **{**arrs, "x_train": flat}))
    assert train.std[1] == 1.0
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")            # ordinary data: none of these
        load_splits(write_npz(tmp_path, "fine.npz", **arrs, num_classes=np.array(9)))   # 4..8 on purpose


def test_the_natural_partition_holds_writers_out_as_the_test_set(small_config, tmp_path):
    """FedFM Table VII's protocol, by hand: ten writers of 5 training and 2 test images each, all
    pooled; test_writers 0.2 makes the 14 images of two writers the test set, and the 8 clients are
    the other eight writers, each with all 7 of its images (training plus its held-out split)."""
    from helpers import write_leaf_femnist

    from fedhet.core.errors import PartitionError

    names = [f"f{i:04d}_00" for i in range(10)]
    write_leaf_femnist(tmp_path, {n: ([i % 62] * 5, [(i + 1) % 62] * 2) for i, n in enumerate(names)})
    raw = copy.deepcopy(small_config)
    raw["data"] = {"dataset": "femnist", "root": str(tmp_path), "pool": "train+test", "num_clients": 8,
                   "partition": {"kind": "natural", "test_writers": 0.2},
                   "local_test": {"source": "holdout", "fraction": 0.3}}
    raw["train"]["clients_per_round"] = 2

    def writer_of(images: torch.Tensor) -> list[int]:
        return (images.reshape(len(images), -1)[:, 0].long() - 1).tolist()     # the helper's pixel 0

    feds = [build_federation(load_config(raw=raw).data, seed=s) for s in (0, 1)]
    for fed in feds:
        held = set(writer_of(fed.test.x))
        assert len(held) == 2 and len(fed.test.y) == 14
        assert sorted(fed.test.y.tolist()) == sorted(y for w in held for y in [w % 62] * 5 + [(w + 1) % 62] * 2)
        clients = []
        for cid in range(fed.num_clients):
            train = writer_of(fed.pool.x[fed.train_idx[cid]])
            local = writer_of(fed.local_test(cid)[0])
            assert len(set(train + local)) == 1 and len(train) + len(local) == 7     # one writer, all its images
            clients.append(train[0])
        assert sorted(clients) == sorted(set(range(10)) - held)
    # the same writers held out whatever the run's seed, as a dataset's fixed test split is
    assert torch.equal(feds[0].test.x, feds[1].test.x)

    raw["data"]["num_clients"] = 9
    with pytest.raises(PartitionError, match=r"9 clients requested but the data has 8 writers \(its natural clients: "
                                             r"FEMNIST's writers, or the client ids of data of one's own\) once "
                                             r"data.partition.test_writers are held out; lower data.num_clients"):
        build_federation(load_config(raw=raw).data, seed=0)
    raw["data"]["num_clients"] = 8
    for partition, message in [({"kind": "natural", "writers": 0.2}, "takes no option 'writers'; its options: "
                                                                      "test_writers"),
                               ({"kind": "natural", "test_writers": 1.0}, r"must be a fraction in \[0, 1\)"),
                               ({"kind": "natural", "test_writers": 0.96}, "holds out 10 of the data's 10 writers")]:
        raw["data"]["partition"] = partition
        with pytest.raises(PartitionError, match=message):
            build_federation(load_config(raw=raw).data, seed=0)


def test_data_of_ones_own_named_without_its_format_or_its_npz_suffix_says_the_name_to_use(tmp_path):
    path = write_npz(tmp_path, "small8.npz", **arrays()).removeprefix("npz:")
    with pytest.raises(DataError, match=f"npz:{tmp_path / 'small8'}: no such file, and {tmp_path / 'small8.npz'} is "
                                        f"one .*did you mean npz:{tmp_path / 'small8.npz'}\\?"):
        load_dataset(f"npz:{tmp_path / 'small8'}")
    with pytest.raises(DataError, match=f"unknown dataset '{path}': data of your own is named with its format, "
                                        f"npz:{path} \\(arrays in an .npz file"):
        load_dataset(path)
    with pytest.raises(DataError, match=f"data of your own is named with its format, folder:{tmp_path} "):
        load_dataset(str(tmp_path))


def test_images_of_a_bad_shape_are_named_by_the_shape_given(tmp_path):
    from fedhet.extend import save_arrays

    x, y = np.zeros((12, 16, 15), np.uint8), np.arange(12) % 3
    with pytest.raises(DataError, match=r"x_train: images must be .*got shape \(12, 16, 15\) \(height and width "
                                        r"differ: fedhet's models take square images; crop or pad them\)"):
        save_arrays(tmp_path / "ns", x, y, x, y)
    with pytest.raises(DataError, match=r"got shape \(12, 2, 16, 16\)$"):
        save_arrays(tmp_path / "two", np.zeros((12, 2, 16, 16), np.uint8), y, x, y)
