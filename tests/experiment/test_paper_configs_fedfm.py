"""Every FedFM paper config (configs/papers/fedfm) parses, and the CIFAR-10/CINIC-10/CIFAR-100
ones build their partition and model on small files written in the datasets' real formats
(the real archives cannot be downloaded here)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fedhet.data.federated import build_federation
from fedhet.experiment.build import build_models
from fedhet.experiment.config import load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "papers" / "fedfm"
FILES = sorted(CONFIGS.glob("*.yaml"))
CIFAR_LIKE = [f for f in FILES if not f.name.startswith("fmnist")]
def test_the_generator_wrote_every_file():
    r = subprocess.run([sys.executable, str(CONFIGS / "generate.py"), "--check"], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert len(CIFAR_LIKE) == 36 and len(FILES) == 56


@pytest.mark.parametrize("path", FILES, ids=[f.stem for f in FILES])
def test_config_parses_and_states_its_number(path):
    cfg = load_config(path)
    head = path.read_text().splitlines()[0]
    assert head.startswith("# FedFM paper (Ye et al.)")
    if not path.name.startswith("fmnist"):
        assert "paper " in head and "%" in head                     # the number it corresponds to
    # the same number as a paper section (fedhet compare prints it), none for the Fashion-MNIST proxy
    stated = re.search(r"paper (\d+\.\d+)%", head)
    if stated:
        assert cfg.paper is not None and cfg.paper.metric == "global_acc"
        assert cfg.paper.value == pytest.approx(float(stated.group(1)) / 100, abs=1e-9)
        assert cfg.paper.source.startswith(("FedFM (Ye et al.) Table", "FedFM (Ye et al.) Sec. VII-C.6"))
        assert (path.stem == "cifar10_niid1_fedfm_l2") == ("Sec." in cfg.paper.source)   # 67.98: the text's
    else:
        assert cfg.paper is None
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
