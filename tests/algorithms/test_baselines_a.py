"""FedProx, FedAvgM, SCAFFOLD and FedDyn: hand-computed terms, client and server rules, short runs."""

import copy
import math
import re

import numpy as np
import pydantic
import pytest
import torch
from helpers import train_call_view
from torch import nn

from fedhet.algorithms import algorithm_class, compose, register
from fedhet.algorithms.fedavg import FedAvg
from fedhet.algorithms.fedavgm import FedAvgM
from fedhet.algorithms.feddyn import FedDyn
from fedhet.algorithms.fedprox import FedProx
from fedhet.algorithms.scaffold import Scaffold
from fedhet.core.contract import (
    ClientData,
    Forward,
    Message,
    RoundContext,
    TrainSettings,
)
from fedhet.core.errors import ConfigError
from fedhet.core.seeding import torch_generator
from fedhet.experiment.config import load_config
from fedhet.experiment.runner import Experiment, read_metrics
from fedhet.training.local import forward, train_local
from fedhet.training.objective import CrossEntropy, LossTerm
from fedhet.training.steps import normalizing_factor as effective_steps
from fedhet.training.terms import Linear, Proximal

for _cls in (FedProx, FedAvgM, Scaffold, FedDyn):
    register(_cls)


# --- tiny fixtures ------------------------------------------------------------------------
class TinyNet(nn.Module):
    """A linear classifier with the (features, logits) interface of fedhet's models."""

    def __init__(self, d_in=3, classes=2):
        super().__init__()
        self.fc = nn.Linear(d_in, classes)

    def forward(self, x, with_features=False):
        h = x.flatten(1)
        logits = self.fc(h)
        return (h, logits) if with_features else logits


