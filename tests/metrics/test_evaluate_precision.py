"""eval.precision: the evaluation passes in fp32, or in the run's precision (bf16 autocast); and
the personalized loss (personal_loss) those passes give, on a hand-computed case."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch.func import functional_call

from fedhet.experiment.config import load_config
from fedhet.experiment.runner import Experiment, read_metrics
from fedhet.metrics.evaluate import predict


def normalize(x: torch.Tensor) -> torch.Tensor:
    return x.float() / 255 - 0.3


def channels_last(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 else t


def hand_loss(model, weights, x, y, bf16: bool) -> float:
    """The summed cross-entropy of one forward pass in predict's layout, with or without bf16 autocast."""
    model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logits = functional_call(model, {k: channels_last(v) for k, v in weights.items()},
                                 (channels_last(normalize(x)),), strict=False)
    return float(torch.nn.functional.cross_entropy(logits.float(), y, reduction="sum"))


def test_predict_in_bf16_is_the_forward_under_bf16_autocast(cnn_client):
    model, data, weights = cnn_client
    x, y = data.x[:40], data.y[:40]
    hits32, losses32 = predict(model, weights, x, y, normalize, batch_size=40)
    hits16, losses16 = predict(model, weights, x, y, normalize, batch_size=40, precision="bf16")
    loss32, loss16 = float(losses32.double().sum()), float(losses16.double().sum())
    assert loss32 == pytest.approx(hand_loss(model, weights, x, y, bf16=False), rel=1e-6)
    assert loss16 == pytest.approx(hand_loss(model, weights, x, y, bf16=True), rel=1e-6)
    # bf16 keeps 8 mantissa bits: its loss must show that rounding (fails when autocast is off)
    assert abs(loss16 - loss32) > 1e-5 * abs(loss32)
    assert hits16.dtype == torch.bool and len(hits16) == 40
    with pytest.raises(ValueError, match="'fp32' or 'bf16'"):
        predict(model, weights, x, y, normalize, batch_size=40, precision="fp16")


def bf16_config(small_config, eval_precision: str | None, precision: str = "bf16"):
    raw = copy.deepcopy(small_config)
    raw["train"]["rounds"] = 1
    raw["run"]["precision"] = precision
    if eval_precision is not None:
        raw["eval"]["precision"] = eval_precision
    return load_config(raw=raw)


@pytest.mark.parametrize("eval_precision,expected", [(None, "fp32"), ("fp32", "fp32"), ("run", "bf16")])
def test_a_bf16_run_evaluates_in_the_precision_eval_precision_names(small_config, tmp_path, eval_precision,
                                                                   expected):
    exp = Experiment.create(bf16_config(small_config, eval_precision), tmp_path / "r")
    exp.run(progress=False)
    assert exp.summary["precision"] == "bf16" and exp.summary["eval_precision"] == expected
    fed = exp.federation
    weights = exp.loop.server_state["model"]
    row = read_metrics(exp.run_dir)[-1]
    model = exp.loop.host.models["cnn2"]
    losses = {p: float(predict(model, weights, fed.test.x, fed.test.y, fed.normalize, 2048, p)[1].double().sum())
              / len(fed.test.y) for p in ("fp32", "bf16")}
    assert abs(losses["fp32"] - losses["bf16"]) > 1e-5 * losses["fp32"]    # the check below can tell them apart
    assert row["global_loss"] == pytest.approx(losses[expected], rel=1e-6)


def test_eval_precision_run_in_an_fp32_run_is_fp32(small_config, tmp_path):
    exp = Experiment.create(bf16_config(small_config, "run", precision="fp32"), tmp_path / "r")
    assert exp.eval_precision == "fp32"


def test_unknown_eval_precision_is_a_config_error(small_config):
    from fedhet.core.errors import ConfigError

    with pytest.raises(ConfigError, match="eval.precision"):
        bf16_config(small_config, "bf16")


