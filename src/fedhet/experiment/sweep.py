"""``fedhet sweep``: a set of experiments run as a persistent queue in parallel lanes.

A sweep file (YAML) names the runs::

    name: fedacd_fmnist                 # also the default output folder: runs/<name>
    out: runs/fedacd_fmnist_p0.1_r20    # optional
    lanes: 2                            # processes side by side; each run gets usable CPUs // lanes threads
                                        # (or the command line's --set run.threads=N)
    seeds: [0]                          # default seeds of every run
    set: [data.pool_fraction=0.1, train.rounds=20]    # overrides of every run
    grid: {algorithm.params.margin_weight: [0.5, 1.0]}   # optional: every run once per combination
    paired: b0.1_fedavg                 # optional: per-seed differences against this tag's runs
    verdicts: [...]                     # optional: claims decided from the completed runs (fedhet.experiment.verdict)
    runs:
      - config: configs/papers/fedacd/fmnist_b0.1_fedavg.yaml
        tag: b0.1_fedavg                # default: the config's file name without .yaml
      - {config: configs/papers/fedacd/fmnist_b0.1_fedacd.yaml, seeds: [0, 1], set: [eval.every=2]}

Each (run, grid point, seed) is one job with its own run directory ``<out>/<tag>[_<grid>]_s<seed>``
and config name ``<tag>[_<grid>]`` (so ``fedhet compare`` pools its seeds). The queue is the
sweep file plus the run directories: a job whose ``summary.json`` says ``completed`` is skipped, one
with a checkpoint is resumed (``fedhet run --resume``), the others start fresh. So a killed sweep
continues where it stopped when started again, and no completed run is ever re-run. A job that
fails (a config error, a diverged run) is reported, marked ``<out>/<run>.failed`` with its log's
tail, and the others go on; ``--retry-failed`` runs the failed ones again. Each job's output is
in ``<out>/<run>.log``. A run directory whose recorded config differs from what the sweep file now
asks for (an edited ``set``, say) is ``stale``: reported and left alone, never mixed into a group.
A completed run with fewer rounds than the sweep now asks for (a raised ``train.rounds``) is
``extend``: its recorded config gets the new round count and the run continues from its last
checkpoint. (An interrupted run is resumed with the new count as well.) The extended run equals
one made at the new length from the start, except where the old last round acted as the last:
it was evaluated whatever ``eval.every`` says, and FedFM-Lite uploaded the models there
(``model_every``). While a sweep runs a job, ``<out>/<run>.lock`` holds the run's process id; another
sweep over the same folder sees the job as ``running`` and leaves it alone (a lock whose process
is gone is ignored).
``--only TAG`` (repeatable) starts, resumes or retries just the runs of that tag (a run entry's tag,
or one grid group); the others are left as they are, the table still covers every completed run of
the sweep, and the exit status counts only the chosen runs. Two sweep processes with different
``--only`` over one folder share it safely (the locks above). ``--no-start-after SECONDS`` starts no
run once SECONDS have passed since the sweep started (the lanes' first runs always start): the runs
going on then finish and the rest wait for the next sweep, so a short compute window ends with its
runs instead of a run it cannot finish. ``--finish-by SECONDS`` is the window itself: at the limit,
runs still going on are stopped (each records its summary and keeps its checkpoint, so a sweep with
time resumes it) and no run starts. The progress lines of every sweep say when each running run
should end at its pace (:func:`seconds_left`, from the rounds it recorded in this sweep, at their
recent speed), and say when that is after the ``--finish-by`` limit, so a run that cannot end in time
shows it early. (They do not stop it early: a run's pace changes when a run
beside it ends or a slow evaluation comes, as in the committed 200-round runs of
benchmarks/runs/fedacd_fmnist_e5_r200, so a projection is a guide, not a verdict.)
Runs are resumed with the sweep's thread count: change ``lanes`` and a resumed run may differ from
an uninterrupted one in the last float bits. The sweep ends by writing ``<out>/sweep.md`` (the ``fedhet compare``
table of every group, then the outcome of each of the file's ``verdicts``) and ``sweep.png``;
``fedhet sweep FILE --table`` writes and prints them from the runs there are, starting none.
Run folders may be committed with their small files only (config, summary, metrics): a sweep
started in a fresh clone skips them as completed. ``--adopt FOLDER_OR_ARCHIVE`` copies a sweep's
completed runs made elsewhere (a lent GPU's archive, another machine's ``--out``) into its own
folder, only :data:`KEPT_FILES` of each.
"""

