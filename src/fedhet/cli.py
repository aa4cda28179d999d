"""The ``fedhet`` command line: run, sweep, partition, compare, features, flower, list."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
import time
import warnings
from pathlib import Path

from fedhet.core.errors import ConfigError, FedhetError, OutputError, Terminated


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _feature_samples(text: str) -> int:
    """``fedhet features --samples``: at least 20 images, eval.features_samples' minimum (more than
    the dataset's classes is checked where they are known, :func:`fedhet.metrics.features.feature_quality`)."""
    value = _positive_int(text)
    if value < 20:
        raise argparse.ArgumentTypeError(f"expected at least 20 test samples to embed, got {text!r}")
    return value


def _cmd_run(args) -> int:
    from fedhet.experiment.config import load_config, parse_value, split_override
    from fedhet.experiment.report import compare
    from fedhet.experiment.runner import Experiment

    given = [value.strip() for key, value in map(split_override, args.set) if key == "run.threads"]
    if args.threads and given and parse_value(given[-1], "run.threads") != args.threads:
        raise FedhetError(f"run.threads is given twice, as --threads {args.threads} and as --set "
                          f"run.threads={given[-1]}: give it once")
    if args.resume is not None:
        if args.config:
            raise FedhetError("--resume continues a run with its recorded config; do not pass a CONFIG")
        if args.out:
            raise FedhetError(f"--resume continues the run in its own folder ({args.resume}); --out does not apply: "
                              "copy the folder first to continue a copy elsewhere")
        # --set only for how the run is carried out (run.device, run.engine...): Experiment.resume checks
        exp = Experiment.resume(args.resume, threads=args.threads, run_settings=args.set)
        total = exp.cfg.train.rounds
        planned = (exp.restored or {}).get("config", {}).get("train", {}).get("rounds")
        if not exp.start_round:
            said = f"{exp.run_dir} has no checkpoint: the run starts again from round 1"
        elif exp.start_round >= total:
            said = (f"{exp.run_dir} has all its {total} rounds: its summary and plot are written again "
                    "(--set train.rounds=N extends it)")
        elif planned == exp.start_round:
            said = f"extending {exp.run_dir} from {exp.start_round} to {total} rounds"
        else:
            said = f"resuming {exp.run_dir} after round {exp.start_round} of {total}"
        print(said, file=sys.stderr)
        if (note := exp.set_aside_note()) is not None:
            print(note, file=sys.stderr)
    else:
        if not args.config:
            raise FedhetError("fedhet run needs a CONFIG file (see configs/) or --resume RUN_DIR")
        # --threads is run.threads: the torch threads and the engine's CPU budget (engine: auto
        # picks workers within it, so side-by-side sweep lanes do not oversubscribe the cores)
        cfg = load_config(args.config, [*args.set, *([f"run.threads={args.threads}"] if args.threads else [])])
        exp = Experiment.create(cfg, args.out)
        print(f"run directory: {exp.run_dir}", file=sys.stderr)
    try:
        with _stop_after_the_round(exp):
            exp.run(progress=False if args.no_progress else None)
    except KeyboardInterrupt:
        print(f"fedhet: {exp.stop_note()}", file=sys.stderr)
        return 130
    print(compare([exp.run_dir], None, None))
    print(f"\nresults: {exp.run_dir}/summary.json, metrics.jsonl, accuracy.png")
    return 0


