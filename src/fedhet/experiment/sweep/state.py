"""A job's state, read from its run directory: completed, failed, interrupted, stale, extend or new;
the lock a sweep running it holds; how its recorded config differs from what the sweep file asks for
now."""

from __future__ import annotations

import copy
import functools
import json
import os
from pathlib import Path
from typing import Any

import yaml

from fedhet.core.errors import ConfigError
from fedhet.experiment.config import ExperimentConfig, config_changes, load_config
from fedhet.experiment.rundir import CHECKPOINT, read_metrics
from fedhet.experiment.sweep.spec import Job
from fedhet.experiment.yaml_io import parse_yaml

# What a completed run folder needs to count as completed and to be compared: the files a
# repository keeps of it (no checkpoint, no plot).
KEPT_FILES = ("config.yaml", "summary.json", "metrics.jsonl", "partition.json")


def failure_marker(job: Job) -> Path:
    return job.run_dir.parent / f"{job.name}.failed"


# A failure marker's first line: the config the run failed with (what config.yaml would record).
_MARKER_CONFIG = "config: "


def write_failure_marker(job: Job, text: str) -> None:
    try:
        recorded = json.dumps(current_config(job).model_dump(mode="json"))
    except (ConfigError, OSError):         # the config was read when the run started; gone since
        recorded = ""
    failure_marker(job).write_text(f"{_MARKER_CONFIG}{recorded}\n{text}")


def _failed_as_asked_now(job: Job) -> bool:
    """Whether ``job`` has a failure marker of the config the sweep asks of it now, compared as a
    run's recorded config is (:func:`config_changes`: how a run is carried out may differ). A marker
    that names no config (written before markers did) counts as of this one; a failure of another
    config does not hold the job back."""
    try:
        first = failure_marker(job).read_text().split("\n", 1)[0]
    except OSError:
        return False
    if not first.startswith(_MARKER_CONFIG) or not first.removeprefix(_MARKER_CONFIG):
        return True
    try:
        recorded = json.loads(first.removeprefix(_MARKER_CONFIG))
        return not config_changes(recorded, current_config(job))
    except (ValueError, ConfigError, OSError):     # a damaged marker, or a config that no longer loads
        return True


def first_problem(error: str) -> str:
    """The first problem of a config error: the line under ``invalid config (...):``, else its first line."""
    lines = error.splitlines()
    return lines[1].strip() if len(lines) > 1 and lines[0].startswith("invalid config") else lines[0]


def config_error(job: Job) -> str | None:
    """Why the config the sweep file asks of ``job`` does not load (None when it does)."""
    try:
        current_config(job)
    except (ConfigError, OSError) as e:
        return str(e)
    return None


def unloadable_jobs(jobs: list[Job], status: dict[str, str], retry_failed: bool) -> list[tuple[Job, str]]:
    """The jobs a sweep would start (by their ``status``, :func:`job_status` by name) whose config
    does not load, each with why; and the runs "stale" only because of that (a typo in a --set):
    no run of another config, nothing to delete."""
    return [(job, why) for job in jobs
            if (would_start(status[job.name], retry_failed) or status[job.name] == "stale")
            and (why := config_error(job))]


def unloadable_message(broken: list[tuple[Job, str]]) -> str:
    """One error for a sweep with ``broken`` jobs (:func:`unloadable_jobs`): none starts."""
    names = [job.name for job, _ in broken]
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return (f"{len(broken)} run(s) of the sweep have a config that does not load ({shown}): fix the sweep file "
            f"or the --set values; no run starts and no run folder or table is touched. "
            f"{broken[0][0].name}: {broken[0][1]}")


def lock_path(job: Job) -> Path:
    return job.run_dir.parent / f"{job.name}.lock"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:       # exists, owned by someone else
        return True
    return True


def lock_holder(job: Job) -> int | None:
    """A live process id of the sweep running ``job`` or of the run itself, or None (no lock, or
    both processes are gone)."""
    try:
        pids = [int(x) for x in lock_path(job).read_text().split()]
    except (OSError, ValueError):
        return None
    return next((pid for pid in pids if _alive(pid)), None)


def take_lock(job: Job) -> bool:
    """Create the job's lock for this process; False when a live process holds it."""
    path = lock_path(job)
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            if lock_holder(job) is not None:
                return False
            path.unlink(missing_ok=True)          # its process is gone: a stale lock
            continue
        with os.fdopen(fd, "w") as f:
            f.write(f"{os.getpid()}\n")
        return True
    return False


def write_lock(job: Job, text: str) -> None:
    """Replace the lock's content atomically: a reader never sees it empty (and takes it for dead)."""
    tmp = lock_path(job).with_suffix(".lock.tmp")
    tmp.write_text(text)
    os.replace(tmp, lock_path(job))


