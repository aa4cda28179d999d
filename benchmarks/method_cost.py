"""What a round of each of a sweep's methods costs on this machine, side by side: which runs fit a CPU window.

    .venv/bin/python benchmarks/method_cost.py benchmarks/fedacd_fmnist_e5_r200.sweep.yaml \\
        --only fedavg fedlc fedacd_base fedacd --set run.memory_format=channels_last

For every tag of ``--only`` (the sweep's first job of that tag: its config, the sweep's ``set``, then the
command line's ``--set``), one round of ``--clients`` clients with the run's own local training (its
epochs, batch size, loss terms and statistics passes), on one intra-op thread in the reference engine;
``--repeats`` times, the tags' order rotating from one repeat to the next so that a drift of the
machine's speed falls on every tag alike. Every tag draws the same clients (the draw depends on the
seed and the round only), so the rounds train the same sample-steps. Its figures: the training speed,
the round's sample-steps over its training seconds (statistics passes included, evaluation not), as a
median over the repeats with their range; and the ratio to the first tag, the median over the repeats
of the tag's speed over the first tag's in the same repeat (a shared machine's speed moves less within
a repeat than across them), with its range.

A sweep run on a 2-core CPU (``--set run.engine=parallel``) trains its clients in two worker processes
of one thread each, the same local training measured here, so the ratios should carry over: a run's
hours follow from another tag's window speed, sample-steps / (that speed x ratio), plus its
evaluations. Writes
benchmarks/results/method_cost_NAME.{md,json} with the machine and commit.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import tempfile
from pathlib import Path

import fedhet
from fedhet.experiment.summary import machine_info
from fedhet.experiment.sweep import Job, load_sweep

RESULTS = Path(__file__).resolve().parent / "results"


def one_round(job: Job, clients: int, extra_set: list[str], workdir: Path) -> tuple[int, float]:
    """(sample-steps, training seconds) of round 1 of ``job`` with ``clients`` clients and one thread."""
    overrides = [*job.overrides, "train.rounds=1", f"train.clients_per_round={clients}", "run.threads=1",
                 "run.engine=reference", "run.progress=false", "eval.local_risk=false", *extra_set]
    with tempfile.TemporaryDirectory(dir=workdir) as out, contextlib.redirect_stdout(io.StringIO()):
        row = fedhet.run(str(job.config), overrides, out=Path(out) / "run").rows[0]
    return int(row["samples"]), float(row["seconds"]["train"])


def measure(jobs: list[Job], clients: int, repeats: int, extra_set: list[str], workdir: Path) -> list[dict]:
    speeds: dict[str, list[float]] = {job.tag: [] for job in jobs}
    samples: dict[str, int] = {}
    for job in jobs:                                   # warm-up: dataset caches, first-call allocations
        steps, seconds = one_round(job, clients, extra_set, workdir)
        print(f"warm-up {job.tag}: {steps} sample-steps in {seconds:.1f} s", flush=True)
    for i in range(repeats):
        order = jobs[i % len(jobs):] + jobs[:i % len(jobs)]
        for job in order:
            steps, seconds = one_round(job, clients, extra_set, workdir)
            samples[job.tag] = steps
            speeds[job.tag].append(steps / seconds)
            print(f"repeat {i + 1}/{repeats} {job.tag}: {steps} sample-steps in {seconds:.1f} s, "
                  f"{steps / seconds:.0f} samples/s", flush=True)
    reference = speeds[jobs[0].tag]
    rows = []
    for job in jobs:
        ratios = [s / r for s, r in zip(speeds[job.tag], reference)]       # each against the same repeat's
        rows.append({"tag": job.tag, "config": str(job.config), "sample_steps": samples[job.tag],
                     "samples_per_s": statistics.median(speeds[job.tag]), "samples_per_s_all": speeds[job.tag],
                     "ratio": statistics.median(ratios), "ratios": ratios})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep", help="a sweep file (benchmarks/*.sweep.yaml)")
    parser.add_argument("--only", nargs="+", required=True, help="the sweep's tags to measure; the first is the reference")
    parser.add_argument("--set", dest="extra_set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every tag (repeatable), e.g. run.memory_format=channels_last")
    parser.add_argument("--clients", type=int, default=2, help="clients in the measured round (default 2)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--name", default=None, help="result file name (default: the sweep's name)")
    parser.add_argument("--note", default="", help="a line added to the result file (e.g. what else ran)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder of the result files (default benchmarks/results)")
    args = parser.parse_args(argv)
    if args.clients < 1 or args.repeats < 1:
        parser.error("--clients and --repeats must be at least 1")
    sweep = load_sweep(args.sweep)
    first_of_tag: dict[str, Job] = {}
    for job in sweep.jobs:
        first_of_tag.setdefault(job.tag, job)
    unknown = [t for t in args.only if t not in first_of_tag]
    if unknown:
        parser.error(f"--only {' '.join(unknown)}: not a tag of {args.sweep}; its tags: {', '.join(first_of_tag)}")
    jobs = [first_of_tag[t] for t in dict.fromkeys(args.only)]
    with tempfile.TemporaryDirectory() as workdir:
        rows = measure(jobs, args.clients, args.repeats, args.extra_set, Path(workdir))
    for r in rows:
        spread = f"{min(r['samples_per_s_all']):.0f}-{max(r['samples_per_s_all']):.0f}"
        print(f"{r['tag']}: {r['samples_per_s']:.0f} samples/s ({spread}), {r['ratio']:.2f}x {rows[0]['tag']} "
              f"({min(r['ratios']):.2f}-{max(r['ratios']):.2f})")

    name = args.name or sweep.name
    info = machine_info()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"method_cost_{name}.json").write_text(json.dumps(
        {"machine": info, "sweep": args.sweep, "set": args.extra_set, "clients": args.clients,
         "repeats": args.repeats, "note": args.note, "rows": rows}, indent=1))
    sets = "".join(f" --set {s}" for s in args.extra_set)
    command = (f".venv/bin/python benchmarks/method_cost.py {args.sweep} --only {' '.join(args.only)}{sets} "
               f"--clients {args.clients} --repeats {args.repeats}" + (f" --name {args.name}" if args.name else ""))
    lines = [f"# What a round of each method costs: {name}", "", "Command:", "", "```bash", command, "```", "",
             f"Commit {info['commit']}, {info['cpu_model']}, torch {info['torch']}. Round 1 of each tag's first "
             f"seed with {args.clients} clients (the same clients for every tag), one thread, reference engine; "
             f"medians of {args.repeats} rounds a tag, the order rotating, with the range. Speed = the round's "
             "sample-steps over its training seconds (statistics passes included, evaluation not); ratio: the "
             f"median over the repeats of the tag's speed over {rows[0]['tag']}'s in the same repeat, with the "
             "range.", ""]
    if args.note:
        lines += [args.note, ""]
    lines += ["| tag | sample-steps a round | samples/s (median) | range | ratio | range |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['tag']} | {r['sample_steps']} | {r['samples_per_s']:.0f} | "
                     f"{min(r['samples_per_s_all']):.0f}-{max(r['samples_per_s_all']):.0f} | {r['ratio']:.2f}x | "
                     f"{min(r['ratios']):.2f}-{max(r['ratios']):.2f} |")
    (args.out / f"method_cost_{name}.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