def _cmd_partition(args) -> int:
    import numpy as np

    from fedhet.data.federated import build_federation
    from fedhet.experiment.config import load_config
    from fedhet.experiment.plots import plot_partition, plot_path

    cfg = load_config(args.config, args.set)
    if args.out is None:
        out = Path(cfg.run.out_dir) / f"{cfg.name}-partition.png"
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OutputError(f"cannot make run.out_dir {out.parent} for the heatmap ({e.strerror or e}); "
                              "give --out PATH, or another run.out_dir") from None
    else:
        out = plot_path(args.out, "--out")
    fed = build_federation(cfg.data, cfg.seed)
    train, test = fed.train_counts(), fed.test_counts()
    header = "client | " + " ".join(f"{c:>5}" for c in range(fed.num_classes)) + " |  train   test"
    print(header)
    print("-" * len(header))
    for k in range(fed.num_clients):
        print(f"{k:>6} | " + " ".join(f"{n:>5}" for n in train[k]) + f" | {train[k].sum():>6} {test[k].sum():>6}")
    sizes = train.sum(1)
    present = (train > 0).sum(1)
    print(f"\n{fed.num_clients} clients, {sizes.sum()} training samples (min {sizes.min()}, median {int(np.median(sizes))}, "
          f"max {sizes.max()}); classes per client: mean {present.mean():.1f}; local test: {fed.local_test_source}; "
          + (f"global test set: {len(fed.test.y)} images of {int((np.bincount(fed.test.y.numpy()) > 0).sum())} classes"
             if fed.test is not None else "no global test set (data.pool: train+test)"))
    plot_partition(train, out, f"{cfg.data.dataset}: {cfg.data.partition.kind} {cfg.data.partition.options()}")
    print(f"heatmap: {out}")
    return 0


def _cmd_compare(args) -> int:
    from fedhet.experiment.plots import plot_path
    from fedhet.experiment.report import compare

    run_dirs = [Path(d) for d in args.run_dirs]
    # a glob over a folder of runs (`runs/S/*`) also matches the files beside them: a sweep's logs
    # and its table; any other file named is an error of its own
    folders = {d.parent for d in run_dirs if d.is_dir()}
    files = [d for d in run_dirs if d.is_file() and d.parent in folders]
    if files:
        run_dirs = [d for d in run_dirs if d not in files]
        shown = ", ".join(map(str, files[:3])) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
        print(f"fedhet: left out {len(files)} file(s), not run directories: {shown}", file=sys.stderr)
    plot = plot_path(args.plot, "--plot") if args.plot is not None else None     # checked before any work
    print(compare(run_dirs, args.metric, plot, paired=args.paired))
    if plot is not None:
        print(f"\noverlay plot: {plot}")
    return 0


def _list_sweep(sweep, jobs, retry_failed: bool) -> None:
    """Each run's status and command; for a run the sweep would start, how long it should take here at
    the pace of the slowest completed run of its tag (or costs_like) on a machine like this one, and a total for
    sizing a window."""
    from fedhet.experiment.summary import cpu_identity
    from fedhet.experiment.sweep import expected_run_seconds, job_status, pace_runs, sweep_threads
    from fedhet.experiment.sweep.pace import duration
    from fedhet.experiment.sweep.state import (
        DAMAGED_FIX,
        STALE_FIX,
        first_problem,
        stale_note,
        unloadable_jobs,
        unloadable_message,
        would_start,
    )

    cpu, threads = cpu_identity(), sweep_threads(sweep)
    pace_by_tag: dict[str, tuple[str, list]] = {}     # the runs of a tag that would start share their like runs
    to_run, known, stale = 0, [], 0
    statuses = {job.name: job_status(job) for job in jobs}
    broken = unloadable_jobs(jobs, statuses, retry_failed)
    why_broken = {job.name: why for job, why in broken}
    for job in jobs:
        status = statuses[job.name]
        guess = ""
        if job.name in why_broken:
            guess = f"  [its config does not load: {first_problem(why_broken[job.name])}]"
        elif status == "stale":
            stale += 1
            guess = f"  [{stale_note(job)}]"
        elif status == "damaged":
            guess = f"  [{DAMAGED_FIX}]"
        elif would_start(status, retry_failed):
            to_run += 1
            if job.tag not in pace_by_tag:
                pace_by_tag[job.tag] = pace_runs(job, sweep.jobs, cpu, threads)
            estimate = expected_run_seconds(job, pace_by_tag[job.tag])
            if estimate is not None:
                known.append(estimate.seconds)
                of = "" if estimate.like_tag == job.tag else f" of {estimate.like_tag} (costs_like)"
                guess = f"  [about {duration(estimate.seconds)} here: the slowest of {estimate.like_runs} like run(s){of}]"
        shown = "unloadable" if job.name in why_broken else status    # not stale: nothing is wrong with the run
        print(f"{shown:12s} {job.run_dir}  <- {job.config} {' '.join(job.overrides)}{guess}")
    like = f"on a machine like this one ({threads} thread(s) a run, on the CPU)"
    if known:
        # a run goes on one lane: the lanes take at least the longest run, and at least an even share
        least = max(sum(known) / sweep.lanes, max(known))
        print(f"{to_run} run(s) to run; {len(known)} with completed runs of their tag (or costs_like) {like}: about "
              f"{duration(sum(known))} of runs, in {sweep.lanes} lane(s) at least {duration(least)}"
              + (" (the others: no estimate)" if len(known) < to_run else ""), file=sys.stderr)
    elif to_run:
        print(f"{to_run} run(s) to run; no completed run of their tags (or costs_like) timed {like} to say how long "
              "they take",
              file=sys.stderr)
    if stale:
        print(f"{stale} run(s) stale: {STALE_FIX}", file=sys.stderr)
    if broken:
        raise ConfigError(unloadable_message(broken))