# A sweep's status reads every run's recorded config and, per job, its config file with the job's
# overrides, on every status, listing and table: each text is parsed once per process below
# (parse_yaml itself goes through libyaml where it can).


@functools.lru_cache(maxsize=4096)
def _parsed_yaml(text: str) -> Any:
    """``parse_yaml(text)``, each text parsed once per process (callers must not change what it
    returns); raises parse_yaml's own error."""
    return parse_yaml(text)


def current_config(job: Job) -> ExperimentConfig:
    """``load_config(job.config, job.overrides)``, what the sweep file asks of the job now: loaded
    once per text of the config file and overrides (callers must not change it); raises what
    load_config raises."""
    try:
        text = job.config.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError):
        text = None
    if text is None or "\x00" in text:
        return load_config(job.config, job.overrides)          # raises load_config's own error
    return _loaded_config(job.config, text, tuple(job.overrides))


@functools.lru_cache(maxsize=4096)
def _loaded_config(path: Path, text: str, overrides: tuple[str, ...]) -> ExperimentConfig:
    try:
        raw = _parsed_yaml(text)
    except yaml.YAMLError:
        raw = None
    if not isinstance(raw, dict):              # not YAML, empty, not a mapping
        return load_config(path, list(overrides))     # raises load_config's own error
    return load_config(path, list(overrides), raw=copy.deepcopy(raw))


def _requested_rounds(job: Job) -> int | None:
    try:
        return current_config(job).train.rounds
    except (ConfigError, OSError):
        return None


def config_mismatch(job: Job) -> list[str]:
    """How the config recorded in the job's run directory differs from what the sweep file asks
    for now (``config_changes``: run.* settings and a raised train.rounds aside); [] without a run."""
    recorded = job.run_dir / "config.yaml"
    if not recorded.is_file():
        return []
    try:
        current = current_config(job)
    except (ConfigError, OSError) as e:
        # a run exists, but what the sweep file asks for now cannot be read: not the same run
        return [f"the sweep file's config cannot be loaded ({first_problem(str(e))})"]
    try:
        return config_changes(_parsed_yaml(recorded.read_text()) or {}, current)
    except (OSError, yaml.YAMLError):
        return []          # the run itself reports a recorded config it cannot load


def stale_note(job: Job, most: int = 2) -> str:
    """Why ``job`` is stale, short: its first ``most`` :func:`config_mismatch` entries."""
    changes = config_mismatch(job)
    return "; ".join(changes[:most]) + (f"; {len(changes) - most} more" if len(changes) > most else "")


STALE_FIX = ("a stale run's folder holds a run of another config than this command asks for (the sweep file, its "
             "set lists and the command's --set): give the --set the runs were made with, restore the sweep file, "
             "or delete the folder to run it anew")


def would_start(status: str, retry_failed: bool) -> bool:
    """Whether a sweep starts (or resumes) a run of this :func:`job_status`."""
    return status in ("new", "interrupted", "extend") or (retry_failed and status == "failed")


def job_status(job: Job) -> str:
    """completed | failed | interrupted (its run directory exists: resumed) | new; ``stale`` when
    the run directory holds a run of another config than the sweep file now asks for; ``extend``
    when it completed fewer rounds than now asked for; ``damaged`` when every round is recorded but
    the summary is lost and no checkpoint is left (:data:`DAMAGED_FIX`); ``running`` while a live
    sweep runs it."""
    if lock_holder(job) is not None:
        return "running"
    return recorded_status(job)


def recorded_status(job: Job) -> str:
    """:func:`job_status` from the run directory alone (whoever holds the lock)."""
    if config_mismatch(job):
        return "stale"
    summary = job.run_dir / "summary.json"
    recorded: dict = {}
    if summary.is_file():
        try:
            recorded = json.loads(summary.read_text())
        except (OSError, ValueError):
            recorded = {}
    status = recorded.get("status")
    if status == "completed":
        wanted = _requested_rounds(job)
        if wanted is not None and int(recorded.get("rounds_completed", wanted)) < wanted:
            # an extension that failed (refused, say) is not started again by every sweep
            return "failed" if _failed_as_asked_now(job) else "extend"
        return "completed"
    if status == "failed" or _failed_as_asked_now(job):
        return "failed"
    if not recorded and _all_rounds_recorded_without_checkpoint(job):
        return "damaged"
    if (job.run_dir / "config.yaml").is_file():
        return "interrupted"
    return "new"


DAMAGED_FIX = ("its summary.json is missing or unreadable while its metrics.jsonl holds every round, and it has no "
               "checkpoint to finish from: restore summary.json from where the run is kept (git checkout, a copy), "
               "or delete the folder to run it again; a sweep leaves it alone rather than recompute recorded rounds")


