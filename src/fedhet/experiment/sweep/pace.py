"""When a running run should end, at the pace of the rounds it recorded in this sweep; how long a run
not started yet should take, from like runs that completed."""

from __future__ import annotations

import statistics
import time


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
    shared machine's speed drifts within a run, which the recent rows follow (such a run:
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


def expected_seconds(like_runs: list[list[dict]], recorded: int, planned: int) -> float | None:
    """Seconds a run that has recorded ``recorded`` of ``planned`` rounds needs for the rest, from
    ``like_runs`` (the metrics rows of completed runs like it): the slowest of their mean seconds a
    round (each round's ``seconds.total``: training and evaluation), times the rounds left. The slowest,
    since a run stopped at a window's end is lost where its checkpoint does not survive, and like runs
    took up to 27% longer a round than each other on one kind of shared machine (18.4 against 23.3 s:
    benchmarks/results/fedclassavg_fmnist_full_cnn.md). Start-up and checkpoint writes are
    not in the rows, so it is a little short. None without a like run that timed its rounds."""
    per_round = []
    for rows in like_runs:
        totals = [r["seconds"]["total"] for r in rows if isinstance(r.get("seconds"), dict) and "total" in r["seconds"]]
        if totals and len(totals) == len(rows):
            per_round.append(statistics.fmean(totals))
    if not per_round:
        return None
    return max(0, planned - recorded) * max(per_round)


def duration(seconds: float) -> str:
    """``seconds`` as one plans a compute window with them: 95 s, 41 min, 1 h 31 min."""
    if round(seconds) < 100:
        return f"{seconds:.0f} s"
    minutes = round(seconds / 60)
    return f"{minutes} min" if minutes < 60 else f"{minutes // 60} h {minutes % 60} min"


def clock_at(seconds_from_now: float) -> str:
    """The wall-clock time ``seconds_from_now`` from now, HH:MM (with the date when not today)."""
    then = time.localtime(time.time() + seconds_from_now)
    same_day = time.strftime("%Y-%m-%d", then) == time.strftime("%Y-%m-%d")
    return time.strftime("%H:%M" if same_day else "%Y-%m-%d %H:%M", then)
