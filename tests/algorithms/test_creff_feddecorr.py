"""FedDecorr and CReFF: hand-computed terms, client uploads, server rules and short runs."""

import copy
import dataclasses
import math

import helpers
import numpy as np
import pydantic
import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

import fedhet
from fedhet.algorithms import algorithm_class
from fedhet.algorithms.creff import (
    CReFF,
    aggregate_gradients,
    class_gradients,
    fresh_linear,
    linear_head,
    match_features,
    matching_distance,
    mean_ce,
    retrain_classifier,
    synthetic_gradients,
)
from fedhet.algorithms.fedavg import FedAvg
from fedhet.algorithms.feddecorr import Decorrelation, FedDecorr, decorrelation_loss
from fedhet.core.contract import Forward, Message
from fedhet.experiment.config import load_config
from fedhet.experiment.runner import Experiment, read_metrics
from fedhet.models import build_model
from fedhet.training.local import forward
from fedhet.training.terms import Proximal


def ctx(clients, num_classes=10, seed=0):
    """helpers.ctx with the server stream seeded by ``seed`` (CReFF draws its server randomness from it)."""
    return dataclasses.replace(helpers.ctx(clients, num_classes), rng=np.random.default_rng(seed))


def drive(algo, state, context, make_replies):
    """One server round; ``make_replies(phase)`` answers the train phase. Returns (phase, new state)."""
    gen = algo.round(state, context)
    phase = next(gen)
    with pytest.raises(StopIteration) as stop:
        gen.send(make_replies(phase))
    return phase, stop.value.value


def e2e(small_config, name, params=None, rounds=2):
    cfg = copy.deepcopy(small_config)
    cfg["algorithm"] = {"name": name, "params": params or {}}
    cfg["train"]["rounds"] = rounds
    cfg["eval"] = {"every": 1, "final_window": 1, "personalized": False}
    cfg["run"]["checkpoint_every"] = rounds
    return cfg


def final_state(res):
    """The server state of a finished ``fedhet.run`` (its last checkpoint)."""
    return torch.load(res.run_dir / "checkpoint.pt", weights_only=False)["sim"]["server_state"]


def run_experiment(cfg, out):
    exp = Experiment.create(load_config(raw=cfg), out)
    exp.run(progress=False)
    return exp


# ================================ FedDecorr ====================================================
def hand_decorrelation(rows, eps=1e-8):
    """The official FedDecorr loss written out with Python floats, for small batches."""
    n, d = len(rows), len(rows[0])
    cols = [[r[j] for r in rows] for j in range(d)]
    z = []
    for col in cols:
        mean = sum(col) / n
        var = sum((v - mean) ** 2 for v in col) / (n - 1)          # unbiased, as torch.var
        z.append([(v - mean) / math.sqrt(eps + var) for v in col])
    total = 0.0
    for i in range(d):
        for j in range(d):
            if i != j:
                total += sum(z[i][k] * z[j][k] for k in range(n)) ** 2
    return total / (d * (d - 1)) / n


def test_decorrelation_by_hand():
    # Two perfectly correlated dimensions, B = 2: z_hat columns are both (-1/sqrt2, 1/sqrt2), K_01 = 1,
    # L = (1^2 + 1^2) / (2 * 1) / 2 = 0.5 (up to eps).
    z = torch.tensor([[0.0, 0.0], [1.0, 2.0]])
    assert decorrelation_loss(z).item() == pytest.approx(0.5, rel=1e-6)
    # Anti-correlated: the same.
    assert decorrelation_loss(torch.tensor([[0.0, 2.0], [1.0, 0.0]])).item() == pytest.approx(0.5, rel=1e-6)
    # Uncorrelated (orthogonal +-1 patterns): zero.
    z = torch.tensor([[1.0, 1.0], [-1.0, 1.0], [1.0, -1.0], [-1.0, -1.0]])
    assert decorrelation_loss(z).item() == pytest.approx(0.0, abs=1e-7)
    # A batch of one sample, or one dimension: zero (the reference returns 0 for N == 1).
    assert decorrelation_loss(torch.randn(1, 5)).item() == 0.0
    assert decorrelation_loss(torch.randn(6, 1)).item() == 0.0


