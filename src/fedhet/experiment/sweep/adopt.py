"""Runs of a sweep made elsewhere (a lent GPU's archive, another machine's folder) copied into its own
folder, their small files only."""

from __future__ import annotations

import shutil
import tarfile
import tempfile
from pathlib import Path

from fedhet.core.errors import ConfigError
from fedhet.experiment.sweep.spec import Job, Sweep
from fedhet.experiment.sweep.state import KEPT_FILES, job_status


def adopt_runs(sweep: Sweep, source: str | Path, log=print) -> list[str]:
    """Copy the sweep's runs that are completed in ``source`` (a folder of run directories, or a
    ``.tar.gz`` of one) and not in the sweep's own folder, :data:`KEPT_FILES` only. A run counts
    when its summary says completed and its recorded config is what the sweep file asks for, the
    test a sweep applies to its own runs. Returns the adopted run names."""
    source = Path(source)
    if not source.exists():
        raise ConfigError(f"--adopt {source}: no such folder or archive")
    adopted = []
    with tempfile.TemporaryDirectory() as scratch:
        folder = source
        if source.is_file():
            try:
                with tarfile.open(source) as tar:
                    tar.extractall(scratch, filter="data")
            except (tarfile.TarError, OSError) as e:
                raise ConfigError(f"--adopt {source}: not a readable .tar.gz of run folders ({e})") from e
            inner = [p for p in Path(scratch).iterdir() if p.is_dir()]
            folder = inner[0] if len(inner) == 1 else Path(scratch)
        jobs = sweep.jobs
        if any(folder.name == job.name for job in jobs) and (folder / "config.yaml").is_file():
            # one run's own folder (elsewhere/fedavg_s0): that run alone, from the folder above it
            jobs = [job for job in jobs if job.name == folder.name]
            folder = folder.parent
        here_done: list[str] = []
        not_done: list[str] = []        # "name (status)" of those there but not completed or of another config
        for job in jobs:
            there = Job(job.tag, job.seed, job.config, job.overrides, folder / job.name, job.run_tag)
            if job_status(job) == "completed":
                here_done.append(job.name)
                continue
            if not there.run_dir.is_dir():
                continue
            if (status := job_status(there)) != "completed":
                not_done.append(f"{job.name} ({status})")
                continue
            job.run_dir.mkdir(parents=True, exist_ok=True)
            for name in KEPT_FILES:
                if (there.run_dir / name).is_file():
                    shutil.copy2(there.run_dir / name, job.run_dir / name)
            adopted.append(job.name)
            log(f"adopted {job.name} from {source}")
        absent = len(jobs) - len(adopted) - len(here_done) - len(not_done)
        shown = f" ({', '.join(not_done[:5])}{' and more' if len(not_done) > 5 else ''})" if not_done else ""
        # a folder with none of the sweep's run folders is likely another sweep's, or one level off
        hint = (f": it holds no folder named like a run of sweep {sweep.name!r}, e.g. {sweep.jobs[0].name}"
                if absent and not adopted and not not_done else "")
        log(f"--adopt {source}: {len(adopted)} run(s) adopted; {len(here_done)} already completed here, "
            f"{len(not_done)} there not completed or of another config{shown}, {absent} not there{hint}")
    return adopted
