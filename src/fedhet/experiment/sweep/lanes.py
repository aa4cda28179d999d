"""Running a sweep: its jobs in parallel lanes of ``fedhet run`` processes, each started, resumed or
extended from what its run directory holds, within the --no-start-after and --finish-by limits."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

from fedhet.core.cpus import usable_cpus
from fedhet.core.errors import ConfigError, Terminated
from fedhet.experiment.config import RESUMABLE_CHANGES, override_key, parse_value, split_override
from fedhet.experiment.rundir import CHECKPOINT
from fedhet.experiment.summary import cpu_identity
from fedhet.experiment.sweep.pace import clock_at, expected_seconds, rows_since, seconds_left
from fedhet.experiment.sweep.spec import Job, Sweep, select_jobs
from fedhet.experiment.sweep.state import (
    DAMAGED_FIX,
    STALE_FIX,
    config_mismatch,
    current_config,
    failure_marker,
    job_status,
    lock_holder,
    lock_path,
    pace_runs,
    recorded_rows,
    recorded_status,
    resume_round,
    rounds_done,
    rounds_to_extend,
    take_lock,
    unloadable_jobs,
    unloadable_message,
    would_start,
    write_failure_marker,
    write_lock,
)


def _command(job: Job, threads: int, resume: bool, extra_set: list[str] = (), rounds: int | None = None) -> list[str]:
    # -P: the working directory is not put on sys.path, as for `fedhet run`, so a run of a user's
    # method imports it here only where `fedhet run --resume` can (PYTHONPATH or installed)
    base = [sys.executable, "-P", "-m", "fedhet.cli", "run"]
    if resume:
        # the command line's settings of how runs are carried out (run.device, run.engine...) apply
        # to resumed runs too: a run stopped on a lent GPU goes on on the CPU with --set run.device=cpu;
        # ``rounds``: more than it recorded, which the run checks before it records them
        more = [f"train.rounds={rounds}"] if rounds is not None else []
        sets = [x for item in [*resumable_sets(extra_set), *more] for x in ("--set", item)]
        return [*base, "--resume", str(job.run_dir), *sets, "--no-progress", "--threads", str(threads)]
    sets = [x for o in job.overrides for x in ("--set", o)]
    return [*base, str(job.config), *sets, "--out", str(job.run_dir), "--no-progress", "--threads", str(threads)]


def lane_threads(lanes: int) -> int:
    """``run.threads`` of each run of a sweep with ``lanes`` lanes: the usable CPUs split evenly."""
    return max(1, usable_cpus() // lanes)


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


class RunEstimate(NamedTuple):
    seconds: float          # for the rounds left
    like_runs: int          # how many completed runs it goes by
    after: int              # the round the run would resume after (0: from the start)
    planned: int            # its last round
    like_tag: str           # the tag of those runs: the job's own, or its run entry's costs_like


def expected_run_seconds(job: Job, pace: tuple[str, list[list[dict]]]) -> RunEstimate | None:
    """How long ``job`` should take here from the round it would resume after (:func:`resume_round`), at
    the pace of its :func:`pace_runs` ``pace`` by :func:`expected_seconds`. None without a like run,
    or when its config cannot be read (the run itself reports that)."""
    like_tag, like = pace
    try:
        planned = current_config(job).train.rounds
    except (ConfigError, OSError):
        return None
    after = resume_round(job)
    seconds = expected_seconds(like, after, planned)
    return None if seconds is None else RunEstimate(seconds, len(like), after, planned, like_tag)


def _wait_for_any(procs: list[subprocess.Popen], seconds: float) -> None:
    """Return once one of ``procs`` has exited or ``seconds`` have passed (at once when none runs),
    so a lane that frees up takes its next run without waiting out the whole poll."""
    end = time.monotonic() + seconds
    while procs and all(p.poll() is None for p in procs) and time.monotonic() < end:
        time.sleep(min(0.05, max(0.0, end - time.monotonic())))


def run_sweep(sweep: Sweep, *, retry_failed: bool = False, only: list[str] | None = None,
              no_start_after: float | None = None, finish_by: float | None = None,
              skip_unfinishable: bool = False, poll_seconds: float = 2.0, report_every: float = 60.0,
              log=print) -> dict[str, str]:
    """Run every job not completed yet, ``sweep.lanes`` at a time (a ConfigError before any starts
    when the config of one it would start does not load); return ``{run dir name: status}``
    (``stopped``: a run ``finish_by`` stopped; its folder holds it as interrupted; ``not started``:
    one ``skip_unfinishable`` left for a sweep with more time).
    ``only``: run just the jobs of these tags (the others are neither started nor touched).
    ``no_start_after``: start no run once this many seconds have passed since the sweep started; the
    runs going on then finish, the others are left for the next sweep (a compute window's last runs
    that could not finish inside it).
    ``finish_by``: the seconds the sweep has: at the limit every run still going on is stopped and
    no run starts.
    ``skip_unfinishable`` (with ``finish_by``): start no run that would end after that limit, by the
    seconds a round of the slowest of its tag's completed runs on a machine like this one, or while
    it has none of its run entry's ``costs_like`` tag (:func:`expected_run_seconds`, :func:`pace_runs`);
    the next run of the queue that fits starts instead. A run with neither starts."""
    if no_start_after is not None and not 0 <= no_start_after < math.inf:
        raise ConfigError(f"--no-start-after must be 0 or more seconds, got {no_start_after:g}")
    if finish_by is not None and not 0 < finish_by < math.inf:
        raise ConfigError(f"--finish-by must be a positive number of seconds, got {finish_by:g}")
    if skip_unfinishable and finish_by is None:
        raise ConfigError("--skip-runs-that-cannot-finish needs --finish-by SECONDS: the time the runs must end in")
    t_start = time.monotonic()
    deadline = None if finish_by is None else t_start + finish_by
    jobs = select_jobs(sweep, only)
    threads = sweep_threads(sweep)          # a bad --set run.threads stops the sweep before it touches its folder
    initial = {j.name: job_status(j) for j in jobs}
    broken = unloadable_jobs(jobs, initial, retry_failed)
    if broken:       # refused before any run starts: each would fail the same way in its first second
        raise ConfigError(unloadable_message(broken))
    sweep.out.mkdir(parents=True, exist_ok=True)
    for j in jobs:
        if initial[j.name] == "stale":
            log(f"skipped {j.name}, stale ({'; '.join(config_mismatch(j))}): {STALE_FIX} ({j.run_dir})")
        if initial[j.name] == "damaged":
            log(f"skipped {j.name}, damaged: {DAMAGED_FIX} ({j.run_dir})")
        if initial[j.name] == "running":
            log(f"skipped {j.name}: another sweep process runs it (pid {lock_holder(j)}, lock {lock_path(j)})")
    todo = [j for j in jobs if would_start(initial[j.name], retry_failed)]
    left = [initial[j.name] for j in jobs if j not in todo]      # skipped: completed, failed, stale, damaged, running
    skipped = ", ".join(f"{left.count(s)} {s}{' elsewhere' if s == 'running' else ''}"
                        f"{' (--retry-failed runs them again)' if s == 'failed' else ''}"
                        for s in ("completed", "failed", "stale", "damaged", "running") if s in left)
    chosen = f" (--only {', '.join(dict.fromkeys(only))}: {len(jobs)} of {len(sweep.jobs)})" if only else ""
    log(f"sweep {sweep.name}: {len(jobs)} runs{chosen}, {skipped or 'none'} left alone, {len(todo)} to run "
        f"in {sweep.lanes} lane(s) of {threads} thread(s); output {sweep.out}")
    own = sorted({str(j.config) for j in todo if current_config(j).run.threads not in (None, threads)})
    if own:       # a config's own run.threads gives way to the lanes' share, said rather than silently
        log(f"run.threads of {', '.join(own)} is replaced by the sweep's {threads} a run (its lanes' share of "
            "the CPUs); fedhet sweep FILE --set run.threads=N chooses another")
    cpu = cpu_identity()
    running: dict[str, tuple[Job, subprocess.Popen, float]] = {}
    rows_before: dict[str, list[dict]] = {}     # what a run had recorded when this sweep started it
    outcome: dict[str, str] = {}
    last_report = time.monotonic()

    def pace(name: str, job: Job) -> tuple[int, int | None, float | None]:
        """(rounds recorded, rounds planned, seconds left at the pace of the rounds this sweep saw)."""
        rows = recorded_rows(job)
        new_rows = rows_since(rows_before[name], rows)
        try:
            cfg = current_config(job)
        except (ConfigError, OSError):
            return len(rows), None, None
        left = seconds_left(new_rows, len(rows), cfg.train.rounds, cfg.eval.every) if len(new_rows) >= 2 else None
        return len(rows), cfg.train.rounds, left

    def cannot_finish(job: Job) -> str | None:
        """Why ``job`` would end after the --finish-by limit (None when it fits or nothing says)."""
        need = expected_run_seconds(job, pace_runs(job, sweep.jobs, cpu, threads))    # a costs_like left out by --only too
        left = deadline - time.monotonic() if deadline is not None else math.inf
        if need is None or need.seconds <= left:
            return None
        rounds = f"round {need.planned}" if need.after + 1 == need.planned else f"rounds {need.after + 1}-{need.planned}"
        return (f"it needs about {need.seconds:.0f} s for {rounds} at the pace of the slowest of {need.like_runs} "
                f"completed run(s) of {need.like_tag} on a machine like this one, and {max(0.0, left):.0f} s are left "
                "before the --finish-by limit")

    def finish(name: str) -> None:
        """Record a run whose process has exited: completed, or failed with its log's tail."""
        job, proc, t0 = running.pop(name)
        rc = proc.returncode
        lock_path(job).unlink(missing_ok=True)
        status = job_status(job)
        if status == "completed" and rc != 0:      # recorded completed; something after it failed
            log(f"{time.strftime('%H:%M:%S')} note   {name} completed but exited with status {rc} "
                f"(see {job.run_dir.parent / (name + '.log')})")
        if status != "completed":
            status = "failed"
            tail = _log_tail(job.run_dir.parent / f"{name}.log")
            write_failure_marker(job, f"exit status {rc}\n{tail}\n")
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
            if recorded_status(running[n][0]) == "completed":    # it had ended, only its process had not
                finish(n)
                continue
            job, _, _ = running.pop(n)
            lock_path(job).unlink(missing_ok=True)
            outcome[n] = "stopped"
            log(f"{time.strftime('%H:%M:%S')} stop   {n} at round {rounds_done(job)}: {why}")
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
                if not take_lock(job):
                    log(f"{time.strftime('%H:%M:%S')} skip   {job.name}: another sweep process started it")
                    continue
                now = recorded_status(job)     # another sweep may have run it since this one started
                if now in ("completed", "stale", "damaged") or (now == "failed" and not retry_failed):
                    lock_path(job).unlink(missing_ok=True)
                    log(f"{time.strftime('%H:%M:%S')} skip   {job.name}: {now} meanwhile (another sweep process)")
                    continue
                why = cannot_finish(job) if skip_unfinishable else None
                if why:
                    lock_path(job).unlink(missing_ok=True)
                    outcome[job.name] = "not started"
                    log(f"{time.strftime('%H:%M:%S')} skip   {job.name}: {why} (--skip-runs-that-cannot-finish)")
                    continue
                # a run directory with a config is resumed: from its checkpoint, or from round 1;
                # with the rounds the sweep file asks for now (completed, interrupted or failed)
                resume = (job.run_dir / "config.yaml").is_file()
                failure_marker(job).unlink(missing_ok=True)
                job.run_dir.parent.mkdir(parents=True, exist_ok=True)
                logf = open(job.run_dir.parent / f"{job.name}.log", "a" if resume else "w")
                rows_before[job.name] = recorded_rows(job)      # before a resumed run cuts them back
                proc = subprocess.Popen(_command(job, threads, resume, sweep.extra_set,
                                                 rounds_to_extend(job) if resume else None), stdout=logf,
                                        stderr=subprocess.STDOUT)
                logf.close()
                write_lock(job, f"{os.getpid()} {proc.pid}\n")      # the run outlives a killed sweep
                running[job.name] = (job, proc, time.monotonic())
                how = ("" if not resume else " (resuming)" if (job.run_dir / CHECKPOINT).is_file()
                       else " (again from round 1: its folder keeps no checkpoint)")
                log(f"{time.strftime('%H:%M:%S')} start  {job.name}{how}")
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
                    ends = f", ends about {clock_at(left)}" if left is not None else ""
                    if left is not None and deadline is not None and time.monotonic() + left > deadline:
                        ends += f", after the --finish-by limit at {clock_at(deadline - time.monotonic())}"
                    parts.append(f"{n} (round {recorded}{of}{ends})")
                log(f"{time.strftime('%H:%M:%S')} {done}/{len(jobs)} completed; running: {', '.join(parts)}")
    except BaseException as e:
        # A Ctrl-C in a terminal reached the runs too, and each is ending its round to checkpoint it:
        # give them time; then SIGTERM (a run's first signal lets its round end, a second stops it at
        # once; a background job ignores SIGINT), and only then kill. `fedhet sweep` gets SIGTERM as
        # Terminated, a KeyboardInterrupt that reached no run (fedhet.cli.main).
        ctrl_c = isinstance(e, KeyboardInterrupt) and not isinstance(e, Terminated)
        _stop([proc for _, proc, _ in running.values()], grace=30.0 if ctrl_c else 0.0)
        for job, _, _ in running.values():
            lock_path(job).unlink(missing_ok=True)
        log("sweep stopped: its running runs were stopped; run the same command again to resume them")
        raise
    return outcome


def resumable_sets(extra_set: list[str]) -> list[str]:
    """The command line's ``--set`` values that a resumed run takes (``RESUMABLE_CHANGES``: device,
    engine, workers, checkpointing...), but ``run.threads``, the sweep's own (one share per lane), and
    ``run.out_dir``, which a resume refuses (a sweep names each run's folder itself).
    Other settings are part of what a run is: a run recorded with other values is stale and left alone."""
    taken = set(RESUMABLE_CHANGES) - {"run.threads", "run.out_dir"}
    return [item for item in extra_set if override_key(item) in taken]


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
