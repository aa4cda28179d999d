"""FedNova, FedRS and MOON: hand-computed rules, the projection model, short end-to-end runs."""

import copy
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedhet.algorithms import ALGORITHMS, compose
from fedhet.algorithms.fedavg import FedAvg
from fedhet.algorithms.fednova import FedNova
from fedhet.algorithms.fedrs import (
    FedRS,
    RestrictedCrossEntropy,
    classifier_weight_name,
    restricted_distribution,
)
from fedhet.algorithms.moon import ModelContrastive, Moon, contrastive_loss
from fedhet.core.contract import (
    Batch,
    ClientData,
    Forward,
    LocalResult,
    Message,
    RoundContext,
)
from fedhet.core.errors import ConfigError
from fedhet.experiment.config import load_config
from fedhet.experiment.runner import Experiment, read_metrics
from fedhet.models import build_model
from fedhet.training.local import forward
from fedhet.training.objective import CrossEntropy
from fedhet.training.steps import normalizing_factor


def ctx(clients):
    return RoundContext(round=0, clients=clients, num_clients=5, num_classes=3,
                        client_sizes={c: 1 for c in range(5)}, rng=np.random.default_rng(0))


def run_round(algo, state, replies):
    gen = algo.round(state, ctx(sorted(replies)))
    next(gen)
    with pytest.raises(StopIteration) as stop:
        gen.send(replies)
    return stop.value.value


class FakeClient:
    """A runtime whose training adds 1 to every tensor and records the loss terms it was given."""

    cid, round, arch, num_classes, num_samples = 0, 0, "cnn", 3, 6
    buffer_names: list = []

    def __init__(self, steps=3, momentum=0.0, model=None, lr=0.1):
        self.steps = steps
        self.settings = SimpleNamespace(momentum=momentum, lr=lr)
        self.model = model
        self.data = ClientData(torch.zeros(6, 1, 2, 2, dtype=torch.uint8), torch.tensor([0, 0, 2, 0, 2, 0]),
                               torch.arange(6), torch.zeros(1, 1, 1, 1), torch.ones(1, 1, 1, 1))
        self.terms = None

    def train(self, weights, terms=None, **kw):
        self.terms = terms
        return LocalResult({k: v + 1 for k, v in weights.items()}, {}, self.steps, 10, 0.0)


# --- FedNova ----------------------------------------------------------------------------------

def test_fednova_normalizing_factor_hand_values():
    assert normalizing_factor(3, 0.0) == 3.0
    # momentum 0.9, 3 steps: a = 1 + (1 + .9) + (1 + .9 + .81) = 5.61 = (3 - .9 (1 - .729)/.1)/.1
    assert normalizing_factor(3, 0.9) == pytest.approx(5.61)
    # a proximal term, lr * mu = 0.1 (FedNova Sec. 4, FedProx): a = 1 + .9 + .81 = 2.71 = (1 - .9^3) / .1
    assert normalizing_factor(3, 0.0, 0.1) == pytest.approx(2.71)
    # both, 2 steps: v = 1, u = 1; then v = .5 * 1 + 1 - .1 * 1 = 1.4, u = 2.4
    assert normalizing_factor(2, 0.5, 0.1) == pytest.approx(2.4)


def test_fednova_with_fedprox_counts_the_proximal_pull_in_a_i():
    from fedhet.algorithms import algorithm_class

    both = algorithm_class("fedprox+fednova")
    msg = Message("train", {"model": {"w": torch.tensor([0.0])}})
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(1))                     # the proximal term's one tensor
    reply, _ = both(both.Params(mu=0.5)).client_update(msg, None, FakeClient(3, 0.0, model, lr=0.2))
    assert reply.scalars["a_i"] == pytest.approx(2.71)            # lr * mu = 0.1
    # FedNova alone, or with a method whose own mu is no proximal term, keeps a_i = steps
    reply, _ = FedNova().client_update(msg, None, FakeClient(steps=3, momentum=0.0, lr=0.2))
    assert reply.scalars["a_i"] == 3.0
    moon = algorithm_class("moon+fednova")
    assert moon(moon.Params(mu=5.0)).proximal_pull() == 0.0
    dyn = algorithm_class("feddyn+fednova")                          # FedDyn's (alpha/2)||w - w_t||^2 too
    assert dyn(dyn.Params(alpha=0.25)).proximal_pull() == 0.25


