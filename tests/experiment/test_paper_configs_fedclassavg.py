"""Every FedClassAvg paper config (configs/papers/fedclassavg) parses, builds its method and states
its number; the heterogeneous Fashion-MNIST federation builds four architectures with one head shape."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fedhet.experiment.build import make_algorithm
from fedhet.experiment.config import load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "papers" / "fedclassavg"
FILES = sorted(CONFIGS.glob("*.yaml"))


def test_the_generator_wrote_every_file():
    r = subprocess.run([sys.executable, str(CONFIGS / "generate.py"), "--check"], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    # Table 2: 4 methods x 2 splits x 3 datasets; Table 3: 6 methods x 2 federations x 3; Table 4: 3 x 3
    assert len(FILES) == 24 + 36 + 9


@pytest.mark.parametrize("path", FILES, ids=[f.stem for f in FILES])
def test_config_parses_builds_its_method_and_states_its_number(path):
    cfg = load_config(path)
    head = path.read_text().splitlines()[0]
    assert head.startswith("# FedClassAvg paper (Jang et al., ICPP 2022), Table")
    assert make_algorithm(cfg).name == cfg.algorithm.name
    assert cfg.train.optimizer == "adam" and cfg.train.betas == (0.5, 0.999) and cfg.train.local_epochs == 1
    if path.stem.startswith(("t2_", "t4_")):
        assert cfg.model.archs() == ["fca_resnet18", "fca_shufflenetv2", "fca_googlenet", "fca_alexnet"]
    if path.stem.startswith("t3_"):      # Table 3: FedAvg, FedProx and KT-pFL on the FedAvg paper's CNNs
        fedavg_cnn = "simple_cnn" if cfg.data.dataset == "cifar10" else "cnn2"
        assert cfg.model.archs() == (["fca_resnet18"] if cfg.algorithm.name == "fedclassavg" else [fedavg_cnn])
    if path.stem == "t2_fmnist_skewed_fedclassavg":
        assert "paper 0.9800" in head and cfg.algorithm.params["rho"] == 0.4662 and cfg.train.lr == 6e-4
    # the paper's numbers and their ± (std over clients), hand-copied from Tables 2-4
    published = {"t2_cifar10_dir0.5_ktpfl": (0.6228, 0.0783), "t2_emnist_skewed_fedproto": (0.2183, 0.0661),
                 "t2_fmnist_dir0.5_fedproto": (0.6042, 0.0500), "t3_emnist_dir0.5_fedprox_k100": (0.8677, 0.0923),
                 "t3_cifar10_dir0.5_fedclassavg_weight": (0.8546, 0.0406), "t4_emnist_dir0.5_fedclassavg_pr": (0.8993, None),
                 "t3_fmnist_dir0.5_ktpfl_weight_k100": (0.8647, 0.066), "t3_emnist_dir0.5_ktpfl_weight": (0.6774, 0.2311)}
    if path.stem in published:
        value, std = published[path.stem]
        assert cfg.paper.value == pytest.approx(value)
        assert cfg.paper.std is None if std is None else cfg.paper.std == pytest.approx(std)
    if cfg.algorithm.name == "ktpfl":                     # the codes' public data: another dataset
        assert cfg.data.public is not None and cfg.data.public.source == "dataset"
        assert cfg.data.public.dataset == ("cifar100" if cfg.data.dataset == "cifar10" else "mnist")
    else:
        assert cfg.data.public is None
    if cfg.algorithm.name == "ktpfl_weight":             # KTpFL_homo.py's settings per dataset
        mnist_family = cfg.data.dataset != "cifar10"
        assert cfg.algorithm.params == {"distill_lr": 0.01, "rho": 0.6 if mnist_family else 0.7,
                                        "c_lr": 0.005 if mnist_family else 0.01}
    assert cfg.model.options == ({"relu_features": True} if cfg.algorithm.name == "fedproto" else {})


def test_arch_options_reach_one_architecture_only():
    from types import SimpleNamespace

    from fedhet.core.errors import ConfigError
    from fedhet.experiment.build import build_models

    raw = {"data": {"num_clients": 4}, "train": {"clients_per_round": 4},
           "model": {"arch": ["fca_cnn_a", "fca_alexnet"], "options": {"relu_features": True},
                     "arch_options": {"fca_alexnet": {"dropout": 0.5}}}}
    fed = SimpleNamespace(in_channels=1, num_classes=10, image_size=28, num_clients=4)
    models, archs = build_models(load_config(raw=raw), fed)
    assert archs == ["fca_cnn_a", "fca_alexnet"] * 2
    dropouts = [m.p for m in models["fca_alexnet"].modules() if isinstance(m, torch.nn.Dropout)]
    assert dropouts == [0.5]
    assert not any(isinstance(m, torch.nn.Dropout) for m in models["fca_cnn_a"].modules())
    assert all("feature_relu" in dict(m.body.named_children()) for m in models.values())   # `options`: both
    with pytest.raises(ConfigError, match=r"names \['fca_cnn_b'\], which model.arch does not list"):
        load_config(raw={**raw, "model": {**raw["model"], "arch_options": {"fca_cnn_b": {}}}})
    bad = load_config(raw={**raw, "model": {"arch": ["fca_cnn_a", "fca_alexnet"], "options": {"dropout": 0.5}}})
    with pytest.raises(ConfigError, match="model fca_cnn_a: .*does not take option"):
        build_models(bad, fed)