def _cmd_sweep(args) -> int:
    from fedhet.experiment.sweep import adopt_runs, job_status, load_sweep, run_sweep, select_jobs, write_report
    from fedhet.experiment.sweep.state import STALE_FIX, unloadable_jobs, unloadable_message

    sweep = load_sweep(args.sweep_file, out=args.out, lanes=args.lanes, extra_set=args.set)
    jobs = select_jobs(sweep, args.only)
    if args.list:
        _list_sweep(sweep, jobs, args.retry_failed)
        return 0
    # a config that does not load (a typo in --set) makes no run stale and no table: refused before
    # anything is written (run_sweep refuses it too, for a caller of its own)
    status = {j.name: job_status(j) for j in sweep.jobs}
    if broken := unloadable_jobs(jobs, status, args.retry_failed):
        raise ConfigError(unloadable_message(broken))
    if args.adopt:
        for source in args.adopt:
            adopt_runs(sweep, source, log=lambda m: print(m, file=sys.stderr))
        left = [j.name for j in sweep.jobs if job_status(j) != "completed"]
        print(f"{sweep.name}: {len(sweep.jobs) - len(left)} of {len(sweep.jobs)} runs completed in {sweep.out}"
              + (f"; not yet: {', '.join(left)}" if left else ""), file=sys.stderr)
        return 0
    if args.table:
        stale = [name for name, now in status.items() if now == "stale"]
        kept = bool(stale) and (sweep.out / "sweep.md").is_file()
        print(write_report(sweep, replace=not kept, status=status))
        if stale:
            print(f"fedhet: {len(stale)} run(s) stale: {STALE_FIX}" + (
                f"; {sweep.out / 'sweep.md'} is kept as it was (this table, with stale runs left out, is only "
                "printed)" if kept else ""), file=sys.stderr)
        return 0
    try:
        outcome = run_sweep(sweep, retry_failed=args.retry_failed, only=args.only,
                            no_start_after=args.no_start_after, finish_by=args.finish_by,
                            skip_unfinishable=args.skip_runs_that_cannot_finish,
                            log=lambda m: print(m, file=sys.stderr, flush=True))
    except KeyboardInterrupt:
        write_report(sweep)
        print("fedhet: sweep interrupted; run the same `fedhet sweep` command again to resume it", file=sys.stderr)
        return 130
    except FedhetError:
        if sweep.out.is_dir():        # the table of what finished, then the error (none before the folder)
            write_report(sweep)
        raise
    status = {j.name: job_status(j) for j in sweep.jobs}      # read once, after the runs
    report = write_report(sweep, status=status)
    print(report)
    print(f"table: {sweep.out / 'sweep.md'}, plot: {sweep.out / 'sweep.png'}")
    stopped = [name for name, status in outcome.items() if status == "stopped"]
    if stopped:
        print(f"fedhet: {len(stopped)} run(s) stopped by --finish-by: {', '.join(stopped)} (whatever they recorded "
              f"stays in their folders; a sweep with more time resumes them)", file=sys.stderr)
    unstarted = [name for name, status in outcome.items() if status == "not started"]
    if unstarted:
        print(f"fedhet: {len(unstarted)} run(s) not started by --skip-runs-that-cannot-finish: {', '.join(unstarted)} "
              "(they would have ended after the --finish-by limit; a sweep with more time runs them)", file=sys.stderr)
    failed = [j.name for j in jobs if status[j.name] in ("failed", "stale", "damaged")]
    if failed:
        print(f"fedhet: {len(failed)} run(s) failed, stale or damaged: {', '.join(failed)} (logs: "
              f"{sweep.out}/<run>.log)", file=sys.stderr)
        return 1
    return 0


