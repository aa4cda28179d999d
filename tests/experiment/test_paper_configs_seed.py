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
