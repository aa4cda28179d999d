"""Deployment helpers: the Flower app directory, run-config files and the one-machine loopback
deployment behind ``fedhet flower run`` (its certificates and node keys: ``credentials``).

The loopback starts ``flower-superlink`` and one ``flower-supernode`` per partition on
127.0.0.1 (free ports, ``FLWR_HOME`` in a temporary directory, update check off), submits the
app with ``flwr run``, follows the run with ``flwr list`` until it finishes - ``flwr run
--stream`` exits 0 even when the run failed - and stops every process by
process group, also on errors and Ctrl-C. The ServerApp writes the run directory itself (same
machine), so the run directory is complete when the run has finished.

Commands and flags are those of flwr 1.41/1.42; the app directory
holds only ``pyproject.toml``: the apps are imported from the installed fedhet package, which
must therefore be installed on every host, like torch (runtime dependency installation is
disabled: the SuperLink would otherwise run ``uv sync`` for the app's dependencies).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedhet.core.errors import FedhetError
from fedhet.flower import INSTALL_HINT, FlowerMissingError
from fedhet.flower.credentials import make_certificates, make_node_key, public_key_path

CONNECTION = "fedhet-loopback"
APP_NAME = "fedhet-flower"

NODE_STATE = "node-state"     # the loopback nodes' state directory, inside the run directory
RUN_CONFIG_DEFAULTS: dict[str, Any] = {
    "fedhet-config": "", "run-dir": "", "data-root": "",
    "min-clients": 1, "phase-timeout": 600.0, "node-timeout": 120.0, "poll-interval": 0.2,
    "resume": False, "node-state-dir": "",
}


class DeploymentError(FedhetError):
    """A Flower process failed to start, or the run did not finish as completed."""


def _mtime(path: Path | None) -> float | None:
    try:
        return path.stat().st_mtime if path is not None else None
    except OSError:
        return None


# --- app directory and run config ---------------------------------------------------------
def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return json.dumps(str(v))        # a JSON string is a valid TOML basic string


def write_app(app_dir: str | Path) -> Path:
    """Write the Flower app directory (``pyproject.toml`` only) that ``flwr run`` bundles."""
    app_dir = Path(app_dir)
    app_dir.mkdir(parents=True, exist_ok=True)
    config = "\n".join(f"{k} = {_toml_value(v)}" for k, v in RUN_CONFIG_DEFAULTS.items())
    text = f"""# The fedhet Flower app; its apps come from the installed fedhet package (docs/deployment.md).
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "{APP_NAME}"
version = "0.1.0"
description = "Any fedhet algorithm as a Flower app"
license = "Apache-2.0"
dependencies = ["fedhet", "flwr>=1.41,<1.43"]

[tool.flwr.app]
publisher = "fedhet"

[tool.flwr.app.components]
serverapp = "fedhet.flower.server_app:app"
clientapp = "fedhet.flower.client_app:app"

# Run config: every key must exist here to be overridable with `flwr run --run-config`.
[tool.flwr.app.config]
{config}
"""
    (app_dir / "pyproject.toml").write_text(text)
    return app_dir


def write_run_config(path: str | Path, config_text: str, run_dir: str | Path | None = None,
                     **settings: Any) -> Path:
    """A TOML file for ``flwr run --run-config FILE``: the fedhet config plus app settings
    (``min_clients=2`` is written as ``min-clients = 2``)."""
    values = {"fedhet-config": config_text}
    if run_dir:
        values["run-dir"] = str(Path(run_dir).resolve())
    for k, v in settings.items():
        key = k.replace("_", "-")
        if key not in RUN_CONFIG_DEFAULTS:
            raise FedhetError(f"unknown Flower app setting {k!r}; known: {', '.join(RUN_CONFIG_DEFAULTS)}")
        if v is not None:
            values[key] = v
    path = Path(path)
    path.write_text("".join(f"{k} = {_toml_value(v)}\n" for k, v in values.items()))
    return path


# --- processes ----------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def flower_bin() -> Path:
    """The directory holding flwr's commands (the SuperLink starts flower-superexec via PATH)."""
    for d in (Path(sys.executable).parent, *(Path(p) for p in os.environ.get("PATH", "").split(os.pathsep) if p)):
        if (d / "flower-superlink").exists() and (d / "flwr").exists():
            return d
    raise FlowerMissingError(f"the Flower commands (flower-superlink, flower-supernode, flwr) were not found: "
                             f"{INSTALL_HINT}")


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux /proc; empty elsewhere)."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for e in entries:
        if e.isdigit():
            try:
                stat = open(f"/proc/{e}/stat").read()
                ppid = int(stat[stat.rindex(")") + 2:].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(e))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