def _cmd_features(args) -> int:
    from fedhet.experiment.features import features_report

    rep = features_report(args.run_dir, samples=args.samples, seed=args.seed, plot=not args.no_plot,
                          round=args.round)
    print(f"{rep['run']} round {rep['round']} ({rep['algorithm']}, {rep['samples']} test samples): "
          f"NMI {rep['feature_nmi']:.4f}, silhouette {rep['feature_silhouette']:.4f}")
    written = Path(rep["run"]) / f"features_round{rep['round']}.json"
    print(f"wrote {written}" + (f" and {Path(rep['plot']).name} beside it" if "plot" in rep else ""))
    return 0


def _cmd_list(args) -> int:
    from fedhet.experiment.describe import catalogue, describe

    print(describe(args.method) if args.method else catalogue())
    return 0


def _cmd_flower(args) -> int:
    from fedhet.flower.deploy import cli

    return cli(args)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fedhet")
    except PackageNotFoundError:       # a source tree on PYTHONPATH, not installed
        return "(not installed)"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fedhet", description="Federated learning under data heterogeneity.",
                                epilog="A run goes on from its checkpoint with fedhet run --resume RUN_DIR.")
    p.add_argument("--version", action="version", version=f"fedhet {_version()}")
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="run an experiment from a YAML config")
    r.add_argument("config", nargs="?", help="YAML config (see configs/)")
    r.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set train.rounds=5 (repeatable); with --resume only "
                        "how the run is carried out, e.g. --set run.device=cpu, and a raised train.rounds, which "
                        "extends a finished run")
    r.add_argument("--out", help="run directory (default: <run.out_dir>/<name>-s<seed>-<time>)")
    r.add_argument("--resume", metavar="RUN_DIR", help="continue an interrupted run from its last checkpoint (or "
                                                        "extend a finished one: --set train.rounds=N)")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    r.add_argument("--threads", type=_positive_int,
                   help="run.threads: the torch threads of the run, and the CPU budget within which engine: auto "
                        "picks its workers (also on --resume)")
    r.set_defaults(func=_cmd_run)

    pa = sub.add_parser("partition", help="print per-client label counts and write a client x class heatmap")
    pa.add_argument("config")
    pa.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config value, e.g. --set data.partition.alpha=0.1 (repeatable)")
    pa.add_argument("--out", help="heatmap PNG path (default: <run.out_dir>/<name>-partition.png)")
    pa.set_defaults(func=_cmd_partition)

    c = sub.add_parser("compare", help="markdown table (mean ± std over seeds) and overlay plot of runs")
    c.add_argument("run_dirs", nargs="+")
    c.add_argument("--metric", help="metric to compare (default: each run's headline metric)")
    c.add_argument("--plot", help="write an overlay plot to this PNG")
    c.add_argument("--paired", metavar="NAME", action="append",
                   help="also list every run's per-seed difference of final against the runs of this config name "
                        "(e.g. a FedAvg baseline) at the seeds where both ran on the same per-client label counts "
                        "(equal partition.json), on --metric or else this baseline's headline metric; given once a "
                        "split, each run is paired with the baselines on its data, one table a baseline")
    c.set_defaults(func=_cmd_compare)

    sw = sub.add_parser("sweep", help="run a sweep file's experiments (configs x seeds x --set grids) in parallel "
                                      "lanes; re-running skips completed runs and resumes interrupted ones")
    sw.add_argument("sweep_file", help="YAML sweep file (format: fedhet.experiment.sweep, e.g. benchmarks/*.sweep.yaml)")
    sw.add_argument("--lanes", type=int, help="runs side by side (default: the file's lanes, else 1)")
    sw.add_argument("--out", help="output folder (default: the file's out, else runs/<name>)")
    sw.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config value in every run, after the file's own set lists, e.g. "
                         "--set run.device=cuda (repeatable). The values are part of each run's config: a run "
                         "folder recorded with others is stale and left alone, except for how runs are carried "
                         "out (run.device, run.engine, run.workers, ...), which resumed runs take too (e.g. runs "
                         "stopped on a GPU go on with --set run.device=cpu)")
    sw.add_argument("--only", action="append", metavar="TAG",
                    help="run only the runs of this tag or grid group (repeatable), e.g. --only fedpac; the "
                         "table still shows every completed run of the sweep; the exit status counts only "
                         "these runs")
    sw.add_argument("--retry-failed", action="store_true", help="run the failed runs again")
    sw.add_argument("--no-start-after", type=float, metavar="SECONDS",
                    help="start no run once SECONDS have passed since the sweep started: the runs going on then "
                         "finish, the rest wait for the next sweep (e.g. 0 on a short device call: only the first "
                         "lanes' runs, such as the one an earlier call left, run)")
    sw.add_argument("--finish-by", type=float, metavar="SECONDS",
                    help="the sweep's time in seconds from its start (e.g. a compute window's): at the limit every "
                         "run still going on is stopped (SIGTERM: it ends the round it is in, checkpoints it and "
                         "records its summary; killed if that takes over 30 s, it keeps its last checkpoint; a "
                         "later sweep resumes it) and none starts. Stopped runs do not fail the sweep (exit status 0). The "
                         "progress lines say when each running run should end at its pace")
    sw.add_argument("--skip-runs-that-cannot-finish", action="store_true",
                    help="with --finish-by: start no run that would end after the limit, by the seconds a round of "
                         "the slowest of its tag's completed runs on a machine like this one (the same CPU model, "
                         "instruction sets and CPU count, as many threads a run as this sweep's, recorded on the CPU, "
                         "not a GPU), or while its tag has none, its run entry's costs_like tag's; the next run of "
                         "the queue that fits starts instead, and a run with neither starts. For compute windows "
                         "whose stopped runs cannot be resumed later")
    sw.add_argument("--list", action="store_true",
                    help="list the runs and their status, and how long each run the sweep would start should take "
                         "here by the slowest completed run of its tag (or its costs_like tag) on a machine like this "
                         "one; start nothing")
    sw.add_argument("--adopt", action="append", metavar="FOLDER_OR_ARCHIVE",
                    help="copy the sweep's runs completed elsewhere (a folder of run folders, or a .tar.gz of one, "
                         "e.g. what a GPU machine sent back) into its folder, config/summary/metrics/partition "
                         "only; start nothing (repeatable)")
    sw.add_argument("--table", action="store_true",
                    help="write and print the table and the verdicts of the runs completed so far; start nothing")
    sw.set_defaults(func=_cmd_sweep)

    fe = sub.add_parser("features", help="feature-space quality of a run's global model: k-means NMI, "
                                         "silhouette, t-SNE plot (needs pip install -e .[features])")
    fe.add_argument("run_dir")
    fe.add_argument("--samples", type=_feature_samples, default=2000,
                    help="test samples to embed, at least 20 (default 2000)")
    fe.add_argument("--seed", type=int, default=0, help="seed of the test sample, k-means and t-SNE")
    fe.add_argument("--no-plot", action="store_true", help="only the numbers (t-SNE is the slow part)")
    fe.add_argument("--round", type=int, help="the checkpoint's round (default: whichever it holds)")
    fe.set_defaults(func=_cmd_features)

    fl = sub.add_parser("flower", help="run on Flower: a loopback deployment, or the app for a real one "
                                       "(docs/deployment.md; needs pip install -e .[flower])")
    flc = fl.add_subparsers(dest="flower_command", required=True)
    flr = flc.add_parser("run", help="one-machine deployment: SuperLink + one SuperNode per client on 127.0.0.1")
    fla = flc.add_parser("app", help="write the Flower app directory and a run-config file for `flwr run`")
    flr.add_argument("config", nargs="?", help="YAML config (see configs/); none with --resume")
    fla.add_argument("config", nargs="?", help="YAML config (see configs/); none with --resume")
    for q in (flr, fla):
        q.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config value; with --resume only how the run is carried out and a "
                            "raised train.rounds, which extends a finished run")
        q.add_argument("--min-clients", type=int, help="fewest answers a phase needs, else the run fails (default 1)")
        q.add_argument("--phase-timeout", type=float, help="seconds to wait for a phase's replies (default 600)")
        q.add_argument("--node-timeout", type=float,
                       help="seconds to wait for the SuperNodes at the start (default 120)")
    flr.add_argument("--nodes", type=int,
                     help="SuperNodes (default: data.num_clients; node i hosts clients i, i+N, ...)")
    flr.add_argument("--out", help="run directory (default: runs/<name>-s<seed>-<time>-flower)")
    flr.add_argument("--tls", action="store_true",
                     help="TLS between SuperNodes and SuperLink (self-signed certificates)")
    flr.add_argument("--auth", action="store_true",
                     help="SuperNode authentication (implies --tls): a key pair per SuperNode, registered with "
                          "the SuperLink before the nodes start; unregistered nodes are refused")
    flr.add_argument("--simulation", action="store_true",
                     help="Flower's simulation runtime instead of SuperNode processes: a --simulation SuperLink "
                          "runs --nodes virtual SuperNodes on Ray (needs pip install -e .[flower-sim])")
    flr.add_argument("--resume", metavar="RUN_DIR",
                     help="continue a Flower run from its last checkpoint (run.checkpoint_every), or extend a "
                          "finished one (--set train.rounds=N): the server's state from RUN_DIR/checkpoint.pt, the "
                          "clients' from the nodes' commits in RUN_DIR/node-state")
    flr.add_argument("--timeout", type=float, default=24 * 3600,
                     help="stop the run after this many seconds (default: 86400, a day)")
    flr.add_argument("--keep-logs", action="store_true",
                     help="keep the Flower logs and FLWR_HOME (temporary directory)")
    fla.add_argument("--out", required=True, help="directory to write the app into")
    fla.add_argument("--run-dir",
                     help="run directory on the SuperLink host (default: runs/<name>-s<seed>-<time>-flower; with "
                          "--resume, RUN_DIR)")
    fla.add_argument("--resume", metavar="RUN_DIR",
                     help="write the run config that continues the run in RUN_DIR (its config.yaml, resume = true; "
                          "--set as for flower run --resume), to submit to the deployment it ran on")
    fl.set_defaults(func=_cmd_flower)

    ls = sub.add_parser("list", help="list algorithms, datasets, partitions and models; with a name, that method's, "
                                     "partition's or model's parameters and their defaults, or the dataset's shape "
                                     "and where to get it")
    ls.add_argument("method", nargs="?", help="a method (fedrema, fedprox+fedfm, MODULE:CLASS), partition kind "
                                              "(dirichlet), model (resnet18) or dataset (femnist) to describe")
    ls.set_defaults(func=_cmd_list)
    return p


