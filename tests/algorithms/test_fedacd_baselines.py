"""FedACD's label-skew baselines against their own papers' equations: FedLC, FedNTD, FedROD, FedNH."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import bn_model, build_loop, config, ctx, run_killed_in_round, runtime

from fedhet.algorithms import algorithm_class, compose
from fedhet.algorithms.fedavg import FedAvg
from fedhet.algorithms.fedlc import FedLC, calibration
from fedhet.algorithms.fednh import SCALE_NAME, CosineCrossEntropy, FedNH, orthonormal_rows, smoothed_prototypes
from fedhet.algorithms.fedntd import NotTrueDistillation, not_true, not_true_kl
from fedhet.algorithms.fedrod import FedROD, log_prior, train_personal_head
from fedhet.core.contract import Batch, Forward, Message, TrainSettings
from fedhet.core.errors import ConfigError, NumericalError
from fedhet.core.split import is_head
from fedhet.experiment.config import load_config
from fedhet.experiment.runner import Experiment, read_metrics
from fedhet.training.terms import OffsetCrossEntropy


def batch(y):
    y = torch.tensor(y)
    return Batch(torch.zeros(len(y), 1, 2, 2), y, torch.arange(len(y)))


# --- FedLC ------------------------------------------------------------------------------------

def test_fedlc_calibration_hand_values():
    offset = calibration(torch.tensor([16, 1, 0]), tau=2.0)
    torch.testing.assert_close(offset, torch.tensor([2 * 0.5, 2 * 1.0, 2 * 100.0]))


def test_fedlc_term_is_ce_of_calibrated_logits_and_replaces_plain_ce(small_config):
    logits = torch.tensor([[1.0, 2.0, 0.5]])
    offset = torch.tensor([0.5, 1.0, 100.0])
    value = OffsetCrossEntropy(-offset)(Forward(torch.zeros(1, 1), logits), batch([1]), {})
    z = [0.5, 1.0, -99.5]
    assert float(value) == pytest.approx(-z[1] + math.log(sum(math.exp(v) for v in z)), rel=1e-6)
    loop = build_loop(config(small_config, "fedlc", {"calibration_tau": 1.0}))
    client = runtime(loop, 0)
    (term,) = FedLC(FedLC.Params(calibration_tau=1.0)).data_terms(Message("train"), None, client)
    counts = torch.bincount(client.data.y[client.data.train_idx], minlength=10)
    torch.testing.assert_close(term.offset, -calibration(counts, 1.0))


# --- FedNTD -----------------------------------------------------------------------------------

def test_not_true_drops_exactly_the_true_column():
    logits = torch.tensor([[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]])
    torch.testing.assert_close(not_true(logits, torch.tensor([1, 2])), torch.tensor([[0.0, 2.0], [3.0, 4.0]]))


def test_not_true_kl_hand_value_and_zero_for_equal_not_true_logits():
    s = torch.tensor([[5.0, 0.0, 1.0]])
    t = torch.tensor([[-3.0, 1.0, 0.0]])
    tau = 2.0
    ps = torch.softmax(torch.tensor([0.0, 1.0]) / tau, 0)
    pt = torch.softmax(torch.tensor([1.0, 0.0]) / tau, 0)
    expected = float((pt * (pt / ps).log()).sum())
    assert float(not_true_kl(s, t, torch.tensor([0]), tau)) == pytest.approx(expected, rel=1e-5)
    # PFLlib's form multiplies by tau^2; the paper's Eq. 5 and the official criterion do not
    assert float(not_true_kl(s, t, torch.tensor([0]), tau, tau_squared=True)) == pytest.approx(4 * expected, rel=1e-5)
    # by hand: not-true student logits (0, 0)/2 -> (0.5, 0.5); teacher (2, 0)/2 -> (0.7311, 0.2689);
    # KL = 0.7311 ln(0.7311/0.5) + 0.2689 ln(0.2689/0.5) = 0.1109
    value = float(not_true_kl(torch.tensor([[5.0, 0.0, 0.0]]), torch.tensor([[-5.0, 2.0, 0.0]]), torch.tensor([0]), 2.0))
    assert value == pytest.approx(0.1109, abs=1e-4)
    # KL(teacher || student) (paper Eq. 5; the official KLDivLoss(student log-probs, teacher probs)):
    # with three not-true classes whose distributions are not mirror images the direction shows.
    # Not-true softmaxes at tau 1: student (0.2, 0.3, 0.5), teacher (0.6, 0.3, 0.1).
    student = torch.tensor([[9.0, math.log(0.2), math.log(0.3), math.log(0.5)]])
    teacher = torch.tensor([[-9.0, math.log(0.6), math.log(0.3), math.log(0.1)]])
    teacher_first = 0.6 * math.log(0.6 / 0.2) + 0.3 * math.log(1.0) + 0.1 * math.log(0.1 / 0.5)
    student_first = 0.2 * math.log(0.2 / 0.6) + 0.5 * math.log(0.5 / 0.1)
    assert abs(teacher_first - student_first) > 0.05             # 0.498 against 0.585
    value = float(not_true_kl(student, teacher, torch.tensor([0]), 1.0))
    assert value == pytest.approx(teacher_first, rel=1e-5)
    # the true class's logit is free: teacher and student differing only there give 0
    assert float(not_true_kl(s, torch.tensor([[-9.0, 0.0, 1.0]]), torch.tensor([0]), tau)) == pytest.approx(0, abs=1e-7)


def test_ntd_term_distills_from_the_received_model(small_config):
    loop = build_loop(config(small_config, "fedntd"))
    client = runtime(loop, 0)
    weights = loop.server_state["model"]
    x = client.data.batch(torch.arange(8))
    model = client.model
    model.eval()
    from fedhet.training.local import forward
    out = forward(model, weights, x.x)
    term = NotTrueDistillation(model, weights, tau=3.0, beta=1.0)
    assert float(term(out, x, weights)) == pytest.approx(0.0, abs=1e-6)       # student = teacher
    other = {k: v + 0.05 * torch.randn_like(v) for k, v in weights.items()}
    term2 = NotTrueDistillation(model, other, tau=3.0, beta=0.5)
    teacher = forward(model, other, x.x).logits
    assert float(term2(out, x, weights)) == pytest.approx(0.5 * float(not_true_kl(out.logits, teacher, x.y, 3.0)),
                                                          rel=1e-5)


# --- FedROD -----------------------------------------------------------------------------------

def test_fedrod_balanced_softmax_hand_values():
    lp = log_prior(torch.tensor([3, 1, 0]))
    torch.testing.assert_close(lp, torch.log(torch.tensor([3 / (4 + 1e-12), 1 / (4 + 1e-12), 1e-12 / 4])))
    logits = torch.tensor([[0.2, 0.1, 3.0]])
    value = OffsetCrossEntropy(lp)(Forward(torch.zeros(1, 1), logits), batch([0]), {})
    torch.testing.assert_close(value, F.cross_entropy(logits + lp, torch.tensor([0])))


def test_fedrod_personal_head_learns_on_top_of_the_detached_generic_logits():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(64, 4, generator=g)
    y = (h[:, 0] > 0).long()
    generic = torch.zeros(64, 2)
    head = {"head.fc.weight": torch.zeros(2, 4), "head.fc.bias": torch.zeros(2)}
    new = train_personal_head(h, generic, y, head, "head.fc.weight", "head.fc.bias", epochs=20, batch_size=16,
                              lr=0.5, generator_of_epoch=lambda e: torch.Generator().manual_seed(e))
    acc = float(((F.linear(h, new["head.fc.weight"], new["head.fc.bias"])).argmax(1) == y).float().mean())
    assert acc > 0.9 and torch.equal(head["head.fc.weight"], torch.zeros(2, 4))   # input not modified


def test_fedrod_personal_head_steps_are_plain_sgd_over_the_shuffled_batches_in_order():
    """Four SGD steps by hand, two epochs of two batches: batch 1 = the first two positions of the
    epoch's own permutation, then the rest; the gradient of the batch-mean CE of ``W h + b + generic``
    is ``(softmax - onehot)^T h / 2``."""
    h = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [-1.0, 0.5]], dtype=torch.float64)
    generic = torch.tensor([[0.5, 0.0], [0.0, 0.2], [0.1, 0.1], [0.0, 0.0]], dtype=torch.float64)
    y = torch.tensor([0, 1, 1, 0])
    head = {"w": torch.zeros(2, 2, dtype=torch.float64), "b": torch.zeros(2, dtype=torch.float64)}
    w, b = head["w"].clone(), head["b"].clone()
    for epoch in range(2):
        order = torch.randperm(4, generator=torch.Generator().manual_seed(3 + epoch))
        for batch in (order[:2], order[2:]):
            p = torch.softmax(h[batch] @ w.T + b + generic[batch], dim=1)
            delta = (p - F.one_hot(y[batch], 2).double()) / 2
            w, b = w - 0.3 * delta.T @ h[batch], b - 0.3 * delta.sum(0)
    new = train_personal_head(h, generic, y, head, "w", "b", epochs=2, batch_size=2, lr=0.3,
                              generator_of_epoch=lambda e: torch.Generator().manual_seed(3 + e))
    torch.testing.assert_close(new["w"], w)
    torch.testing.assert_close(new["b"], b)


def test_fedrod_client_keeps_a_personal_head_and_is_evaluated_with_the_sum_of_heads(small_config):
    loop = build_loop(config(small_config, "fedrod"))
    algo = loop.algorithm
    weights = loop.server_state["model"]
    reply, state = algo.client_update(Message("train", {"model": weights}), None, runtime(loop, 2))
    personal = state["personal_head"]
    assert set(personal) == {"head.fc2.weight", "head.fc2.bias"}
    assert not torch.equal(personal["head.fc2.weight"], loop.host.init_models["cnn2"]["head.fc2.weight"])
    view = algo.client_model(2, loop.server_state, state)
    torch.testing.assert_close(view["head.fc2.weight"], weights["head.fc2.weight"] + personal["head.fc2.weight"])
    torch.testing.assert_close(view["body.conv1.0.weight"], weights["body.conv1.0.weight"])
    assert algo.global_model(loop.server_state) is weights          # the generic model is the global one
    client = runtime(loop, 2)
    (term,) = FedROD().data_terms(Message("train"), None, client)
    assert isinstance(term, OffsetCrossEntropy) and term.name == "balanced_ce"
    # balanced softmax adds +log pi_c (the client's prior), not the logit adjustment's -log pi_c
    counts = client.data.label_counts(client.num_classes)
    torch.testing.assert_close(term.offset, log_prior(counts))
    assert float(term.offset[counts.argmax()]) > float(term.offset[counts.argmin()])


# --- FedNH ------------------------------------------------------------------------------------

def test_fednh_prototypes_start_orthonormal():
    w = torch.randn(10, 192, generator=torch.Generator().manual_seed(1))
    q = orthonormal_rows(w)
    torch.testing.assert_close(q @ q.T, torch.eye(10), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="feature dimensions"):
        orthonormal_rows(torch.randn(5, 3))


def test_fednh_smoothed_prototype_update_hand_computed():
    prev = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
    # class 0: two clients, means (0,1) x3 and (1,0) x1 -> average (0.25, 0.75), normalised
    # class 1: one client, mean (1, 0); class 2: nobody -> keeps its prototype
    uploads = [(torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.0, 0.0]]), torch.tensor([3, 2, 0])),
               (torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.0, 0.0]]), torch.tensor([1, 0, 0]))]
    new = smoothed_prototypes(prev, uploads, rho=0.9)
    avg0 = torch.tensor([0.25, 0.75]) / math.hypot(0.25, 0.75)
    torch.testing.assert_close(new[0], F.normalize(0.9 * prev[0] + 0.1 * avg0, dim=0))
    torch.testing.assert_close(new[1], F.normalize(0.9 * prev[1] + 0.1 * torch.tensor([1.0, 0.0]), dim=0))
    torch.testing.assert_close(new[2], prev[2])


def test_fednh_cosine_ce_hand_value():
    out = Forward(torch.tensor([[3.0, 4.0]]), torch.zeros(1, 2))
    w = {"head.fc3.weight": torch.tensor([[2.0, 0.0], [0.0, 1.0]])}
    value = CosineCrossEntropy("head.fc3.weight", 10.0)(out, batch([1]), w)
    z = torch.tensor([[6.0, 8.0]])        # 10 * cos = 10 * (0.6, 0.8)
    torch.testing.assert_close(value, F.cross_entropy(z, torch.tensor([1])))


def test_fednh_learned_scale_is_read_from_the_weights_with_the_hand_gradient():
    # d/ds CE(s c, y) = sum_k p_k c_k - c_y; at s = 10, c = (0.6, 0.8), y = 1: p_0 (0.6 - 0.8)
    out = Forward(torch.tensor([[3.0, 4.0]]), torch.zeros(1, 2))
    scale = torch.tensor([10.0], requires_grad=True)
    w = {"head.fc3.weight": torch.tensor([[2.0, 0.0], [0.0, 1.0]]), SCALE_NAME: scale}
    value = CosineCrossEntropy("head.fc3.weight", 99.0, SCALE_NAME)(out, batch([1]), w)
    torch.testing.assert_close(value, F.cross_entropy(torch.tensor([[6.0, 8.0]]), torch.tensor([1])))
    (grad,) = torch.autograd.grad(value, scale)
    p0 = 1 / (1 + math.exp(2.0))
    torch.testing.assert_close(grad, torch.tensor([p0 * (0.6 - 0.8)]))


def test_fednh_learned_scale_trains_on_the_client_and_is_averaged_on_the_server(small_config):
    raw = copy.deepcopy(small_config)
    raw["model"] = {"arch": "simple_cnn"}
    loop = build_loop(config(raw, "fednh", {"learn_scale": True, "cosine_scale": 1.0}))
    state = loop.server_state
    assert torch.equal(state["model"][SCALE_NAME], torch.tensor([1.0]))    # starts at cosine_scale
    replies = {}
    for cid in (0, 1):
        reply, _ = loop.algorithm.client_update(Message("train", {"model": state["model"]}), None,
                                                runtime(loop, cid))
        assert float(reply.arrays["model"][SCALE_NAME]) > 1.0     # CE drives a small scale up
        replies[cid] = reply
    new = loop.algorithm.aggregate(dict(state), replies, ctx([0, 1], num_clients=6))
    n = [float(replies[c].scalars["num_samples"]) for c in (0, 1)]
    s = [replies[c].arrays["model"][SCALE_NAME] for c in (0, 1)]
    torch.testing.assert_close(new["model"][SCALE_NAME], (n[0] * s[0] + n[1] * s[1]) / (n[0] + n[1]))
    # the fixed-scale default has no such entry
    fixed = build_loop(config(raw, "fednh"))
    assert SCALE_NAME not in fixed.server_state["model"]


def test_fednh_refuses_a_learned_scale_that_is_not_positive(small_config):
    raw = copy.deepcopy(small_config)
    raw["model"] = {"arch": "simple_cnn"}
    loop = build_loop(config(raw, "fednh", {"learn_scale": True}))
    state = loop.server_state
    reply, _ = loop.algorithm.client_update(Message("train", {"model": state["model"]}), None, runtime(loop, 0))
    reply.arrays["model"][SCALE_NAME] = torch.tensor([-0.5])
    with pytest.raises(NumericalError, match="logit scale became -0.5 in round 1"):
        loop.algorithm.aggregate(dict(state), {0: reply}, ctx([0], num_clients=6))


def test_fednh_learned_scale_run_evaluates_and_resumes_exactly(small_config, tmp_path, monkeypatch):
    # the scale rides through evaluation (kept out of the forward pass) and the checkpoint
    raw = copy.deepcopy(small_config)
    raw["model"] = {"arch": "simple_cnn"}
    raw["algorithm"] = {"name": "fednh", "params": {"learn_scale": True, "cosine_scale": 1.0}}
    raw["train"]["rounds"] = 3
    full = Experiment.create(load_config(raw=copy.deepcopy(raw)), tmp_path / "full")
    full.run(progress=False)
    cut = Experiment.create(load_config(raw=copy.deepcopy(raw)), tmp_path / "cut")
    run_killed_in_round(cut, monkeypatch, 2)            # checkpoint after round 2
    resumed = Experiment.resume(cut.run_dir)
    resumed.run(progress=False)
    rows = read_metrics(full.run_dir)
    assert [r["round"] for r in rows] == [1, 2, 3] and all("global_acc" in r for r in rows)
    assert [r["global_acc"] for r in read_metrics(resumed.run_dir)] == [r["global_acc"] for r in rows]
    for k, v in full.loop.server_state["model"].items():
        assert torch.equal(v, resumed.loop.server_state["model"][k]), k
    assert float(full.loop.server_state["model"][SCALE_NAME]) != 1.0
    # each round records the server's scale after aggregation; the last is the final state's
    scales = [r["fednh_logit_scale"] for r in rows]
    assert len(set(scales)) == 3 and scales[-1] == float(full.loop.server_state["model"][SCALE_NAME])


class BodyAndHeadPhases(FedAvg):
    """A method of one's own whose phases know only the network's body and head."""

    name = "body_and_head_phases"
    only_body_and_head = True


def test_fednh_learned_scale_is_refused_beside_a_method_whose_phases_know_only_body_and_head(small_config):
    raw = copy.deepcopy(small_config)
    raw["model"] = {"arch": "simple_cnn"}
    init = build_loop(config(raw, "fednh")).host.init_models
    combined = compose([FedNH, BodyAndHeadPhases])
    with pytest.raises(ConfigError, match="learn_scale: fednh\\+body_and_head_phases combines FedNH with "
                                          "body_and_head_phases, whose phases"):
        combined(combined.Params(learn_scale=True)).init_server_state(init)
    assert SCALE_NAME not in combined(combined.Params()).init_server_state(init)["model"]   # the fixed scale combines
    # FedPer, FedRep and FedBABU, whose phases are such, refuse FedNH anyway: their clients train their own head
    with pytest.raises(ConfigError, match="fednh's clients train against the head the server keeps"):
        build_loop(config(raw, "fednh+fedrep", {"learn_scale": True}))


def learned_scale_round(raw: dict, method: str, params: dict):
    """One client's train round of ``method`` (FedNH combined, its scale learned from 1.0): the loop,
    the message it received, its reply and its new client state."""
    loop = build_loop(config(raw, method, {"learn_scale": True, "cosine_scale": 1.0, **params}))
    msg = loop.algorithm.train_message(loop.server_state, 0, ctx([0], num_clients=6))
    reply, new_state = loop.algorithm.client_update(msg, None, runtime(loop, 0))
    return loop, msg, reply, new_state


def test_fednh_learned_scale_gets_fedprox_pull_and_feddyn_and_scaffold_corrections(small_config):
    raw = copy.deepcopy(small_config)
    raw["model"] = {"arch": "simple_cnn"}
    # FedProx: (mu/2) * (s - s0)^2 for a scale moved by 0.3 from the received 1.0, the rest unmoved
    loop = build_loop(config(raw, "fedprox+fednh", {"learn_scale": True, "cosine_scale": 1.0, "mu": 0.5}))
    msg = loop.algorithm.train_message(loop.server_state, 0, ctx([0], num_clients=6))
    prox = next(t for t in loop.algorithm.local_terms(msg, None, runtime(loop, 0)) if t.name == "prox")
    moved = {**msg.arrays["model"], SCALE_NAME: torch.tensor([1.3])}
    out = Forward(torch.zeros(1, 2), torch.zeros(1, 2))
    assert float(prox(out, None, moved)) == pytest.approx(0.5 * 0.5 * 0.3 ** 2)
    # SCAFFOLD (option II, no momentum, c = c_i = 0 at the start): c_i+ = (x - y) / (lr K), the scale's too
    loop, msg, reply, state = learned_scale_round(raw, "scaffold+fednh", {})
    x, y = msg.arrays["model"][SCALE_NAME], reply.arrays["model"][SCALE_NAME]
    lr, steps = runtime(loop, 0).settings.lr, int(reply.scalars["steps"])
    assert not torch.equal(x, y)
    torch.testing.assert_close(state["control"][SCALE_NAME], (x - y) / (lr * steps))
    torch.testing.assert_close(reply.arrays["control"][SCALE_NAME], state["control"][SCALE_NAME])   # c_i+ - c_i
    # FedDyn: grad_k+ = grad_k - alpha (y - x), from grad_k = 0 in the first round
    loop, msg, reply, state = learned_scale_round(raw, "feddyn+fednh", {"alpha": 0.1})
    x, y = msg.arrays["model"][SCALE_NAME], reply.arrays["model"][SCALE_NAME]
    torch.testing.assert_close(state["dyn_grad"][SCALE_NAME], -0.1 * (y - x))


def test_fednh_learned_scale_is_meta_trained_by_perfedavg_and_the_prototypes_stay_frozen(small_config,
                                                                                           monkeypatch):
    raw = copy.deepcopy(small_config)
    raw["model"] = {"arch": "simple_cnn"}
    _, msg, reply, _ = learned_scale_round(raw, "fednh+perfedavg", {})
    (head,) = [k for k in msg.arrays["model"] if is_head(k)]
    assert head not in reply.arrays["model"] and SCALE_NAME in reply.arrays["model"]   # the prototypes stay home
    monkeypatch.setattr(FedNH, "without_prototypes", staticmethod(lambda model: model))    # to see what trained
    loop, msg, reply, _ = learned_scale_round(raw, "fednh+perfedavg", {})
    sent, trained = msg.arrays["model"], reply.arrays["model"]
    assert float(trained[SCALE_NAME]) > 1.0                          # CE drives a small scale up
    assert torch.equal(trained[head], sent[head])                   # FedNH's prototypes: frozen
    assert all(not torch.equal(trained[k], sent[k]) for k in sent if k.startswith("body.") and k.endswith("weight"))


def test_fednh_round_freezes_the_prototypes_locally_and_smooths_them_on_the_server(small_config):
    raw = copy.deepcopy(small_config)
    raw["model"] = {"arch": "simple_cnn"}
    loop = build_loop(config(raw, "fednh"))
    algo = loop.algorithm
    state = loop.server_state
    name = "head.fc3.weight"
    W = state["model"][name]
    torch.testing.assert_close(W @ W.T, torch.eye(10), atol=1e-5, rtol=0)
    replies = {}
    assert not algo.train_options(Message("train", {"model": state["model"]}), None, runtime(loop, 0))["trainable"](name)
    for cid in (0, 1):
        reply, _ = algo.client_update(Message("train", {"model": state["model"]}), None, runtime(loop, cid))
        assert name not in reply.arrays["model"]                            # not trained, not sent back
        assert algo.local_model(reply.arrays["model"], state["model"])[name] is W
        assert not torch.equal(reply.arrays["model"]["body.fc1.0.weight"], state["model"]["body.fc1.0.weight"])
        means, counts = reply.arrays["prototypes"]["mean"], reply.arrays["prototypes"]["count"]
        norms = means.norm(dim=1)
        torch.testing.assert_close(norms[counts > 0], torch.ones(int((counts > 0).sum())))
        replies[cid] = reply
    new = algo.aggregate(dict(state), replies, ctx([0, 1], num_clients=6))
    uploads = [(replies[c].arrays["prototypes"]["mean"], replies[c].arrays["prototypes"]["count"]) for c in (0, 1)]
    torch.testing.assert_close(new["model"][name], smoothed_prototypes(W, uploads, 0.9))
    assert not torch.equal(new["model"][name], W) and list(new["model"]) == list(state["model"])


# --- BatchNorm models: the received and the uploaded weights stay untouched ----------------------

def bn_loop(small_config, algorithm):
    """A loop whose model has BatchNorm running statistics (the small test CNN, not a ResNet: the
    property needs BN buffers, not depth)."""
    raw = copy.deepcopy(small_config)
    raw["train"]["batch_size"] = 16
    return build_loop(config(raw, algorithm), models={"cnn2": bn_model()})


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_fedntd_teacher_does_not_change_the_received_batchnorm_statistics(small_config, mode):
    raw = copy.deepcopy(small_config)
    raw["train"]["batch_size"] = 16
    loop = build_loop(config(raw, "fedntd", {"ntd_teacher": mode}), models={"cnn2": bn_model()})
    received = {k: v.clone() for k, v in loop.server_state["model"].items()}
    msg = Message("train", {"model": loop.server_state["model"]})
    loop.algorithm.client_update(msg, None, runtime(loop, 0))
    for k, v in received.items():
        assert torch.equal(loop.server_state["model"][k], v), k


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_fedntd_teacher_runs_in_the_mode_asked_for(small_config, mode):
    """On a BatchNorm model the teacher's logits are the global model's in eval mode (running
    statistics: the official code's teacher after its first client) or in train mode (batch statistics)."""
    from fedhet.training.local import forward
    from fedhet.training.mode import in_mode
    loop = bn_loop(small_config, "fedntd")
    client = runtime(loop, 0)
    weights = loop.server_state["model"]
    other = {k: v + 0.05 * torch.randn_like(v) if v.is_floating_point() and "running" not in k else v
             for k, v in weights.items()}
    x = client.data.batch(torch.arange(16))
    model = client.model.train()
    out = forward(model, weights, x.x)
    term = NotTrueDistillation(model, other, tau=2.0, beta=0.5, teacher_mode=mode)
    value = float(term(out, x, weights))
    assert model.training                                         # the student's mode is given back
    teachers = {}
    for m in ("eval", "train"):
        copy_of = {k: v.clone() for k, v in other.items()}        # a train-mode pass moves running statistics
        with torch.no_grad(), in_mode(model, training=m == "train"):
            teachers[m] = forward(model, copy_of, x.x).logits
    assert not torch.allclose(teachers["eval"], teachers["train"])
    assert value == pytest.approx(0.5 * float(not_true_kl(out.logits, teachers[mode], x.y, 2.0)), rel=1e-5)


def test_fedrod_personal_head_pass_does_not_change_the_uploaded_batchnorm_statistics(small_config, monkeypatch):
    loop = bn_loop(small_config, "fedrod")
    client = runtime(loop, 0)
    trained = {}
    real = client.train

    def keep(weights, terms=None, **kw):
        result = real(weights, terms, **kw)
        trained.update({k: v.clone() for k, v in result.weights.items()})
        return result

    client.train = keep
    reply, _ = loop.algorithm.client_update(Message("train", {"model": loop.server_state["model"]}), None, client)
    for k in client.buffer_names:
        assert torch.equal(reply.arrays["model"][k], trained[k]), k


def test_fedrod_names_the_settings_its_plain_sgd_personal_head_leaves_out():
    algo = FedROD(FedROD.Params())
    assert algo.settings_not_applied(TrainSettings(epochs=1, batch_size=8, lr=0.1)) == {}
    dropped = algo.settings_not_applied(TrainSettings(epochs=1, batch_size=8, lr=0.1, momentum=0.9, weight_decay=1e-5))
    assert set(dropped) == {"train.momentum", "train.weight_decay"} and "personal head" in dropped["train.momentum"]
    combined = algorithm_class("fedrod+perfedavg")(algorithm_class("fedrod+perfedavg").Params())
    both = combined.settings_not_applied(TrainSettings(epochs=1, batch_size=8, lr=0.1, clip_grad_norm=1.0,
                                                       optimizer_state="keep"))
    assert set(both) == {"train.clip_grad_norm", "train.optimizer_state"}        # FedROD's and Per-FedAvg's
    # a setting both leave out carries both reasons: the whole model's meta steps and the personal head
    assert "Per-FedAvg" in both["train.clip_grad_norm"] and "personal head" in both["train.clip_grad_norm"]
