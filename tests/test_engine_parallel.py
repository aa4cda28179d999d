"""The client-parallel engine equals the reference engine bit for bit, and fails cleanly."""

import copy

import pytest
import torch

from fedhet.algorithms.local import TrainSettings
from fedhet.data.federated import build_federation
from fedhet.engine import (
    AUTO_PARALLEL_MIN_ROUND_SAMPLES,
    ParallelSimulator,
    Simulator,
    choose_engine,
    make_engine,
)
from fedhet.engine.parallel import WorkerError, dumps, loads, shared_tensors
from fedhet.errors import ConfigError, NumericalError
from fedhet.experiment.config import load_config
from fedhet.experiment.runner import (
    Experiment,
    build_models,
    make_algorithm,
    read_metrics,
)
from fedhet.metrics.evaluate import evaluate


def config(small_config, algorithm="fedavg", params=None, **train):
    raw = copy.deepcopy(small_config)
    raw["algorithm"] = {"name": algorithm, "params": dict(params or {})}
    raw["train"].update(train)
    return load_config(raw=raw)


def build(cfg, workers=None, fed=None):
    fed = fed or build_federation(cfg.data, cfg.seed)
    models, client_arch = build_models(cfg, fed)
    t = cfg.train
    settings = TrainSettings(epochs=t.local_epochs, batch_size=t.batch_size, lr=t.lr, momentum=t.momentum,
                             weight_decay=t.weight_decay, drop_last=t.drop_last, clip_grad_norm=t.clip_grad_norm)
    args = (make_algorithm(cfg), fed, models, client_arch, settings, t.clients_per_round, cfg.seed)
    return ParallelSimulator(*args, workers=workers) if workers else Simulator(*args)


def assert_identical(a, b, where="state"):
    """Exact equality of nested states: tensors bit for bit (dtype and shape too)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            assert_identical(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


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
        with pytest.raises(NumericalError, match=r"non-finite .* round 0, client \d+, algorithm fedavg") as info:
            sim.run_round(0)
        assert "in the worker process" in str(info.value.__cause__)
        assert sim._pool is None                        # shut down, nothing left running
        sim.settings = TrainSettings(**{**sim.settings.__dict__, "lr": 0.05})   # a fresh pool forks this
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
    assert type(ref.sim) is Simulator                   # auto: a test-sized run stays on the reference engine
    ref.run(progress=False)

    raw["run"].update(engine="parallel", workers=2)
    exp = Experiment.create(load_config(raw=copy.deepcopy(raw)), tmp_path / "cut")
    real = exp.sim.run_round

    def interrupted(rnd, *args):                        # checkpoint after round 2, killed in round 3
        if rnd == 2:
            raise KeyboardInterrupt
        return real(rnd, *args)

    monkeypatch.setattr(exp.sim, "run_round", interrupted)
    with pytest.raises(KeyboardInterrupt):
        exp.run(progress=False)
    resumed = Experiment.resume(exp.run_dir)
    assert isinstance(resumed.sim, ParallelSimulator) and resumed.start_round == 2
    resumed.run(progress=False)
    drop = lambda rows: [{k: v for k, v in r.items() if k != "seconds"} for r in rows]  # noqa: E731
    assert drop(read_metrics(resumed.run_dir)) == drop(read_metrics(ref.run_dir))
    assert_identical(ref.sim.server_state, resumed.sim.server_state)
    assert_identical(ref.sim.client_states, resumed.sim.client_states)
    assert resumed.summary["engine"] == {"engine": "parallel", "workers": 2, "reason": "requested"}
    assert resumed.sim._pool is None                    # the runner stops the workers at the end


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
    assert choose_engine("parallel", "auto", "cpu", clients_per_round=10, round_samples=small, cpus=2).workers == 2
    with pytest.raises(ConfigError, match="run.workers"):
        choose_engine("reference", 2)
    with pytest.raises(ConfigError, match="cannot run on"):
        choose_engine("parallel", 2, "cuda")


def test_make_engine_builds_the_chosen_engine(small_config):
    cfg = config(small_config)
    fed = build_federation(cfg.data, cfg.seed)
    models, arch = build_models(cfg, fed)
    settings = TrainSettings(epochs=1, batch_size=32, lr=0.05)
    args = (make_algorithm(cfg), fed, models, arch, settings, 3, cfg.seed)
    sim = make_engine(*args, engine="parallel", workers=2)
    assert isinstance(sim, ParallelSimulator) and sim.workers == 2 and sim._pool is None   # forks lazily
    assert type(make_engine(*args)) is Simulator        # auto, test-sized: reference
