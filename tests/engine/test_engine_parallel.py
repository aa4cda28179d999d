"""The client-parallel engine equals the reference engine bit for bit, and fails cleanly."""

import copy

import pytest
import torch
from helpers import assert_identical, build_host, build_loop, config, run_killed_in_round

from fedhet.core.contract import TrainSettings
from fedhet.core.errors import ConfigError, NumericalError
from fedhet.data.federated import build_federation
from fedhet.engine import AUTO_PARALLEL_MIN_ROUND_SAMPLES, Forked, InProcess, choose_engine, make_loop
from fedhet.engine.parallel import WorkerError, dumps, loads, shared_tensors
from fedhet.experiment.config import load_config
from fedhet.experiment.runner import Experiment, read_metrics
from fedhet.metrics.evaluate import evaluate_loop as evaluate


def build(cfg, workers=None, fed=None):
    return build_loop(cfg, Forked(workers=workers) if workers else None, fed=fed)




def run_rounds(sim, rounds=2):
    out = []
    for rnd in range(rounds):
        s = sim.run_round(rnd, evaluating=True)
        out.append((s.clients, s.phases, s.samples, s.loss_sums, s.steps, sim.ledger.take_round(rnd)))
    return out


CASES = {
    "fedavg": dict(algorithm="fedavg"),
    # client state (c_i) travels to the workers and back every round; momentum exercises its steps
    "scaffold": dict(algorithm="scaffold", momentum=0.5),
    # two phases per round, the mid-round state in between, 2 local epochs so both phases train
    "fedcme": dict(algorithm="fedcme", params={"mu": 0.1}, local_epochs=2),
    # round 0 FedAvg, round 1 anchors then training (the received model kept in client state)
    "fedfm": dict(algorithm="fedfm", params={"start_round": 1, "lam": 1.0}, momentum=0.5),
}


@pytest.mark.parametrize("case", list(CASES))
def test_workers_equal_reference_bit_for_bit(small_config, case):
    cfg = config(small_config, **CASES[case])
    fed = build_federation(cfg.data, cfg.seed)
    ref = build(cfg, fed=fed)
    with build(cfg, workers=2, fed=fed) as par:
        a, b = run_rounds(ref), run_rounds(par)
        assert_identical(a, b, "round stats")
        assert_identical(ref.server_state, par.server_state, "server_state")
        assert_identical(ref.client_states, par.client_states, "client_states")
        assert ref.ledger.totals() == par.ledger.totals()
        assert evaluate(ref) == evaluate(par)
        if case == "scaffold":
            assert par.client_states, "SCAFFOLD keeps a control variate per client"
        if case == "fedcme":
            assert all(p == 2 for _, p, *_ in b)


def test_worker_error_surfaces_with_its_message_and_the_pool_recovers(small_config):
    cfg = config(small_config, lr=1e9)
    with build(cfg, workers=2) as sim:
        with pytest.raises(NumericalError, match=r"non-finite .* round 1, client \d+, algorithm fedavg") as info:
            sim.run_round(0)
        assert "in the worker process" in str(info.value.__cause__)
        assert sim.transport._pool is None              # shut down, nothing left running
        sim.host.settings = TrainSettings(**{**sim.host.settings.__dict__, "lr": 0.05})   # a fresh pool forks this
        assert sim.run_round(0).samples > 0


def test_worker_that_dies_is_reported(small_config, monkeypatch):
    cfg = config(small_config)
    sim = build(cfg, workers=2)

    def die(*args):
        import os
        os._exit(3)

    monkeypatch.setattr(sim.algorithm, "client_update", die)   # before the fork: the workers inherit it
    with pytest.raises(WorkerError, match="died"):
        sim.run_round(0)
    sim.close()


def test_resume_with_workers_equals_uninterrupted_reference(small_config, tmp_path, monkeypatch):
    raw = copy.deepcopy(small_config)
    raw["algorithm"] = {"name": "scaffold"}
    raw["train"]["rounds"] = 3
    ref = Experiment.create(load_config(raw=copy.deepcopy(raw)), tmp_path / "ref")
    assert type(ref.loop.transport) is InProcess                   # auto: a test-sized run stays on the reference engine
    ref.run(progress=False)

    raw["run"].update(engine="parallel", workers=2)
    exp = Experiment.create(load_config(raw=copy.deepcopy(raw)), tmp_path / "cut")
    run_killed_in_round(exp, monkeypatch, 2)   # checkpoint after round 2, killed in round 3
    resumed = Experiment.resume(exp.run_dir)
    assert isinstance(resumed.loop.transport, Forked) and resumed.start_round == 2
    resumed.run(progress=False)
    drop = lambda rows: [{k: v for k, v in r.items() if k != "seconds"} for r in rows]  # noqa: E731
    assert drop(read_metrics(resumed.run_dir)) == drop(read_metrics(ref.run_dir))
    assert_identical(ref.loop.server_state, resumed.loop.server_state)
    assert_identical(ref.loop.client_states, resumed.loop.client_states)
    assert resumed.summary["engine"] == {"engine": "parallel", "workers": 2, "reason": "requested"}
    assert resumed.loop.transport._pool is None                    # the runner stops the workers at the end