class ScalarNet(nn.Module):
    """One parameter ``w``; the data loss is supplied as a :class:`Quadratic` term."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))

    def forward(self, x, with_features=False):
        h = torch.zeros(len(x), 1)
        logits = torch.zeros(len(x), 2)
        return (h, logits) if with_features else logits


class Quadratic(LossTerm):
    """f(w) = 0.5 * a * (w - b)^2, the same on every batch."""

    name = "quad"

    def __init__(self, a, b):
        self.a, self.b = a, b

    def __call__(self, out, batch, weights):
        return 0.5 * self.a * ((weights["w"] - self.b) ** 2).sum()


def tiny_data(n=10, d_in=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (n, d_in, 1, 1), dtype=torch.uint8, generator=g)
    y = torch.randint(0, 2, (n,), generator=g)
    return ClientData(x, y, torch.arange(n), torch.full((1, 1, 1, 1), 0.5), torch.full((1, 1, 1, 1), 0.25))


class Runtime:
    """A ClientRuntime running real ``train_local``; ``data_loss`` replaces the cross-entropy term."""

    def __init__(self, model, data, settings, data_loss=None, cid=0):
        self.cid, self.round, self.arch, self.num_classes = cid, 0, "tiny", 2
        self.model, self.data, self.settings, self.data_loss = model, data, settings, data_loss
        self.buffer_names = [n for n, _ in model.named_buffers()]
        self.num_samples = len(data.train_idx)

    def train(self, weights, terms=None, *, epochs=None, data=None, settings=None, stream="batches",
              carry_optimizer_state=True, **kw):
        # ClientRuntime.train's options; no optimizer state is carried across rounds here
        terms = list(terms or [CrossEntropy()])
        if self.data_loss is not None:
            terms = [self.data_loss if isinstance(t, CrossEntropy) else t for t in terms]
        data, s = train_call_view(self, epochs, data, settings)
        return train_local(self.model, weights, data, terms, s,
                           lambda e: torch_generator(0, "b" if stream == "batches" else stream, self.cid, e), **kw)

    def generator(self, *purpose):
        return torch_generator(0, *purpose)


def ctx(clients, num_clients=4, sizes=None):
    return RoundContext(round=0, clients=clients, num_clients=num_clients, num_classes=2,
                        client_sizes=sizes or {c: 1 for c in range(num_clients)}, rng=np.random.default_rng(0))


def drive(algo, state, context, replies):
    """Run one server round with hand-made replies; returns (phase sent, new state)."""
    gen = algo.round(state, context)
    phase = next(gen)
    with pytest.raises(StopIteration) as stop:
        gen.send(replies)
    return phase, stop.value.value


def reply(model, n=1, **groups):
    return Message("update", {"model": model, **groups}, {"num_samples": n})


def weights_of(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# --- end-to-end helpers -------------------------------------------------------------------
def e2e_config(small_config, name, params=None, rounds=3):
    cfg = copy.deepcopy(small_config)
    cfg["algorithm"] = {"name": name, "params": params or {}}
    cfg["data"]["num_clients"] = 12                       # ~100 samples per client keeps runs short
    cfg["train"]["rounds"] = rounds
    cfg["eval"] = {"every": rounds, "final_window": 1, "personalized": False}
    return cfg


def run(cfg, out):
    exp = Experiment.create(load_config(raw=cfg), out)
    exp.run(progress=False)
    return exp


def assert_learns(exp):
    rows = read_metrics(exp.run_dir)
    assert len(rows) == 3
    assert rows[-1]["train_loss"] < rows[0]["train_loss"]
    # 10 balanced classes: chance is 0.1; three rounds on the learnable synthetic data reach well above
    assert math.isfinite(rows[-1]["global_acc"]) and rows[-1]["global_acc"] > 0.3, rows[-1]["global_acc"]
    return rows


# --- FedProx ------------------------------------------------------------------------------
def test_proximal_value_and_gradient_hand_computed():
    anchor = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([0.0])}
    w = {"w": torch.tensor([2.0, 4.0], requires_grad=True), "b": torch.tensor([3.0], requires_grad=True)}
    term = Proximal(anchor, mu=0.5, names=["w"])           # only "w" is pulled
    out = Forward(torch.zeros(1, 1), torch.zeros(1, 2))
    value = term(out, None, w)
    assert value.item() == pytest.approx(0.25 * (1 + 4))
    value.backward()
    assert torch.equal(w["w"].grad, torch.tensor([0.5, 1.0]))   # mu * (w - anchor)
    assert w["b"].grad is None


def test_fedprox_gradient_is_ce_gradient_plus_mu_times_distance():
    torch.manual_seed(0)
    model, data = TinyNet(), tiny_data()
    global_w = weights_of(model)
    w = {k: (v + 0.3 * torch.randn_like(v)).requires_grad_(True) for k, v in global_w.items()}
    batch = data.batch(torch.arange(10))
    mu = 0.7
    prox = FedProx(FedProx.Params(mu=mu)).local_terms(Message("train", {"model": global_w}), None,
                                                       Runtime(model, data, None))
    assert [type(t) for t in prox] == [Proximal] and prox[0].mu == mu
    out = forward(model, w, batch.x)
    loss = CrossEntropy()(out, batch, w) + prox[0](out, batch, w)
    total = torch.autograd.grad(loss, list(w.values()))
    out = forward(model, w, batch.x)
    ce = torch.autograd.grad(CrossEntropy()(out, batch, w), list(w.values()))
    for (k, wk), gt, gc in zip(w.items(), total, ce):
        torch.testing.assert_close(gt, gc + mu * (wk.detach() - global_w[k]), rtol=1e-6, atol=1e-7)


def test_fedprox_with_mu_zero_is_bitwise_fedavg(small_config, tmp_path):
    a = run(e2e_config(small_config, "fedavg", rounds=2), tmp_path / "avg")
    b = run(e2e_config(small_config, "fedprox", {"mu": 0.0}, rounds=2), tmp_path / "prox")
    for k, v in a.loop.server_state["model"].items():
        assert torch.equal(v, b.loop.server_state["model"][k]), k


def test_params_are_validated():
    with pytest.raises(pydantic.ValidationError, match="mu"):
        FedProx.Params(mu=-1)
    with pytest.raises(pydantic.ValidationError, match="server_lr"):
        FedAvgM.Params(server_lr=0)
    with pytest.raises(pydantic.ValidationError, match="option"):
        Scaffold.Params(option="III")
    with pytest.raises(pydantic.ValidationError, match="alpha"):
        FedDyn.Params(alpha=0)
    with pytest.raises(pydantic.ValidationError, match="mu"):
        FedDyn.Params(mu=1)           # extra keys are rejected


# --- FedAvgM ------------------------------------------------------------------------------
def test_fedavgm_two_rounds_hand_computed():
    algo = FedAvgM(FedAvgM.Params(server_momentum=0.5, server_lr=0.5))
    state = algo.init_server_state({"cnn": {"w": torch.tensor([0.0]), "bn.running_var": torch.tensor([1.0]),
                                            "bn.num_batches_tracked": torch.tensor(0)}})
    assert set(state["velocity"]) == {"w"}
    # round 1: avg = (1*1 + 3*3)/4 = 2.5; d = 0 - 2.5; v = -2.5; w = 0 - 0.5*(-2.5) = 1.25
    _, state = drive(algo, state, ctx([0, 1]), {
        0: reply({"w": torch.tensor([1.0]), "bn.running_var": torch.tensor([2.0]), "bn.num_batches_tracked": torch.tensor(4)}, 1),
        1: reply({"w": torch.tensor([3.0]), "bn.running_var": torch.tensor([6.0]), "bn.num_batches_tracked": torch.tensor(8)}, 3)})
    assert state["model"]["w"].item() == pytest.approx(1.25)
    assert state["velocity"]["w"].item() == pytest.approx(-2.5)
    assert state["model"]["bn.running_var"].item() == pytest.approx(5.0)    # statistics: plain average
    assert state["model"]["bn.num_batches_tracked"].item() == 7
    # round 2: avg = 4; d = 1.25 - 4 = -2.75; v = 0.5*(-2.5) - 2.75 = -4; w = 1.25 + 0.5*4 = 3.25
    _, state = drive(algo, state, ctx([2, 3]), {
        2: reply({"w": torch.tensor([4.0]), "bn.running_var": torch.tensor([1.0]), "bn.num_batches_tracked": torch.tensor(9)}),
        3: reply({"w": torch.tensor([4.0]), "bn.running_var": torch.tensor([1.0]), "bn.num_batches_tracked": torch.tensor(9)})})
    assert state["velocity"]["w"].item() == pytest.approx(-4.0)
    assert state["model"]["w"].item() == pytest.approx(3.25)


def test_fedavgm_without_momentum_is_fedavg():
    torch.manual_seed(1)
    init = {"w": torch.randn(4, 3), "b": torch.randn(3)}
    replies = {c: reply({k: torch.randn_like(v) for k, v in init.items()}, n) for c, n in ((0, 5), (2, 7), (3, 1))}
    _, avg = drive(FedAvg(), FedAvg().init_server_state({"m": init}), ctx([0, 2, 3]), replies)
    m = FedAvgM(FedAvgM.Params(server_momentum=0.0, server_lr=1.0))
    _, new = drive(m, m.init_server_state({"m": init}), ctx([0, 2, 3]), replies)
    for k in init:
        torch.testing.assert_close(new["model"][k], avg["model"][k], rtol=0, atol=1e-6)


class _WithBuffer(nn.Module):
    """body: a Linear and a floating-point buffer ``scale`` (persistent or not); head: a Linear,
    optionally with a buffer of its own; BatchNorm beside them."""

    def __init__(self, persistent: bool, where: str = "body"):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
        self.head = nn.Linear(2, 2)
        getattr(self, where).register_buffer("scale", torch.ones(2), persistent=persistent)


@pytest.mark.parametrize(("algorithm", "rule"), [
    (FedAvgM(), "its server momentum"), (Scaffold(), "its control variates"), (FedDyn(), "its state h"),
])
def test_a_method_with_a_server_rule_over_the_weights_refuses_a_buffer_it_would_take_for_one(algorithm, rule):
    """The server tells buffers from weights by BatchNorm's names: a model with another persistent
    floating-point buffer is refused with the fix (a non-persistent buffer, not sent at all); BatchNorm's
    statistics and a non-persistent buffer pass."""
    with pytest.raises(ConfigError, match=rf"{algorithm.name} with model mine: .*'body\.scale', which {rule}.*"
                                          r"persistent=False"):
        algorithm.check_model("mine", _WithBuffer(persistent=True))
    algorithm.check_model("mine", _WithBuffer(persistent=False))
    FedAvg().check_model("mine", _WithBuffer(persistent=True))      # FedAvg averages a buffer as it is


def test_fedbabu_refuses_only_a_buffer_in_the_head_it_freezes():
    from fedhet.algorithms.fedbabu import FedBABU
    FedBABU().check_model("mine", _WithBuffer(persistent=True, where="body"))
    with pytest.raises(ConfigError, match=r"fedbabu with model mine: .*'head\.scale', which its head freezing"):
        FedBABU().check_model("mine", _WithBuffer(persistent=True, where="head"))


# --- SCAFFOLD -----------------------------------------------------------------------------
def test_linear_term_sgd_step_is_corrected_gradient_step():
    torch.manual_seed(2)
    model, data = TinyNet(), tiny_data()
    w0 = weights_of(model)
    c = {k: torch.randn_like(v) for k, v in w0.items()}
    ci = {k: torch.randn_like(v) for k, v in w0.items()}
    lr = 0.1
    settings = TrainSettings(epochs=1, batch_size=10, lr=lr)      # one step on the whole split
    result = train_local(model, w0, data, [CrossEntropy(), Linear({k: c[k] - ci[k] for k in c})], settings,
                         lambda e: torch_generator(0, e))
    assert result.steps == 1
    w = {k: v.clone().requires_grad_(True) for k, v in w0.items()}
    batch = data.batch(torch.arange(10))
    g = torch.autograd.grad(CrossEntropy()(forward(model, w, batch.x), batch, w), list(w.values()))
    for (k, v), gk in zip(w0.items(), g):
        torch.testing.assert_close(result.weights[k], v - lr * (gk + c[k] - ci[k]), rtol=1e-6, atol=1e-7)


def scalar_runtime(a, b, settings, n=4):
    data = ClientData(torch.zeros(n, 1, 1, 1, dtype=torch.uint8), torch.zeros(n, dtype=torch.long), torch.arange(n),
                      torch.zeros(1, 1, 1, 1), torch.ones(1, 1, 1, 1))
    return Runtime(ScalarNet(), data, settings, data_loss=Quadratic(a, b))


def test_scaffold_option_ii_on_a_quadratic_matches_algorithm_1():
    a, b, x, c, ci, eta = 2.0, 3.0, 1.0, 0.4, -0.3, 0.1
    settings = TrainSettings(epochs=2, batch_size=2, lr=eta)       # K = 2 epochs * 2 batches = 4 steps
    algo = Scaffold()
    msg = Message("train", {"model": {"w": torch.tensor([x])}, "control": {"w": torch.tensor([c])}})
    state = {"control": {"w": torch.tensor([ci])}}
    rep, new_state = algo.client_update(msg, state, scalar_runtime(a, b, settings))
    y = x
    for _ in range(4):                          # y <- y - eta * (g(y) + c - c_i)
        y -= eta * (a * (y - b) + c - ci)
    ci_new = ci - c + (x - y) / (4 * eta)
    assert rep.arrays["model"]["w"].item() == pytest.approx(y, abs=1e-6)
    assert new_state["control"]["w"].item() == pytest.approx(ci_new, abs=1e-5)
    assert rep.arrays["control"]["w"].item() == pytest.approx(ci_new - ci, abs=1e-5)
    assert rep.scalars["steps"] == 4
    # a first-time client starts from c_i = 0 and keeps its new c_i in its explicit state only
    rep0, st0 = algo.client_update(msg, None, scalar_runtime(a, b, settings))
    assert torch.equal(rep0.arrays["control"]["w"], st0["control"]["w"])


def test_scaffold_option_ii_with_momentum_recovers_the_true_gradient():
    """With a constant local gradient (a = 0: f_i is flat) the correct c_i+ is grad f_i = 0; the momentum-aware
    step count makes option II exact, where K*eta would give c_i+ = (c - c_i) * (displacement/(K eta) - 1) != 0."""
    c, ci, eta, rho = 0.5, -0.25, 0.1, 0.9
    settings = TrainSettings(epochs=3, batch_size=1, lr=eta, momentum=rho)
    msg = Message("train", {"model": {"w": torch.tensor([0.0])}, "control": {"w": torch.tensor([c])}})
    rep, st = Scaffold().client_update(msg, {"control": {"w": torch.tensor([ci])}},
                                       scalar_runtime(0.0, 0.0, settings, n=2))
    assert rep.scalars["steps"] == 6
    assert effective_steps(6, 0.0) == 6 and effective_steps(6, rho) == pytest.approx(
        sum((1 - rho ** k) / (1 - rho) for k in range(1, 7)))
    assert st["control"]["w"].item() == pytest.approx(0.0, abs=1e-5)


class BodyHeadScalars(nn.Module):
    """Two scalar parameters, ``body.w`` and ``head.w``; the data loss is supplied as a term."""

    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Module(), nn.Module()
        self.body.w, self.head.w = nn.Parameter(torch.zeros(1)), nn.Parameter(torch.zeros(1))

    def forward(self, x, with_features=False):
        h, logits = torch.zeros(len(x), 1), torch.zeros(len(x), 2)
        return (h, logits) if with_features else logits


class Flat(LossTerm):
    """A data loss with zero gradient everywhere: grad f_i = 0, so SCAFFOLD's c_i+ must be 0."""

    name = "flat"

    def __call__(self, out, batch, weights):
        return 0.0 * (weights["body.w"] + weights["head.w"]).sum()