def test_fednova_client_reports_a_i_from_its_momentum():
    msg = Message("train", {"model": {"w": torch.tensor([0.0])}})
    reply, _ = FedNova().client_update(msg, None, FakeClient(steps=3, momentum=0.9))
    assert reply.scalars["steps"] == 3 and reply.scalars["a_i"] == pytest.approx(5.61)
    reply, _ = FedNova().client_update(msg, None, FakeClient(steps=4, momentum=0.0))
    assert reply.scalars["a_i"] == 4.0


def test_fednova_server_rule_with_unequal_steps_hand_computed():
    algo = FedNova()
    state = algo.init_server_state({"cnn": {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(0)}})
    replies = {
        0: Message("update", {"model": {"w": torch.tensor([0.0, 0.0]), "n": torch.tensor(2)}},
                   {"num_samples": 1, "steps": 2, "a_i": 2.0}),
        1: Message("update", {"model": {"w": torch.tensor([4.0, 8.0]), "n": torch.tensor(6)}},
                   {"num_samples": 3, "steps": 6, "a_i": 6.0}),
    }
    new = run_round(algo, state, replies)
    # p = [.25, .75]; d_0 = ([1,2]-[0,0])/2 = [.5, 1]; d_1 = ([1,2]-[4,8])/6 = [-.5, -1]
    # sum p d = [-.25, -.5]; tau_eff = .25*2 + .75*6 = 5; w = [1,2] + 5*[.25,.5] = [2.25, 4.5]
    torch.testing.assert_close(new["model"]["w"], torch.tensor([2.25, 4.5]))
    # FedAvg would give [3, 6]; the integer buffer is a plain weighted average: .25*2 + .75*6 = 5
    assert new["model"]["n"].dtype == torch.int64 and int(new["model"]["n"]) == 5


@pytest.mark.parametrize("name", ["fednova+fedavgm", "fedavgm+fednova", "fednova+scaffold", "scaffold+fednova",
                                  "fednova+feddyn", "feddyn+fednova"])
def test_fednova_in_a_composition_averages_and_the_others_server_rules_go_on_from_its_average(name):
    """FedNova replaces the average, not the server rule after it, in either order. By hand: w = 1,
    clients at 0 and 1 with 10 and 30 samples after a_i = 2 and 4 steps: FedNova's average 0.5625
    (FedAvg's mean 0.75). FedAvgM at server_lr 0.5, momentum 0.9, first round: v = 1 - 0.5625 =
    0.4375, w = 1 - 0.5 v = 0.78125; SCAFFOLD at server_lr 0.5: 1 + 0.5 (0.5625 - 1) = 0.78125;
    FedDyn, alpha 0.1, 5 clients, h = 0 before: its uniform weights make FedNova's p = (1/2, 1/2),
    tau_eff = 3 and the average 1 - 3 (1/4) = 0.25; h = -(0.1/5) ((0 - 1) + (1 - 1)) = 0.02, so
    w = 0.25 - 0.02/0.1 = 0.05."""
    params = {"fedavgm": {"server_lr": 0.5, "server_momentum": 0.9}, "scaffold": {"server_lr": 0.5},
              "feddyn": {"alpha": 0.1}}
    other = next(part for part in name.split("+") if part != "fednova")
    cls = compose([ALGORITHMS[part] for part in name.split("+")])
    algo = cls(cls.Params(**params[other]))
    state = algo.init_server_state({"cnn": {"w": torch.tensor([1.0])}})
    control = {"control": {"w": torch.zeros(1)}} if other == "scaffold" else {}
    replies = {0: Message("update", {"model": {"w": torch.tensor([0.0])}, **control},
                          {"num_samples": 10, "steps": 2, "a_i": 2.0}),
               1: Message("update", {"model": {"w": torch.tensor([1.0])}, **control},
                          {"num_samples": 30, "steps": 4, "a_i": 4.0})}
    new = algo.aggregate(state, replies, ctx([0, 1]))
    expected = {"fedavgm": 0.78125, "scaffold": 0.78125, "feddyn": 0.05}[other]
    assert float(new["model"]["w"]) == pytest.approx(expected, abs=1e-7)