from __future__ import annotations

import copy
import functools
import itertools
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from fedhet.core.cpus import usable_cpus
from fedhet.core.errors import ConfigError
from fedhet.experiment.config import (
    RESUMABLE_CHANGES,
    ExperimentConfig,
    config_changes,
    load_config,
    override_key,
    parse_value,
    parse_yaml,
    read_yaml,
    split_override,
)
from fedhet.experiment.rundir import read_metrics
from fedhet.experiment.verdict import MissingValue, Verdict, parse_verdicts, run_value, verdict_table

# What a completed run folder needs to count as completed and to be compared: the files a
# repository keeps of it (no checkpoint, no plot).
KEPT_FILES = ("config.yaml", "summary.json", "metrics.jsonl", "partition.json")


@dataclass
class Job:
    tag: str                  # group name (config name of the run): seeds of one tag are pooled
    seed: int
    config: Path
    overrides: list[str]
    run_dir: Path
    run_tag: str = ""         # the sweep file's tag of the run entry (the group name without a grid suffix)

    @property
    def name(self) -> str:
        return self.run_dir.name


@dataclass
class Sweep:
    name: str
    out: Path
    lanes: int
    jobs: list[Job]
    metric: str | None = None
    source: Path | None = None
    notes: list[str] = field(default_factory=list)
    paired: str | None = None     # tag of the baseline for per-seed paired differences in the report
    extra_set: list[str] = field(default_factory=list)   # the command line's --set, applied to every run
    verdicts: list[Verdict] = field(default_factory=list)  # claims fixed before the runs, decided from them


def _as_list(value: Any, what: str, where: str) -> list:
    if value is None:
        return []
    if not isinstance(value, list):
        raise ConfigError(f"{where}: '{what}' must be a list, got {value!r}")
    return value


def _grid_points(grid: dict[str, list]) -> list[tuple[str, list[str]]]:
    """(suffix, overrides) for every combination of the grid (one empty point without a grid)."""
    if not grid:
        return [("", [])]
    keys = list(grid)
    for k in keys:
        if not isinstance(grid[k], list) or not grid[k]:
            raise ConfigError(f"sweep grid: '{k}' needs a non-empty list of values")
    points = []
    for values in itertools.product(*(grid[k] for k in keys)):
        suffix = "_".join(f"{k.rsplit('.', 1)[-1]}{v}" for k, v in zip(keys, values))
        points.append((suffix, [f"{k}={v}" for k, v in zip(keys, values)]))
    return points


