"""Write a committed result file (markdown + json) from finished run directories.

    python benchmarks/collect.py --name NAME --command "the exact command" [--paper "text"] RUN_DIR...

The json keeps each run's summary (machine info, commit, speed, memory, communication); the
markdown has the comparison table, the per-run figures and the command that produced them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from fedhet.experiment.plots import plot_compare
from fedhet.experiment.report import compare_table, load_summary
from fedhet.experiment.report.result_files import runs_made_at
from fedhet.experiment.rundir import read_metrics
from fedhet.experiment.summary import cpu_name, git_commit, machine_info


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("run_dirs", nargs="+")
    p.add_argument("--name", required=True)
    p.add_argument("--command", required=True, help="the command(s) that produced the runs")
    p.add_argument("--paper", default="", help="published numbers to print beside ours")
    p.add_argument("--notes", default="")
    p.add_argument("--metric")
    p.add_argument("--out", default="benchmarks/results")
    a = p.parse_args()

    dirs = [Path(d) for d in a.run_dirs]
    summaries = {str(d): load_summary(d) for d in dirs}
    table, curves = compare_table(dirs, a.metric)
    lines = [f"# {a.name}", "", "Command:", "", "```bash", a.command, "```", "", table, ""]
    if a.paper:
        lines += ["Published: " + a.paper, ""]
    lines += ["| run dir | status | rounds | final | best (round) | median s/round | train samples/s | peak MB | up+down floats |",
              "|---|---|---|---|---|---|---|---|---|"]
    for d, s in summaries.items():
        h = s["headline"]
        comm = s["communication"]
        floats = comm.get("up", {}).get("floats", 0) + comm.get("down", {}).get("floats", 0)
        lines.append(f"| {Path(d).name} | {s['status']} | {s['rounds_completed']} | {h.get('final', 0) * 100:.2f} | "
                     f"{h.get('best', 0) * 100:.2f} ({h.get('best_round')}) | {s['seconds_per_round_median']:.2f} | "
                     f"{s['client_samples_per_second']:.0f} | {s['peak_memory_mb']:.0f} | {floats:.3g} |")
    lines += ["", "Headline metric at 1/5 .. 5/5 of the rounds (as in the FedCME paper's Table III):", "",
              "| run dir | " + " | ".join(f"{k}/5 T" for k in range(1, 6)) + " |", "|---|" + "---|" * 5]
    for d, s in summaries.items():
        by_round = {r["round"]: r.get(s["headline_metric"]) for r in read_metrics(d)}
        t = s["rounds_completed"]
        cells = [by_round.get(round(k * t / 5)) for k in range(1, 6)]
        lines.append(f"| {Path(d).name} | " + " | ".join(f"{c * 100:.2f} (r{round(k * t / 5)})" if c is not None else "-"
                                                      for k, c in enumerate(cells, 1)) + " |")
    m = next(iter(summaries.values()))["machine"]
    lines += ["", f"Runs made at {runs_made_at(dirs)}; the first with torch {m['torch']} ({m['torch_threads']} "
              f"threads), python {m['python']}; collected on {cpu_name(machine_info())} at commit {git_commit()}.",
              ""]
    if a.notes:
        lines += [a.notes, ""]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    plot_compare(curves, a.metric or "headline accuracy", out / f"{a.name}.png")
    lines += [f"![curves]({a.name}.png)", ""]
    (out / f"{a.name}.md").write_text("\n".join(lines))
    (out / f"{a.name}.json").write_text(json.dumps({"name": a.name, "command": a.command, "paper": a.paper,
                                                     "collector_machine": machine_info(), "runs": summaries}, indent=2))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