def test_fednova_equal_steps_without_momentum_is_fedavg():
    g = torch.Generator().manual_seed(0)
    glob = {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)}
    replies = {c: Message("update", {"model": {k: torch.randn(v.shape, generator=g) for k, v in glob.items()}},
                          {"num_samples": n, "steps": 5, "a_i": normalizing_factor(5, 0.0)})
               for c, n in ((0, 10), (1, 30), (3, 7))}
    nova = run_round(FedNova(), FedNova().init_server_state({"cnn": glob}), replies)
    avg = run_round(FedAvg(), FedAvg().init_server_state({"cnn": glob}), replies)
    for k in glob:
        torch.testing.assert_close(nova["model"][k], avg["model"][k])


# --- FedRS ------------------------------------------------------------------------------------

def test_fedrs_restricted_logits_and_loss_hand_computed():
    cdist = restricted_distribution(torch.tensor([4, 0, 2]), 0.5)
    torch.testing.assert_close(cdist, torch.tensor([1.0, 0.5, 0.75]))
    h = torch.tensor([[1.0, 2.0], [0.0, -1.0]])
    weights = {"head.fc.weight": torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]),
               "head.fc.bias": torch.tensor([5.0, -5.0, 0.0])}
    term = RestrictedCrossEntropy(cdist, "head.fc.weight")
    # h W^T = [[1, 2, 3], [0, -1, -1]]; * cdist = [[1, 1, 2.25], [0, -.5, -.75]]; the bias is not used
    torch.testing.assert_close(term.logits(h, weights), torch.tensor([[1.0, 1.0, 2.25], [0.0, -0.5, -0.75]]))
    y = torch.tensor([0, 2])
    lse = lambda *v: math.log(sum(math.exp(x) for x in v))  # noqa: E731
    expected = ((lse(1, 1, 2.25) - 1) + (lse(0, -0.5, -0.75) + 0.75)) / 2
    loss = term(Forward(h, torch.zeros(2, 3)), Batch(torch.zeros(2), y, torch.arange(2)), weights)
    assert float(loss) == pytest.approx(expected, rel=1e-6)


def test_fedrs_alpha_one_is_plain_cross_entropy_without_bias():
    cdist = restricted_distribution(torch.tensor([4, 0, 2]), 1.0)
    assert torch.equal(cdist, torch.ones(3))
    g = torch.Generator().manual_seed(1)
    h, w, b = torch.randn(5, 4, generator=g), torch.randn(3, 4, generator=g), torch.randn(3, generator=g)
    y = torch.tensor([0, 1, 2, 1, 0])
    loss = RestrictedCrossEntropy(cdist, "W")(Forward(h, h @ w.T + b), Batch(h, y, torch.arange(5)), {"W": w})
    torch.testing.assert_close(loss, F.cross_entropy(h @ w.T, y))
    assert not torch.allclose(loss, F.cross_entropy(h @ w.T + b, y))


def test_fedrs_trains_on_restricted_ce_only_with_client_label_counts():
    model = build_model("cnn2", 1, 3, 28)
    assert classifier_weight_name(model) == "head.fc2.weight"
    client = FakeClient(model=model)               # labels [0, 0, 2, 0, 2, 0] -> counts [4, 0, 2]
    FedRS(FedRS.Params(alpha=0.5)).client_update(Message("train", {"model": {"w": torch.zeros(1)}}), None, client)
    assert len(client.terms) == 1 and not isinstance(client.terms[0], CrossEntropy)
    torch.testing.assert_close(client.terms[0].cdist, torch.tensor([1.0, 0.5, 0.75]))
    # composed with FedNova in either order, the restricted CE and FedNova's a_i both apply
    for combo in (compose([FedRS, FedNova]), compose([FedNova, FedRS])):
        client = FakeClient(steps=3, momentum=0.9, model=model)
        reply, _ = combo().client_update(Message("train", {"model": {"w": torch.zeros(1)}}), None, client)
        assert [type(t) for t in client.terms] == [RestrictedCrossEntropy]
        assert reply.scalars["a_i"] == pytest.approx(5.61)
    with pytest.raises(ConfigError, match=r"single Linear layer; set model.split to the stage of its last Linear layer \('fc2'\)"):
        classifier_weight_name(build_model("cnn2", 1, 3, 28, split="fc1"))


