"""Real Flower deployments on 127.0.0.1: a SuperLink and 2-3 SuperNodes, the flwr CLI, processes.

Each test starts its own SuperLink and SuperNodes (free ports, FLWR_HOME in tmp_path), so they
take about a minute each (Flower polls every few seconds and starts a fresh ClientApp process,
which imports torch, for every message); checks that can share a deployment share one. They run in the default ``pytest``
invocation; ``-m "not deploy"`` leaves them out.
"""

from __future__ import annotations

import copy
import os
import ssl
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("flwr", reason="Flower is not installed (pip install -e .[flower])")

from helpers import assert_identical  # noqa: E402

from fedhet.experiment.config import load_config  # noqa: E402
from fedhet.experiment.runner import Experiment, read_metrics  # noqa: E402
from fedhet.flower import FlowerMissingError  # noqa: E402
from fedhet.flower.credentials import make_node_key  # noqa: E402
from fedhet.flower.deploy import run_loopback  # noqa: E402
from fedhet.flower.engine import load_server_state  # noqa: E402
from fedhet.flower.loopback import DeploymentError  # noqa: E402

try:
    from fedhet.flower.loopback import flower_bin

    flower_bin()
except FlowerMissingError as e:  # flwr importable but its commands are not on this machine
    pytest.skip(str(e), allow_module_level=True)

pytestmark = pytest.mark.deploy

# Generous: a phase normally takes 5-40 s here (two shared cores); a killed node is noticed by
# the SuperLink after about 60 s (2 missed 30 s heartbeats, flwr.common.constant).
SETTINGS = {"phase_timeout": 150.0, "node_timeout": 120.0}


def deploy_config(small_config, algorithm, rounds=2, clients=3):
    raw = copy.deepcopy(small_config)
    raw["algorithm"] = {"name": algorithm, "params": {}}
    raw["data"]["num_clients"] = clients
    raw["train"].update(rounds=rounds, clients_per_round=clients, local_epochs=2)
    raw["eval"]["every"] = rounds                  # one evaluation, after the last round
    raw["run"]["threads"] = 1                      # nodes and the reference: same float sums
    return load_config(raw=raw)


def users_own_config(small_config, tmp_path, monkeypatch, rounds):
    """docs/extending.md's files: the method FedDamp, the model small_mlp and a dataset written from
    arrays by save_arrays, all from examples/extending, which the SuperNodes' ClientApps import from
    PYTHONPATH as the ServerApp does. 4 users' clients."""
    examples = Path(__file__).resolve().parents[2] / "examples" / "extending"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(examples), os.environ.get("PYTHONPATH")])))
    monkeypatch.syspath_prepend(str(examples))
    from toy_arrays import toy_arrays

    from fedhet.extend import save_arrays

    *splits, users = toy_arrays(users=4, per_user=40)
    dataset = save_arrays(tmp_path / "toy.npz", *splits, clients_train=users)
    raw = copy.deepcopy(small_config)
    raw["algorithm"] = {"name": "feddamp:FedDamp", "params": {"server_lr": 0.5, "logit_penalty": 0.01}}
    raw["model"] = {"arch": "nets:small_mlp", "options": {"hidden": 16}}
    raw["data"].update(dataset=dataset, pool="train", num_clients=4, partition={"kind": "natural"})
    raw["train"].update(rounds=rounds, clients_per_round=4)
    raw["eval"]["every"] = rounds
    raw["run"]["threads"] = 1
    return load_config(raw=raw)


