"""The table of ``fedhet compare`` (and the one printed after ``fedhet run`` and in a sweep's
``sweep.md``): one row per experiment, its seeds pooled, with the paper's number where the config
gives it; and ``compare``, which adds the plot and the paired differences."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path

from fedhet.core.errors import CheckpointError
from fedhet.core.suggest import did_you_mean
from fedhet.experiment.plots import plot_compare
from fedhet.experiment.report.paired import paired_differences
from fedhet.experiment.report.runs import group_runs, load_paper
from fedhet.experiment.report.stats import format_mean_std
from fedhet.experiment.rundir import read_metrics
from fedhet.experiment.summary import SUMMARIZED_METRICS, selected_value
from fedhet.experiment.verdict import run_value


def compare_table(run_dirs: list[Path], metric: str | None = None,
                  grouped: tuple[dict[str, list[tuple[Path, dict]]], list[str]] | None = None) -> tuple[str, dict]:
    """Markdown table grouping runs by config name (seeds pooled), and the curves for plotting.

    When a run's config carries a ``paper`` section, two columns give the paper's number and the
    measured mean over seeds minus it, measured as the section's ``measured_as`` says (final, best,
    or at the round where another metric is lowest or highest, to follow the paper's rule); the
    notes say which rule each side used and where the runs are shorter than the paper's."""
    groups, left_out = grouped or group_runs(run_dirs)
    if metric is not None:
        recorded = {m for runs in groups.values() for _, s in runs for m, v in s["metrics"].items() if v}
        if metric not in recorded:
            near = did_you_mean(metric, sorted(recorded | set(SUMMARIZED_METRICS)), cutoff=0.85)
            if near and metric not in SUMMARIZED_METRICS:       # a misspelling, not a metric these runs lack
                raise CheckpointError(f"--metric {metric}: no such metric{near}; the runs' summaries hold: "
                                      f"{', '.join(sorted(recorded)) or 'none'}")
            per_round = "" if metric in SUMMARIZED_METRICS else (
                f" (compare reads the metrics the runs' summaries hold: {', '.join(SUMMARIZED_METRICS)}; any "
                f"other, such as a loss, is in each round's row of metrics.jsonl: fedhet.load(RUN_DIR)"
                f".metric({metric!r}))")
            raise CheckpointError(f"--metric {metric}: no run compared has it in its summary{per_round}; theirs "
                                  f"hold: {', '.join(sorted(recorded)) or 'none'}")
    papers = {name: load_paper(runs[0][0]) for name, runs in groups.items()}
    with_paper = any(papers.values())
    head = "| run | algorithm | metric | seeds | rounds | final (%) | best (%) | s/round |"
    rule = "|---|---|---|---|---|---|---|---|"
    metric_of = {name: metric or runs[0][1]["headline_metric"] for name, runs in groups.items()}
    selected = {name: [v for _, s in runs if (v := selected_value(s, metric_of[name])) is not None]
                for name, runs in groups.items()}
    with_selected = any(selected.values())
    if with_selected:
        head, rule = head + " at best val (%) |", rule + "---|"
    if with_paper:
        head, rule = head + " paper (%) | measured - paper |", rule + "---|---|"
    lines = [head, rule]
    curves: dict[str, list[list[tuple[int, float]]]] = {}
    measured_rules: set[str] = set()
    paper_notes: list[str] = []
    unplotted: list[str] = []
    cut: list[str] = []                # metrics.jsonl damaged after some rows: a shorter curve than the table's
    for name, runs in groups.items():
        m = metric_of[name]
        stats = [s["metrics"].get(m, {}) for _, s in runs]
        finals = [x["final"] for x in stats if x]
        bests = [x["best"] for x in stats if x]
        measured_rules.update(x["final_rule"] for x in stats if x.get("final_rule"))
        rounds = sorted({s["rounds_completed"] for _, s in runs})
        spr = [s["seconds_per_round_median"] for _, s in runs if s.get("seconds_per_round_median")]
        spr_text = f"{statistics.median(spr):.2f}" if spr else "-"
        row = (f"| {name} | {runs[0][1]['algorithm']} | {m} | {len(runs)} | {'/'.join(map(str, rounds))} | "
               f"{format_mean_std(finals)} | {format_mean_std(bests)} | {spr_text} |")
        if with_selected:
            row += f" {format_mean_std(selected[name])} |"
        if with_paper:
            row += " " + _paper_cells(papers[name], m, runs) + " |"
        lines.append(row)
        rows_of = [read_metrics(d) for d, _ in runs]
        curves[name] = [[(r["round"], r[m]) for r in rows if r.get(m) is not None] for rows in rows_of]
        unplotted.extend(f"{d} ({f'its rows record no {m}' if rows else 'no readable metrics.jsonl rows'})"
                         for (d, _), curve, rows in zip(runs, curves[name], rows_of) if not curve)
        cut.extend(f"{d} (rows up to round {rows[-1]['round']} of {s['rounds_completed']})"
                   for (d, s), rows in zip(runs, rows_of) if rows and rows[-1]["round"] < s["rounds_completed"])
        paper = papers[name]
        if paper:
            where = ", ".join(x for x in (paper.get("source"), paper.get("cell")) if x)
            paper_notes.append(f"- {name}: {where}" + (f"; paper's rule: {paper['rule']}" if paper.get("rule") else "")
                               + _paper_gaps(paper, m, runs))
    notes = ("final = mean of the metric over the last evaluations (window in each summary"
             + (f": {'; '.join(sorted(measured_rules))}" if measured_rules else "") + "); "
             "best = max over evaluated rounds; ± = sample std over seeds."
             + (" at best val = the metric at the first round with the highest validation accuracy (the "
                "clients' held-out splits)." if with_selected else ""))
    precisions = {name: sorted({(s.get("precision", "fp32"), s.get("eval_precision", "fp32")) for _, s in runs})
                  for name, runs in groups.items()}
    if len({p for ps in precisions.values() for p in ps}) > 1:     # rounding differs between the rows
        notes += ("\n\nNot every run has the same precision (trained / evaluated): "
                  + "; ".join(f"{name}: {', '.join(f'{t} / {e}' for t, e in ps)}" for name, ps in precisions.items()))
    if left_out:
        notes += "\n\nLeft out (not completed): " + "; ".join(left_out)
    # an interrupted (or still running) run is pooled with the rounds it has, and said so
    unfinished = [f"{d} ({s.get('status')}, {s.get('rounds_completed')} of {s.get('rounds_planned')} rounds)"
                  for runs in groups.values() for d, s in runs if s.get("status") != "completed"]
    if unfinished:
        notes += ("\n\nNot finished, counted with the rounds they have (their final is not the planned run's): "
                  + "; ".join(unfinished))
    if unplotted:
        notes += "\n\nIn the table from their summaries, but not in the plot: " + "; ".join(unplotted)
    if cut:
        notes += ("\n\nIn the table from their summaries, but plotted only as far as their metrics.jsonl is readable: "
                  + "; ".join(cut))
    if paper_notes:
        notes += ("\n\nPaper columns: the number the config's `paper` section gives (± its std); measured - "
                  "paper uses the measured mean over seeds of the same metric, taken as the section's "
                  "`measured_as` says (final unless the cell names best, or the round where another metric "
                  "is lowest or highest).\n" + "\n".join(paper_notes))
    return "\n".join(lines) + "\n\n" + notes, curves