def test_decorrelation_term_equals_direct_formula_times_beta():
    g = torch.Generator().manual_seed(0)
    z = torch.randn(5, 4, generator=g) @ torch.randn(4, 4, generator=g)      # correlated dimensions
    term = Decorrelation(0.1)
    value = term(Forward(z, torch.zeros(5, 3)), None, {})
    assert value.item() == pytest.approx(0.1 * hand_decorrelation(z.tolist()), rel=1e-5)
    assert Decorrelation(0.0)(Forward(z, torch.zeros(5, 3)), None, {}).item() == 0.0
    assert term.vectorizable


def test_decorrelation_under_vmap_equals_per_client():
    g = torch.Generator().manual_seed(0)
    z = torch.relu(torch.randn(3, 16, 20, generator=g) - 1.0)
    torch.testing.assert_close(torch.func.vmap(decorrelation_loss)(z), torch.stack([decorrelation_loss(x) for x in z]))
    grads = torch.func.vmap(torch.func.grad(decorrelation_loss))(z)
    torch.testing.assert_close(grads, torch.stack([torch.func.grad(decorrelation_loss)(x) for x in z]))


def offdiag_corr(z):
    c = torch.corrcoef(z.T)
    return (c - torch.diag(torch.diag(c))).abs().sum().item()


def test_a_gradient_step_on_the_term_decorrelates_the_features():
    g = torch.Generator().manual_seed(1)
    z = (torch.randn(32, 6, generator=g) @ torch.randn(6, 6, generator=g)).requires_grad_(True)
    before = offdiag_corr(z.detach())
    (grad,) = torch.autograd.grad(Decorrelation(1.0)(Forward(z, torch.zeros(32, 2)), None, {}), [z])
    assert grad.abs().sum() > 0
    stepped = (z - 5.0 * grad).detach()
    assert offdiag_corr(stepped) < 0.9 * before
    assert decorrelation_loss(stepped) < decorrelation_loss(z.detach())


def test_feddecorr_appends_the_term_and_composes():
    algo = FedDecorr(FedDecorr.Params(decorr_beta=0.3))
    terms = algo.local_terms(Message("train", {"model": {}}), None, None)
    assert [type(t) for t in terms] == [Decorrelation] and terms[0].beta == 0.3
    assert FedDecorr.Params().decorr_beta == 0.1                      # the reference's --feddecorr_coef
    with pytest.raises(pydantic.ValidationError, match="decorr_beta"):
        FedDecorr.Params(decorr_beta=-1)
    both = algorithm_class("fedprox+feddecorr")
    algo = both(both.Params(mu=0.01, decorr_beta=0.2))

    class Client:
        model = torch.nn.Linear(2, 2)

    terms = algo.local_terms(Message("train", {"model": {"weight": torch.zeros(2, 2)}}), None, Client())
    assert sorted(type(t).__name__ for t in terms) == sorted([Proximal.__name__, Decorrelation.__name__])


def test_feddecorr_end_to_end_beta_zero_is_fedavg_and_beta_changes_training(small_config, tmp_path):
    avg = run_experiment(e2e(small_config, "fedavg", rounds=1), tmp_path / "avg")
    zero = fedhet.run(e2e(small_config, "feddecorr", {"decorr_beta": 0.0}, rounds=1), out=tmp_path / "zero")
    zero_state = final_state(zero)
    for k, v in avg.loop.server_state["model"].items():
        assert torch.equal(v, zero_state["model"][k]), k                # the term adds exactly nothing
    res = fedhet.run(e2e(small_config, "feddecorr", rounds=1), out=tmp_path / "decorr")    # decorr_beta = 0.1
    assert res.summary["status"] == "completed" and len(res.rows) == 1
    assert math.isfinite(res.rows[0]["train_loss"]) and math.isfinite(res.rows[0]["global_acc"])
    assert not torch.equal(final_state(res)["model"]["body.fc1.0.weight"], zero_state["model"]["body.fc1.0.weight"])