def test_scaffold_option_ii_divides_each_entrys_drift_by_the_steps_of_its_own_phase():
    """scaffold+fedrep: 6 head steps (3 epochs of 2 batches), then 2 body steps. With a flat loss each
    entry drifts lr * K_entry * (c - c_i), so c_i+ = 0 only with each entry's own K (the whole
    training's 8 would give -0.75 for the body and -0.25 for the head)."""
    cls = algorithm_class("scaffold+fedrep")
    algo = cls(cls.Params(rep_head_epochs=3))
    n = 12
    data = ClientData(torch.zeros(n, 1, 1, 1, dtype=torch.uint8), torch.zeros(n, dtype=torch.long), torch.arange(n),
                      torch.zeros(1, 1, 1, 1), torch.ones(1, 1, 1, 1))
    client = Runtime(BodyHeadScalars(), data, TrainSettings(epochs=1, batch_size=6, lr=0.1), data_loss=Flat())
    client.init_weights = lambda: {"body.w": torch.zeros(1), "head.w": torch.zeros(1)}
    one = torch.ones(1)
    msg = Message("train", {"model": {"body.w": torch.zeros(1)}, "control": {"body.w": one, "head.w": one}})
    reply, state = algo.client_update(msg, {"control": {"body.w": 0 * one, "head.w": 0 * one}}, client)
    assert reply.scalars["steps"] == 8
    assert state["head"]["head.w"].item() == pytest.approx(-0.1 * 6)            # the personal head: 6 steps
    assert state["control"]["body.w"].item() == pytest.approx(0.0, abs=1e-6)
    assert state["control"]["head.w"].item() == pytest.approx(0.0, abs=1e-6)
    # without a head phase the head never moves, so its control variate stays what it was (not c_i - c = -1)
    no_head = cls(cls.Params(rep_head_epochs=0))
    _, state = no_head.client_update(msg, {"control": {"body.w": 0 * one, "head.w": 0.5 * one}}, client)
    assert state["control"]["head.w"].item() == 0.5
    assert state["control"]["body.w"].item() == pytest.approx(0.0, abs=1e-6)