# --- MOON -------------------------------------------------------------------------------------

def test_moon_contrastive_loss_hand_computed():
    z = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    z_glob = torch.tensor([[1.0, 1.0], [0.0, 1.0]])
    z_prev = torch.tensor([[0.0, 3.0], [1.0, -1.0]])
    # row 0: cos(z,zg) = 1/sqrt2, cos(z,zp) = 0  -> logits [sqrt2, 0] at tau .5: log(1 + e^{-sqrt2})
    # row 1: cos = 1, cos = -1/sqrt2             -> logits [2, -sqrt2]:          log(1 + e^{-2-sqrt2})
    expected = (math.log1p(math.exp(-math.sqrt(2))) + math.log1p(math.exp(-2 - math.sqrt(2)))) / 2
    assert float(contrastive_loss(z, z_glob, z_prev, 0.5)) == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("split", ["fc2", "fc1"])
def test_projection_model_features_are_the_projection(split):
    torch.manual_seed(0)
    model = build_model("cnn2", 1, 10, 28, split=split, projection_dim=64)
    model.eval()
    x = torch.randn(3, 1, 28, 28)
    feats, logits = model(x, with_features=True)
    assert model.feature_dim == 64 and feats.shape == (3, 64)
    assert torch.equal(model.head(model.features(x)), logits) and torch.equal(model(x), logits)
    first = "head.fc2.weight" if split == "fc2" else "head.fc1.0.weight"
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert shapes[first][1] == 64
    d = 512 if split == "fc2" else 1024
    assert shapes["body.proj.0.weight"] == (d, d) and shapes["body.proj.2.weight"] == (64, d)
    with pytest.raises(ValueError, match="projection_dim"):
        build_model("cnn2", 1, 10, 28, projection_dim=0)


def test_moon_term_first_round_and_client_state():
    torch.manual_seed(0)
    model = build_model("cnn2", 1, 3, 28, projection_dim=8)
    glob = {k: v.clone() for k, v in model.state_dict().items()}
    algo = Moon(Moon.Params(mu=2.0, tau=0.5))
    client = FakeClient(model=model)
    reply, state = algo.client_update(Message("train", {"model": glob}), None, client)
    ce, moon = client.terms
    assert isinstance(ce, CrossEntropy) and isinstance(moon, ModelContrastive)
    # first participation: previous model = global model, so both similarities are equal: l_con = log 2
    x = torch.randn(4, 1, 28, 28)
    local = {k: v + 0.01 for k, v in glob.items()}
    out = forward(model, local, x)
    value = moon(out, Batch(x, torch.zeros(4, dtype=torch.long), torch.arange(4)), local)
    assert float(value) == pytest.approx(2.0 * math.log(2.0), rel=1e-5)
    # the client keeps its trained model as the next round's previous model
    assert set(state) == {"moon_prev"}
    assert all(torch.equal(state["moon_prev"][k], reply.arrays["model"][k]) for k in glob)
    algo.client_update(Message("train", {"model": glob}), state, client)
    assert client.terms[1].prev_weights is state["moon_prev"] and client.terms[1].global_weights is glob
    # later rounds: the global model's features are the positive, the previous model's the negative,
    # each model in eval mode: mu * mean log(1 + exp((cos(z, z_prev) - cos(z, z_glob)) / tau)) by hand
    model.eval()
    with torch.no_grad():
        z, z_glob, z_prev = (forward(model, w, x).features for w in (local, glob, state["moon_prev"]))
    gap = (F.cosine_similarity(z, z_prev, dim=-1) - F.cosine_similarity(z, z_glob, dim=-1)) / 0.5
    expected = 2.0 * torch.log1p(torch.exp(gap)).mean()
    value = client.terms[1](out, Batch(x, torch.zeros(4, dtype=torch.long), torch.arange(4)), local)
    assert abs(float(gap.mean())) > 0.1                  # the two references differ: a swap would show
    assert float(value) == pytest.approx(float(expected), rel=1e-5)