@pytest.mark.parametrize("algorithm", ["fedavg", "fedper"])
def test_every_evaluation_pass_of_a_bf16_run_gets_the_evaluation_precision(small_config, tmp_path, monkeypatch,
                                                                         algorithm):
    """Under eval.precision: run every pass is bf16: FedAvg's global, held-out validation and
    local-risk passes; FedPer's personalized passes (clients have their own heads, no global model;
    eval.local_risk is refused for FedPer, whose clients upload only the body)."""
    import fedhet.metrics.evaluate as evaluate_module

    raw = copy.deepcopy(small_config)
    raw["train"]["rounds"] = 1
    raw["algorithm"] = {"name": algorithm}
    raw["data"]["local_test"] = {"source": "holdout", "fraction": 0.2}
    raw["run"]["precision"] = "bf16"
    raw["eval"].update(precision="run", local_risk=algorithm == "fedavg")
    calls: list[tuple[int, str]] = []
    real_predict = evaluate_module.predict

    def spy(model, weights, x, y, normalize, batch_size, precision="fp32", device="cpu", **kwargs):
        calls.append((len(y), precision))
        return real_predict(model, weights, x, y, normalize, batch_size, precision, device, **kwargs)

    monkeypatch.setattr(evaluate_module, "predict", spy)
    exp = Experiment.create(load_config(raw=raw), tmp_path / "r")
    exp.run(progress=False)
    fed = exp.federation
    local_sizes = [len(fed.local_test(c)[1]) for c in range(fed.num_clients)]
    local_models = raw["train"]["clients_per_round"]
    sizes = sorted(n for n, _ in calls)
    assert {p for _, p in calls} == {"bf16"}
    if algorithm == "fedavg":       # global test set, the union of the held-out splits, the local models
        assert sizes == sorted([len(fed.test.y)] * (1 + local_models) + [sum(local_sizes)])
    else:                           # every client's split once (in groups of clients sharing a weights
        # object: those never trained share the initial model), no global test set
        assert len(fed.test.y) not in sizes or len(fed.test.y) in local_sizes
        assert sum(sizes) == sum(local_sizes)


@pytest.mark.parametrize("native", [False, True])
def test_bf16_evaluation_on_a_cpu_without_native_bf16_warns(small_config, tmp_path, monkeypatch, native):
    import warnings

    import fedhet.experiment.runner as runner_module

    monkeypatch.setattr(runner_module, "bf16_native", lambda device="cpu": native)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Experiment.create(bf16_config(small_config, "run"), tmp_path / "r")
    said = [str(w.message) for w in caught if "eval.precision" in str(w.message)]
    if native:
        assert said == []
    else:
        assert len(said) == 1 and "without native bf16" in said[0] and "eval.precision: fp32" in said[0]


# --- personal_loss: each client's mean cross-entropy on its own local test split, mean over clients ---------------

# 1x1x2 uint8 images whose normalised pixels are the features (0 or 1) of a linear model with 3 classes.
FEATURES = [(0, 0), (1, 0), (0, 1), (1, 1), (1, 0), (0, 1), (1, 1), (0, 0)]
LABELS = [0, 1, 2, 1, 0, 0, 2, 2]
SPLITS = [[0], [1, 2], [3, 4, 5, 6, 7]]         # clients' local test rows: 1, 2 and 5 samples
GLOBAL = ([[1.0, -1.0], [0.5, 2.0], [-1.0, 0.0]], [0.1, -0.2, 0.3])
OWN_A = ([[2.0, 0.0], [0.0, 2.0], [1.0, 1.0]], [0.0, 0.0, 0.0])
OWN_B = ([[-1.0, 1.0], [0.5, 0.5], [0.0, -2.0]], [0.2, 0.0, -0.1])


def hand_ce(params, rows) -> list[float]:
    """Cross-entropy of each row, from the logits W f + b written out in plain math."""
    (w, b), out = params, []
    for r in rows:
        f = FEATURES[r]
        logits = [w[c][0] * f[0] + w[c][1] * f[1] + b[c] for c in range(3)]
        out.append(math.log(sum(math.exp(z) for z in logits)) - logits[LABELS[r]])
    return out


def as_weights(params) -> dict[str, torch.Tensor]:
    return {"1.weight": torch.tensor(params[0]), "1.bias": torch.tensor(params[1])}


def toy_federation(source: str):
    from fedhet.data.datasets import ImageData
    from fedhet.data.federated import Federation

    x = torch.tensor([[[[255 * a, 255 * b]]] for a, b in FEATURES], dtype=torch.uint8)
    data = ImageData(x, torch.tensor(LABELS), 3, (0.0,), (1.0,))
    everything = torch.arange(len(LABELS))                 # training rows: only their label counts are read
    return Federation("toy", 3, 1, 2, pool=data, test=data, train_idx=[everything] * len(SPLITS),
                      test_idx=[torch.tensor(s) for s in SPLITS], local_test_source=source,
                      mean=torch.zeros(1, 1, 1, 1), std=torch.ones(1, 1, 1, 1))