def load_sweep(path: str | Path, out: str | Path | None = None, lanes: int | None = None,
               extra_set: list[str] | None = None) -> Sweep:
    """Read and check a sweep file; every job is listed, none is started. ``extra_set`` (the
    command line's ``--set``) applies to every run, after the file's own ``set`` lists."""
    path = Path(path)
    raw = read_yaml(path, "sweep file")
    if not isinstance(raw, dict) or not raw.get("runs"):
        raise ConfigError(f"{path}: a sweep file is a mapping with a non-empty 'runs' list (see fedhet sweep --help)")
    unknown = set(raw) - {"name", "out", "lanes", "seeds", "set", "grid", "runs", "metric", "paired", "verdicts"}
    if unknown:
        raise ConfigError(f"{path}: unknown sweep keys {sorted(unknown)}; "
                          "known: name, out, lanes, seeds, set, grid, runs, metric, paired, verdicts")
    name = str(raw.get("name") or path.stem)
    out_dir = Path(out or raw.get("out") or Path("runs") / name)
    try:
        n_lanes = int(lanes if lanes is not None else raw.get("lanes", 1))
    except (TypeError, ValueError):
        n_lanes = 0
    if n_lanes < 1:
        raise ConfigError(f"{path}: lanes must be a whole number of at least 1, got {raw.get('lanes')!r}")
    seeds = _as_list(raw.get("seeds", [0]), "seeds", str(path))
    common = [str(s) for s in _as_list(raw.get("set"), "set", str(path))]
    _refuse_threads_in_file(common, str(path))
    grid = raw.get("grid") or {}
    if not isinstance(grid, dict):
        raise ConfigError(f"{path}: 'grid' must map config keys to lists of values")
    jobs: list[Job] = []
    seen: dict[Path, str] = {}
    tag_owner: dict[str, tuple[str, list[str], str]] = {}
    for i, entry in enumerate(_as_list(raw["runs"], "runs", str(path))):
        where = f"{path}: runs[{i}]"
        if isinstance(entry, str):
            entry = {"config": entry}
        if not isinstance(entry, dict) or "config" not in entry:
            raise ConfigError(f"{where} needs a 'config' (a path, relative to the working directory)")
        extra = set(entry) - {"config", "tag", "seeds", "set"}
        if extra:
            raise ConfigError(f"{where}: unknown keys {sorted(extra)}; known: config, tag, seeds, set")
        config = Path(entry["config"])
        tag = str(entry.get("tag") or config.stem)
        run_seeds = _as_list(entry.get("seeds", seeds), "seeds", where)
        own = [str(s) for s in _as_list(entry.get("set"), "set", where)]
        _refuse_threads_in_file(own, where)
        first = tag_owner.setdefault(tag, (str(config), own, where))
        if first[:2] != (str(config), own):
            raise ConfigError(f"{where}: tag {tag!r} is also used by {first[2]} for another config or 'set'; "
                              "runs of one tag are pooled as seeds of one experiment - give it another tag")
        for suffix, grid_set in _grid_points(grid):
            group = f"{tag}_{suffix}" if suffix else tag
            for seed in run_seeds:
                run_dir = out_dir / f"{group}_s{seed}"
                if run_dir in seen:
                    raise ConfigError(f"{where}: run directory {run_dir} is also made by {seen[run_dir]}; "
                                      "give the runs different tags")
                seen[run_dir] = where
                overrides = [*common, *own, *grid_set, *(extra_set or []), f"seed={seed}", f"name={group}"]
                jobs.append(Job(group, int(seed), config, overrides, run_dir, tag))
    paired = raw.get("paired")
    if paired is not None and str(paired) not in {j.tag for j in jobs}:
        raise ConfigError(f"{path}: paired: {paired!r} is not the tag of any run (tags: "
                          f"{', '.join(sorted({j.tag for j in jobs}))})")
    verdicts = parse_verdicts(raw.get("verdicts"), str(path), {(j.tag, j.seed) for j in jobs})
    return Sweep(name, out_dir, n_lanes, jobs, raw.get("metric"), path,
                 paired=str(paired) if paired is not None else None, extra_set=list(extra_set or []),
                 verdicts=verdicts)


def _failure_marker(job: Job) -> Path:
    return job.run_dir.parent / f"{job.name}.failed"


def _lock_path(job: Job) -> Path:
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
        pids = [int(x) for x in _lock_path(job).read_text().split()]
    except (OSError, ValueError):
        return None
    return next((pid for pid in pids if _alive(pid)), None)


def _take_lock(job: Job) -> bool:
    """Create the job's lock for this process; False when a live process holds it."""
    path = _lock_path(job)
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


def _write_lock(job: Job, text: str) -> None:
    """Replace the lock's content atomically: a reader never sees it empty (and takes it for dead)."""
    tmp = _lock_path(job).with_suffix(".lock.tmp")
    tmp.write_text(text)
    os.replace(tmp, _lock_path(job))


# A sweep's status reads every run's recorded config and, per job, its config file with the job's
# overrides, on every status, listing and table: each text is parsed once per process below
# (parse_yaml itself goes through libyaml where it can).


@functools.lru_cache(maxsize=4096)
def _parsed_yaml(text: str) -> Any:
    """``parse_yaml(text)``, each text parsed once per process (callers must not change what it
    returns); raises parse_yaml's own error."""
    return parse_yaml(text)


