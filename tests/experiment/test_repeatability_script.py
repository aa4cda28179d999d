"""benchmarks/repeatability.py, the script that says whether a seed repeats bit for bit on a device
with and without run.deterministic: its comparison on hand-made runs, and a whole call on the CPU."""

from __future__ import annotations

import json
import math

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


def run(rows, **state):
    return {"rows": rows, "state": {f".model.{k}": v for k, v in state.items()}}


def test_a_difference_anywhere_is_found_and_located(repeatability):
    first = run([{"round": 1, "global_acc": 0.5, "train_loss": 2.0}, {"round": 2, "global_acc": 0.6}],
                w=torch.tensor([1.0, 2.0]), steps=torch.tensor(3))
    same = run([dict(r) for r in first["rows"]], w=torch.tensor([1.0, 2.0]), steps=torch.tensor(3))
    assert repeatability.compare(first, same) == {
        "state_identical": True, "rows_identical": True, "rows_mismatched": [], "max_metric_diff": 0.0,
        "max_metric_diff_at": None, "max_state_diff": 0.0, "max_state_diff_at": None}
    other = run([{"round": 1, "global_acc": 0.5, "train_loss": 2.0}, {"round": 2, "global_acc": 0.625}],
                w=torch.tensor([1.0, 2.5]), steps=torch.tensor(3))
    c = repeatability.compare(first, other)
    assert not c["state_identical"] and not c["rows_identical"]
    assert c["max_metric_diff"] == pytest.approx(0.025) and c["max_metric_diff_at"] == "round 2 global_acc"
    assert c["max_state_diff"] == 0.5 and c["max_state_diff_at"] == ".model.w"
    # the same rows, one server-state value a bit apart; then a 0-dim integer tensor (BatchNorm's step count) apart
    bit = float(torch.nextafter(torch.tensor(2.0), torch.tensor(3.0)))
    c = repeatability.compare(first, run(first["rows"], w=torch.tensor([1.0, bit]), steps=torch.tensor(3)))
    assert not c["state_identical"] and c["rows_identical"] and 0 < c["max_state_diff"] < 1e-6
    c = repeatability.compare(first, run(first["rows"], w=torch.tensor([1.0, 2.0]), steps=torch.tensor(4)))
    assert not c["state_identical"] and c["max_state_diff"] == 1.0 and c["max_state_diff_at"] == ".model.steps"


def test_nan_equals_nan_and_rows_or_numbers_only_one_run_has_are_named(repeatability):
    nan = math.nan
    first = run([{"round": 1, "silhouette": nan, "global_acc": 0.5}], w=torch.tensor([nan]))
    c = repeatability.compare(first, run([{"round": 1, "silhouette": nan, "global_acc": 0.5}], w=torch.tensor([nan])))
    assert c["state_identical"] and c["rows_identical"] and c["max_metric_diff"] == 0 and c["max_state_diff"] == 0
    c = repeatability.compare(first, run([{"round": 1, "silhouette": 0.3, "global_acc": 0.5}], w=torch.tensor([1.0])))
    assert not c["rows_identical"] and c["max_metric_diff"] == math.inf and c["max_state_diff"] == math.inf
    c = repeatability.compare(first, run([{"round": 1, "global_acc": 0.5}, {"round": 2, "global_acc": 0.6}],
                                         w=torch.tensor([nan])))
    assert not c["rows_identical"] and c["max_metric_diff"] == 0
    assert c["rows_mismatched"] == ["1 rows against 2", "round 1: silhouette"]


def test_a_cpu_call_repeats_bit_for_bit_in_both_modes_each_in_its_own_process(repeatability, small_config,
                                                                              tmp_path):
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(small_config))
    stem = tmp_path / "rep"
    assert repeatability.main(["--config", str(config), "--device", "cpu", "--rounds", "2", "--threads", "1",
                               "--out", str(stem)]) == 0
    result = json.loads(stem.with_suffix(".json").read_text())
    assert [(r["mode"], r["runs"], len(r["comparisons"]), r["exit_status"]) for r in result["results"]] == [
        ("plain", 2, 1, 0), ("deterministic", 2, 1, 0)]
    assert all(c["state_identical"] and c["rows_identical"] for r in result["results"] for c in r["comparisons"])
    table = stem.with_suffix(".md").read_text()
    assert "| plain | 2 of 2 | yes | yes | 0 (-) | 0 (-) |" in table
    assert "| deterministic | 2 of 2 | yes | yes | 0 (-) | 0 (-) |" in table
    assert not torch.are_deterministic_algorithms_enabled()       # the modes ran in processes of their own


def test_fewer_than_two_repeats_are_refused(repeatability, capsys):
    with pytest.raises(SystemExit):
        repeatability.main(["--repeats", "1"])
    assert "at least 2" in capsys.readouterr().err