def test_transport_is_exact_and_shares_repeated_tensors():
    w = torch.randn(4, 3, 5, 5).contiguous(memory_format=torch.channels_last)
    obj = {"w": w, "bf16": torch.randn(7).bfloat16(), "scalar": torch.tensor(3), "empty": torch.zeros(0, 2),
           "bool": torch.tensor([True, False]), "grad": torch.ones(2, requires_grad=True), "same": [w, w]}
    back = loads(dumps(obj))
    for k in ("w", "bf16", "scalar", "empty", "bool", "grad"):
        assert torch.equal(back[k], obj[k]) and back[k].dtype == obj[k].dtype, k
    assert back["grad"].requires_grad and back["same"][0] is back["same"][1]
    g = torch.randn(3)
    table = shared_tensors([{"a": g, "b": torch.ones(1)}, {"c": g}, {"d": torch.ones(1)}])
    assert len(table) == 1 and table[0] is g
    back = loads(dumps({"x": g}, {id(g): 0}), [g])
    assert back["x"] is g                               # a shared tensor comes back as the same object


def test_auto_rule():
    big, small = AUTO_PARALLEL_MIN_ROUND_SAMPLES * 10, AUTO_PARALLEL_MIN_ROUND_SAMPLES / 10
    assert choose_engine("auto", "auto", "cpu", clients_per_round=10, round_samples=big, cpus=2).engine == "parallel"
    assert choose_engine("auto", "auto", "cpu", clients_per_round=10, round_samples=big, cpus=2).workers == 2
    assert choose_engine("auto", "auto", "cpu", clients_per_round=3, round_samples=big, cpus=16).workers == 3
    assert choose_engine("auto", "auto", "cpu", clients_per_round=10, round_samples=big, cpus=1).engine == "reference"
    assert choose_engine("auto", "auto", "cpu", clients_per_round=10, round_samples=small, cpus=2).engine == "reference"
    assert choose_engine("auto", 1, "cpu", clients_per_round=10, cpus=2).engine == "reference"
    assert choose_engine("auto", "auto", "cpu", clients_per_round=10, round_samples=big, cpus=8,
                         threads=1).engine == "reference"               # run.threads: 1 is a one-core budget
    assert choose_engine("auto", "auto", "cpu", clients_per_round=10, round_samples=big, cpus=8, threads=4).workers == 4
    assert choose_engine("auto", 4, "cpu", clients_per_round=10, cpus=2).workers == 4
    assert "4 workers share 2 usable CPU(s)" in choose_engine("auto", 4, "cpu", clients_per_round=10, cpus=2).reason
    # no more workers than clients a round: the others would only wait
    many = choose_engine("parallel", 64, "cpu", clients_per_round=20, cpus=2)
    assert many.workers == 20 and "64 workers asked for, 20 clients a round: 20 started" in many.reason
    assert choose_engine("auto", 8, "cpu", clients_per_round=1, cpus=2).engine == "reference"
    assert choose_engine("parallel", "auto", "cpu", clients_per_round=10, round_samples=small, cpus=2).workers == 2
    with pytest.raises(ConfigError, match="run.workers"):
        choose_engine("reference", 2)
    with pytest.raises(ConfigError, match="cannot run on"):
        choose_engine("parallel", 2, "cuda")


def test_auto_on_cuda_names_why_it_takes_the_slower_path(monkeypatch):
    from fedhet.engine import vectorized
    monkeypatch.setattr(vectorized, "available", lambda: False)          # as on a machine without CUDA
    with pytest.warns(RuntimeWarning, match="vectorized engine is unavailable .no CUDA device"):
        choice = choose_engine("auto", "auto", "cuda", clients_per_round=10)
    assert choice.engine == "reference" and "no CUDA device is visible" in choice.reason
    monkeypatch.setattr(vectorized, "available", lambda: True)
    with pytest.warns(RuntimeWarning, match="run.workers 4 ignored"):
        choice = choose_engine("auto", 4, "cuda", clients_per_round=10)
    assert choice.engine == "vectorized" and "run.workers 4 ignored" in choice.reason


def test_make_engine_builds_the_chosen_engine(small_config):
    cfg = config(small_config)
    fed = build_federation(cfg.data, cfg.seed)
    host = build_host(cfg, fed=fed)
    loop, choice = make_loop(host, 3, engine="parallel", workers=2)
    assert isinstance(loop.transport, Forked) and loop.transport.workers == 2 and loop.transport._pool is None  # lazy
    assert choice.engine == "parallel"
    assert type(make_loop(host, 3)[0].transport) is InProcess        # auto, test-sized: reference


def test_a_pool_never_closed_does_not_hold_up_the_exit():
    """The workers ignore SIGTERM (a stop lets their round end), which multiprocessing's exit sends
    its daemon children before waiting for them: a pool left open is killed first."""
    import subprocess
    import sys

    script = ("from fedhet.engine.parallel import Forked\n"
              "t = Forked(workers=1)\nt.host = None\nt._start()\nprint('started', flush=True)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout == "started\n", done.stderr