def _current_config(job: Job) -> ExperimentConfig:
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
        return _current_config(job).train.rounds
    except (ConfigError, OSError):
        return None


def config_mismatch(job: Job) -> list[str]:
    """How the config recorded in the job's run directory differs from what the sweep file asks
    for now (``config_changes``: run.* settings and a raised train.rounds aside); [] without a run."""
    recorded = job.run_dir / "config.yaml"
    if not recorded.is_file():
        return []
    try:
        current = _current_config(job)
    except (ConfigError, OSError) as e:
        # a run exists, but what the sweep file asks for now cannot be read: not the same run
        return [f"the sweep file's config cannot be loaded ({str(e).splitlines()[0]})"]
    try:
        return config_changes(_parsed_yaml(recorded.read_text()) or {}, current)
    except (OSError, yaml.YAMLError):
        return []          # the run itself reports a recorded config it cannot load


def job_status(job: Job) -> str:
    """completed | failed | interrupted (its run directory exists: resumed) | new; ``stale`` when
    the run directory holds a run of another config than the sweep file now asks for; ``extend``
    when it completed fewer rounds than now asked for; ``running`` while a live sweep runs it."""
    if lock_holder(job) is not None:
        return "running"
    return _recorded_status(job)


def _recorded_status(job: Job) -> str:
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
            return "extend"
        return "completed"
    if status == "failed" or _failure_marker(job).is_file():
        return "failed"
    if (job.run_dir / "config.yaml").is_file():
        return "interrupted"
    return "new"


def _command(job: Job, threads: int, resume: bool, extra_set: list[str] = ()) -> list[str]:
    base = [sys.executable, "-m", "fedhet.cli", "run"]
    if resume:
        # the command line's settings of how runs are carried out (run.device, run.engine...) apply
        # to resumed runs too: a run stopped on a lent GPU goes on on the CPU with --set run.device=cpu
        sets = [x for item in resumable_sets(extra_set) for x in ("--set", item)]
        return [*base, "--resume", str(job.run_dir), *sets, "--no-progress", "--threads", str(threads)]
    sets = [x for o in job.overrides for x in ("--set", o)]
    return [*base, str(job.config), *sets, "--out", str(job.run_dir), "--no-progress", "--threads", str(threads)]