def test_scaffold_option_ii_reads_per_fedavgs_own_step_size_and_no_momentum():
    """scaffold+perfedavg: the meta-steps are plain SGD at perfedavg_beta whatever the run's lr and
    momentum. With a flat loss (ScalarNet's logits do not depend on w) c_i+ = grad f_i = 0 only when
    option II divides by beta and K steps (the run's lr and momentum gave 0.44 of the right norm)."""
    cls = algorithm_class("scaffold+perfedavg")
    algo = cls(cls.Params(perfedavg_beta=0.05))
    c, ci = 0.5, -0.25
    settings = TrainSettings(epochs=1, batch_size=1, lr=0.1, momentum=0.9)
    msg = Message("train", {"model": {"w": torch.tensor([0.0])}, "control": {"w": torch.tensor([c])}})
    client = scalar_runtime(0.0, 0.0, settings)
    client.account = lambda result: None                                # Per-FedAvg counts its own steps
    rep, st = algo.client_update(msg, {"control": {"w": torch.tensor([ci])}}, client)
    steps = rep.scalars["steps"]
    assert steps == 2                                                   # 4 samples, 2 batches a meta-step
    assert rep.arrays["model"]["w"].item() == pytest.approx(-0.05 * steps * (c - ci))
    assert st["control"]["w"].item() == pytest.approx(0.0, abs=1e-6)


def test_fednova_a_i_counts_per_fedavgs_meta_steps_as_plain_steps(small_config):
    """fednova+perfedavg with the run's momentum 0.9: a_i is the number of meta-steps (plain SGD),
    not the momentum-enlarged count."""
    from helpers import build_loop, config, runtime
    loop = build_loop(config(copy.deepcopy(small_config), "fednova+perfedavg", {"perfedavg_beta": 0.05}, momentum=0.9))
    msg = loop.algorithm.train_message(loop.server_state, 0, ctx([0]))
    rep, _ = loop.algorithm.client_update(msg, None, runtime(loop, 0))
    assert rep.scalars["steps"] > 1 and rep.scalars["a_i"] == pytest.approx(rep.scalars["steps"])