def _all_rounds_recorded_without_checkpoint(job: Job) -> bool:
    """A finished run's folder that lost its summary.json (a bad copy, a merge): resumed, it would
    start again from round 1 and throw away the rows it holds."""
    if (job.run_dir / CHECKPOINT).is_file() or not (job.run_dir / "config.yaml").is_file():
        return False
    planned = _recorded_rounds(job)          # the run's own, whatever the sweep asks for now
    rounds = [r["round"] for r in recorded_rows(job)]
    return bool(planned) and rounds == list(range(1, len(rounds) + 1)) and len(rounds) >= planned


def rounds_done(job: Job) -> int:
    try:
        with open(job.run_dir / "metrics.jsonl", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def recorded_rows(job: Job) -> list[dict]:
    try:
        return read_metrics(job.run_dir)
    except OSError:             # the file went away while it was read: nothing to go by this time
        return []


def resume_round(job: Job) -> int:
    """The round a run of ``job`` goes on after: its checkpoint's, the last round that
    ``run.checkpoint_every`` of its recorded config (or the run's end) saved; 0 for a run without a
    checkpoint (a new one, or a committed folder, which keeps no checkpoint: it starts from round 1)."""
    if not (job.run_dir / CHECKPOINT).is_file():
        return 0
    rows = rounds_done(job)
    if recorded_status(job) in ("completed", "extend"):
        return rows                                # the last round is always saved
    try:
        every = load_config(job.run_dir / "config.yaml").run.checkpoint_every
    except (ConfigError, OSError):
        return 0
    return rows // every * every


def like_runs(job: Job, jobs: list[Job], cpu: dict, threads: int, tag: str | None = None) -> list[list[dict]]:
    """The metrics rows of the completed runs of ``job``'s tag (its other seeds; or of ``tag``) that are a
    guide to how long it takes here: recorded on the CPU, not a GPU, of a machine with ``cpu`` (model name,
    instruction sets, CPU count: :func:`fedhet.experiment.summary.cpu_identity`), with ``threads``
    threads a run, in the engine and memory format ``job`` asks for (where it names one rather than
    ``auto``), every round timed and all in one session (a resumed run's earlier rounds may have run
    elsewhere).
    Machines of one model still differ (a shared one, most of all), so it is a guide, not a promise."""
    try:
        asked = current_config(job).run
    except (ConfigError, OSError):
        return []
    if asked.device != "cpu":
        return []
    found = []
    for other in jobs:
        if other.tag != (tag or job.tag) or other.run_dir == job.run_dir or recorded_status(other) not in ("completed", "extend"):
            continue
        try:
            summary = json.loads((other.run_dir / "summary.json").read_text())
        except (OSError, ValueError):
            continue
        recorded = summary.get("machine") or {}
        engine = (summary.get("engine") or {}).get("engine")
        if (summary.get("device") != "cpu" or recorded.get("torch_threads") != threads
                or any(recorded.get(key) != value for key, value in cpu.items())
                or asked.engine not in ("auto", engine) or asked.memory_format not in ("auto", summary.get("memory_format"))):
            continue
        rows = recorded_rows(other)
        totals = [r["seconds"]["total"] for r in rows if isinstance(r.get("seconds"), dict) and "total" in r["seconds"]]
        one_session = sum(totals) <= float(summary.get("wall_seconds_this_session") or 0.0)
        if rows and len(totals) == len(rows) and one_session:        # every round timed, in one session
            found.append(rows)
    return found


def pace_runs(job: Job, jobs: list[Job], cpu: dict, threads: int) -> tuple[str, list[list[dict]]]:
    """The tag whose runs say how long ``job`` takes here and their :func:`like_runs`: its own tag's,
    else, while that has none, those of the tag its run entry names in ``costs_like`` (an ablation
    that costs what the whole method does, before any run of it has completed)."""
    own = like_runs(job, jobs, cpu, threads)
    if not own and job.costs_like and (theirs := like_runs(job, jobs, cpu, threads, tag=job.costs_like)):
        return job.costs_like, theirs
    return job.tag, own


def rounds_to_extend(job: Job) -> int | None:
    """The train.rounds the sweep asks for, where it is more than the run's recorded config has:
    its resume gets ``--set train.rounds=N`` and continues the run (completed or not) to that
    length; the run checks the extension and records it (Experiment.resume), so a refused one
    leaves config.yaml as it was."""
    have, wanted = _recorded_rounds(job), _requested_rounds(job)
    return wanted if have is not None and wanted is not None and wanted > have else None


def _recorded_rounds(job: Job) -> int | None:
    """train.rounds of the config recorded in the job's run directory (None: none readable)."""
    try:
        recorded = parse_yaml((job.run_dir / "config.yaml").read_text()) or {}
        return int(recorded.get("train", {}).get("rounds", 0))
    except (OSError, yaml.YAMLError, TypeError, ValueError, AttributeError):
        return None          # the run itself reports a config it cannot load