def test_loopback_runs_the_users_own_code_over_tls_with_authentication_as_the_simulator_does(
        small_config, tmp_path, monkeypatch):
    """One deployment checks three things at once (each alone costs a deployment, about a minute
    here): the user's own method, model and data (``users_own_config``) on real SuperNodes, 4
    clients on 2 nodes, one round, end with the simulator's parameters and metrics; the transport is
    TLS (self-signed CA; the SuperLink answers HTTPS and refuses plain HTTP); and with
    --enable-supernode-auth the registered SuperNodes (keys registered through `flwr supernode
    register`) run the round while both kinds of stranger are refused: a node whose key was never
    registered, and a node without a key (which, on a SuperLink without authentication, registers
    itself and joins). Each stranger exits and never gets a message. Two rounds of the same method
    run in-process in test_flower.py; FedCME's two phases run deployed on Flower's simulation
    runtime below, with the same ClientApp."""
    cfg = users_own_config(small_config, tmp_path, monkeypatch, rounds=1)
    cfg.eval.personalized = False                  # the evaluate message is covered by the kill test
    probes, strangers = {}, {}

    def probe_then_start_strangers(lb, run_id):
        ctx = ssl.create_default_context(cafile=str(lb.certs["ca"]))
        with urllib.request.urlopen(f"https://127.0.0.1:{lb.port}/health", context=ctx, timeout=10) as r:
            probes["https"] = r.status
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{lb.port}/health", timeout=10)
            probes["http"] = "answered"
        except OSError as e:
            probes["http"] = f"refused: {e}"
        procs = {"unregistered": lb.start_node(0, make_node_key(lb.workdir / "keys" / "stranger"),
                                               name="unregistered"),
                 "keyless": lb.start_node(1, None, name="keyless")}
        for name, proc in procs.items():
            try:
                code = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                code = None
            strangers[name] = (code, lb.tail(name, 60))

    res = run_loopback(cfg, tmp_path / "flower", nodes=2, auth=True, workdir=tmp_path / "work", timeout=600,
                       on_submitted=probe_then_start_strangers, **SETTINGS)
    assert res.status == "finished:completed" and res.summary["status"] == "completed"
    assert res.summary["algorithm"] == "feddamp"
    assert probes["https"] == 200 and probes["http"].startswith("refused"), probes
    for name, (code, log) in strangers.items():
        assert code not in (None, 0) and "Failed to" in log and "Receiving" not in log, (name, code, log)

    ref = Experiment.create(cfg, tmp_path / "sim")
    ref.run(progress=False)
    assert_identical(load_server_state(tmp_path / "flower")["server_state"], ref.loop.server_state)
    sim_rows, rows = read_metrics(tmp_path / "sim"), read_metrics(tmp_path / "flower")
    assert [r["round"] for r in rows] == [1]
    for s, f in zip(sim_rows, rows, strict=True):
        assert f["train_loss"] == s["train_loss"] and f["comm"] == s["comm"]
        assert [p["kinds"] for p in f["flower"]["phases"]] == [["train"]]
        assert all(p["sent"] == p["answered"] == 4 and p["messages"] == 2 for p in f["flower"]["phases"])
    for key in ("global_acc", "global_loss"):
        assert rows[-1][key] == pytest.approx(sim_rows[-1][key], abs=1e-9), key
    for name in ("config.yaml", "metrics.jsonl", "summary.json", "accuracy.png", "checkpoint.pt"):
        assert (tmp_path / "flower" / name).is_file(), name
    print(f"\nloopback, the user's own code (TLS, auth): {res.seconds}; "
          f"phases: {[[p['seconds'] for p in r['flower']['phases']] for r in rows]}")


def test_simulation_runtime_fedcme_matches_simulator(small_config, tmp_path):
    """The same app on Flower's simulation runtime (a --simulation SuperLink, 3 virtual
    SuperNodes on Ray): the same server state and metrics as the simulator. Runs where the
    flower-sim extra is installed (scripts/setup.sh installs it, so CI runs it)."""
    pytest.importorskip("ray", reason="Flower's simulation runtime is not installed (pip install -e .[flower-sim])")
    cfg = deploy_config(small_config, "fedcme")
    res = run_loopback(cfg, tmp_path / "ray", nodes=3, simulation=True, workdir=tmp_path / "work", timeout=600,
                       **SETTINGS)
    assert res.status == "finished:completed" and res.summary["status"] == "completed"
    # The runtime really was the simulation: Flower says so in the run's log, and no SuperNode
    # process was started (real SuperNodes give the same numbers, so only this tells them apart).
    logs = tmp_path / "work" / "logs"
    assert "Starting Flower Simulation" in (logs / "run.log").read_text(errors="replace")
    assert not list(logs.glob("supernode-*.log")), sorted(logs.iterdir())

    ref = Experiment.create(cfg, tmp_path / "sim")
    ref.run(progress=False)
    assert_identical(load_server_state(tmp_path / "ray")["server_state"], ref.loop.server_state)
    sim_rows, rows = read_metrics(tmp_path / "sim"), read_metrics(tmp_path / "ray")
    for s, f in zip(sim_rows, rows, strict=True):
        assert f["train_loss"] == s["train_loss"] and f["fedcme_pairs"] == s["fedcme_pairs"]
        assert all(p["sent"] == p["answered"] == 3 for p in f["flower"]["phases"])
    assert [p["kinds"] for p in rows[0]["flower"]["phases"]] == [["train"], ["continue", "exchange"]]
    for key in ("global_acc", "personal_acc"):           # evaluated after the last round
        assert rows[-1][key] == pytest.approx(sim_rows[-1][key], abs=1e-9), key


