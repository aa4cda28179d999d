"""What a round of each of a sweep's methods costs on this machine, side by side: which runs fit a CPU window.

    .venv/bin/python benchmarks/method_cost.py benchmarks/fedacd_fmnist_e5_r200.sweep.yaml \\
        --only fedavg fedlc fedacd_base fedacd --set run.memory_format=channels_last

For every tag of ``--only`` (the sweep's first job of that tag: its config, the sweep's ``set``, then the
command line's ``--set``), one round of ``--clients`` clients with the run's own local training (its
epochs, batch size, loss terms and statistics passes), on one intra-op thread in the reference engine;
``--repeats`` times, the tags' order rotating from one repeat to the next so that a drift of the
machine's speed falls on the tags alike (evenly when ``--repeats`` is a multiple of the number of tags).
The tags must share their first seed: in one federation (the same clients, partition and
participation) that seed draws the same clients for every tag, which the script checks by their
sample-steps (a line says where they differ). ``--round N`` measures the last of N rounds instead of round 1:
round 1 holds one-off work of some methods (FedClassAvg pre-trains a client for an epoch at its first
participation: with one local epoch, as in its paper configs, round 1 trains twice the sample-steps of a later
round); with ``--clients`` as many as the federation has, round 2 is its steady round. (A method whose phases
change later, as FedFM's warm-up rounds, needs ``--set-for`` instead; see below.) Each repeat trains N rounds,
so the script takes N times as long. ``--set-for TAG KEY=VALUE`` overrides one tag only: to
time FedFM's matching rounds rather than its FedAvg warm-up, ``--set-for fedfm_lam5 algorithm.params.start_round=0``
(FedAvg has no such parameter). Its figures: the training speed,
the round's sample-steps over its training seconds (statistics passes included, evaluation not), as a
median over the repeats with their range; and the ratio to the first tag, the median over the repeats
of the tag's speed over the first tag's in the same repeat (a shared machine's speed moves less within
a repeat than across them), with its range.

A sweep run on a 2-core CPU (``--set run.engine=parallel``) trains its clients in two worker processes
of one thread each, the same local training measured here, so the ratios should carry over: a run's
hours follow from another tag's window speed, sample-steps / (that speed x ratio), plus its
evaluations. It measures the clients' training only, and one round of it: the measured round is the
run's last, so it is evaluated, and a method that adds a client phase to evaluated rounds (FedBABU's
and Per-FedAvg's fine-tuning) is measured with it (the table's "phases" says so); server-side training
(CReFF's) is in the aggregation seconds, reported beside the speed, not in it. Writes
benchmarks/results/method_cost_NAME.{md,json} with the machine and commit.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shlex
import statistics
import tempfile
from pathlib import Path

import fedhet
from fedhet.experiment.summary import cpu_name, machine_info
from fedhet.experiment.sweep import Job, load_sweep

RESULTS = Path(__file__).resolve().parent / "results"
# What the measurement fixes; a --set of these would change what is measured under the same headings.
FIXED_KEYS = ("train.rounds", "train.clients_per_round", "run.threads", "run.engine")


def one_round(job: Job, clients: int, extra_set: list[str], workdir: Path, measured_round: int = 1) -> dict:
    """Round ``measured_round`` (the run's last) of ``job`` with ``clients`` clients on one thread: its
    sample-steps, training and aggregation seconds and client phases (evaluation, not measured, kept small)."""
    overrides = [*job.overrides, *extra_set, f"train.rounds={measured_round}", f"train.clients_per_round={clients}", "run.threads=1",
                 "run.engine=reference", "run.progress=false", "eval.local_risk=false", "eval.personalized=false"]
    with tempfile.TemporaryDirectory(dir=workdir) as out, contextlib.redirect_stdout(io.StringIO()):
        row = fedhet.run(str(job.config), overrides, out=Path(out) / "run").rows[-1]
    return {"samples": int(row["samples"]), "train": float(row["seconds"]["train"]),
            "aggregate": float(row["seconds"]["aggregate"]), "phases": int(row["phases"])}


def measure(jobs: list[Job], clients: int, repeats: int, extra_set: list[str], workdir: Path,
            set_for: dict[str, list[str]] | None = None, measured_round: int = 1) -> list[dict]:
    """One row a tag: its round's sample-steps, phases and median aggregation seconds, its speeds
    (one a repeat), their median, and its ratios to the first tag's speed of the same repeat.
    ``set_for`` adds a tag's own overrides after ``extra_set``; ``measured_round``: the round timed."""
    set_for = set_for or {}

    def sets(job: Job) -> list[str]:
        return [*extra_set, *set_for.get(job.tag, [])]

    speeds: dict[str, list[float]] = {job.tag: [] for job in jobs}
    rounds: dict[str, list[dict]] = {job.tag: [] for job in jobs}
    for job in jobs:                                   # warm-up: dataset caches, first-call allocations
        r = one_round(job, clients, sets(job), workdir, measured_round)
        print(f"warm-up {job.tag}: {r['samples']} sample-steps in {r['train']:.1f} s", flush=True)
    for i in range(repeats):
        order = jobs[i % len(jobs):] + jobs[:i % len(jobs)]
        for job in order:
            r = one_round(job, clients, sets(job), workdir, measured_round)
            rounds[job.tag].append(r)
            speeds[job.tag].append(r["samples"] / r["train"])
            print(f"repeat {i + 1}/{repeats} {job.tag}: {r['samples']} sample-steps in {r['train']:.1f} s, "
                  f"{r['samples'] / r['train']:.0f} samples/s", flush=True)
    reference = speeds[jobs[0].tag]
    rows = []
    for job in jobs:
        ratios = [s / r for s, r in zip(speeds[job.tag], reference)]       # each against the same repeat's
        last = rounds[job.tag][-1]
        rows.append({"tag": job.tag, "config": str(job.config), "set_for": set_for.get(job.tag, []),
                     "sample_steps": last["samples"],
                     "phases": last["phases"],
                     "aggregate_seconds": statistics.median(r["aggregate"] for r in rounds[job.tag]),
                     "samples_per_s": statistics.median(speeds[job.tag]), "samples_per_s_all": speeds[job.tag],
                     "ratio": statistics.median(ratios), "ratios": ratios})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep", help="a sweep file (benchmarks/*.sweep.yaml)")
    parser.add_argument("--only", nargs="+", required=True, help="the sweep's tags to measure; the first is the reference")
    parser.add_argument("--set", dest="extra_set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every tag (repeatable), e.g. run.memory_format=channels_last")
    parser.add_argument("--set-for", dest="set_for", action="append", nargs=2, default=[], metavar=("TAG", "KEY=VALUE"),
                        help="a config override for one tag of --only (repeatable), after --set")
    parser.add_argument("--clients", type=int, default=2, help="clients in the measured round (default 2)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--round", dest="measured_round", type=int, default=1, metavar="N",
                        help="time the last of N rounds (default 1; each repeat trains all N); round 1 holds "
                             "one-off work of some methods (FedClassAvg's pre-training epoch), so --round 2 with "
                             "all the federation's clients measures FedClassAvg's steady round")
    parser.add_argument("--name", default=None, help="result file name (default: the sweep's name)")
    parser.add_argument("--note", default="", help="a line added to the result file (e.g. what else ran)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder of the result files (default benchmarks/results)")
    args = parser.parse_args(argv)
    if args.clients < 1 or args.repeats < 1 or args.measured_round < 1:
        parser.error("--clients, --repeats and --round must be at least 1")
    given = [("--set", item) for item in args.extra_set] + [(f"--set-for {tag}", item) for tag, item in args.set_for]
    fixed = [f"{flag} {item}" for flag, item in given if item.split("=", 1)[0].strip() in FIXED_KEYS]
    if fixed:
        parser.error(f"{', '.join(fixed)}: the measurement fixes {', '.join(FIXED_KEYS)} "
                     "(one round of --clients clients on one thread in the reference engine); drop it")
    sweep = load_sweep(args.sweep)
    first_of_tag: dict[str, Job] = {}
    for job in sweep.jobs:
        first_of_tag.setdefault(job.tag, job)
    unknown = [t for t in args.only if t not in first_of_tag]
    if unknown:
        parser.error(f"--only {' '.join(unknown)}: not a tag of {args.sweep}; its tags: {', '.join(first_of_tag)}")
    stray = [tag for tag, _ in args.set_for if tag not in args.only]
    if stray:
        parser.error(f"--set-for {' '.join(dict.fromkeys(stray))}: not a tag of --only ({' '.join(args.only)})")
    set_for: dict[str, list[str]] = {}
    for tag, item in args.set_for:
        set_for.setdefault(tag, []).append(item)
    jobs = [first_of_tag[t] for t in dict.fromkeys(args.only)]
    seeds = {job.tag: job.seed for job in jobs}
    if len(set(seeds.values())) > 1:
        parser.error("the tags' first seeds differ (" + ", ".join(f"{t}: {s}" for t, s in seeds.items())
                     + "), so their rounds would train other clients; measure tags that start with one seed")
    with tempfile.TemporaryDirectory() as workdir:
        rows = measure(jobs, args.clients, args.repeats, args.extra_set, Path(workdir), set_for, args.measured_round)
    same_clients = len({r["sample_steps"] for r in rows}) == 1
    for r in rows:
        spread = f"{min(r['samples_per_s_all']):.0f}-{max(r['samples_per_s_all']):.0f}"
        print(f"{r['tag']}: {r['samples_per_s']:.0f} samples/s ({spread}), {r['ratio']:.2f}x {rows[0]['tag']} "
              f"({min(r['ratios']):.2f}-{max(r['ratios']):.2f})")
    steps_line = ("Every tag's round trained the same sample-steps." if same_clients else
                  "The tags' rounds trained different sample-steps (other clients, or a method that trains more "
                  "than its clients' epochs): compare their speeds, not their rounds.")
    print(steps_line)

    name = args.name or sweep.name
    info = machine_info()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"method_cost_{name}.json").write_text(json.dumps(
        {"machine": info, "sweep": args.sweep, "set": args.extra_set, "set_for": set_for, "clients": args.clients,
         "round": args.measured_round,
         "repeats": args.repeats, "same_sample_steps": same_clients, "note": args.note, "rows": rows}, indent=1))
    command = shlex.join([".venv/bin/python", "benchmarks/method_cost.py", args.sweep, "--only", *args.only,
                          *(x for item in args.extra_set for x in ("--set", item)),
                          *(x for tag, item in args.set_for for x in ("--set-for", tag, item)), "--clients", str(args.clients),
                          "--repeats", str(args.repeats), *(("--round", str(args.measured_round)) if args.measured_round > 1 else ()),
                          *(("--name", args.name) if args.name else ())])
    lines = [f"# What a round of each method costs: {name}", "", "Command:", "", "```bash", command, "```", "",
             f"Commit {info['commit']}, {cpu_name(info)}, torch {info['torch']}. Round {args.measured_round} (the last, so "
             f"evaluated) of each tag's seed {jobs[0].seed} with {args.clients} clients, one thread, reference "
             f"engine; medians of {args.repeats} rounds a tag, the order rotating, with the range. Speed = the "
             "round's sample-steps over its training seconds (statistics passes and the phases of an evaluated "
             "round included, evaluation not); ratio: the median over the repeats of the tag's speed over "
             f"{rows[0]['tag']}'s in the same repeat, with the range. Server-side work is the aggregation "
             f"seconds. {steps_line}", ""]
    if args.note:
        lines += [args.note, ""]
    lines += ["| tag | sample-steps a round | phases | samples/s (median) | range | ratio | range | aggregation (s) |",
              "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['tag']} | {r['sample_steps']} | {r['phases']} | {r['samples_per_s']:.0f} | "
                     f"{min(r['samples_per_s_all']):.0f}-{max(r['samples_per_s_all']):.0f} | {r['ratio']:.2f}x | "
                     f"{min(r['ratios']):.2f}-{max(r['ratios']):.2f} | {r['aggregate_seconds']:.2f} |")
    (args.out / f"method_cost_{name}.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
