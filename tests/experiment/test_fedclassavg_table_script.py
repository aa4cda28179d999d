"""benchmarks/fedclassavg_table.py, the table behind the FedClassAvg results: hand-made run folders of
the committed sweep's runs, evaluated every 2 rounds, and the figures they must give."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from helpers import benchmark_script, write_metrics

ROOT = Path(__file__).resolve().parents[2]
SWEEP = ROOT / "benchmarks" / "fedclassavg_fmnist_tiny.sweep.yaml"
COMMITTED = ROOT / "benchmarks" / "runs" / "fedclassavg_fmnist_tiny"


def write_run(runs: Path, name: str, accs: dict[int, float], losses: dict[int, float], completed: bool,
              rounds: int) -> None:
    folder = runs / name
    folder.mkdir(parents=True)
    shutil.copy(COMMITTED / name / "config.yaml", folder / "config.yaml")     # the run's own method and paper number
    rows = []
    for rnd in range(1, rounds + 1):
        row = {"round": rnd, "train_loss": 1.0, "seconds": {"total": 2.0}}
        if rnd in accs:
            row.update(personal_acc=accs[rnd], personal_acc_std=0.05, personal_loss=losses[rnd])
        rows.append(row)
    write_metrics(folder, rows)
    if completed:
        summary = {"name": name, "status": "completed", "metrics": {}, "rounds_completed": rounds,
                   "machine": {"processor": "x86_64", "cpus": 2, "torch": "2.x"}}
        (folder / "summary.json").write_text(json.dumps(summary))


def test_runs_evaluated_every_two_rounds_meet_at_their_last_shared_round(tmp_path):
    runs = tmp_path / "runs"
    # Local: 6 rounds, evaluated at 2, 4, 6; FedClassAvg stopped after round 5 (no summary), evaluated at 2, 4
    write_run(runs, "dir0.5_local_s0", {2: 0.60, 4: 0.70, 6: 0.90}, {2: 0.9, 4: 0.5, 6: 0.6}, completed=True,
              rounds=6)
    write_run(runs, "dir0.5_fedclassavg_s0", {2: 0.50, 4: 0.80}, {2: 0.8, 4: 0.7}, completed=False, rounds=5)
    out = tmp_path / "results"
    assert benchmark_script("fedclassavg_table").main([str(SWEEP), "--runs", str(runs), "--out", str(out)]) == 0
    rows = {r["method"]: r for r in json.loads((out / "fedclassavg_fmnist_runs.json").read_text())["rows"]}
    local, fca = rows["local"], rows["fedclassavg"]
    assert (local["rounds"], fca["rounds"]) == (6, 5) and not fca["completed"]
    assert (local["best"], local["best_round"]) == (0.90, 6)
    assert (local["at_min_loss"], local["min_loss_round"]) == (0.70, 4)      # the authors' rule: lowest loss
    text = (out / "fedclassavg_fmnist_runs.md").read_text()
    assert "@4: at round 4, the last that every run below evaluated" in text
    # Local at round 4 (70.00), not at its 2nd evaluation; FedClassAvg marked as stopped
    assert "| Dir(0.5) | Local (augmented) | 0 | 6 |" in text and "| 90.00 @6 | 70.00 @4 | 70.00 | 88.40 |" in text
    assert "| Dir(0.5) | FedClassAvg (CA+PR+CL) | 0 | 5 (stopped) |" in text