def test_loopback_resume_after_superlink_killed(small_config, tmp_path):
    """SCAFFOLD, checkpoint every round: SIGKILL the SuperLink's process group (and the ServerApp
    in it) as soon as the checkpoint of round 1 is on disk; `--resume` on a fresh deployment
    reloads each node's committed c_i from run_dir/node-state and ends with the server state
    and metrics of the uninterrupted simulator run. 3 clients on 2 SuperNodes: one node commits
    the states of two clients."""
    cfg = deploy_config(small_config, "scaffold")
    cfg.run.checkpoint_every = 1
    run_dir = tmp_path / "flower"
    killed = threading.Event()

    def kill_superlink_after_checkpoint(lb, run_id):
        def watch():
            end = time.monotonic() + 300
            while time.monotonic() < end:
                if (run_dir / "checkpoint.pt").exists():
                    lb.kill("superlink")
                    killed.set()
                    return
                time.sleep(0.1)

        threading.Thread(target=watch, daemon=True).start()

    with pytest.raises(DeploymentError):
        run_loopback(cfg, run_dir, nodes=2, workdir=tmp_path / "work1", timeout=600,
                     on_submitted=kill_superlink_after_checkpoint, **SETTINGS)
    assert killed.is_set() and [r["round"] for r in read_metrics(run_dir)] == [1]
    assert load_server_state(run_dir)["round"] == 1
    assert len(list((run_dir / "node-state").rglob("round-1.pt"))) == 2          # one commit per node

    res = run_loopback(cfg, run_dir, nodes=2, resume=True, workdir=tmp_path / "work2", timeout=600, **SETTINGS)
    assert res.summary["status"] == "completed" and res.summary["rounds_completed"] == 2
    ref = Experiment.create(cfg, tmp_path / "sim")
    ref.run(progress=False)
    assert_identical(load_server_state(run_dir)["server_state"], ref.loop.server_state)
    sim_rows, rows = read_metrics(tmp_path / "sim"), read_metrics(run_dir)
    assert [r["round"] for r in rows] == [1, 2]
    for s, f in zip(sim_rows, rows):
        assert f["train_loss"] == s["train_loss"] and f["comm"] == s["comm"], f["round"]
    assert rows[-1]["global_acc"] == pytest.approx(sim_rows[-1]["global_acc"], abs=1e-9)
    assert rows[-1]["personal_acc"] == pytest.approx(sim_rows[-1]["personal_acc"], abs=1e-9)
    assert rows[-1]["personal_loss"] == pytest.approx(sim_rows[-1]["personal_loss"], rel=1e-5)


def test_supernode_killed_mid_round(small_config, tmp_path):
    """SIGKILL one SuperNode's process group as soon as it receives its first training message:
    that client is dropped from round 1 (no reply) and from round 2 (its node is gone), the run
    completes with the other two (min-clients 2), and everything is recorded."""
    cfg = deploy_config(small_config, "fedavg")
    killed = threading.Event()

    def kill_node_2_when_training(lb, run_id):
        log = lb.logs / "supernode-2.log"

        def watch():
            end = time.monotonic() + 300
            while time.monotonic() < end:
                if log.exists() and "Receiving: train" in log.read_text(errors="replace"):
                    lb.kill("supernode-2")
                    killed.set()
                    return
                time.sleep(0.2)

        threading.Thread(target=watch, daemon=True).start()

    res = run_loopback(cfg, tmp_path / "flower", nodes=3, workdir=tmp_path / "work", timeout=600,
                       on_submitted=kill_node_2_when_training, min_clients=2, **SETTINGS)
    assert killed.is_set()
    assert res.summary["status"] == "completed" and res.summary["rounds_completed"] == 2
    r1, r2 = read_metrics(tmp_path / "flower")
    assert set(r1["flower"]["dropped"]) == {"2"} and set(r2["flower"]["dropped"]) == {"2"}
    assert r1["flower"]["phases"][0]["answered"] == 2 and r2["flower"]["phases"][0]["answered"] == 2
    assert "2" not in r2["personal_acc_by_client"] and "0" in r2["personal_acc_by_client"]
    print(f"\nkilled node: {res.seconds}; round 1 dropped: {r1['flower']['dropped']}; "
          f"round 2 dropped: {r2['flower']['dropped']}")
