"""benchmarks/fedacd_table.py --sweep, the table behind the FedACD results' local KL, risk and score
figures: hand-made run folders and the figures they must give."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import benchmark_script, write_metrics

MACHINE = {"processor": "x86_64", "cpu_model": "Test CPU", "cpus": 2, "torch": "2.x"}


@pytest.fixture(scope="module")
def fedacd_table():
    return benchmark_script("fedacd_table")


def write_run(folder: Path, seed: int, rows: list[dict], seconds: float = 10.0, **recorded) -> None:
    write_metrics(folder, rows)
    summary = {**recorded, "name": folder.name, "status": "completed", "seed": seed, "rounds_completed": rows[-1]["round"],
               "metrics": {}, "seconds_per_round_median": seconds, "machine": MACHINE, "device": "cpu",
               "engine": {"engine": "reference"}}
    (folder / "summary.json").write_text(json.dumps(summary))


def evaluation(rnd: int, acc: float, kl: float, risk: float, **scores) -> dict:
    return {"round": rnd, "global_acc": acc, "global_labeldist_acc": acc - 0.1, "local_kl": kl,
            "local_risk": risk, **scores}


def test_a_sweep_table_averages_the_last_two_evaluations_and_spreads_the_scores(fedacd_table, tmp_path):
    runs = tmp_path / "runs"
    # FedAvg, two seeds: final = mean of rounds 10 and 15 (round 5 and the training-only row 12 left out)
    write_run(runs / "fedavg_s0", 0, [evaluation(5, 0.50, 3.0, 0.6), evaluation(10, 0.70, 1.0, 0.5),
                                      {"round": 12, "train_loss": 0.3}, evaluation(15, 0.80, 0.5, 0.4)])
    write_run(runs / "fedavg_s1", 1, [evaluation(5, 0.40, 2.0, 0.7), evaluation(10, 0.60, 1.5, 0.5),
                                      evaluation(15, 0.60, 0.5, 0.3)], memory_format="channels_last")
    # FedACD, one seed, with its per-round scores V (min, max) and weight ratio max V / min V
    scores = [dict(fedacd_score_min=0.55, fedacd_score_max=0.66, fedacd_weight_ratio=1.2),
              dict(fedacd_score_min=0.52, fedacd_score_max=0.78, fedacd_weight_ratio=1.5),
              dict(fedacd_score_min=0.60, fedacd_score_max=0.66, fedacd_weight_ratio=1.1)]
    write_run(runs / "fedacd_pair_trainingV_s0", 0,
              [evaluation(5 * (i + 1), acc, kl, 0.3, **sc) for i, (acc, kl, sc) in
               enumerate(zip((0.6, 0.7, 0.9), (2.0, 1.8, 1.6), scores))])
    out = tmp_path / "results"
    assert fedacd_table.main([str(runs), "--sweep", "0.1", "--name", "t", "--out", str(out)]) == 0
    rows = {r["method"]: r for r in json.loads((out / "fedacd_fmnist_t.json").read_text())["rows"]}
    fedavg, fedacd = rows["fedavg"], rows["fedacd_pair_trainingV"]
    assert fedavg["seeds"] == [0, 1] and fedavg["global_final"] == pytest.approx([0.75, 0.60])
    assert fedavg["global_best"] == pytest.approx([0.80, 0.60])
    assert fedavg["local_kl_final"] == pytest.approx([0.75, 1.0])
    assert fedavg["local_risk_final"] == pytest.approx([0.45, 0.4])
    assert fedavg["score_range"] is None and fedavg["paper_t1"] == 68.35       # CIFAR-10 Table 1, beta 0.1
    assert fedacd["global_final"] == pytest.approx([0.8]) and fedacd["local_kl_final"] == pytest.approx([1.7])
    assert fedacd["score_range"] == pytest.approx([0.52, 0.78]) and fedacd["weight_ratio_max"] == 1.5
    # per seed: V min, V max, median and max of a round's weight ratio
    assert fedacd["score_spread_by_seed"] == [[0, 0.52, 0.78, 1.2, 1.5]]
    text = (out / "fedacd_fmnist_t.md").read_text()
    assert "| FedAvg | 2 | 67.50 ± 10.61 | s0: 75.00, s1: 60.00 |" in text
    assert "| FedACD, pair flattening, V from training (the default) | 0 | 0.520-0.780 | 1.200 (1.500) |" in text
    # where each ran, the layout included (runs recorded before the key trained in the default layout)
    assert "- Test CPU, 2 CPUs, torch 2.x, device cpu, engine reference, default layout: fedacd_pair_trainingV_s0, " \
           "fedavg_s0\n- Test CPU, 2 CPUs, torch 2.x, device cpu, engine reference, channels_last: fedavg_s1" in text
