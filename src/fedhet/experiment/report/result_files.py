"""What the per-paper table scripts (``benchmarks/*_table.py``) share: a folder of run directories
in, a result file (Markdown, JSON, plot) out; each script keeps only its paper's layout, columns
and numbers."""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path

from fedhet.core.errors import FedhetError
from fedhet.experiment.plots import plot_compare
from fedhet.experiment.report.runs import load_summary
from fedhet.experiment.rundir import CONFIG, read_metrics
from fedhet.experiment.summary import cpu_name, git_commit, machine_info


def run_table_script(main: Callable[[], int]) -> int:
    """A table script's exit status: ``main()``'s, or 2 with fedhet's error on one line (a folder
    that is not there, a sweep file that does not load), as the fedhet command reports it."""
    try:
        return main()
    except FedhetError as e:
        print(f"{Path(sys.argv[0]).name}: error: {e}", file=sys.stderr)
        return 2


def read_run_folder(folder: Path) -> tuple[list[tuple[Path, dict]], list[tuple[str, int, str]]]:
    """The run directories directly under ``folder``, by name: the completed ones with their
    summaries, and the others as (name, rounds recorded, why): the summary's error or status, or
    "no summary.json" (rounds counted in its metrics.jsonl)."""
    if not Path(folder).is_dir():
        raise FedhetError(f"{folder} is not a folder of runs (working directory {Path.cwd()}): name the folder "
                          "a sweep wrote its runs to (its out), e.g. benchmarks/runs/<sweep>")
    completed: list[tuple[Path, dict]] = []
    unfinished: list[tuple[str, int, str]] = []
    for d in sorted(p for p in Path(folder).iterdir() if p.is_dir()):
        if not (d / "summary.json").is_file():
            rounds = len(read_metrics(d)) if (d / "metrics.jsonl").is_file() else 0
            unfinished.append((d.name, rounds, "no summary.json"))
            continue
        summary = load_summary(d)
        if summary["status"] != "completed":
            unfinished.append((d.name, summary["rounds_completed"], summary.get("error") or summary["status"]))
            continue
        completed.append((d, summary))
    return completed, unfinished


def unfinished_lines(unfinished: list[tuple[str, int, str]]) -> list[str]:
    """Markdown lines naming the runs a table left out (``read_run_folder``'s second list); none
    when there are none."""
    if not unfinished:
        return []
    return ["", "Runs that did not finish (left out of the table above):", "",
            *(f"- `{name}`: {rounds} rounds recorded; {why}" for name, rounds, why in unfinished)]


def runs_made_at(runs: Sequence[Path]) -> str:
    """Where ``runs`` were made, from their summaries: each commit and CPU with its number of runs,
    e.g. "cc8170f on Intel Xeon (AVX512, bf16, amx) (3 runs); 4e8e146 on AMD EPYC (AVX2) (1 run)"."""
    made: dict[tuple[str, str], int] = defaultdict(int)
    for run in runs:
        recorded = load_summary(run).get("machine") or {}
        made[str(recorded.get("commit")), cpu_name(recorded)] += 1
    return "; ".join(f"{commit} on {cpu} ({n} run{'s' if n > 1 else ''})" for (commit, cpu), n in made.items())


def provenance_lines(runs: Sequence[Path], others_differ_in: str, machine: dict | None = None) -> list[str]:
    """Markdown lines closing a result file: the commits and CPUs the ``runs`` were made at (their
    summaries), the machine and commit the table is made on (``machine``, default this one's
    ``machine_info``), and the first run's config, the others differing in ``others_differ_in``."""
    m = machine or machine_info()
    return ["", f"Runs made at {runs_made_at(runs)}; the table made on {cpu_name(m)}, {m['cpus']} CPUs, torch "
            f"{m['torch']}, at commit {git_commit()}.", "",
            f"Config of the first run (the others differ in {others_differ_in}):", "", "```yaml",
            (Path(runs[0]) / CONFIG).read_text().strip(), "```", ""]


def write_result_files(out: Path, stem: str, lines: list[str], payload: dict,
                       curves: dict[str, list[list[tuple[int, float]]]], metric: str) -> str:
    """``out/<stem>.md`` (the lines), ``<stem>.json`` (the payload) and ``<stem>.png`` (the curves
    of ``metric``, as ``fedhet compare`` plots them); returns the Markdown text."""
    text = "\n".join(lines)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.md").write_text(text + "\n")
    (out / f"{stem}.json").write_text(json.dumps(payload, indent=2))
    plot_compare(curves, metric, out / f"{stem}.png")
    return text