class ToyAlgorithm:
    def __init__(self, weights):
        self.weights = weights

    def global_model(self, state):
        return self.weights


def evaluate_toy(monkeypatch, source: str, global_weights, client_weights: list, clients=None):
    """evaluate() of the toy federation, and the sizes of the forward passes it ran."""
    import fedhet.metrics.evaluate as evaluate_module

    passes: list[int] = []
    real_predict = evaluate_module.predict

    def spy(model, weights, x, y, *args, **kwargs):
        passes.append(len(y))
        return real_predict(model, weights, x, y, *args, **kwargs)

    monkeypatch.setattr(evaluate_module, "predict", spy)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(2, 3))
    fed = toy_federation(source)
    out = evaluate_module.evaluate(ToyAlgorithm(global_weights), {}, lambda cid: client_weights[cid],
                                   {"linear": model}, ["linear"] * len(SPLITS), fed, batch_size=3, clients=clients)
    return out, passes


@pytest.mark.parametrize("source", ["test_set", "holdout"])
def test_personal_loss_of_clients_tested_with_the_global_model_reuses_its_pass(monkeypatch, source):
    """Every client evaluated with the global model: the losses come from the global test pass
    (test_set) or the validation pass (holdout), with no pass of their own."""
    g = as_weights(GLOBAL)
    out, passes = evaluate_toy(monkeypatch, source, g, [g] * len(SPLITS))
    per_client = [hand_ce(GLOBAL, rows) for rows in SPLITS]
    means = [sum(ce) / len(ce) for ce in per_client]
    pooled = sum(map(sum, per_client)) / sum(map(len, per_client))
    assert out["personal_loss"] == pytest.approx(sum(means) / len(means), abs=1e-6)
    assert abs(out["personal_loss"] - pooled) > 1e-2        # the clients' sizes differ: not the pooled mean
    assert out["personal_loss_by_client"] == pytest.approx(dict(enumerate(means)), abs=1e-5)
    assert passes == [len(LABELS)] * (1 if source == "test_set" else 2)     # global (and validation) pass only
    assert out["global_loss"] == pytest.approx(sum(hand_ce(GLOBAL, range(len(LABELS)))) / len(LABELS), abs=1e-6)


def test_personal_loss_of_clients_with_their_own_weights(monkeypatch):
    """Client 0 on the global model (its pass reused), clients 1 and 2 on their own weights; then
    clients 0 and 1 sharing one weights object (one pass, split by client), client 2 left out."""
    g, a, b = as_weights(GLOBAL), as_weights(OWN_A), as_weights(OWN_B)
    out, passes = evaluate_toy(monkeypatch, "test_set", g, [g, a, b])
    means = [sum(ce) / len(ce) for ce in (hand_ce(GLOBAL, SPLITS[0]), hand_ce(OWN_A, SPLITS[1]),
                                          hand_ce(OWN_B, SPLITS[2]))]
    assert out["personal_loss"] == pytest.approx(sum(means) / 3, abs=1e-6)
    assert out["personal_loss_by_client"] == pytest.approx(dict(enumerate(means)), abs=1e-5)
    assert sorted(passes) == sorted([len(LABELS), len(SPLITS[1]), len(SPLITS[2])])

    out, passes = evaluate_toy(monkeypatch, "test_set", None, [a, a, b], clients=[0, 1])
    per_client = [hand_ce(OWN_A, SPLITS[0]), hand_ce(OWN_A, SPLITS[1])]
    means = [sum(ce) / len(ce) for ce in per_client]
    pooled = sum(map(sum, per_client)) / sum(map(len, per_client))
    assert out["personal_loss"] == pytest.approx(sum(means) / 2, abs=1e-6)
    assert abs(out["personal_loss"] - pooled) > 1e-2
    assert out["personal_loss_by_client"] == pytest.approx(dict(enumerate(means)), abs=1e-5)   # split back by client
    assert passes == [len(SPLITS[0]) + len(SPLITS[1])]
