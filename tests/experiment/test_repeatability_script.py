"""benchmarks/repeatability.py, the script that says whether a seed repeats bit for bit on a device
with and without run.deterministic: its comparison on hand-made runs, and a whole call on the CPU."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from helpers import benchmark_script


@pytest.fixture(scope="module")
def repeatability():
    return benchmark_script("repeatability")


def test_recorded_numbers_are_every_number_but_the_times(repeatability):
    row = {"round": 5, "global_acc": 0.5, "seconds": {"train": 3.0}, "ok": True,
           "local_kl_by_client": {"3": 1.5}, "phases": ["train"], "per_class": [0.25, 0.75]}
    assert repeatability.float_leaves(row) == {"round": 5.0, "global_acc": 0.5, "local_kl_by_client.3": 1.5,
                                               "per_class[0]": 0.25, "per_class[1]": 0.75}


def test_a_difference_anywhere_is_found_and_located(repeatability):
    first = {"rows": [{"round": 1, "global_acc": 0.5, "train_loss": 2.0}, {"round": 2, "global_acc": 0.6}],
             "state": {".model.w": torch.tensor([1.0, 2.0]), ".model.steps": torch.tensor([3])}}
    same = {"rows": [dict(r) for r in first["rows"]], "state": {k: v.clone() for k, v in first["state"].items()}}
    assert repeatability.compare(first, same) == {"bitwise": True, "max_metric_diff": 0.0, "max_metric_diff_at": None,
                                                  "max_state_diff": 0.0, "max_state_diff_at": None}
    other = {"rows": [{"round": 1, "global_acc": 0.5, "train_loss": 2.0}, {"round": 2, "global_acc": 0.625}],
             "state": {".model.w": torch.tensor([1.0, 2.5]), ".model.steps": torch.tensor([3])}}
    c = repeatability.compare(first, other)
    assert not c["bitwise"] and c["max_metric_diff"] == pytest.approx(0.025) and c["max_state_diff"] == 0.5
    assert c["max_metric_diff_at"] == "round 2 global_acc" and c["max_state_diff_at"] == ".model.w"
    # equal rows, one server-state bit apart: not bit-identical
    flipped = {"rows": first["rows"], "state": {".model.w": torch.tensor([1.0, float(torch.nextafter(
        torch.tensor(2.0), torch.tensor(3.0)))]), ".model.steps": torch.tensor([3])}}
    c = repeatability.compare(first, flipped)
    assert not c["bitwise"] and c["max_metric_diff"] == 0 and 0 < c["max_state_diff"] < 1e-6


def test_a_cpu_call_repeats_bit_for_bit_in_both_modes(repeatability, small_config, tmp_path, determinism_restored):
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(small_config))
    stem = tmp_path / "rep"
    assert repeatability.main(["--config", str(config), "--device", "cpu", "--rounds", "2", "--threads", "1",
                               "--out", str(stem)]) == 0
    result = json.loads(stem.with_suffix(".json").read_text())
    assert [(r["mode"], r["runs"], len(r["comparisons"])) for r in result["results"]] == [
        ("plain", 2, 1), ("deterministic", 2, 1)]
    assert all(c["bitwise"] and c["max_state_diff"] == 0 for r in result["results"] for c in r["comparisons"])
    table = stem.with_suffix(".md").read_text()
    assert "| plain | 2 | yes | yes |" in table and "| deterministic | 2 | yes | yes |" in table
    assert torch.are_deterministic_algorithms_enabled()       # the second mode's setting, process-wide


def test_modes_in_the_wrong_order_are_refused(repeatability, capsys):
    with pytest.raises(SystemExit):
        repeatability.main(["--modes", "deterministic,plain"])
    assert "plain before deterministic" in capsys.readouterr().err