def test_scaffold_option_i_is_the_full_gradient_at_the_global_model():
    torch.manual_seed(3)
    model, data = TinyNet(), tiny_data(n=10)
    x = weights_of(model)
    algo = Scaffold(Scaffold.Params(option="I"))
    c = {k: torch.randn_like(v) for k, v in x.items()}
    msg = Message("train", {"model": x, "control": c})
    rep, st = algo.client_update(msg, None, Runtime(model, data, TrainSettings(epochs=1, batch_size=4, lr=0.1)))
    w = {k: v.clone().requires_grad_(True) for k, v in x.items()}
    batch = data.batch(torch.arange(10))
    g = torch.autograd.grad(CrossEntropy()(forward(model, w, batch.x), batch, w), list(w.values()))
    for k, gk in zip(w, g):
        torch.testing.assert_close(st["control"][k], gk, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(rep.arrays["control"][k], gk, rtol=1e-5, atol=1e-6)   # c_i was 0


def test_scaffold_option_i_takes_the_gradient_of_the_data_term_local_training_minimises():
    """In a composition whose other method replaces the cross-entropy (FedRS's restricted softmax,
    here twice the cross-entropy), c_i is the gradient of that term, as local training minimises it."""
    class TwiceCE(LossTerm):
        def __call__(self, out, batch, weights):
            return 2 * CrossEntropy()(out, batch, weights)

    class Twice(FedAvg):
        name = "twice"

        def data_terms(self, msg, state, client):
            return [TwiceCE()]

    torch.manual_seed(3)
    model, data = TinyNet(), tiny_data(n=10)
    x = weights_of(model)
    combined = compose([Scaffold, Twice])
    algo = combined(combined.Params(option="I"))
    msg = Message("train", {"model": x, "control": {k: torch.zeros_like(v) for k, v in x.items()}})
    _, st = algo.client_update(msg, None, Runtime(model, data, TrainSettings(epochs=1, batch_size=4, lr=0.1)))
    w = {k: v.clone().requires_grad_(True) for k, v in x.items()}
    batch = data.batch(torch.arange(10))
    g = torch.autograd.grad(CrossEntropy()(forward(model, w, batch.x), batch, w), list(w.values()))
    for k, gk in zip(w, g):
        torch.testing.assert_close(st["control"][k], 2 * gk, rtol=1e-5, atol=1e-6)


def test_scaffold_server_rule_uses_sampled_fraction_of_all_clients():
    algo = Scaffold(Scaffold.Params(server_lr=0.5))
    state = algo.init_server_state({"m": {"w": torch.tensor([2.0]), "bn.running_mean": torch.tensor([1.0])}})
    assert set(state["control"]) == {"w"}            # no control variate for BatchNorm statistics
    phase, new = drive(algo, state, ctx([1, 3], num_clients=4), {
        1: reply({"w": torch.tensor([4.0]), "bn.running_mean": torch.tensor([3.0])}, 1, control={"w": torch.tensor([1.0])}),
        3: reply({"w": torch.tensor([8.0]), "bn.running_mean": torch.tensor([7.0])}, 3, control={"w": torch.tensor([3.0])})})
    assert all(set(m.arrays) == {"model", "control"} for m in phase.values())
    assert phase[1].arrays["control"]["w"].item() == 0.0
    # avg = (4 + 24)/4 = 7; x = 2 + 0.5 * (7 - 2) = 4.5; c = 0 + (2/4) * mean(1, 3) = 1
    assert new["model"]["w"].item() == pytest.approx(4.5)
    assert new["model"]["bn.running_mean"].item() == pytest.approx(6.0)
    assert new["control"]["w"].item() == pytest.approx(1.0)
    # server_lr = 1 is exactly FedAvg's aggregate
    one = Scaffold()
    _, new1 = drive(one, one.init_server_state({"m": {"w": torch.tensor([2.0])}}), ctx([1, 3]), {
        1: reply({"w": torch.tensor([4.0])}, 1, control={"w": torch.tensor([1.0])}),
        3: reply({"w": torch.tensor([8.0])}, 3, control={"w": torch.tensor([3.0])})})
    assert torch.equal(new1["model"]["w"], torch.tensor([7.0]))


def test_scaffold_end_to_end_sends_control_both_ways(small_config, tmp_path):
    exp = run(e2e_config(small_config, "scaffold"), tmp_path / "scaffold")
    rows = assert_learns(exp)
    n = sum(v.numel() for v in exp.loop.server_state["model"].values())
    for row in rows:
        for d in ("down", "up"):
            assert row["comm"][f"{d}/control"]["floats"] == row["comm"][f"{d}/model"]["floats"] == 3 * n
    trained = {c for r in rows for c in r["clients"]}
    assert set(exp.loop.client_states) == trained
    assert all(set(s) == {"control"} for s in exp.loop.client_states.values())
    assert rows[-1]["scaffold_control_norm"] > 0


# --- FedDyn -------------------------------------------------------------------------------
def test_feddyn_terms_value_and_gradient_hand_computed():
    algo = FedDyn(FedDyn.Params(alpha=0.2))
    rt = Runtime(ScalarNet(), tiny_data(), None)
    msg = Message("train", {"model": {"w": torch.tensor([0.0])}})
    terms = algo.local_terms(msg, {"dyn_grad": {"w": torch.tensor([0.5])}}, rt)
    w = {"w": torch.tensor([1.0], requires_grad=True)}
    out = Forward(torch.zeros(1, 1), torch.zeros(1, 2))
    values = [t(out, None, w) for t in terms]
    # -<0.5, 1> = -0.5 ; 0.2/2 * (1 - 0)^2 = 0.1
    assert [t.name for t in terms] == ["dyn_linear", "dyn_prox"]
    assert values[0].item() == pytest.approx(-0.5) and values[1].item() == pytest.approx(0.1)
    (g,) = torch.autograd.grad(sum(values), [w["w"]])
    assert g.item() == pytest.approx(-0.5 + 0.2 * 1.0)        # -grad_i + alpha * (w - w_global)


class PlusOne:
    """A ClientRuntime whose training adds 1 to every weight."""

    cid, round, arch, num_classes, num_samples, buffer_names = 0, 0, "s", 2, 5, []
    model = ScalarNet()

    def train(self, weights, terms=None, **kw):
        from fedhet.core.contract import LocalResult
        return LocalResult({k: v + 1 for k, v in weights.items()}, {}, 1, 5, 0.0)


def test_feddyn_client_gradient_state_update():
    algo = FedDyn(FedDyn.Params(alpha=0.3))
    msg = Message("train", {"model": {"w": torch.tensor([2.0])}})
    rep, st = algo.client_update(msg, None, PlusOne())
    assert rep.arrays["model"]["w"].item() == 3.0 and set(rep.arrays) == {"model"}
    assert st["dyn_grad"]["w"].item() == pytest.approx(-0.3)          # 0 - 0.3 * (3 - 2)
    _, st = algo.client_update(msg, st, PlusOne())
    assert st["dyn_grad"]["w"].item() == pytest.approx(-0.6)


def test_feddyn_server_h_and_model_two_rounds():
    algo = FedDyn(FedDyn.Params(alpha=0.5))
    state = algo.init_server_state({"m": {"w": torch.tensor([1.0]), "bn.running_mean": torch.tensor([0.0])}})
    assert set(state["h"]) == {"w"}
    # uniform avg = 4 (sample counts ignored); h = 0 - 0.5/4 * ((3-1) + (5-1)) = -0.75; theta = 4 + 0.75/0.5 = 5.5
    _, state = drive(algo, state, ctx([0, 1]), {
        0: reply({"w": torch.tensor([3.0]), "bn.running_mean": torch.tensor([2.0])}, 1),
        1: reply({"w": torch.tensor([5.0]), "bn.running_mean": torch.tensor([4.0])}, 100)})
    assert state["h"]["w"].item() == pytest.approx(-0.75)
    assert state["model"]["w"].item() == pytest.approx(5.5)
    assert state["model"]["bn.running_mean"].item() == pytest.approx(3.0)
    # avg = 6.5; h = -0.75 - 0.125 * ((5.5-5.5) + (7.5-5.5)) = -1.0; theta = 6.5 + 2 = 8.5
    _, state = drive(algo, state, ctx([2, 3]), {
        2: reply({"w": torch.tensor([5.5]), "bn.running_mean": torch.tensor([0.0])}),
        3: reply({"w": torch.tensor([7.5]), "bn.running_mean": torch.tensor([0.0])})})
    assert state["h"]["w"].item() == pytest.approx(-1.0)
    assert state["model"]["w"].item() == pytest.approx(8.5)
    assert algo.global_model(state) is state["model"]


def test_feddyn_corrects_only_the_entries_the_clients_upload():
    """feddyn+fedper: the clients upload the body only; its h and model follow FedDyn's rule, and the
    head (never uploaded) keeps h = 0 and the server's value."""
    cls = algorithm_class("feddyn+fedper")
    algo = cls(cls.Params(alpha=0.5))
    state = algo.init_server_state({"m": {"body.w": torch.tensor([1.0]), "head.w": torch.tensor([7.0])}})
    assert set(state["h"]) == {"body.w", "head.w"}
    # as in the two-round case above: avg 4, h = -0.75, theta = 5.5
    _, state = drive(algo, state, ctx([0, 1]), {0: reply({"body.w": torch.tensor([3.0])}, 1),
                                                1: reply({"body.w": torch.tensor([5.0])}, 100)})
    assert state["h"]["body.w"].item() == pytest.approx(-0.75)
    assert state["model"]["body.w"].item() == pytest.approx(5.5)
    assert state["h"]["head.w"].item() == 0.0 and state["model"]["head.w"].item() == 7.0


def test_server_rules_over_the_model_leave_the_entries_no_client_uploads():
    """fedbabu+fedavgm and fedbabu+fednova: FedBABU's clients upload the body only. FedAvgM's momentum
    and FedNova's normalised step act on it; the head keeps its value and FedAvgM's velocity (they
    stopped with a KeyError on the head)."""
    t = torch.tensor
    for name, params, replies, body in [
        # avg 4; v = 0.5 * 0 + (1 - 4) = -3; w = 1 - (-3) = 4
        ("fedbabu+fedavgm", {"server_momentum": 0.5},
         {0: reply({"body.w": t([3.0])}), 1: reply({"body.w": t([5.0])})}, 4.0),
        # p = 1/2 each; tau_eff = (1 + 3)/2 = 2; d = 0.5/1 * (1 - 3) + 0.5/3 * (1 - 5) = -5/3; w = 1 + 2 * 5/3
        ("fedbabu+fednova", {},
         {0: Message("update", {"model": {"body.w": t([3.0])}}, {"num_samples": 1, "a_i": 1.0}),
          1: Message("update", {"model": {"body.w": t([5.0])}}, {"num_samples": 1, "a_i": 3.0})}, 1 + 10 / 3)]:
        cls = algorithm_class(name)
        algo = cls(cls.Params(**params))
        state = algo.init_server_state({"m": {"body.w": t([1.0]), "head.w": t([7.0])}})
        _, state = drive(algo, state, ctx([0, 1]), replies)
        assert state["model"]["body.w"].item() == pytest.approx(body), name
        assert state["model"]["head.w"].item() == 7.0, name
        if "velocity" in state:
            assert state["velocity"]["head.w"].item() == 0.0 and state["velocity"]["body.w"].item() == -3.0


# --- every method end to end, and composition ---------------------------------------------
@pytest.mark.parametrize("name,params", [("fedprox", {"mu": 0.01}), ("fedavgm", {}), ("feddyn", {"alpha": 0.01})])
def test_method_learns_end_to_end(small_config, tmp_path, name, params):
    exp = run(e2e_config(small_config, name, params), tmp_path / name)
    assert_learns(exp)
    if name == "feddyn":
        assert all(set(s) == {"dyn_grad"} for s in exp.loop.client_states.values())


def test_fedprox_plus_scaffold_composes_both_terms():
    cls = algorithm_class("fedprox+scaffold")
    algo = cls(cls.Params(mu=0.2, option="I"))
    assert algo.params.mu == 0.2 and algo.params.option == "I"
    model = TinyNet()
    x = weights_of(model)
    msg = algo.train_message(algo.init_server_state({"t": x}), 0, ctx([0]))
    assert set(msg.arrays) == {"model", "control"}
    terms = algo.local_terms(msg, None, Runtime(model, tiny_data(), None))
    kinds = {type(t) for t in terms}
    assert kinds == {Proximal, Linear}
    assert next(t for t in terms if isinstance(t, Proximal)).mu == 0.2


def test_feddyn_server_rule_chains_in_a_composition():
    """feddyn+scaffold: SCAFFOLD's control variate is updated (FedDyn's aggregate calls the rest
    of the composition) and FedDyn's h correction applies to the uniform mean."""
    cls = algorithm_class("feddyn+scaffold")
    algo = cls(cls.Params(alpha=0.5))
    state = algo.init_server_state({"m": {"w": torch.tensor([1.0])}})
    _, state = drive(algo, state, ctx([0, 1]), {
        0: reply({"w": torch.tensor([3.0])}, 1, control={"w": torch.tensor([2.0])}),
        1: reply({"w": torch.tensor([5.0])}, 100, control={"w": torch.tensor([6.0])})})
    # as test_feddyn_server_h_and_model_two_rounds: uniform mean 4, h = -0.75, theta = 5.5;
    # SCAFFOLD: c = 0 + (2 + 6) / 4 = 2
    assert state["h"]["w"].item() == pytest.approx(-0.75)
    assert state["model"]["w"].item() == pytest.approx(5.5)
    assert state["control"]["w"].item() == pytest.approx(2.0)
    # two parts that each set the aggregation weights cannot be combined silently
    for name in ("feddyn+fedacd", "fedacd+feddyn"):
        with pytest.raises(ConfigError, match="each define the aggregation weights"):
            algorithm_class(name)


# --- FedAvg.client_model and server_trainable (mutation-testing survivors) -----------------
from fedhet.algorithms.aggregate import server_trainable  # noqa: E402


def test_fedavg_client_model_local_bn_evaluates_the_global_weights_with_the_clients_statistics():
    algo = FedAvg(FedAvg.Params(bn_buffers="local"))
    server = {"model": {"w": torch.tensor([0.5]), "bn.running_mean": torch.tensor([7.0])}}
    own = {"buffers": {"bn.running_mean": torch.tensor([102.0])}}
    view = algo.client_model(4, server, own)
    assert set(view) == {"w", "bn.running_mean"}
    assert torch.equal(view["w"], torch.tensor([0.5]))                     # global weight
    assert torch.equal(view["bn.running_mean"], torch.tensor([102.0]))     # the client's own statistics
    assert torch.equal(server["model"]["bn.running_mean"], torch.tensor([7.0]))   # server state untouched
    # a client that has never trained (no state, or a state without buffers) sees the global model
    assert algo.client_model(1, server, None) is server["model"]
    assert algo.client_model(1, server, {}) is server["model"]
    assert algo.client_model(1, server, {"other": 1}) is server["model"]


def test_fedavg_client_model_average_bn_ignores_client_statistics():
    algo = FedAvg()                                  # bn_buffers="average"
    server = {"model": {"w": torch.tensor([0.5]), "bn.running_mean": torch.tensor([7.0])}}
    stale = {"buffers": {"bn.running_mean": torch.tensor([102.0])}}
    assert algo.client_model(0, server, stale) is server["model"]
    assert algo.client_model(0, server, None) is server["model"]


def test_server_trainable_drops_batchnorm_statistics_at_any_depth_and_integer_tensors():
    f = torch.zeros(2)
    weights = {
        "conv.weight": f,
        "bn.running_mean": f,                              # statistics of a top-level BatchNorm
        "body.layer1.0.bn1.weight": f,                     # BN affine parameters are trainable
        "body.layer1.0.bn1.bias": f,
        "body.layer1.0.bn1.running_mean": f,               # statistics nested three modules deep
        "body.layer1.0.bn1.running_var": f,
        "body.layer1.0.bn1.num_batches_tracked": torch.tensor(3.0),
        "head.bn.num_batches_tracked": torch.tensor(3),    # integer counter
        "steps": torch.tensor([1, 2]),                     # any integer tensor
        "head.fc.bias": f,
    }
    assert server_trainable(weights) == ["conv.weight", "body.layer1.0.bn1.weight", "body.layer1.0.bn1.bias",
                                         "head.fc.bias"]


def test_weighted_average_normalises_the_weights_in_double_and_refuses_no_models():
    """FedAvg's weighted mean: equal weights of three float64 models of ones give exactly one (1/3
    in double sums back to 1; in float32 the coefficient 0.33333334 would give 1 + 3e-8), and an
    empty list is refused with a message that says what is missing."""
    from fedhet.algorithms.aggregate import weighted_average

    ones = [{"w": torch.ones(4, dtype=torch.float64)} for _ in range(3)]
    assert torch.equal(weighted_average(ones, [1, 1, 1])["w"], torch.ones(4, dtype=torch.float64))
    with pytest.raises(ValueError) as err:
        weighted_average([], [])
    assert str(err.value) == "weighted_average needs at least one model"


def test_weighted_average_refuses_negative_or_zero_weights_and_averages_only_the_keys_asked():
    from fedhet.algorithms.aggregate import weighted_average

    models = [{"a": torch.tensor([1.0]), "b": torch.tensor([5.0])}, {"a": torch.tensor([3.0]), "b": torch.tensor([7.0])}]
    for bad in ([-1, 2], [0, 0]):                       # a negative weight (sum still positive); a zero sum
        with pytest.raises(ValueError) as err:
            weighted_average(models, bad)
        assert str(err.value) == f"aggregation weights must be non-negative with a positive sum, got {bad}"
    assert weighted_average(models, [1, 3], keys=["a"]) == {"a": torch.tensor([2.5])}


def test_weighted_average_of_float32_models_is_the_float32_weighted_sum_bit_for_bit():
    """The documented contract (aggregate.py): the same products and sum as (stacked * w).sum(0) with
    the normalised weights in the tensors' dtype, so runs reproduce earlier runs' bits."""
    from fedhet.algorithms.aggregate import weighted_average

    g = torch.Generator().manual_seed(0)
    models = [{"w": torch.randn(1000, generator=g)} for _ in range(3)]
    weights = torch.tensor([1.0, 2.0, 4.0], dtype=torch.float64)
    coef = (weights / weights.sum()).to(torch.float32).view(-1, 1)
    want = (torch.stack([m["w"] for m in models]) * coef).sum(0)
    assert torch.equal(weighted_average(models, [1, 2, 4])["w"], want)


def test_weighted_average_of_integer_tensors_rounds_the_weighted_mean_per_entry():
    """Integer tensors (BatchNorm's counters, or any) average in double and round back, entry by entry."""
    from fedhet.algorithms.aggregate import weighted_average

    models = [{"n": torch.tensor([4, 8, 10])}, {"n": torch.tensor([8, 0, 2])}]
    got = weighted_average(models, [1, 3])["n"]            # (1 * a + 3 * b) / 4 = [7, 2, 4]
    assert got.dtype == torch.int64 and torch.equal(got, torch.tensor([7, 2, 4]))


class HookRecorder(FedAvg):
    """FedAvg with each hook recording the arguments it receives (a composed method's view of them)."""

    name = "hook_recorder"

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.seen: dict[str, tuple] = {}

    def train_message(self, state, cid, ctx):
        self.seen.setdefault("train_message", []).append(cid)
        return super().train_message(state, cid, ctx)

    def with_local_buffers(self, weights, state, client):
        self.seen["with_local_buffers"] = (state, client)
        return super().with_local_buffers(weights, state, client)

    def data_terms(self, msg, state, client):
        self.seen["data_terms"] = (msg, state, client)
        return super().data_terms(msg, state, client)

    def local_terms(self, msg, state, client):
        self.seen["local_terms"] = (msg, state, client)
        return super().local_terms(msg, state, client)

    def train_options(self, msg, state, client):
        self.seen["train_options"] = (msg, state, client)
        return {"trainable": lambda name: False}          # the options reach client.train: nothing moves

    def uploads(self, result, msg, state, client):
        self.seen["uploads"] = (result, msg, state, client)
        return super().uploads(result, msg, state, client)

    def upload_scalars(self, result, msg, state, client):
        self.seen["upload_scalars"] = (result, msg, state, client)
        return {"extra": 1.5}

    def after_training(self, result, msg, state, client):
        return {"after": True}


def test_fedavg_hands_every_hook_its_own_arguments_and_replies_an_update():
    """A method that extends FedAvg through its hooks gets the round's message, the client's state
    (after training where the reply is built) and the client; the reply is an "update" message with
    the sample count, steps, mean loss and the hook's scalars."""
    model, data = TinyNet(), tiny_data()
    client = Runtime(model, data, TrainSettings(epochs=1, batch_size=5, lr=0.1))
    algo = HookRecorder()
    msg = Message("train", {"model": weights_of(model)})
    before = {"mine": True}
    reply_msg, state = algo.client_update(msg, before, client)
    assert reply_msg.kind == "update" and state == {"after": True}
    assert set(reply_msg.scalars) == {"num_samples", "steps", "loss", "extra"}
    assert reply_msg.scalars["num_samples"] == 10 and reply_msg.scalars["steps"] == 2
    assert all(torch.equal(reply_msg.arrays["model"][k], v) for k, v in msg.arrays["model"].items())   # all frozen
    assert reply_msg.scalars["extra"] == 1.5
    assert algo.seen["with_local_buffers"][0] is before and algo.seen["with_local_buffers"][1] is client
    for hook in ("data_terms", "local_terms", "train_options"):
        got_msg, got_state, got_client = algo.seen[hook]
        assert got_msg is msg and got_state is before and got_client is client
    for hook in ("uploads", "upload_scalars"):
        result, got_msg, got_state, got_client = algo.seen[hook]
        assert result is not None and result.steps == 2
        assert got_msg is msg and got_state == {"after": True} and got_client is client
    # the server asks each of the round's clients by its own id
    sent = next(algo.round(algo.init_server_state({"tiny": weights_of(model)}), ctx([2, 0])))
    assert sorted(sent) == [0, 2] and algo.seen["train_message"] == [2, 0]


def test_hooks_get_the_weights_training_starts_from_in_the_rounds_own_message():
    """A method whose training starts elsewhere than the received model (FedPer: its own head)
    hands its hooks the round's message with that start as "model", its kind, other arrays and
    scalars unchanged."""
    model, data = TinyNet(), tiny_data()
    client = Runtime(model, data, TrainSettings(epochs=1, batch_size=5, lr=0.1))

    class OwnStart(HookRecorder):
        def start_weights(self, msg, state, client):
            return {k: v + 1.0 for k, v in msg.arrays["model"].items()}

    algo = OwnStart()
    msg = Message("train", {"model": weights_of(model), "extra": {"x": torch.ones(1)}}, {"lr_scale": 0.5})
    algo.client_update(msg, None, client)
    for hook in ("data_terms", "local_terms", "train_options"):
        got = algo.seen[hook][0]
        assert got.kind == "train" and got.scalars == {"lr_scale": 0.5} and got.arrays["extra"] is msg.arrays["extra"]
        assert all(torch.equal(got.arrays["model"][k], v + 1.0) for k, v in msg.arrays["model"].items())


def test_a_method_that_trains_without_its_train_options_is_refused_when_mixup_is_on():
    """mixup is handed to client.train through train_options: a method of one's own that builds its
    own call would train without it, and says so instead."""
    class OwnCall(FedAvg):
        name = "own_call"

        def local_training(self, weights, msg, state, client):
            return client.train(weights, [CrossEntropy()])

    model, data = TinyNet(), tiny_data()
    client = Runtime(model, data, TrainSettings(epochs=1, batch_size=5, lr=0.1))
    client.train_augmentations = []
    message = ("algorithm.params.mixup: own_call's local training does not pass its train_options to client.train, "
               "so it would run without mixup; turn mixup off for this method")
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        OwnCall(FedAvg.Params(mixup=True)).client_update(Message("train", {"model": weights_of(model)}), None, client)
    OwnCall().client_update(Message("train", {"model": weights_of(model)}), None, client)     # mixup off: trains


def test_fedavg_keeps_no_buffers_entry_for_a_model_without_buffers():
    """bn_buffers: local on a model with no buffers leaves the client's state as it was."""
    model, data = TinyNet(), tiny_data()
    client = Runtime(model, data, TrainSettings(epochs=1, batch_size=5, lr=0.1))
    state = {"mine": True}
    assert FedAvg(FedAvg.Params(bn_buffers="local")).keep_local_buffers(weights_of(model), state, client) is state


def test_fedavg_buffer_policy_keeps_the_rest_of_the_state_and_ignores_kept_buffers_when_averaging():
    from types import SimpleNamespace

    client = SimpleNamespace(buffer_names=["bn.running_mean"])
    weights = {"fc.weight": torch.ones(2), "bn.running_mean": torch.full((2,), 3.0)}
    kept = FedAvg(FedAvg.Params(bn_buffers="local")).keep_local_buffers(weights, {"mine": True}, client)
    assert set(kept) == {"mine", "buffers"} and kept["mine"] is True
    assert set(kept["buffers"]) == {"bn.running_mean"}
    # bn_buffers: average (the default) trains from the server's buffers even if a state holds some
    assert FedAvg().with_local_buffers(weights, {"buffers": {"bn.running_mean": torch.zeros(2)}}, client) is weights


def test_fedavg_refuses_several_architectures_naming_them():
    with pytest.raises(ValueError, match=r"^fedavg averages whole models, so every client needs the same "
                                         r"architecture; got \['a', 'b'\]$"):
        FedAvg().init_server_state({"b": {}, "a": {}})
