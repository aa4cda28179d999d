"""Every FedFM paper config (configs/papers/fedfm) parses, and the CIFAR-10/CINIC-10/CIFAR-100
ones build their partition and model on small files written in the datasets' real formats
(the real archives cannot be downloaded here)."""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fedhet.data.federated import build_federation
from fedhet.experiment.build import build_models
from fedhet.experiment.config import load_config

CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "papers" / "fedfm"
FILES = sorted(CONFIGS.glob("*.yaml"))
CIFAR_LIKE = [f for f in FILES if not f.name.startswith("fmnist")]
CINIC_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


def balanced_batch(num_classes: int, per_class: int, label_key: bytes, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    labels = np.repeat(np.arange(num_classes), per_class)
    return {b"batch_label": b"batch", b"data": rng.integers(0, 256, (labels.size, 3072), dtype=np.uint8),
            label_key: labels.tolist(), b"filenames": [b"x.png"] * labels.size}


def dump(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pickle.dumps(obj, protocol=2))


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    """CIFAR-10 / CIFAR-100 python pickles and CINIC-10 PNG folders, 50-60 images per class
    (NIID-2 cuts every class into 50 shards)."""
    from PIL import Image

    root = tmp_path_factory.mktemp("papers_data")
    for i in range(1, 6):
        dump(root / "cifar-10-batches-py" / f"data_batch_{i}", balanced_batch(10, 12, b"labels", i))
    dump(root / "cifar-10-batches-py" / "test_batch", balanced_batch(10, 2, b"labels", 9))
    train = balanced_batch(100, 50, b"fine_labels", 1)
    test = balanced_batch(100, 1, b"fine_labels", 2)
    for name, batch in (("train", train), ("test", test)):
        batch[b"coarse_labels"] = [0] * len(batch[b"fine_labels"])
        dump(root / "cifar100" / "cifar-100-python" / name, batch)
    rng = np.random.default_rng(0)
    for split, per_class in (("train", 60), ("test", 2)):
        for cls in CINIC_CLASSES:
            folder = root / "cinic-10" / split / cls
            folder.mkdir(parents=True)
            for i in range(per_class):
                Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    return root


def test_the_generator_wrote_every_file():
    r = subprocess.run([sys.executable, str(CONFIGS / "generate.py"), "--check"], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert len(CIFAR_LIKE) == 36 and len(FILES) == 56


@pytest.mark.parametrize("path", FILES, ids=[f.stem for f in FILES])
def test_config_parses_and_states_its_number(path):
    cfg = load_config(path)
    head = path.read_text().splitlines()[0]
    assert head.startswith("# FedFM paper (papers/001)")
    if not path.name.startswith("fmnist"):
        assert "paper " in head and "%" in head                     # the number it corresponds to
    assert cfg.data.num_clients == 10 and cfg.train.clients_per_round == 10
    assert cfg.data.local_test.source == "holdout" and cfg.data.local_test.fraction == 0.2


@pytest.mark.parametrize("path", CIFAR_LIKE, ids=[f.stem for f in CIFAR_LIKE])
def test_cifar_configs_build_partition_and_model(path, data_root):
    cfg = load_config(path, overrides=[f"data.root={data_root}", "data.verify=false"])
    fed = build_federation(cfg.data, cfg.seed)
    assert fed.num_clients == 10 and all(len(t) > 0 for t in fed.train_idx)
    models, arch = build_models(cfg, fed)
    model = models[arch[0]].eval()
    x = fed.normalize(fed.pool.x[fed.train_idx[0][:2]])
    with torch.no_grad():
        feats, logits = model(x, with_features=True)
    assert logits.shape == (2, fed.num_classes)
    assert feats.shape[1] == (2048 if "cifar100" in path.name else 512)   # ResNet-50 / ResNet-18 features
