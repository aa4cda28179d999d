"""benchmarks/fedfm_lambda_rule.py, the rule that picks FedFM's lambda before a sweep's pairs run:
the highest seed-0 validation accuracy in any round, a diverged or unfinished run last, ties to the
larger lambda. Hand-made run folders and the choice they must give."""

from __future__ import annotations

import json
from pathlib import Path

from helpers import benchmark_script, write_metrics


def write_run(runs: Path, lam: str, val_accs: list[float], status: str = "completed", error: str | None = None) -> None:
    folder = runs / f"fedfm_lam{lam}_s0"
    rows = []
    for i, val in enumerate(val_accs, start=1):
        rows += [{"round": i, "train_loss": 1.0 / i, "global_val_acc": val, "global_acc": val - 0.01}]
    write_metrics(folder, rows)
    (folder / "summary.json").write_text(json.dumps({"status": status, "error": error}))


def chosen(capsys, runs: Path) -> tuple[str, str]:
    assert benchmark_script("fedfm_lambda_rule").main([str(runs)]) == 0
    out = capsys.readouterr().out
    return out.strip().splitlines()[-1], out


def test_the_highest_validation_accuracy_of_a_finished_run_wins_and_a_diverged_one_ranks_last(tmp_path, capsys):
    write_run(tmp_path, "0.5", [0.70, 0.80, 0.79])
    write_run(tmp_path, "5", [0.75, 0.82, 0.81])                   # best at round 2
    write_run(tmp_path, "50", [0.85, 0.90], status="failed",        # higher, but its loss blew up
              error="training loss is non-finite (nan) at round 3")
    last, out = chosen(capsys, tmp_path)
    assert last == "lambda* = 5"
    assert "| 5 | 0.8200 (2) | 81.00 | completed |" in out
    assert "| 50 | 0.9000 (2) | 89.00 | failed (non-finite loss) |" in out


def test_a_tie_goes_to_the_larger_lambda(tmp_path, capsys):
    write_run(tmp_path, "0.5", [0.70, 0.82])
    write_run(tmp_path, "5", [0.82, 0.80])
    assert chosen(capsys, tmp_path)[0] == "lambda* = 5"


def test_an_unfinished_run_ranks_last_and_makes_the_choice_provisional(tmp_path, capsys):
    write_run(tmp_path, "0.5", [0.70, 0.80])
    write_run(tmp_path, "5", [0.90], status="running")
    assert chosen(capsys, tmp_path)[0] == "lambda* = 0.5 (provisional: 1 run(s) not finished)"
