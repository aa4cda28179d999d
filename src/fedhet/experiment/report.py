"""Tables over run directories: ``fedhet compare`` and the table printed after ``fedhet run``."""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path

from fedhet.core.errors import CheckpointError
from fedhet.experiment.plots import plot_compare
from fedhet.experiment.rundir import read_metrics


def load_summary(run_dir: Path) -> dict:
    path = Path(run_dir) / "summary.json"
    if not path.is_file():
        raise CheckpointError(f"{run_dir} has no summary.json (not a fedhet run directory, or the run never started)")
    return json.loads(path.read_text())


def _mean_std(values: list[float]) -> str:
    if not values:
        return "-"
    pct = [v * 100 for v in values]
    if len(pct) == 1:
        return f"{pct[0]:.2f}"
    return f"{statistics.mean(pct):.2f} ± {statistics.stdev(pct):.2f}"


def compare_table(run_dirs: list[Path], metric: str | None = None) -> tuple[str, dict]:
    """Markdown table grouping runs by config name (seeds pooled), and the curves for plotting."""
    groups: dict[str, list[tuple[Path, dict]]] = defaultdict(list)
    for d in run_dirs:
        s = load_summary(d)
        groups[s["name"]].append((Path(d), s))
    lines = ["| run | algorithm | metric | seeds | rounds | final (%) | best (%) | s/round |",
             "|---|---|---|---|---|---|---|---|"]
    curves: dict[str, list[list[tuple[int, float]]]] = {}
    for name, runs in groups.items():
        m = metric or runs[0][1]["headline_metric"]
        stats = [s["metrics"].get(m, {}) for _, s in runs]
        finals = [x["final"] for x in stats if x]
        bests = [x["best"] for x in stats if x]
        rounds = sorted({s["rounds_completed"] for _, s in runs})
        spr = [s["seconds_per_round_median"] for _, s in runs if s.get("seconds_per_round_median")]
        spr_text = f"{statistics.median(spr):.2f}" if spr else "-"
        lines.append(f"| {name} | {runs[0][1]['algorithm']} | {m} | {len(runs)} | {'/'.join(map(str, rounds))} | "
                     f"{_mean_std(finals)} | {_mean_std(bests)} | {spr_text} |")
        curves[name] = [[(r["round"], r[m]) for r in read_metrics(d) if r.get(m) is not None] for d, _ in runs]
    notes = ("final = mean of the metric over the last evaluations (window in each summary); "
             "best = max over evaluated rounds; ± = sample std over seeds.")
    return "\n".join(lines) + "\n\n" + notes, curves


def compare(run_dirs: list[Path], metric: str | None, plot_path: Path | None) -> str:
    table, curves = compare_table(run_dirs, metric)
    if plot_path is not None:
        plot_compare(curves, metric or "headline accuracy", plot_path)
    return table