def _measured_for_paper(paper: dict, metric: str, runs: list[tuple[Path, dict]]) -> list[float]:
    """Each run's value of the paper's metric, taken the way the paper's rule takes it (as a
    sweep's verdicts take a run's value); runs without it are left out."""
    pm = paper.get("metric") or metric
    how = paper.get("measured_as") or "final"        # configs recorded before measured_as: final
    return [v for d, s in runs if (v := run_value(d, s, pm, how)) is not None]


def _measured_label(how: str) -> str:
    """How a difference was measured, for its cell: nothing for final, "best", "at lowest personal_loss"."""
    if how == "final":
        return ""
    extreme, _, by = how.partition(":")
    return f" (at {extreme} {by})" if by else f" ({how})"


def _paper_cells(paper: dict | None, metric: str, runs: list[tuple[Path, dict]]) -> str:
    if not paper:
        return "- | -"
    pm = paper.get("metric") or metric
    measured = _measured_for_paper(paper, metric, runs)
    value = 100 * paper["value"]
    text = f"{value:.2f}" + (f" ± {100 * paper['std']:.2f}" if paper.get("std") is not None else "")
    if pm != metric:
        text += f" ({pm})"
    label = _measured_label(paper.get("measured_as") or "final")
    diff = f"{100 * statistics.mean(measured) - value:+.2f}{label}" if measured else "-"
    return f"{text} | {diff}"


def _paper_gaps(paper: dict, metric: str, runs: list[tuple[Path, dict]]) -> str:
    """What keeps the difference from being like for like, for the row's paper note: runs shorter
    than the paper's T, and runs without the statistic the paper's rule needs."""
    gaps = ""
    ran = min(s["rounds_completed"] for _, s in runs)      # the shortest run decides
    if paper.get("rounds") and ran < paper["rounds"]:
        gaps += f"; ran {ran} of the paper's {paper['rounds']} rounds, so the difference is not like for like"
    changed = paper.get("changed") or []
    if changed:
        listed = ", ".join(changed[:6]) + (f" and {len(changed) - 6} more" if len(changed) > 6 else "")
        gaps += (f"; run with {listed} changed from the config that states the paper's number, so the difference "
                 "is not like for like")
    missing = len(runs) - len(_measured_for_paper(paper, metric, runs))
    if missing:
        by = (paper.get("measured_as") or "final").partition(":")[2]
        what = f"no {paper.get('metric') or metric}" + (f" or no {by}" if by else "")
        if by == "global_val_acc":
            what += " (global_val_acc needs data.local_test.source: holdout)"
        gaps += f"; {missing} of {len(runs)} runs recorded {what} and are left out of the difference"
    return gaps


def compare(run_dirs: Sequence[str | Path] | str | Path, metric: str | None, plot_path: Path | None,
            paired: str | Sequence[str] | None = None) -> str:
    """The compare table of ``run_dirs`` (a list, or one run's path) with its notes, then the paired
    differences against each baseline in ``paired`` (none when empty); the curves of ``metric``
    plotted to ``plot_path``."""
    run_dirs = [Path(run_dirs)] if isinstance(run_dirs, (str, Path)) else [Path(d) for d in run_dirs]
    grouped = group_runs(run_dirs)          # each summary read once
    table, curves = compare_table(run_dirs, metric, grouped)
    if plot_path is not None:
        headlines = {name: runs[0][1]["headline_metric"] for name, runs in grouped[0].items()}
        if metric is None and len(set(headlines.values())) > 1:      # each line names what it plots
            curves = {f"{name}: {headlines[name]}": curve for name, curve in curves.items()}
        label = metric or (next(iter(headlines.values())) if len(set(headlines.values())) == 1 else "headline metric")
        plot_compare(curves, label, plot_path)
    if paired:
        table += "\n\n" + paired_differences(run_dirs, paired, metric, grouped)
    return table
