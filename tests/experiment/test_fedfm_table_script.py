"""benchmarks/fedfm_table.py, the table behind the FedFM results: hand-made run folders (evaluated
every 2 rounds) and the figures they must give."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import benchmark_script, write_metrics


def write_run(runs: Path, name: str, seed: int, selected: float, final: float, floats: tuple[int, int]) -> None:
    folder = runs / name
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(f"name: {name}\n")
    rows = [{"round": 1, "train_loss": 1.0}, {"round": 2, "global_acc": final - 0.1},
            {"round": 3, "train_loss": 0.5}, {"round": 4, "global_acc": final}]
    write_metrics(folder, rows)
    summary = {"name": name, "status": "completed", "seed": seed, "seconds_per_round_median": 3.0,
               "communication": {"up": {"floats": floats[0]}, "down": {"floats": floats[1]}},
               "model_selection": {"value": selected, "round": 2},
               "metrics": {"global_acc": {"final": final, "best": final}},
               "machine": {"processor": "x86_64", "cpus": 2, "torch": "2.x", "commit": "abc"}}
    (folder / "summary.json").write_text(json.dumps(summary))


def test_seeds_pool_and_communication_is_relative_to_fedavg(tmp_path):
    runs = tmp_path / "fedfm_fmnist_test"
    write_run(runs, "niid1_fedavg_s0", 0, 0.60, 0.62, (100, 100))
    write_run(runs, "niid1_fedavg_s1", 1, 0.70, 0.66, (100, 100))
    write_run(runs, "niid1_fedfm_s0", 0, 0.75, 0.70, (150, 150))
    out = tmp_path / "results"
    assert benchmark_script("fedfm_table").main([str(runs), "--out", str(out)]) == 0
    rows = {r["method"]: r for r in json.loads((out / "fedfm_fmnist_test.json").read_text())["rows"]}
    assert rows["fedavg"]["selected"] == [0.60, 0.70] and rows["fedavg"]["final"] == [0.62, 0.66]
    assert rows["fedfm"]["floats"] == 300 and rows["fedfm"]["floats_vs_fedavg"] == pytest.approx(1.5)
    assert rows["fedfm"]["paper"] == 72.89                        # CIFAR-10 NIID-1, FedFM
    text = (out / "fedfm_fmnist_test.md").read_text()
    assert "| niid1 | FedAvg | 2 | 65.00 ± 7.07 | 64.00 ± 2.83 |" in text
    assert "| niid1 | FedFM (CG, lambda 50) | 1 | 75.00 | 70.00 | 70.00 | 300 (1.500) | 3.0 | 72.89 |" in text


def test_a_folder_that_is_not_there_is_one_line_of_error(tmp_path, capsys, monkeypatch):
    script = benchmark_script("fedfm_table")
    monkeypatch.setattr("sys.argv", ["fedfm_table.py", str(tmp_path / "nothere")])
    assert script.run_table_script(script.main) == 2
    assert f"fedfm_table.py: error: {tmp_path / 'nothere'} is not a folder of runs" in capsys.readouterr().err