# ================================ CReFF ========================================================
def test_linear_head_names():
    cnn2 = build_model("cnn2", in_channels=1, num_classes=10, image_size=28)
    assert linear_head(dict(cnn2.state_dict())) == ("head.fc2.weight", "head.fc2.bias")
    simple = build_model("simple_cnn", in_channels=3, num_classes=10, image_size=32)
    assert linear_head(dict(simple.state_dict())) == ("head.fc3.weight", None)
    two = build_model("cnn2", in_channels=1, num_classes=10, image_size=28, split="fc1")
    with pytest.raises(ValueError, match="single Linear"):
        linear_head(dict(two.state_dict()))


def shifted_head(weights, seed=5):
    """A classifier that differs from the model's own (plays the previous round's re-trained one)."""
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.1 * torch.randn(v.shape, generator=g) for k, v in weights.items() if k.startswith("head.")}


class Runtime:
    def __init__(self, model, data, num_classes=10):
        self.model, self.data, self.num_classes = model, data, num_classes
        self.num_samples = len(data.train_idx)


def test_client_uploads_per_class_gradients_equal_autograd(cnn_client):
    model, data, weights = cnn_client
    head = shifted_head(weights)
    msg = Message("train", {"model": weights, "creff_head": head})
    up = CReFF().uploads(None, msg, None, Runtime(model, data))["creff_grads"]
    received = {**weights, **head}
    model.eval()
    with torch.no_grad():
        h = forward(model, received, data.inputs(data.train_idx)).features
    labels = data.y[data.train_idx]
    held = sorted(set(labels.tolist()))
    assert up["classes"].tolist() == held and "count" not in up             # uniform: no counts leave the client
    assert up["weight"].shape == (len(held), 10, 512) and up["bias"].shape == (len(held), 10)
    for row, c in enumerate(held):
        w = head["head.fc2.weight"].clone().requires_grad_(True)
        b = head["head.fc2.bias"].clone().requires_grad_(True)
        logits = functional_call(model.head, {"fc2.weight": w, "fc2.bias": b}, (h[labels == c],))
        gw, gb = torch.autograd.grad(F.cross_entropy(logits, torch.full((int((labels == c).sum()),), c)), [w, b])
        torch.testing.assert_close(up["weight"][row], gw, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(up["bias"][row], gb, rtol=1e-4, atol=1e-6)
    # With count weighting the counts travel too; the gradients are the model's own head's without a re-trained one.
    counted = CReFF(CReFF.Params(creff_weighting="counts")).uploads(None, Message("train", {"model": weights}), None,
                                                                   Runtime(model, data))["creff_grads"]
    assert counted["count"].tolist() == [int((labels == c).sum()) for c in held]
    assert not torch.allclose(counted["weight"], up["weight"])


def test_class_gradients_zero_for_absent_classes_and_mode_restored(cnn_client):
    model, data, weights = cnn_client
    y = data.y.clone()
    y[y == 3], y[y == 7] = 0, 1                          # classes 3 and 7 absent, so the check below checks
    data = dataclasses.replace(data, y=y)
    model.train()
    g_w, g_b, counts = class_gradients(model, weights, data, 10, "head.fc2.weight", "head.fc2.bias", batch_size=7)
    assert model.training
    assert counts.tolist() == torch.bincount(data.y[data.train_idx], minlength=10).tolist()
    absent = counts == 0
    assert absent[[3, 7]].all() and not absent.all()
    assert (g_w[absent] == 0).all() and (g_b[absent] == 0).all() and (g_w[~absent] != 0).any()
    # batch size does not matter beyond float rounding
    g_w2, _, _ = class_gradients(model, weights, data, 10, "head.fc2.weight", "head.fc2.bias")
    torch.testing.assert_close(g_w, g_w2, rtol=1e-5, atol=1e-7)


def test_aggregation_uniform_and_by_counts():
    a0, a2, b2 = torch.full((3, 2), 1.0), torch.full((3, 2), 2.0), torch.full((3, 2), 5.0)
    ups = [{"classes": torch.tensor([0, 2]), "weight": torch.stack([a0, a2]), "bias": torch.tensor([[1.0] * 3, [3.0] * 3]),
            "count": torch.tensor([4, 1])},
           {"classes": torch.tensor([2]), "weight": b2.unsqueeze(0), "bias": torch.tensor([[6.0] * 3]),
            "count": torch.tensor([3])}]
    w, b, present = aggregate_gradients(ups, 3, "uniform")
    assert present.tolist() == [True, False, True]
    torch.testing.assert_close(w[0], a0)
    torch.testing.assert_close(w[2], torch.full((3, 2), 3.5))                 # (2 + 5) / 2
    torch.testing.assert_close(b[2], torch.full((3,), 4.5))
    w, b, present = aggregate_gradients(ups, 3, "counts")
    torch.testing.assert_close(w[2], torch.full((3, 2), (1 * 2.0 + 3 * 5.0) / 4))
    torch.testing.assert_close(b[2], torch.full((3,), (1 * 3.0 + 3 * 6.0) / 4))
    torch.testing.assert_close(w[0], a0)
    assert aggregate_gradients([], 3) is None
    with pytest.raises(ValueError, match="counts"):
        aggregate_gradients([{k: v for k, v in ups[0].items() if k != "count"}], 3, "counts")


def test_synthetic_gradients_and_their_feature_gradient_equal_autograd():
    g = torch.Generator().manual_seed(2)
    feats = torch.randn(2, 5, 4, generator=g, dtype=torch.float64, requires_grad=True)
    classes = torch.tensor([0, 2])
    w = torch.randn(3, 4, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, generator=g, dtype=torch.float64, requires_grad=True)
    real_w, real_b = torch.randn(2, 3, 4, generator=g, dtype=torch.float64), torch.randn(2, 3, generator=g, dtype=torch.float64)
    gw, gb = synthetic_gradients(feats, classes, w, b)
    loss = matching_distance(gw, real_w, gb, real_b).sum()
    (closed,) = torch.autograd.grad(loss, [feats])
    ref = 0
    for p, c in enumerate(classes.tolist()):
        ce = F.cross_entropy(F.linear(feats[p], w, b), torch.full((5,), c))
        aw, ab = torch.autograd.grad(ce, [w, b], create_graph=True)           # the reference's create_graph
        torch.testing.assert_close(gw[p], aw)
        torch.testing.assert_close(gb[p], ab)
        ref = ref + matching_distance(aw.unsqueeze(0), real_w[p:p + 1], ab.unsqueeze(0), real_b[p:p + 1]).sum()
    (auto,) = torch.autograd.grad(ref, [feats])
    torch.testing.assert_close(closed, auto)


def test_matching_distance_by_hand():
    real = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])
    assert matching_distance(real.clone(), real).item() == pytest.approx(0.0, abs=1e-5)
    ortho = torch.tensor([[[0.0, 1.0], [1.0, 0.0]]])
    assert matching_distance(ortho, real).item() == pytest.approx(2.0, abs=1e-5)     # two rows, cos 0 each
    # row by row, not flattened: scaling one row does not change the distance
    assert matching_distance(real * torch.tensor([[[3.0], [1.0]]]), real).item() == pytest.approx(0.0, abs=1e-5)
    bias = torch.tensor([[1.0, -1.0]])
    assert matching_distance(real, real, -bias, bias).item() == pytest.approx(2.0, abs=1e-5)   # opposite bias


