"""A sweep's ``sweep.md`` and ``sweep.png``: the ``fedhet compare`` table of its completed runs, the
outcome of its verdicts and the runs not (yet) completed."""

from __future__ import annotations

import json
import os
import shlex

from fedhet.experiment.sweep.spec import Sweep
from fedhet.experiment.sweep.state import DAMAGED_FIX, job_status, stale_note
from fedhet.experiment.verdict import MissingValue, Verdict, run_value, verdict_table


def write_report(sweep: Sweep, replace: bool = True, status: dict[str, str] | None = None) -> str:
    """``<out>/sweep.md`` and ``sweep.png``: the ``fedhet compare`` table of the completed runs,
    and the list of runs that are not (yet) completed (a stale one with what differs). With
    ``replace=False`` an existing ``sweep.md`` (and its ``sweep.png``) is kept and the text only
    returned. ``status``: every job's :func:`job_status` by name, where the caller has read them."""
    from fedhet.experiment.report import compare

    keep = not replace and (sweep.out / "sweep.md").is_file()     # then neither sweep.md nor sweep.png changes
    if status is None:
        status = {j.name: job_status(j) for j in sweep.jobs}   # each reads the run's files once
    done = [j.run_dir for j in sweep.jobs if status[j.name] == "completed"]
    missing = [(j.name, status[j.name]) for j in sweep.jobs if status[j.name] != "completed"]
    lines = [f"# Sweep {sweep.name}", "", "Command:", "", "```bash",
             " ".join(["fedhet sweep", *([str(sweep.source)] if sweep.source else []),
                       *([f"--out {shlex.quote(str(sweep.out))}"] if sweep.out_given else []),
                       *(f"--set {shlex.quote(item)}" for item in sweep.extra_set)]), "```", ""]
    if done:
        completed_tags = {j.tag for j in sweep.jobs if status[j.name] == "completed"}
        paired = [tag for tag in sweep.paired if tag in completed_tags]
        lines.append(compare(done, sweep.metric, None if keep else sweep.out / "sweep.png", paired=paired))
    else:
        lines.append("No completed runs yet.")
    if sweep.verdicts:
        lines += ["", "Verdicts (rules fixed in the sweep file before its runs; differences in points):", "",
                  verdict_table(sweep.verdicts, _completed_value(sweep, status), sweep.metric)]
    if missing:
        jobs = {j.name: j for j in sweep.jobs}
        lines += ["", "Not completed:", ""] + [
            f"- `{name}`: {status}" + (f" ({stale_note(jobs[name])})" if status == "stale" else
                                        f" ({DAMAGED_FIX})" if status == "damaged" else "")
            for name, status in missing]
    text = "\n".join(lines) + "\n"
    if keep:
        return text
    sweep.out.mkdir(parents=True, exist_ok=True)       # --table before any run has made the folder
    partial = sweep.out / f".sweep.md.{os.getpid()}"   # two sweeps over one folder (--only) never tear it
    partial.write_text(text)
    os.replace(partial, sweep.out / "sweep.md")
    return text


def _completed_value(sweep: Sweep, status: dict[str, str]):
    """``value_of(verdict, tag, seed)`` for :func:`verdict_table`: the completed run's number, else None."""
    jobs = {(j.tag, j.seed): j for j in sweep.jobs}

    def value_of(verdict: Verdict, tag: str, seed: int) -> float | None:
        job = jobs.get((tag, seed))
        if job is None or status[job.name] != "completed":
            return None
        summary = json.loads((job.run_dir / "summary.json").read_text())
        metric = verdict.metric or sweep.metric or summary["headline_metric"]
        value = run_value(job.run_dir, summary, metric, verdict.value)
        if value is None:
            recorded = sorted(m for m, v in (summary.get("metrics") or {}).items() if v)
            raise MissingValue(f"{job.name} recorded no {metric} ({verdict.value}); it has: {', '.join(recorded)}")
        return value

    return value_of
