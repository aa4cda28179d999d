"""Per-round figures of finished (or stopped) runs, as quoted in the result files.

    python benchmarks/per_round.py RUN_DIR [RUN_DIR ...] [--metric personal_acc] [--at 10 50 100]
                                   [--window 26 30] [--range 10 100] [--loss-at 1 2] [--by-client]
                                   [--speed [FIRST LAST]] ...

For each run: the metric at the rounds of --at (accuracies in %, other metrics as recorded), its
best round (the lowest for a loss, KL or risk), its mean over the evaluated rounds of --window
(inclusive), its min and max over each --range (repeatable), and train_loss at --loss-at. With two runs,
also how far apart they are over the rounds both evaluated (max and mean |difference|): the check that two
engines or devices trained the same seed alike; at how many of those rounds (within each --range if given)
the first run is ahead (higher, or lower for a loss, KL or risk); with --by-client, at how many of the client
evaluations of those rounds (``<metric>_by_client``; within each --range if given) the first run is
below the second. ``--speed`` (repeatable; every timed round, or rounds FIRST-LAST) adds a run's training
speed: its sample-steps over the engine's training seconds, pooled over the rounds, the slowest and
fastest round's, its evaluations' count and seconds, and the median and sum of a round's whole time, as the
result files quote a run's pace.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from fedhet.experiment.rundir import METRICS, read_metrics


def by_round(rows: list[dict], key: str) -> dict[int, Any]:
    """``key``'s value (a number, or a mapping client id -> number for ``*_by_client``) in each round
    that recorded it. Runs recorded before ``personal_*_by_client`` became a mapping hold a list over
    all clients (None where not tested): read as the mapping."""
    def value(v: Any) -> Any:
        return {str(c): x for c, x in enumerate(v) if x is not None} if isinstance(v, list) else v
    return {row["round"]: value(row[key]) for row in rows if key in row}


def lower_is_better(metric: str) -> bool:
    return any(word in metric for word in ("loss", "kl", "risk"))


def client_comparison(rows_of_runs: list[list[dict]], metric: str, rounds: list[int]) -> str:
    """How often the first run's per-client value is below the second's, over ``rounds``."""
    first, second = (by_round(rows, f"{metric}_by_client") for rows in rows_of_runs)
    below = above = 0
    for r in rounds:
        for cid, value in first.get(r, {}).items():
            other = second.get(r, {}).get(cid)
            if value is None or other is None:
                continue
            below += value < other
            above += value > other
    return f"{metric} by client, rounds {rounds}: first run below at {below}, above at {above} client evaluations"


def training_speed(rows: list[dict], span: list[int]) -> str | None:
    """A line on the training speed of the timed rounds of ``rows`` (within ``span``, FIRST LAST, if given)."""

    def wanted(row: dict) -> bool:
        return not span or span[0] <= row["round"] <= span[1]

    timed = [r for r in rows if wanted(r) and r.get("samples") and r.get("seconds", {}).get("train", 0) > 0]
    if not timed:
        return None
    samples = sum(r["samples"] for r in timed)
    seconds = sum(r["seconds"]["train"] for r in timed)
    per_round = [r["samples"] / r["seconds"]["train"] for r in timed]
    evaluations = [r["seconds"]["evaluate"] for r in rows if wanted(r) and r.get("seconds", {}).get("evaluate", 0) > 0]
    # a round's whole time (training, the server's step, evaluation): what sizes a run against a time limit
    totals = [r["seconds"]["total"] for r in timed if "total" in r["seconds"]]
    whole = (
        f"; a round in all: median {statistics.median(totals):.2f} s, {sum(totals):,.0f} s together" if totals else ""
    )
    return (
        f"  training, rounds {timed[0]['round']}-{timed[-1]['round']} ({len(timed)} timed): {samples:,} sample-steps "
        f"in {seconds:,.0f} s, {samples / seconds:,.0f} samples/s (rounds {min(per_round):,.0f}-{max(per_round):,.0f}); "
        f"{len(evaluations)} evaluation{'' if len(evaluations) == 1 else 's'}, {sum(evaluations):,.0f} s{whole}"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("run_dirs", nargs="+", type=Path)
    p.add_argument("--metric", default="personal_acc")
    p.add_argument("--at", nargs="*", type=int, default=[])
    p.add_argument("--window", nargs=2, type=int, metavar=("FIRST", "LAST"))
    p.add_argument("--range", nargs=2, type=int, action="append", default=[], metavar=("FIRST", "LAST"),
                   help="min and max over rounds FIRST-LAST, and with two runs who is ahead there (repeatable)")
    p.add_argument("--loss-at", nargs="*", type=int, default=[])
    p.add_argument("--by-client", action="store_true")
    p.add_argument(
        "--speed",
        nargs="*",
        type=int,
        action="append",
        metavar="FIRST LAST",
        help="training speed over every timed round, or rounds FIRST-LAST (repeatable)",
    )
    args = p.parse_args(argv)
    for run in args.run_dirs:
        if not (Path(run) / METRICS).is_file():
            p.error(f"{run}: not a run folder (no {METRICS} there)")
    for span in args.speed or []:
        if len(span) not in (0, 2):
            p.error(f"--speed takes no rounds or two (FIRST LAST), not {len(span)}")
    scale, unit = (100, " pp") if "acc" in args.metric else (1, "")
    pick = min if lower_is_better(args.metric) else max
    rows_of_runs = [read_metrics(run) for run in args.run_dirs]  # each file read once
    curves = []
    for run, rows in zip(args.run_dirs, rows_of_runs):
        acc = {r: scale * v for r, v in by_round(rows, args.metric).items()}
        if not acc:
            p.error(f"{run}: no {args.metric} in its metrics.jsonl")
        curves.append(acc)
        best = pick(acc, key=acc.__getitem__)
        print(f"{run}: {len(acc)} evaluated rounds; best {acc[best]:.2f} (round {best})")
        if args.at:
            print("  at " + ", ".join(f"{r}: {acc[r]:.2f}" for r in args.at if r in acc))
        if args.window:
            window = [acc[r] for r in range(args.window[0], args.window[1] + 1) if r in acc]
            if not window:
                p.error(f"{run}: no evaluated round in --window {args.window[0]} {args.window[1]}")
            print(f"  mean over rounds {args.window[0]}-{args.window[1]}: {sum(window) / len(window):.2f}")
        for first, last in args.range:
            span = [acc[r] for r in range(first, last + 1) if r in acc]
            if not span:
                p.error(f"{run}: no evaluated round in --range {first} {last}")
            print(f"  rounds {first}-{last}: min {min(span):.2f}, max {max(span):.2f}")
        if args.loss_at:
            loss = by_round(rows, "train_loss")
            print("  train_loss at " + ", ".join(f"{r}: {loss[r]:.4f}" for r in args.loss_at if r in loss))
        for span in args.speed or []:
            line = training_speed(rows, span)
            if line is None:
                p.error(
                    f"{run}: no timed round{f' in --speed {span[0]} {span[1]}' if span else ''} in its metrics.jsonl"
                )
            print(line)
    if len(curves) == 2:
        shared = sorted(set(curves[0]) & set(curves[1]))
        if not shared:
            p.error("the two runs evaluated no round in common")
        diffs = [abs(curves[0][r] - curves[1][r]) for r in shared]
        print(
            f"|difference| over {len(shared)} shared rounds: max {max(diffs):.2f}{unit}, "
            f"mean {sum(diffs) / len(diffs):.2f}{unit}"
        )
        for bounds in args.range or [None]:
            span = [r for r in shared if bounds is None or bounds[0] <= r <= bounds[1]]
            ahead = sum(pick(curves[0][r], curves[1][r]) == curves[0][r] != curves[1][r] for r in span)
            where = f" in rounds {bounds[0]}-{bounds[1]}" if bounds else ""
            print(f"first run ahead at {ahead} of {len(span)} shared rounds{where}")
            if args.by_client:
                print(client_comparison(rows_of_runs, args.metric, span))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