def test_matching_loss_decreases_and_absent_classes_stay():
    g = torch.Generator().manual_seed(3)
    C, m, d = 4, 20, 16
    w, b = torch.randn(C, d, generator=g) * 0.3, torch.randn(C, generator=g) * 0.1
    real_feats = torch.randn(C, 30, d, generator=g) + 2 * torch.randn(C, 1, d, generator=g)
    real_w, real_b = synthetic_gradients(real_feats, torch.arange(C), w, b)
    present = torch.tensor([True, True, False, True])
    start = torch.randn(C, m, d, generator=g)
    new, losses = match_features(start, real_w, real_b, present, w, b, iters=60, lr=0.1)
    assert len(losses) == 61
    assert losses[-1] < 0.5 * losses[0]
    assert all(later <= earlier + 1e-4 for earlier, later in zip(losses, losses[1:]))
    assert torch.equal(new[2], start[2]) and not torch.equal(new[0], start[0])
    assert match_features(start, real_w, real_b, torch.zeros(C, dtype=torch.bool), w, b, 5, 0.1)[1] == []


def test_retraining_is_torch_sgd_on_the_features():
    g = torch.Generator().manual_seed(4)
    feats = torch.randn(3, 4, 5, generator=g)
    w0, b0 = fresh_linear(3, 5, True, g)
    w, b = retrain_classifier(feats, w0, b0, epochs=2, lr=0.5, batch_size=5, generator=torch.Generator().manual_seed(9))
    lin = torch.nn.Linear(5, 3)
    with torch.no_grad():
        lin.weight.copy_(w0)
        lin.bias.copy_(b0)
    opt = torch.optim.SGD(lin.parameters(), lr=0.5)
    x, y = feats.reshape(12, 5), torch.arange(3).repeat_interleave(4)
    order_gen = torch.Generator().manual_seed(9)
    for _ in range(2):
        order = torch.randperm(12, generator=order_gen)
        for i in range(0, 12, 5):                                          # batches 5, 5, 2 (last kept)
            opt.zero_grad()
            F.cross_entropy(lin(x[order[i:i + 5]]), y[order[i:i + 5]]).backward()
            opt.step()
    torch.testing.assert_close(w, lin.weight.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(b, lin.bias.detach(), rtol=1e-5, atol=1e-6)
    # bias-free heads stay bias-free
    w, b = retrain_classifier(feats, w0, None, epochs=1, lr=0.5, batch_size=12, generator=torch.Generator())
    assert b is None and not torch.equal(w, w0)


SMALL = {"creff_features": 10, "creff_match_iters": 20, "creff_crt_epochs": 30}


def server_round(cnn_client, params=None, seed=0):
    """One CReFF server round over two clients that trained (perturbed weights) and uploaded real gradients."""
    model, data, weights = cnn_client
    algo = CReFF(CReFF.Params(**{**SMALL, **(params or {})}))
    state = algo.init_server_state({"cnn2": weights})
    g = torch.Generator().manual_seed(7)
    trained = {c: {k: v + 0.01 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
                   for k, v in weights.items()} for c in (0, 1)}
    halves = {0: torch.arange(0, 30), 1: torch.arange(30, 60)}

    def replies(phase):
        out = {}
        for c, msg in phase.items():
            part = copy.copy(data)
            part.train_idx = data.train_idx[halves[c]]
            up = algo.uploads(None, msg, None, Runtime(model, part))
            out[c] = Message("update", {"model": trained[c], **up}, {"num_samples": 10 + 20 * c})
        return out

    phase, new = drive(algo, state, ctx([0, 1], seed=seed), replies)
    return algo, state, phase, new, trained


def test_server_round_fedavg_body_retrained_head(cnn_client):
    algo, state, phase, new, trained = server_round(cnn_client)
    # clients receive the FedAvg model and the classifier the gradients are taken at
    assert phase[0].arrays["model"] is state["model"] and phase[0].arrays["creff_head"] is state["creff_head"]
    avg = FedAvg().aggregate({}, {c: Message("update", {"model": trained[c]}, {"num_samples": 10 + 20 * c})
                                  for c in (0, 1)}, None)["model"]
    for k, v in avg.items():
        assert torch.equal(new["model"][k], v), k                            # the model is FedAvg's average
    evaluated = algo.global_model(new)
    assert algo.client_model(3, new, None) is evaluated
    for k in avg:
        if k.startswith("body."):
            assert torch.equal(evaluated[k], avg[k]), k                      # body: FedAvg's
    assert not torch.allclose(evaluated["head.fc2.weight"], avg["head.fc2.weight"])
    assert evaluated["head.fc2.weight"] is new["creff_head"]["head.fc2.weight"]
    assert new["creff_features"].shape == (10, 10, 512)
    start, end = new["creff_match_loss"]
    assert end < start
    assert algo.round_metrics(new) == {"creff_match_loss_start": start, "creff_match_loss_end": end}


def test_features_are_matched_at_the_classifier_the_clients_took_their_gradients_at(cnn_client, monkeypatch):
    """The gradients uploaded in round t are taken at the previous re-trained head (sent with the
    model); the server matches features against that head, not the head it has just averaged."""
    import fedhet.algorithms.creff as creff

    seen = []
    real = creff.match_features

    def recording(features, real_w, real_b, present, head_w, head_b, *rest):
        seen.append((head_w.clone(), None if head_b is None else head_b.clone()))
        return real(features, real_w, real_b, present, head_w, head_b, *rest)

    monkeypatch.setattr(creff, "match_features", recording)
    _, state, phase, new, _ = server_round(cnn_client)
    (head_w, head_b), = seen
    assert torch.equal(head_w, state["creff_head"]["head.fc2.weight"])
    assert torch.equal(head_b, state["creff_head"]["head.fc2.bias"])
    assert torch.equal(head_w, phase[0].arrays["creff_head"]["head.fc2.weight"])
    assert not torch.equal(head_w, new["model"]["head.fc2.weight"])          # not the round's average


def test_server_retrains_the_classifier_on_the_federated_features(cnn_client):
    algo, _, _, new, _ = server_round(cnn_client)
    feats = new["creff_features"]
    ce, acc = mean_ce(feats, new["creff_head"]["head.fc2.weight"], new["creff_head"]["head.fc2.bias"])
    w0, b0 = fresh_linear(10, 512, True, torch.Generator().manual_seed(0))
    ce0, _ = mean_ce(feats, w0, b0)
    assert acc > 0.9 and ce < 0.5 * ce0                               # an untrained (skipped) classifier fails this
    # "global" init starts from the averaged head instead of a fresh Linear: a different result
    _, _, _, from_avg, _ = server_round(cnn_client, {"creff_crt_init": "global"})
    assert not torch.equal(from_avg["creff_head"]["head.fc2.weight"], new["creff_head"]["head.fc2.weight"])


def test_server_round_is_deterministic_and_checkpointable(cnn_client, tmp_path):
    _, _, _, a, _ = server_round(cnn_client, seed=1)
    _, _, _, b, _ = server_round(cnn_client, seed=1)
    for key in ("creff_features", "creff_head", "creff_global", "model"):
        va, vb = a[key], b[key]
        if isinstance(va, dict):
            assert all(torch.equal(va[k], vb[k]) for k in va), key
        else:
            assert torch.equal(va, vb), key
    torch.save(a, tmp_path / "state.pt")
    back = torch.load(tmp_path / "state.pt")
    assert torch.equal(back["creff_features"], a["creff_features"])
    _, _, _, c, _ = server_round(cnn_client, seed=2)
    assert not torch.equal(a["creff_features"], c["creff_features"])


def test_creff_end_to_end_body_is_fedavg_head_is_retrained(small_config, tmp_path):
    avg = run_experiment(e2e(small_config, "fedavg"), tmp_path / "avg")
    res = fedhet.run(e2e(small_config, "creff", SMALL), out=tmp_path / "creff")
    assert res.summary["status"] == "completed" and len(res.rows) == 2
    state = final_state(res)
    for k, v in avg.loop.server_state["model"].items():
        assert torch.equal(v, state["model"][k]), k                          # training and averaging are FedAvg's
    evaluated = CReFF(CReFF.Params(**SMALL)).global_model(state)
    for k, v in state["model"].items():
        if k.startswith("body."):
            assert torch.equal(evaluated[k], v), k
    assert not torch.allclose(evaluated["head.fc2.weight"], state["model"]["head.fc2.weight"])
    avg_rows = read_metrics(avg.run_dir)
    for row, avg_row in zip(res.rows, avg_rows):
        assert row["train_loss"] == avg_row["train_loss"]
        assert row["creff_match_loss_end"] < row["creff_match_loss_start"]
        assert math.isfinite(row["global_acc"])
        # the ledger counts the extra groups: the re-trained head down (10 x 512 + 10 floats per client),
        # the class gradients up
        assert row["comm"]["down/creff_head"]["floats"] == len(row["clients"]) * (10 * 512 + 10)
        assert row["comm"]["up/creff_grads"]["floats"] > 0
    # the evaluated model is the re-trained one: another accuracy than FedAvg's global model
    assert [r["global_acc"] for r in res.rows] != [r["global_acc"] for r in avg_rows]
