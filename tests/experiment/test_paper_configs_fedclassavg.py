"""Every FedClassAvg paper config (configs/papers/fedclassavg) parses, builds its method and states
its number; the heterogeneous Fashion-MNIST federation builds four architectures with one head shape."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fedhet.experiment.build import make_algorithm
from fedhet.experiment.config import load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "papers" / "fedclassavg"
FILES = sorted(CONFIGS.glob("*.yaml"))


def test_the_generator_wrote_every_file():
    r = subprocess.run([sys.executable, str(CONFIGS / "generate.py"), "--check"], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert len(FILES) == 30


@pytest.mark.parametrize("path", FILES, ids=[f.stem for f in FILES])
def test_config_parses_builds_its_method_and_states_its_number(path):
    cfg = load_config(path)
    head = path.read_text().splitlines()[0]
    assert head.startswith("# FedClassAvg paper (papers/003), Table")
    assert make_algorithm(cfg).name == cfg.algorithm.name
    assert cfg.train.optimizer == "adam" and cfg.train.betas == (0.5, 0.999) and cfg.train.local_epochs == 1
    if path.stem.startswith(("t2_", "t4_")):
        assert cfg.model.archs() == ["fca_resnet18", "fca_shufflenetv2", "fca_googlenet", "fca_alexnet"]
    if path.stem == "t2_fmnist_skewed_fedclassavg":
        assert "paper 0.9800" in head and cfg.algorithm.params["rho"] == 0.4662 and cfg.train.lr == 6e-4