# --- end to end -------------------------------------------------------------------------------

def e2e(small_config, tmp_path, monkeypatch, cls, params=None, model=None, train=None):
    for part in cls.__mro__:   # register the method (and a combination's parts) for this test only
        if part.__dict__.get("name") and "+" not in part.name:
            monkeypatch.setitem(ALGORITHMS, part.name, part)
    raw = copy.deepcopy(small_config)
    raw["algorithm"] = {"name": cls.name, "params": params or {}}
    raw["model"].update(model or {})
    raw["train"].update(train or {})
    exp = Experiment.create(load_config(raw=raw), tmp_path / cls.name.replace("+", "_"))
    exp.run(progress=False)
    rows = read_metrics(exp.run_dir)
    assert [r["round"] for r in rows] == [1, 2, 3]
    assert rows[-1]["train_loss"] < rows[0]["train_loss"]
    assert math.isfinite(rows[-1]["global_acc"]) and 0.0 <= rows[-1]["global_acc"] <= 1.0
    return exp, rows


def final_model(exp) -> dict:
    return exp.loop.server_state["model"]


def relative_difference(a: dict, b: dict) -> float:
    """||a - b|| / ||b|| over the floating-point tensors: far above float noise where the methods differ."""
    keys = [k for k in b if b[k].is_floating_point()]
    diff = torch.cat([(a[k] - b[k]).flatten() for k in keys]).norm()
    return float(diff / torch.cat([b[k].flatten() for k in keys]).norm())


def test_fednova_end_to_end_with_momentum(small_config, tmp_path, monkeypatch):
    """On the Dirichlet split the clients take different step counts, so FedNova's normalised
    average ends elsewhere than FedAvg's from the same start and batches."""
    nova, _ = e2e(small_config, tmp_path, monkeypatch, FedNova, train={"momentum": 0.5, "lr": 0.02})
    avg, _ = e2e(small_config, tmp_path, monkeypatch, FedAvg, train={"momentum": 0.5, "lr": 0.02})
    assert relative_difference(final_model(nova), final_model(avg)) > 1e-4     # 7e-3 measured; noise ~1e-8


def test_fedrs_end_to_end(small_config, tmp_path, monkeypatch):
    """On the Dirichlet split clients lack classes, so damping those classes' logits (alpha 0.5)
    ends elsewhere than the undamped restricted softmax (alpha 1) from the same start and batches."""
    damped, _ = e2e(small_config, tmp_path / "a", monkeypatch, FedRS, {"alpha": 0.5})
    undamped, _ = e2e(small_config, tmp_path / "b", monkeypatch, FedRS, {"alpha": 1.0})
    assert relative_difference(final_model(damped), final_model(undamped)) > 1e-4


def test_moon_end_to_end_keeps_previous_models_locally(small_config, tmp_path, monkeypatch):
    exp, rows = e2e(small_config, tmp_path, monkeypatch, Moon, {"mu": 1.0}, {"options": {"projection_dim": 64}})
    trained = {c for r in rows for c in r["clients"]}
    assert set(exp.loop.client_states) == trained
    assert all("moon_prev" in exp.loop.client_states[c] for c in trained)
    n_params = sum(v.numel() for v in exp.loop.server_state["model"].values())
    assert rows[-1]["comm"]["down/model"]["floats"] == rows[-1]["comm"]["up/model"]["floats"] == 3 * n_params


def test_moon_plus_fedrs_composes(small_config, tmp_path, monkeypatch):
    combo = compose([Moon, FedRS])
    assert set(combo.Params.model_fields) >= {"mu", "tau", "alpha"}
    exp, _ = e2e(small_config, tmp_path, monkeypatch, combo, {"alpha": 0.5, "mu": 1.0}, {"options": {"projection_dim": 32}})
    assert exp.algorithm.name == "moon+fedrs"
    assert all("moon_prev" in s for s in exp.loop.client_states.values())