@dataclass
class Loopback:
    """SuperLink + ``nodes`` SuperNodes on 127.0.0.1, each in its own process group.

    Use as a context manager; :meth:`stop` runs on exit whatever happened. ``node_config``
    adds keys to every SuperNode's ``--node-config`` (e.g. ``data-root``)."""

    nodes: int
    workdir: Path
    tls: bool = False
    simulation: bool = False      # a --simulation SuperLink: Flower's simulation runtime (Ray) runs
                                  # ``nodes`` virtual SuperNodes; no flower-supernode is started
    auth: bool = False            # SuperNode authentication (needs TLS): each node's key is registered
    node_config: dict[str, Any] = field(default_factory=dict)
    echo: Callable[[str], None] | None = None
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    # Process groups of the SuperLink's descendants seen so far (superexec, flwr-serverapp): when the
    # SuperLink dies they are re-parented away from it, and stop() would no longer find them.
    seen_groups: set[int] = field(default_factory=set)

    def __post_init__(self):
        self.workdir = Path(self.workdir)
        self.bin = flower_bin()
        self.home = self.workdir / "flwr-home"
        self.logs = self.workdir / "logs"
        self.home.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, "PATH": f"{self.bin}{os.pathsep}{os.environ.get('PATH', '')}",
                    "FLWR_HOME": str(self.home), "FLWR_DISABLE_UPDATE_CHECK": "1",
                    "PYTHONUNBUFFERED": "1"}          # logs reach the files as they happen
        # The SuperExecs (one beside the SuperLink, one per SuperNode) look for new tasks at Flower's
        # default, every second (FLWR_SUPEREXEC_TASK_POLL_INTERVAL from the environment, if set): on
        # one machine four of them polling every 0.1 s cost a tenth of a core and ended no run sooner
        self.port = free_port()
        if self.auth and not self.tls:
            raise FedhetError("SuperNode authentication needs TLS: use --tls with --auth")
        self.certs = make_certificates(self.workdir / "certs") if self.tls else None

    def _say(self, text: str) -> None:
        if self.echo:
            self.echo(text)

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "w")
        try:
            p = subprocess.Popen([str(self.bin / args[0]), *args[1:]], env=self.env, stdout=log,
                                 stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            log.close()
        self.procs[name] = p
        return p

    # --- lifecycle ------------------------------------------------------------------------
    def __enter__(self) -> Loopback:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, timeout: float = 60.0) -> None:
        t0 = time.monotonic()
        tls = (["--ssl-ca-certfile", str(self.certs["ca"]), "--ssl-certfile", str(self.certs["cert"]),
                "--ssl-keyfile", str(self.certs["key"])] if self.certs else ["--insecure"])
        sim = ["--simulation"] if self.simulation else []
        sim += ["--enable-supernode-auth"] if self.auth else []
        self._spawn("superlink", ["flower-superlink", *sim, *tls, "--disable-runtime-dependency-installation",
                                  "--host", "127.0.0.1", "--port", str(self.port)])
        self._wait_healthy(timeout)
        self._say(f"SuperLink on 127.0.0.1:{self.port}{' (TLS)' if self.certs else ''} ready "
                  f"after {time.monotonic() - t0:.1f} s")
        conn = [f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\n',
                f'address = "127.0.0.1:{self.port}"\n']
        conn.append(f'root-certificates = "{self.certs["ca"]}"\n' if self.certs else "insecure = true\n")
        (self.home / "config.toml").write_text("".join(conn))
        if self.simulation:
            return
        for i in range(self.nodes):
            key = None
            if self.auth:
                key = make_node_key(self.workdir / "keys" / f"supernode-{i}")
                self.register(public_key_path(key))
            self.start_node(i, key)
        self._say(f"{self.nodes} SuperNode(s) started" + (" with registered keys" if self.auth else ""))

    def register(self, public_key: Path) -> None:
        """Register a SuperNode's public key with the SuperLink (``flwr supernode register``)."""
        r = self.flwr("supernode", "register", str(public_key), CONNECTION, timeout=60)
        if r.returncode != 0:
            raise DeploymentError(f"flwr supernode register {public_key} failed (exit {r.returncode}): "
                                  f"{r.stdout.strip()} {r.stderr.strip()}")

    def start_node(self, i: int, key: Path | None = None, name: str | None = None) -> subprocess.Popen:
        """Start SuperNode ``i`` (partition ``i``); ``key``: its private key (authentication)."""
        tls = ["--root-certificates", str(self.certs["ca"])] if self.certs else ["--insecure"]
        cfg = {"partition-id": i, "num-partitions": self.nodes, **self.node_config}
        node_cfg = " ".join(f"{k}={_toml_value(v)}" for k, v in cfg.items())
        auth = ["--auth-supernode-private-key", str(key)] if key else []
        return self._spawn(name or f"supernode-{i}", ["flower-supernode", *tls, *auth, "--superlink",
                                                      f"127.0.0.1:{self.port}", "--port", str(free_port()),
                                                      "--max-retries", "10", "--node-config", node_cfg])

    def _wait_healthy(self, timeout: float) -> None:
        scheme = "https" if self.certs else "http"
        ctx = ssl.create_default_context(cafile=str(self.certs["ca"])) if self.certs else None
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.procs["superlink"].poll() is not None:
                raise DeploymentError(f"flower-superlink exited with code {self.procs['superlink'].returncode}:\n"
                                      + self.tail("superlink"))
            try:
                with urllib.request.urlopen(f"{scheme}://127.0.0.1:{self.port}/health", timeout=2, context=ctx) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.3)
        raise DeploymentError(f"flower-superlink not healthy after {timeout:.0f} s:\n" + self.tail("superlink"))

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Signal one process group (``superlink``, ``supernode-<i>``), e.g. to simulate a crash."""
        _killpg(self.procs[name].pid, sig)

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM to every process group, SIGKILL to what is left after ``grace`` seconds.

        The SuperLink starts its flower-superexec (and that the flwr-serverapp) in a new session,
        so descendants are collected first and their groups signalled too; Flower would end them
        itself (parent-process monitors), but only after a while."""
        self.remember_descendants()
        groups = {p.pid for p in self.procs.values()} | self.seen_groups
        for g in groups:
            _killpg(g, signal.SIGTERM)
        end = time.monotonic() + grace
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for g in groups:
            _killpg(g, signal.SIGKILL)       # a group may outlive its leader (superexec, clientapps)
        for p in self.procs.values():
            if p.poll() is None:
                p.wait(timeout=5)

    def remember_descendants(self) -> None:
        groups = {_pgid(d) for p in self.procs.values() for d in _descendants(p.pid)}
        self.seen_groups |= {g for g in groups if g is not None} - {os.getpgrp()}

    def tail(self, name: str, lines: int = 30) -> str:
        path = self.logs / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    # --- flwr CLI -------------------------------------------------------------------------
    def flwr(self, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
        return subprocess.run([str(self.bin / "flwr"), *args], env=self.env, capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)

    def submit(self, app_dir: str | Path, run_config: str | Path) -> int:
        # the simulation runtime sizes the federation itself and fills in partition-id/num-partitions
        federation = (["--federation-config", f"num-supernodes={self.nodes} client-resources-num-cpus=1"]
                      if self.simulation else [])
        r = self.flwr("run", str(app_dir), CONNECTION, "--run-config", str(run_config), *federation,
                      "--format", "json")
        try:
            out = json.loads(r.stdout)
        except json.JSONDecodeError:
            out = {}
        if r.returncode != 0 or not out.get("success", False) or "run-id" not in out:
            raise DeploymentError(f"flwr run failed (exit {r.returncode}): {r.stdout.strip()} {r.stderr.strip()}")
        return int(out["run-id"])

    def status(self, run_id: int) -> str:
        r = self.flwr("list", CONNECTION, "--run-id", str(run_id), "--format", "json", timeout=60)
        try:
            return json.loads(r.stdout)["runs"][0]["status"]
        except (json.JSONDecodeError, KeyError, IndexError):
            raise DeploymentError(f"flwr list failed (exit {r.returncode}): {r.stdout.strip()} {r.stderr.strip()}") \
                from None

    def follow(self, run_id: int, timeout: float, done_marker: Path | None = None, check_every: float = 60.0) -> str:
        """Stream the run's log to ``logs/run.log`` (and ``echo``) until it finishes; returns
        the final status (``finished:completed`` on success).

        ``flwr list`` is a new Python process each time (about 1.5 s of CPU), so it is asked every
        ``check_every`` seconds only, a safety net: the run's end shows first, as ``done_marker``
        (the run's summary.json) appearing or the log stream ending, and then it is asked every
        2 s until Flower reports the run finished."""
        log_path = self.logs / "run.log"
        with open(log_path, "w") as sink:
            streamer = subprocess.Popen([str(self.bin / "flwr"), "log", str(run_id), CONNECTION, "--stream"],
                                        env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        stdin=subprocess.DEVNULL, start_new_session=True)

            def pump():
                for line in streamer.stdout:
                    sink.write(line)
                    sink.flush()
                    if self.echo:
                        self.echo(line.rstrip("\n"))

            pumper = threading.Thread(target=pump, daemon=True)
            pumper.start()
            try:
                end = time.monotonic() + timeout
                next_check = 0.0
                before = _mtime(done_marker)       # a resumed run's directory has the last one
                while True:
                    now = time.monotonic()
                    hint = streamer.poll() is not None or _mtime(done_marker) != before
                    if self.procs["superlink"].poll() is not None:
                        raise DeploymentError("flower-superlink died:\n" + self.tail("superlink"))
                    if now >= next_check or hint:
                        self.remember_descendants()
                        status = self.status(run_id)
                        if status.startswith("finished"):
                            return status
                        next_check = now + (2.0 if hint else check_every)
                    if now > end:
                        self.flwr("stop", str(run_id), CONNECTION, timeout=30)
                        raise DeploymentError(f"run {run_id} still {status} after {timeout:.0f} s; stopped it")
                    time.sleep(0.25)
            finally:
                time.sleep(0.5)              # let the last log lines arrive
                try:
                    os.killpg(streamer.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
                streamer.wait(timeout=10)
                pumper.join(timeout=5)


def require_simulation_runtime() -> None:
    """Flower's simulation runtime needs Ray (the ``flower-sim`` extra)."""
    try:
        import flwr.simulation  # noqa: F401
        import ray  # noqa: F401
    except ImportError as e:
        raise FlowerMissingError(f"Flower's simulation runtime needs {e.name}, which is not installed: "
                                 f"pip install -e .[flower-sim]") from None


# --- one call: the loopback run -----------------------------------------------------------
@dataclass
class LoopbackResult:
    run_dir: Path
    status: str
    summary: dict | None
    seconds: dict[str, float]
    workdir: Path


def run_loopback(cfg, run_dir: str | Path, nodes: int | None = None, tls: bool = False, auth: bool = False,
                 simulation: bool = False, resume: bool = False, timeout: float = 3600.0,
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

    n = nodes or cfg.data.num_clients
    if not 1 <= n <= cfg.data.num_clients:
        raise FedhetError(f"--nodes must be between 1 and data.num_clients={cfg.data.num_clients}, got {n}")
    if simulation:
        require_simulation_runtime()
    run_dir = Path(run_dir).resolve()
    if resume and not (run_dir / METRICS).exists():
        raise FedhetError(f"{run_dir} holds no run to resume (no {METRICS})")
    if not resume and (run_dir / METRICS).exists():
        raise FedhetError(f"{run_dir} already holds a run; continue it with --resume {run_dir}, or choose another --out")
    RunDir(run_dir).create()             # a path under a file or unwritable: say so before starting Flower
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
                echo(f"run {run_id} submitted ({seconds['submit']:.1f} s); logs in {lb.logs}")
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
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
    if status != "finished:completed":
        cause = (summary or {}).get("error") or logged_error(work / "logs") or f"see {work / 'logs'}"
        hint = f"; {resume_hint(run_dir)}" if (run_dir / CHECKPOINT).exists() else ""
        raise DeploymentError(f"Flower run ended {status}: {cause}{hint}")
    return LoopbackResult(run_dir, status, summary, seconds, work)


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
    from fedhet.experiment.config import dump_config, load_config
    from fedhet.experiment.rundir import checked_run_dir

    if getattr(args, "resume", None) is not None:
        if args.config or args.set:
            raise FedhetError("--resume continues a run with the config in its directory: give no CONFIG or --set")
        if args.out:
            raise FedhetError("--resume RUN_DIR writes to RUN_DIR: give no --out")
        from fedhet.experiment.rundir import CONFIG
        cfg = load_config(checked_run_dir(args.resume, resume=True) / CONFIG)
    elif not args.config:
        raise FedhetError("fedhet flower: give a CONFIG file, or --resume RUN_DIR")
    else:
        cfg = load_config(args.config, args.set)
    if args.flower_command == "run" and args.out is not None:
        checked_run_dir(args.out)
    settings = {"min_clients": args.min_clients, "phase_timeout": args.phase_timeout,
                "node_timeout": args.node_timeout}
    if args.min_clients is not None and args.min_clients > cfg.train.clients_per_round:
        raise FedhetError(f"--min-clients {args.min_clients} exceeds train.clients_per_round="
                          f"{cfg.train.clients_per_round}: no round could complete")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    default_run_dir = Path(cfg.run.out_dir) / f"{cfg.name}-s{cfg.seed}-{stamp}-flower"

    if args.flower_command == "app":
        out = write_app(args.out)
        rc = write_run_config(out / "run-config.toml", dump_config(cfg), args.run_dir or default_run_dir, **settings)
        print(f"Flower app: {out}/pyproject.toml\nrun config: {rc}\n"
              f"submit with: flwr run {out} <SUPERLINK-CONNECTION> --run-config {rc}   (docs/deployment.md)")
        return 0

    from fedhet.experiment.build import algorithm_and_federation, build_models
    from fedhet.experiment.report import compare

    if args.nodes is not None and not 1 <= args.nodes <= cfg.data.num_clients:
        raise FedhetError(f"--nodes must be between 1 and data.num_clients={cfg.data.num_clients}, got {args.nodes}")
    flower_bin()
    if args.simulation:
        require_simulation_runtime()
    # fail here, not on every node, if the data are missing or unfit, or a model does not suit the method
    algorithm, federation = algorithm_and_federation(cfg)
    for arch, model in build_models(cfg, federation)[0].items():
        algorithm.check_model(arch, model)
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
    say(f"loopback: start {result.seconds['start']:.1f} s, submit {result.seconds['submit']:.1f} s, "
        f"run {result.seconds['run']:.1f} s, stop {result.seconds['stop']:.1f} s")
    print(compare([result.run_dir], None, None))
    print(f"\nresults: {result.run_dir}/summary.json, metrics.jsonl, accuracy.png")
    return 0
