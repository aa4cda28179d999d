"""The run folders committed under benchmarks/runs/: small files only, under a size limit, and each one a
completed run of the sweep file that names its folder (so a fresh clone's `fedhet sweep` skips it, and
an edit of a sweep file that would orphan committed runs fails here instead of silently re-running them),
or one that diverged: stopped by a non-finite loss, a result of its settings that a fresh clone's sweep
reports as failed and does not run again (``--retry-failed`` would)."""

from __future__ import annotations

import json
import subprocess
from collections import defaultdict
from pathlib import Path

import pytest

from fedhet.experiment.sweep import KEPT_FILES, job_status, load_sweep

ROOT = Path(__file__).resolve().parents[2]
RUNS = Path("benchmarks/runs")
RUN_FOLDER_LIMIT = 1_000_000      # bytes of one run's kept files (a 100-round run of 20 clients: about 0.1 MB)


def tracked_run_files() -> dict[Path, list[Path]]:
    """Files of benchmarks/runs in git's index, by run folder (what a fresh clone has)."""
    try:
        listed = subprocess.run(["git", "ls-files", str(RUNS)], cwd=ROOT, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"not a git checkout ({e}): the committed runs cannot be listed")
    by_run: dict[Path, list[Path]] = defaultdict(list)
    for line in listed.stdout.splitlines():
        path = Path(line)
        assert len(path.relative_to(RUNS).parts) == 3, f"{path}: committed runs live at {RUNS}/<sweep>/<run>/<file>"
        by_run[path.parent].append(path)
    return by_run


def test_committed_run_folders_hold_small_files_only():
    for run, files in tracked_run_files().items():
        names = {f.name for f in files}
        assert names <= set(KEPT_FILES), f"{run}: only {', '.join(KEPT_FILES)} are kept, found {sorted(names)}"
        assert {"config.yaml", "summary.json", "metrics.jsonl"} <= names, f"{run}: incomplete ({sorted(names)})"
        size = sum((ROOT / f).stat().st_size for f in files)
        assert size <= RUN_FOLDER_LIMIT, f"{run}: {size} bytes, over the {RUN_FOLDER_LIMIT} a run folder may take"


def test_every_committed_run_is_a_completed_run_of_its_sweep_file(monkeypatch):
    monkeypatch.chdir(ROOT)          # sweep files name their configs and folders from the repository's root
    by_run = tracked_run_files()
    sweeps = {}
    for path in sorted(Path("benchmarks").glob("*.sweep.yaml")):
        sweep = load_sweep(path)
        if sweep.out.parts[:2] == RUNS.parts:
            sweeps[sweep.out] = sweep
    for run in by_run:
        sweep = sweeps.get(run.parent)
        assert sweep is not None, f"{run}: no benchmarks/*.sweep.yaml has out: {run.parent}"
        job = next((j for j in sweep.jobs if j.run_dir == run), None)
        assert job is not None, f"{run}: not a run of {sweep.source}"
        status = job_status(job)
        if status == "failed":
            error = json.loads((ROOT / run / "summary.json").read_text()).get("error") or ""
            assert error.startswith("non-finite loss"), f"{run}: failed, but not by diverging ({error!r})"
            continue
        assert status == "completed", f"{run}: {status} for {sweep.source}"


def test_every_run_of_every_sweep_file_loads_and_its_method_accepts_its_settings(monkeypatch):
    """A sweep's runs start only after the runs before them: a config that a newer rule refuses
    (an override form, a method's parameters, schedule or round size: load_config and
    make_algorithm) must fail here, not hours into a window. One run per tag (its seeds differ
    only in the seed); the data and model checks need the datasets and are left to the runs."""
    from fedhet.experiment.build import make_algorithm
    from fedhet.experiment.sweep.state import current_config

    monkeypatch.chdir(ROOT)
    checked = 0
    for path in sorted(Path("benchmarks").glob("*.sweep.yaml")):
        seen: set[str] = set()
        for job in load_sweep(path).jobs:
            if job.tag in seen:
                continue
            seen.add(job.tag)
            try:
                make_algorithm(current_config(job))
            except Exception as e:
                pytest.fail(f"{path}, run {job.name}: {type(e).__name__}: {e}")
            checked += 1
    assert checked > 50
