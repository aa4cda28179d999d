"""Per-round figures of finished (or stopped) runs, as quoted in the result files.

    python benchmarks/per_round.py RUN_DIR [RUN_DIR ...] [--metric personal_acc] [--at 10 50 100]
                                   [--window 26 30] [--range 10 100] [--loss-at 1 2]

For each run: the metric (%) at the rounds of --at, its best round, its mean over the rounds of
--window (inclusive), its min and max over --range, and train_loss at --loss-at. With two runs,
also how far apart they are over the rounds both evaluated (max and mean |difference|, pp): the
check that two engines or devices trained the same seed alike.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from fedhet.experiment.rundir import read_metrics


def by_round(run_dir: Path, key: str) -> dict[int, float]:
    return {row["round"]: row[key] for row in read_metrics(run_dir) if key in row}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("run_dirs", nargs="+", type=Path)
    p.add_argument("--metric", default="personal_acc")
    p.add_argument("--at", nargs="*", type=int, default=[])
    p.add_argument("--window", nargs=2, type=int, metavar=("FIRST", "LAST"))
    p.add_argument("--range", nargs=2, type=int, metavar=("FIRST", "LAST"))
    p.add_argument("--loss-at", nargs="*", type=int, default=[])
    args = p.parse_args()
    curves = []
    for run in args.run_dirs:
        acc = {r: 100 * v for r, v in by_round(run, args.metric).items()}
        if not acc:
            p.error(f"{run}: no {args.metric} in its metrics.jsonl")
        curves.append(acc)
        best = max(acc, key=acc.__getitem__)
        print(f"{run}: {len(acc)} evaluated rounds; best {acc[best]:.2f} (round {best})")
        if args.at:
            print("  at " + ", ".join(f"{r}: {acc[r]:.2f}" for r in args.at if r in acc))
        if args.window:
            window = [acc[r] for r in range(args.window[0], args.window[1] + 1)]
            print(f"  mean over rounds {args.window[0]}-{args.window[1]}: {sum(window) / len(window):.2f}")
        if args.range:
            span = [acc[r] for r in range(args.range[0], args.range[1] + 1) if r in acc]
            print(f"  rounds {args.range[0]}-{args.range[1]}: min {min(span):.2f}, max {max(span):.2f}")
        if args.loss_at:
            loss = by_round(run, "train_loss")
            print("  train_loss at " + ", ".join(f"{r}: {loss[r]:.4f}" for r in args.loss_at if r in loss))
    if len(curves) == 2:
        shared = sorted(set(curves[0]) & set(curves[1]))
        diffs = [abs(curves[0][r] - curves[1][r]) for r in shared]
        print(f"|difference| over {len(shared)} shared rounds: max {max(diffs):.2f} pp, "
              f"mean {sum(diffs) / len(diffs):.2f} pp")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