def _interrupt(signum, frame):
    raise Terminated


@contextlib.contextmanager
def _stop_after_the_round(exp):
    """The first Ctrl-C or SIGTERM during a run lets its round end and checkpoints it (a stop in
    mid-round would lose every round since the last checkpoint); the next stops at once. A
    parallel engine's workers ignore both, so the round they train can end."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    asked_at: list[float] = []

    def handler(signum, frame):
        name = signal.Signals(signum).name
        if asked_at:
            # the same stop sent twice at once (to the process group and again by a sweep): one stop
            if time.monotonic() - asked_at[0] < 1.0:
                return
            raise KeyboardInterrupt(f"{name} received again: stopped at once")
        asked_at.append(time.monotonic())
        exp.request_stop(f"{name} received")
        total = exp.cfg.train.rounds
        if exp.rounds_recorded >= total:
            said = f"every round is done and the summary is being written; {name} again stops at once"
        else:
            ending = exp.round_running or exp.rounds_recorded
            kept = (f"the last checkpoint is of round {exp.checkpointed_round}" if exp.checkpointed_round
                    else "no checkpoint yet")
            said = (f"stopping after round {ending} of {total}, which a checkpoint will keep" if ending
                    else "stopping before round 1") + f"; {name} again stops at once ({kept})"
        print(f"\nfedhet: {name}: {said}", file=sys.stderr, flush=True)

    # an ignored SIGINT stays ignored (a job started with `&` from a script, which Ctrl-C must not stop)
    signals = [sig for sig in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(sig) is not signal.SIG_IGN]
    previous = {sig: signal.signal(sig, handler) for sig in signals}
    try:
        yield
    finally:
        for sig, before in previous.items():
            signal.signal(sig, before)


def _format_warning(message, category, filename, lineno, line=None) -> str:
    """fedhet's own warnings as one line, ``fedhet: warning: ...`` (not the source line that
    raised them); other packages' as Python prints them."""
    if Path(filename).resolve().is_relative_to(Path(__file__).resolve().parent):
        return f"fedhet: warning: {message}\n"
    return _python_format_warning(message, category, filename, lineno, line)


