"""The one-machine Flower deployment behind ``fedhet flower run``: ``flower-superlink`` and one
``flower-supernode`` per partition on 127.0.0.1 (free ports, ``FLWR_HOME`` in a temporary
directory, update check off), each in its own process group, stopped by process group also on
errors and Ctrl-C; certificates and node keys come from :mod:`fedhet.flower.credentials`. The
``flwr`` commands submit a run and follow it: ``flwr run --stream`` exits 0 even when the run
failed, so the run's status is read with ``flwr list``.

Commands and flags are those of flwr 1.41/1.42; runtime dependency installation is disabled (the
SuperLink would otherwise run ``uv sync`` for the app's dependencies).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedhet.core.errors import FedhetError
from fedhet.flower import INSTALL_HINT, FlowerMissingError
from fedhet.flower.app_files import toml_value
from fedhet.flower.credentials import make_certificates, make_node_key, public_key_path

CONNECTION = "fedhet-loopback"


class DeploymentError(FedhetError):
    """A Flower process failed to start, or the run did not finish as completed."""


def _mtime(path: Path | None) -> float | None:
    try:
        return path.stat().st_mtime if path is not None else None
    except OSError:
        return None



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
        node_cfg = " ".join(f"{k}={toml_value(v)}" for k, v in cfg.items())
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