def _rounds_done(job: Job) -> int:
    try:
        with open(job.run_dir / "metrics.jsonl", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def _recorded_rows(job: Job) -> list[dict]:
    try:
        return read_metrics(job.run_dir)
    except OSError:             # the file went away while it was read: nothing to go by this time
        return []


def rows_since(before: list[dict], rows: list[dict]) -> list[dict]:
    """The rows of ``rows`` recorded after ``before`` was read: those past the longest prefix the two
    share (a resumed run first cuts its metrics back to its checkpoint, then records the rounds
    again, each with its own seconds)."""
    shared = 0
    for old, new in zip(before, rows):
        if old != new:
            break
        shared += 1
    return rows[shared:]


RECENT_ROUNDS = 10     # the rounds whose training speed a run's "ends about" goes by (seconds_left)


def seconds_left(rows: list[dict], recorded: int, planned: int, eval_every: int) -> float | None:
    """Seconds a run that has recorded ``recorded`` of ``planned`` rounds needs for the rest, at the
    pace of ``rows`` (rounds it recorded in this sweep). Training, for every round left: the rows'
    mean sample-steps a round at the speed (sample-steps a second) of the last RECENT_ROUNDS rows.
    Rounds differ in size by the clients they draw, which the mean over all rows evens out, while a
    shared machine's speed drifts within a run, which the recent rows follow (a 200-round FedACD_base
    run on a 2-core CPU slowed from 2,754 to 2,350 sample-steps a second over its first 23 rounds,
    benchmarks/results/cpu_window_intel_2026-11-30.md). Rows without their sample-steps: the mean
    seconds of the last RECENT_ROUNDS rows without evaluation. Evaluation: the rows' median
    evaluation for every evaluation left (rounds divisible by ``eval_every`` and the last; a median,
    since one slow evaluation would otherwise count as many times as there are evaluations left).
    Checkpoint writes are not in the rows' seconds, so it is a little short. None without timed
    rows, or when evaluations are left and none of ``rows`` had one."""
    timed = [r for r in rows if isinstance(r.get("seconds"), dict) and "total" in r["seconds"]]
    if not timed:
        return None
    rounds_left = range(recorded + 1, planned + 1)
    evaluations_left = sum(1 for r in rounds_left if r % eval_every == 0 or r == planned)
    evaluations = [r["seconds"]["evaluate"] for r in timed if r["seconds"].get("evaluate", 0) > 0]
    if evaluations_left and not evaluations:
        return None
    training = [r["seconds"]["total"] - r["seconds"].get("evaluate", 0) for r in timed]
    samples = [r.get("samples") for r in timed]
    recent = slice(-RECENT_ROUNDS, None)
    if all(isinstance(n, (int, float)) and n > 0 for n in samples) and sum(training[recent]) > 0:
        per_round = statistics.fmean(samples) * sum(training[recent]) / sum(samples[recent])
    else:
        per_round = statistics.fmean(training[recent])
    return len(rounds_left) * per_round + evaluations_left * (statistics.median(evaluations) if evaluations else 0.0)


def select_jobs(sweep: Sweep, only: list[str] | None) -> list[Job]:
    """The jobs named by ``only`` (the command line's ``--only``; all jobs without it): a run
    entry's tag (every grid point of it) or one group (tag plus grid suffix, as in the run folder
    names). A name that is neither is an error that lists the sweep's names."""
    if not only:
        return list(sweep.jobs)
    wanted = set(only)
    names = {j.tag for j in sweep.jobs} | {j.run_tag for j in sweep.jobs}
    unknown = [name for name in dict.fromkeys(only) if name not in names]
    if unknown:
        raise ConfigError(f"--only {', '.join(unknown)}: no run of sweep {sweep.name!r} has this tag; "
                          f"its tags and groups: {', '.join(sorted(names))}")
    return [j for j in sweep.jobs if j.tag in wanted or j.run_tag in wanted]


def lane_threads(lanes: int) -> int:
    """``run.threads`` of each run of a sweep with ``lanes`` lanes: the usable CPUs split evenly."""
    return max(1, usable_cpus() // lanes)


def _refuse_threads_in_file(items: list[str], where: str) -> None:
    # each run is started with the sweep's --threads, which a file's run.threads would silently lose to
    if any(override_key(item) == "run.threads" for item in items):
        raise ConfigError(f"{where}: run.threads in a sweep file's 'set' would be overridden by the lanes' share "
                          "(usable CPUs // lanes); leave it out, and give it on the command line instead: "
                          "fedhet sweep FILE --set run.threads=N")


def sweep_threads(sweep: Sweep) -> int:
    """``run.threads`` of each run: the command line's ``--set run.threads=N`` where given (e.g. two
    sweeps side by side on one machine), else :func:`lane_threads`."""
    asked = [value.strip() for key, value in map(split_override, sweep.extra_set) if key == "run.threads"]
    if not asked:
        return lane_threads(sweep.lanes)
    threads = parse_value(asked[-1], "run.threads")
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise ConfigError(f"--set run.threads={asked[-1]}: give a whole number of threads of at least 1")
    return threads


def _wait_for_any(procs: list[subprocess.Popen], seconds: float) -> None:
    """Return once one of ``procs`` has exited or ``seconds`` have passed (at once when none runs),
    so a lane that frees up takes its next run without waiting out the whole poll."""
    end = time.monotonic() + seconds
    while procs and all(p.poll() is None for p in procs) and time.monotonic() < end:
        time.sleep(min(0.05, max(0.0, end - time.monotonic())))


def run_sweep(sweep: Sweep, *, retry_failed: bool = False, only: list[str] | None = None,
              no_start_after: float | None = None, finish_by: float | None = None, poll_seconds: float = 2.0,
              report_every: float = 60.0, log=print) -> dict[str, str]:
    """Run every job not completed yet, ``sweep.lanes`` at a time; return ``{run dir name: status}``
    (``stopped``: a run ``finish_by`` stopped; its folder holds it as interrupted).
    ``only``: run just the jobs of these tags (the others are neither started nor touched).
    ``no_start_after``: start no run once this many seconds have passed since the sweep started; the
    runs going on then finish, the others are left for the next sweep (a compute window's last runs
    that could not finish inside it).
    ``finish_by``: the seconds the sweep has: at the limit every run still going on is stopped and
    no run starts."""
    if no_start_after is not None and not 0 <= no_start_after < math.inf:
        raise ConfigError(f"--no-start-after must be 0 or more seconds, got {no_start_after:g}")
    if finish_by is not None and not 0 < finish_by < math.inf:
        raise ConfigError(f"--finish-by must be a positive number of seconds, got {finish_by:g}")
    t_start = time.monotonic()
    deadline = None if finish_by is None else t_start + finish_by
    jobs = select_jobs(sweep, only)
    threads = sweep_threads(sweep)          # a bad --set run.threads stops the sweep before it touches its folder
    sweep.out.mkdir(parents=True, exist_ok=True)
    initial = {j.name: job_status(j) for j in jobs}
    for j in jobs:
        if initial[j.name] == "stale":
            log(f"skipped {j.name}: its run directory holds another config than the sweep file (with its --set) asks for "
                f"({'; '.join(config_mismatch(j))}); restore the sweep file, or delete {j.run_dir} to run it anew")
        if initial[j.name] == "running":
            log(f"skipped {j.name}: another sweep process runs it (pid {lock_holder(j)}, lock {_lock_path(j)})")
    todo = [j for j in jobs if initial[j.name] in ("new", "interrupted", "extend")
            or (retry_failed and initial[j.name] == "failed")]
    left = [initial[j.name] for j in jobs if j not in todo]      # skipped: completed, failed, stale, running
    skipped = ", ".join(f"{left.count(s)} {s}{' elsewhere' if s == 'running' else ''}"
                        for s in ("completed", "failed", "stale", "running") if s in left)
    chosen = f" (--only {', '.join(dict.fromkeys(only))}: {len(jobs)} of {len(sweep.jobs)})" if only else ""
    log(f"sweep {sweep.name}: {len(jobs)} runs{chosen}, {skipped or 'none'} left alone, {len(todo)} to run "
        f"in {sweep.lanes} lane(s) of {threads} thread(s); output {sweep.out}")
    running: dict[str, tuple[Job, subprocess.Popen, float]] = {}
    rows_before: dict[str, list[dict]] = {}     # what a run had recorded when this sweep started it
    outcome: dict[str, str] = {}
    last_report = time.monotonic()

    def pace(name: str, job: Job) -> tuple[int, int | None, float | None]:
        """(rounds recorded, rounds planned, seconds left at the pace of the rounds this sweep saw)."""
        rows = _recorded_rows(job)
        new_rows = rows_since(rows_before[name], rows)
        try:
            cfg = _current_config(job)
        except (ConfigError, OSError):
            return len(rows), None, None
        left = seconds_left(new_rows, len(rows), cfg.train.rounds, cfg.eval.every) if len(new_rows) >= 2 else None
        return len(rows), cfg.train.rounds, left

    def finish(name: str) -> None:
        """Record a run whose process has exited: completed, or failed with its log's tail."""
        job, proc, t0 = running.pop(name)
        rc = proc.returncode
        _lock_path(job).unlink(missing_ok=True)
        status = job_status(job)
        if status == "completed" and rc != 0:      # recorded completed; something after it failed
            log(f"{time.strftime('%H:%M:%S')} note   {name} completed but exited with status {rc} "
                f"(see {job.run_dir.parent / (name + '.log')})")
        if status != "completed":
            status = "failed"
            tail = _log_tail(job.run_dir.parent / f"{name}.log")
            _failure_marker(job).write_text(f"exit status {rc}\n{tail}\n")
            log(f"{time.strftime('%H:%M:%S')} FAILED {name} (exit {rc}): {tail.splitlines()[-1] if tail else ''}")
        else:
            log(f"{time.strftime('%H:%M:%S')} done   {name} in {time.monotonic() - t0:.0f} s")
        outcome[name] = status

    def stop_running(why: str) -> None:
        """SIGTERM every running run at once (each records its summary and keeps its checkpoint); a
        run that ended meanwhile is recorded as it ended."""
        for n in [n for n, (_, proc, _) in running.items() if proc.poll() is not None]:
            finish(n)
        _stop([proc for _, proc, _ in running.values()], grace=0.0)
        for n in list(running):
            if _recorded_status(running[n][0]) == "completed":    # it had ended, only its process had not
                finish(n)
                continue
            job, _, _ = running.pop(n)
            _lock_path(job).unlink(missing_ok=True)
            outcome[n] = "stopped"
            log(f"{time.strftime('%H:%M:%S')} stop   {n} at round {_rounds_done(job)}: {why}")
    try:
        first_fill = True           # the lanes' first runs always start; the limit counts for those after them
        while todo or running:
            if not first_fill and todo and no_start_after is not None and time.monotonic() - t_start > no_start_after:
                log(f"{time.strftime('%H:%M:%S')} {no_start_after:g} s have passed (--no-start-after): "
                    f"{len(todo)} run(s) not started: {', '.join(j.name for j in todo)}")
                todo = []
            if deadline is not None and todo and time.monotonic() >= deadline:
                log(f"{time.strftime('%H:%M:%S')} {finish_by:g} s have passed (--finish-by): "
                    f"{len(todo)} run(s) not started: {', '.join(j.name for j in todo)}")
                todo = []
            while todo and len(running) < sweep.lanes:
                job = todo.pop(0)
                if not _take_lock(job):
                    log(f"{time.strftime('%H:%M:%S')} skip   {job.name}: another sweep process started it")
                    continue
                now = _recorded_status(job)     # another sweep may have run it since this one started
                if now in ("completed", "stale") or (now == "failed" and not retry_failed):
                    _lock_path(job).unlink(missing_ok=True)
                    log(f"{time.strftime('%H:%M:%S')} skip   {job.name}: {now} meanwhile (another sweep process)")
                    continue
                # a run directory with a config is resumed: from its checkpoint, or from round 1;
                # with the rounds the sweep file asks for now (completed, interrupted or failed)
                resume = (job.run_dir / "config.yaml").is_file()
                if resume:
                    _extend_rounds(job)
                _failure_marker(job).unlink(missing_ok=True)
                job.run_dir.parent.mkdir(parents=True, exist_ok=True)
                logf = open(job.run_dir.parent / f"{job.name}.log", "a" if resume else "w")
                rows_before[job.name] = _recorded_rows(job)      # before a resumed run cuts them back
                proc = subprocess.Popen(_command(job, threads, resume, sweep.extra_set), stdout=logf,
                                        stderr=subprocess.STDOUT)
                logf.close()
                _write_lock(job, f"{os.getpid()} {proc.pid}\n")      # the run outlives a killed sweep
                running[job.name] = (job, proc, time.monotonic())
                log(f"{time.strftime('%H:%M:%S')} start  {job.name}{' (resuming)' if resume else ''}")
            first_fill = False
            _wait_for_any([proc for _, proc, _ in running.values()], poll_seconds)
            for name, (_, proc, _) in list(running.items()):
                if proc.poll() is not None:
                    finish(name)
            if deadline is not None and running and time.monotonic() >= deadline:
                stop_running(f"{finish_by:g} s have passed (--finish-by)")
                continue
            if running and time.monotonic() - last_report >= report_every:
                last_report = time.monotonic()
                done = sum(job_status(j) == "completed" for j in jobs)
                parts = []
                for n, (j, _, _) in running.items():
                    recorded, planned, left = pace(n, j)
                    of = f" of {planned}" if planned is not None else ""
                    ends = f", ends about {_clock(left)}" if left is not None else ""
                    if left is not None and deadline is not None and time.monotonic() + left > deadline:
                        ends += f", after the --finish-by limit at {_clock(deadline - time.monotonic())}"
                    parts.append(f"{n} (round {recorded}{of}{ends})")
                log(f"{time.strftime('%H:%M:%S')} {done}/{len(jobs)} completed; running: {', '.join(parts)}")
    except BaseException as e:
        # A Ctrl-C in a terminal reached the runs too: give them time to record their state; then
        # SIGTERM (`fedhet run` stops on it like after Ctrl-C: summary and checkpoints kept; a
        # background job ignores SIGINT), and only then kill. `fedhet sweep` gets SIGTERM as
        # KeyboardInterrupt too (fedhet.cli.main).
        _stop([proc for _, proc, _ in running.values()], grace=10.0 if isinstance(e, KeyboardInterrupt) else 0.0)
        for job, _, _ in running.values():
            _lock_path(job).unlink(missing_ok=True)
        log("sweep stopped: its running runs were stopped; run the same command again to resume them")
        raise
    return outcome


def _clock(seconds_from_now: float) -> str:
    """The wall-clock time ``seconds_from_now`` from now, HH:MM (with the date when not today)."""
    then = time.localtime(time.time() + seconds_from_now)
    same_day = time.strftime("%Y-%m-%d", then) == time.strftime("%Y-%m-%d")
    return time.strftime("%H:%M" if same_day else "%Y-%m-%d %H:%M", then)


def resumable_sets(extra_set: list[str]) -> list[str]:
    """The command line's ``--set`` values that a resumed run takes (``RESUMABLE_CHANGES``: device,
    engine, workers, checkpointing...), but ``run.threads``, the sweep's own (one share per lane).
    Other settings are part of what a run is: a run recorded with other values is stale and left alone."""
    taken = set(RESUMABLE_CHANGES) - {"run.threads"}
    return [item for item in extra_set if override_key(item) in taken]


def _extend_rounds(job: Job) -> None:
    """Raise the recorded config's train.rounds to what the sweep asks for, when it asks for
    more, so ``--resume`` continues the run (completed or not) to that length."""
    wanted = _requested_rounds(job)
    path = job.run_dir / "config.yaml"
    try:
        recorded = parse_yaml(path.read_text()) or {}
        have = int(recorded.get("train", {}).get("rounds", 0))
    except (OSError, yaml.YAMLError, TypeError, ValueError, AttributeError):
        return             # the run itself reports a config it cannot load
    if wanted is None or have >= wanted:
        return
    recorded.setdefault("train", {})["rounds"] = wanted
    path.write_text(yaml.safe_dump(recorded, sort_keys=False))


def _stop(procs: list[subprocess.Popen], grace: float) -> None:
    deadline = time.monotonic() + grace
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _log_tail(path: Path, lines: int = 5) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return ""


def write_report(sweep: Sweep) -> str:
    """``<out>/sweep.md`` and ``sweep.png``: the ``fedhet compare`` table of the completed runs,
    and the list of runs that are not (yet) completed."""
    from fedhet.experiment.report import compare

    status = {j.name: job_status(j) for j in sweep.jobs}       # each reads the run's files once
    done = [j.run_dir for j in sweep.jobs if status[j.name] == "completed"]
    missing = [(j.name, status[j.name]) for j in sweep.jobs if status[j.name] != "completed"]
    lines = [f"# Sweep {sweep.name}", "", "Command:", "", "```bash",
             " ".join(["fedhet sweep", *([str(sweep.source)] if sweep.source else []),
                       *(f"--set {item}" for item in sweep.extra_set)]), "```", ""]
    if done:
        completed_tags = {j.tag for j in sweep.jobs if status[j.name] == "completed"}
        paired = sweep.paired if sweep.paired in completed_tags else None
        lines.append(compare(done, sweep.metric, sweep.out / "sweep.png", paired=paired))
    else:
        lines.append("No completed runs yet.")
    if sweep.verdicts:
        lines += ["", "Verdicts (rules fixed in the sweep file before its runs; differences in points):", "",
                  verdict_table(sweep.verdicts, _completed_value(sweep, status), sweep.metric)]
    if missing:
        lines += ["", "Not completed:", ""] + [f"- `{name}`: {status}" for name, status in missing]
    text = "\n".join(lines) + "\n"
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
