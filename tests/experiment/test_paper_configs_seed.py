"""The FedCME and FedReMa paper configs: generated, parseable, and carrying the paper's number as a
``paper`` section that agrees with the number their first comment line states."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from fedhet.experiment.config import load_config

PAPERS = Path(__file__).resolve().parents[2] / "configs" / "papers"
FILES = sorted((PAPERS / "fedcme").glob("*.yaml")) + sorted((PAPERS / "fedrema").glob("*.yaml"))


@pytest.mark.parametrize("folder", ["fedcme", "fedrema"])
def test_the_generator_wrote_every_file(folder):
    r = subprocess.run([sys.executable, str(PAPERS / folder / "generate.py"), "--check"], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_fedrema_configs_cover_its_tables():
    # Table 1: 11 methods x 3 datasets; Table 2: its 9 rows x 4 values of s; Table 3: 5 deltas; Tables 4-5: 3
    assert len(list((PAPERS / "fedrema").glob("*.yaml"))) == 11 * 3 + 9 * 4 + 5 + 3


def test_fedrema_table2_rows_are_the_papers():
    # Liang et al. Table 2 (CIFAR-10, npc=100), copied by hand: stem -> (mean, std) % and the model split
    expected = {"t2_cifar10_s0.2_fedprox": (40.7, 0.6, "fc3"), "t2_cifar10_s0.4_moon": (47.1, 1.2, "fc3"),
                "t2_cifar10_s0.8_moon": (45.5, 1.2, "fc3"), "t2_cifar10_s0.6_fedproto": (30.9, 2.7, "fc3"),
                "t2_cifar10_s0.8_fedper": (25.1, 0.6, "fc1"), "t2_cifar10_s0.2_fedbabu": (41.3, 0.5, "fc1"),
                "t2_cifar10_s0.4_fedpac": (45.7, 1.2, "fc1"), "t2_cifar10_s0.2_fedrema": (52.9, 1.2, "fc1")}
    for stem, (mean, std, split) in expected.items():
        cfg = load_config(PAPERS / "fedrema" / f"{stem}.yaml")
        s = float(stem.split("_s")[1].split("_")[0])
        assert (cfg.data.partition.samples_per_client, cfg.data.partition.s) == (100, s), stem
        assert cfg.paper.source == "FedReMa (Liang et al.) Table 2" and cfg.model.split == split, stem
        assert (cfg.paper.value, cfg.paper.std) == (pytest.approx(mean / 100), pytest.approx(std / 100)), stem
    # MOON on CIFAR-10 at mu=5, as in Table 1's CIFAR-10 column
    t2 = load_config(PAPERS / "fedrema" / "t2_cifar10_s0.4_moon.yaml")
    t1 = load_config(PAPERS / "fedrema" / "t1_cifar10_moon.yaml")
    assert t2.algorithm == t1.algorithm and t2.algorithm.params["mu"] == 5.0 and t2.model == t1.model


@pytest.mark.parametrize("path", FILES, ids=[f"{f.parent.name}/{f.stem}" for f in FILES])
def test_config_carries_the_number_its_comment_states(path):
    cfg = load_config(path)
    text = path.read_text()
    stated = re.search(r"(?:paper reports|paper(?: best)?) (\d+(?:\.\d+)?)(?:\s*(?:\+-|±)\s*(\d+(?:\.\d+)?))?", text)
    if cfg.paper is None:
        assert "no number" in text.splitlines()[1], path.name
        return
    assert stated, path.name
    assert cfg.paper.value == pytest.approx(float(stated.group(1)) / 100)
    if stated.group(2):
        assert cfg.paper.std == pytest.approx(float(stated.group(2)) / 100)
    assert cfg.paper.metric == ("global_acc" if path.parent.name == "fedcme" else "personal_acc")
