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
        for job in sweep.jobs:
            there = Job(job.tag, job.seed, job.config, job.overrides, folder / job.name, job.run_tag)
            if job_status(job) == "completed" or not there.run_dir.is_dir() or job_status(there) != "completed":
                continue
            job.run_dir.mkdir(parents=True, exist_ok=True)
            for name in KEPT_FILES:
                if (there.run_dir / name).is_file():
                    shutil.copy2(there.run_dir / name, job.run_dir / name)
            adopted.append(job.name)
            log(f"adopted {job.name} from {source}")
    return adopted
