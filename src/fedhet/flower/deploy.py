"""``fedhet flower run`` and ``fedhet flower app``: a fedhet config run on a fresh one-machine
deployment (:class:`~fedhet.flower.loopback.Loopback`), or the app directory and run config for
a deployment of one's own (:mod:`fedhet.flower.app_files`). The ServerApp writes the run directory
itself (same machine), so the run directory is complete when the run has finished.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedhet.core.errors import FedhetError
from fedhet.flower.app_files import write_app, write_run_config
from fedhet.flower.loopback import DeploymentError, Loopback, flower_bin, require_simulation_runtime

NODE_STATE = "node-state"     # the loopback nodes' state directory, inside the run directory


# --- one call: the loopback run -----------------------------------------------------------
@dataclass
class LoopbackResult:
    run_dir: Path
    status: str
    summary: dict | None
    seconds: dict[str, float]
    workdir: Path


def run_loopback(cfg, run_dir: str | Path, nodes: int | None = None, tls: bool = False, auth: bool = False,
                 simulation: bool = False, resume: bool = False, timeout: float = 24 * 3600.0,
                 workdir: str | Path | None = None, keep_workdir: bool = False,
                 echo: Callable[[str], None] | None = None, on_submitted: Callable[[Loopback, int], None] | None = None,
                 **settings: Any) -> LoopbackResult:
    """Run the fedhet config ``cfg`` on a fresh loopback deployment (``simulation``: on Flower's
    simulation runtime, ``nodes`` virtual SuperNodes); raises DeploymentError unless the run
    finished as ``completed``. ``resume``: continue the run in ``run_dir`` from its checkpoint.
    The nodes commit their clients' state under ``run_dir/node-state``. ``settings``:
    min_clients, phase_timeout, ... ``on_submitted(loopback, run_id)`` runs right after
    submission (tests use it to kill a node)."""
    from fedhet.experiment.config import dump_config
    from fedhet.experiment.rundir import CHECKPOINT, METRICS, RunDir

    run_dir = Path(run_dir).resolve()
    recorded = _recorded_nodes(run_dir) if resume else None
    if recorded is not None and nodes is not None and nodes != recorded:
        raise FedhetError(f"--nodes {nodes}: {run_dir}'s nodes committed their clients' state as {recorded} "
                          f"partitions, which only {recorded} nodes find again; resume with --nodes {recorded} (the "
                          "default), or start a new run")
    n = nodes or recorded or cfg.data.num_clients
    if not 1 <= n <= cfg.data.num_clients:
        raise FedhetError(f"--nodes must be between 1 and data.num_clients={cfg.data.num_clients}, got {n}")
    if simulation:
        require_simulation_runtime()
    if resume and not (run_dir / METRICS).exists():
        raise FedhetError(f"{run_dir} holds no run to resume (no {METRICS})")
    if not resume and RunDir(run_dir).holds_run():
        raise FedhetError(f"{run_dir} already holds a run; continue it with --resume {run_dir}, or choose another --out")
    RunDir(run_dir).create()             # a path under a file or unwritable: say so before starting Flower
    if not resume:
        (run_dir / LOOPBACK_NODES).write_text(json.dumps({"nodes": n}) + "\n")
    summary_path = run_dir / "summary.json"
    summary_before = _identity(summary_path)
    settings.setdefault("node_state_dir", str(run_dir / NODE_STATE))
    own_tmp = workdir is None
    work = Path(tempfile.mkdtemp(prefix="fedhet-flower-")) if own_tmp else Path(workdir)
    seconds: dict[str, float] = {}
    t0 = time.monotonic()
    status = "not started"
    try:
        app = write_app(work / "app")
        rc = write_run_config(work / "run-config.toml", dump_config(cfg), run_dir, resume=resume, **settings)
        with Loopback(n, work, tls=tls or auth, auth=auth, simulation=simulation, echo=echo) as lb:
            seconds["start"] = time.monotonic() - t0
            t1 = time.monotonic()
            run_id = lb.submit(app, rc)
            seconds["submit"] = time.monotonic() - t1
            if echo:
                kept = "" if keep_workdir or not own_tmp else " (removed when the run completes; --keep-logs keeps them)"
                echo(f"run {run_id} submitted ({seconds['submit']:.1f} s); logs in {lb.logs}{kept}")
            if on_submitted:
                on_submitted(lb, run_id)
            t2 = time.monotonic()
            try:
                status = lb.follow(run_id, timeout, done_marker=run_dir / "summary.json")
            except DeploymentError as e:
                raise DeploymentError(f"{e}\n{resume_hint(run_dir)}") from None
            seconds["run"] = time.monotonic() - t2
            t3 = time.monotonic()
        seconds["stop"] = time.monotonic() - t3
    finally:
        seconds["total"] = time.monotonic() - t0
        if own_tmp and not keep_workdir and status == "finished:completed":
            shutil.rmtree(work, ignore_errors=True)
    written = summary_path.exists() and _identity(summary_path) != summary_before
    summary = json.loads(summary_path.read_text()) if written else None      # this run's, not an earlier one's
    if status != "finished:completed":
        cause = (summary or {}).get("error") or logged_error(work / "logs") or f"see {work / 'logs'}"
        hint = f"; {resume_hint(run_dir)}" if (run_dir / CHECKPOINT).exists() else ""
        raise DeploymentError(f"Flower run ended {status}: {cause}{hint}")
    return LoopbackResult(run_dir, status, summary, seconds, work)


LOOPBACK_NODES = "loopback-nodes.json"    # how many SuperNodes a loopback run's clients were spread over


def _recorded_nodes(run_dir: Path) -> int | None:
    """The SuperNodes a loopback run ran on (its nodes commit by partition count): as recorded when
    it started, else as its nodes' commits under node-state name it (a run from before the record);
    None when neither says."""
    try:
        nodes = json.loads((run_dir / LOOPBACK_NODES).read_text())["nodes"]
        if isinstance(nodes, int) and not isinstance(nodes, bool) and nodes >= 1:
            return nodes
    except (OSError, ValueError, KeyError, TypeError):
        pass
    counts = {int(m.group(1)) for d in (run_dir / NODE_STATE).glob("*/partition-*-of-*")
              if (m := re.fullmatch(r"partition-\d+-of-(\d+)", d.name))}
    return counts.pop() if len(counts) == 1 else None


def _identity(path: Path) -> tuple[int, int] | None:
    """(inode, mtime) of a file, or None: a summary written again (atomically, so a new inode) differs."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns


TRACEBACK_END = re.compile(r"^(?:\w+\.)*\w*(?:Error|Exception|Interrupt): .*")


def logged_error(logs: Path) -> str | None:
    """The last exception a failed run's apps logged (the ServerApp's first, then the nodes'), with
    the log it is in: a run that failed before it could write its summary, e.g. a ServerApp that
    cannot import the user's method, says why without a look into the logs."""
    for log in [logs / "run.log", *sorted(logs.glob("supernode-*.log"))]:
        if not log.is_file():
            continue
        lines = (line.strip() for line in log.read_text(errors="replace").splitlines())
        found = [line for line in lines if TRACEBACK_END.match(line)]
        if found:
            return f"{found[-1]} (in {log})"
    return None


def resume_hint(run_dir: Path) -> str:
    from fedhet.experiment.rundir import CHECKPOINT, METRICS

    if (run_dir / CHECKPOINT).exists():
        return f"the rounds done are kept: continue with `fedhet flower run --resume {run_dir}`"
    if not (run_dir / METRICS).exists():
        return "the run had not started: give the same command again"
    return (f"no checkpoint was written yet: `fedhet flower run --resume {run_dir}` starts the run again from "
            "round 1 in the same folder")


# --- command line (fedhet flower run | app) ------------------------------------------------
def cli(args) -> int:
    """``fedhet flower run`` and ``fedhet flower app`` (parsers in fedhet/cli.py)."""
    from fedhet.experiment.config import check_resume_settings, dump_config, load_config
    from fedhet.experiment.rundir import checked_run_dir

    if getattr(args, "resume", None) is not None:
        if args.config:
            raise FedhetError("--resume continues a run with the config in its directory: give no CONFIG (--set "
                              "only for how the run is carried out, and a raised train.rounds to extend it)")
        if args.flower_command == "run" and args.out:
            raise FedhetError("--resume RUN_DIR writes to RUN_DIR: give no --out")
        from fedhet.experiment.rundir import CONFIG
        check_resume_settings(args.set)
        # the server checks these against config.yaml and the checkpoint, and records them (Experiment.resume)
        cfg = load_config(checked_run_dir(args.resume, resume=True) / CONFIG, args.set)
        # what the server would refuse, said before any deployment starts
        from fedhet.experiment.rundir import RunDir
        from fedhet.experiment.runner import checkpoint_refusal
        resumed = Path(args.resume)
        if problem := checkpoint_refusal(resumed, RunDir(resumed).load_checkpoint(), cfg.train.rounds, True):
            raise FedhetError(problem)
    elif not args.config:
        raise FedhetError("fedhet flower: give a CONFIG file, or --resume RUN_DIR")
    else:
        cfg = load_config(args.config, args.set)
    if args.flower_command == "run" and args.out is not None:
        checked_run_dir(args.out)
    # checked here, not only by the ServerApp once the SuperLink and the nodes are up
    for flag, value, ok, needs in (("--min-clients", args.min_clients, lambda v: v >= 1, "at least 1"),
                                   ("--phase-timeout", args.phase_timeout, lambda v: v > 0, "more than 0 seconds"),
                                   ("--node-timeout", args.node_timeout, lambda v: v >= 0, "0 or more seconds")):
        if value is not None and not (math.isfinite(value) and ok(value)):
            raise FedhetError(f"{flag} must be {needs}, got {value}")
    if args.flower_command == "run":
        if not (math.isfinite(args.timeout) and args.timeout > 0):
            raise FedhetError(f"--timeout must be more than 0 seconds, got {args.timeout}")
        if args.auth and args.simulation:
            raise FedhetError("--auth authenticates SuperNodes, and --simulation runs none (virtual nodes on Ray): "
                              "give one of the two")
    settings = {"min_clients": args.min_clients, "phase_timeout": args.phase_timeout,
                "node_timeout": args.node_timeout}
    if args.min_clients is not None and args.min_clients > cfg.train.clients_per_round:
        raise FedhetError(f"--min-clients {args.min_clients} exceeds train.clients_per_round="
                          f"{cfg.train.clients_per_round}: no round could complete")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    default_run_dir = Path(cfg.run.out_dir) / f"{cfg.name}-s{cfg.seed}-{stamp}-flower"

    if args.flower_command == "app":
        for flag, value in (("--out", args.out), ("--run-dir", args.run_dir)):
            if value is not None and not value.strip():
                raise FedhetError(f"{flag} is empty: name a folder")
        out = write_app(args.out)
        # --resume: the run config that continues RUN_DIR (its config.yaml, resume = true); --run-dir
        # where the SuperLink's host sees that folder, when not at the same path
        run_dir = args.run_dir or args.resume or default_run_dir
        try:
            rc = write_run_config(out / "run-config.toml", dump_config(cfg), run_dir,
                                  **({"resume": True} if args.resume else {}), **settings)
        except OSError as e:
            raise FedhetError(f"cannot write {out / 'run-config.toml'}: {e.strerror or e}; choose another --out") from None
        print(f"Flower app: {out}/pyproject.toml\nrun config: {rc}" + (" (resumes the run)" if args.resume else "")
              + f"\nsubmit with: flwr run {out} <SUPERLINK-CONNECTION> --run-config {rc}   (docs/deployment.md)")
        return 0

    from fedhet.experiment.build import algorithm_and_federation, build_models, check_local_risk
    from fedhet.experiment.report import compare

    if args.nodes is not None and not 1 <= args.nodes <= cfg.data.num_clients:
        raise FedhetError(f"--nodes must be between 1 and data.num_clients={cfg.data.num_clients}, got {args.nodes}")
    flower_bin()
    if args.simulation:
        require_simulation_runtime()
    # fail here, not on every node, if the data are missing or unfit, or a model does not suit the method
    algorithm, federation = algorithm_and_federation(cfg)
    models = build_models(cfg, federation)[0]
    for arch, model in models.items():
        algorithm.check_model(arch, model)
    if cfg.eval.local_risk:
        check_local_risk(algorithm, models)
    run_dir = Path(args.resume or args.out or default_run_dir)
    say = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    say(f"run directory: {run_dir.resolve()}")

    # SIGTERM arrives as KeyboardInterrupt (fedhet.cli.main): the Loopback stops every process
    try:
        result = run_loopback(cfg, run_dir, nodes=args.nodes, tls=args.tls, auth=args.auth, simulation=args.simulation,
                              resume=bool(args.resume), timeout=args.timeout,
                              keep_workdir=args.keep_logs, echo=say, **settings)
    except KeyboardInterrupt:
        say(f"fedhet: interrupted; every Flower process was stopped; recorded metrics are kept in the run directory; "
            f"continue with `fedhet flower run --resume {run_dir}`")
        return 130
    say(f"{'simulation runtime' if args.simulation else 'loopback'}: start {result.seconds['start']:.1f} s, "
        f"submit {result.seconds['submit']:.1f} s, "
        f"run {result.seconds['run']:.1f} s, stop {result.seconds['stop']:.1f} s")
    print(compare([result.run_dir], None, None))
    print(f"\nresults: {result.run_dir}/summary.json, metrics.jsonl, accuracy.png")
    return 0