_python_format_warning = warnings.formatwarning


def main(argv: list[str] | None = None) -> int:
    given = sys.argv[1:] if argv is None else argv
    if given[:1] == ["resume"]:           # what a user of other tools types first
        print("fedhet: error: there is no resume command: fedhet run --resume RUN_DIR continues a run from its "
              "checkpoint (fedhet flower run --resume RUN_DIR a Flower one)", file=sys.stderr)
        return 2
    spaced = next((i for i, word in enumerate(given) if i > 0 and given[i - 1] != "--set" and word.startswith("=")
                   or (word.endswith("=") and i > 0 and given[i - 1] == "--set" and i + 1 < len(given)
                       and not given[i + 1].startswith("-"))), None)
    if spaced is not None:                # --set train.rounds = 1: the shell made three words of one
        print(f"fedhet: error: {' '.join(given[max(0, spaced - 2):spaced + 2])}: a --set is one word, KEY=VALUE, with "
              "no space around the '=' (quote it where the value holds spaces: --set 'model.arch=[cnn2, cnn2]')",
              file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv)
    warnings.formatwarning = _format_warning
    # SIGTERM (kill, a scheduler, a sweep stopping its runs) stops like Ctrl-C: the run records
    # its status and keeps its checkpoints. SIGINT alone is not enough: a job started with `&`
    # ignores it.
    on_main_thread = threading.current_thread() is threading.main_thread()   # signal handlers live there only
    previous = signal.signal(signal.SIGTERM, _interrupt) if on_main_thread else None
    try:
        return args.func(args)
    except FedhetError as e:
        print(f"fedhet: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fedhet: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader of the output has gone (`fedhet sweep FILE --list | head`): stop quietly, as other
        # command-line tools do. Output still buffered goes to /dev/null, so the flush at exit cannot fail too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    finally:
        warnings.formatwarning = _python_format_warning
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
