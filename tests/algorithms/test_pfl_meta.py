"""Per-FedAvg, FedBABU and FedDistill: hand-computed steps, phases, frozen heads, logits, short runs."""

import copy
import dataclasses
import math

import numpy as np
import pydantic
import pytest
import torch
from helpers import train_call_view
from torch import nn

from fedhet.algorithms import algorithm_class
from fedhet.algorithms.fedavg import FedAvg
from fedhet.algorithms.fedbabu import FINETUNED, FedBABU
from fedhet.algorithms.feddistill import Distillation, FedDistill, local_logits
from fedhet.algorithms.perfedavg import ADAPTED, PerFedAvg, hessian_vector_product
from fedhet.algorithms.prototypes import aggregate_prototypes
from fedhet.core.contract import (
    Batch,
    ClientData,
    Forward,
    Message,
    RoundContext,
    TrainSettings,
)
from fedhet.core.seeding import torch_generator
from fedhet.experiment.config import load_config
from fedhet.experiment.runner import Experiment, read_metrics
from fedhet.models.base import SplitModel
from fedhet.training.local import epoch_batches, forward, train_local
from fedhet.training.objective import CrossEntropy, LossTerm


# --- tiny fixtures ------------------------------------------------------------------------
class VecNet(nn.Module):
    """One parameter vector ``w`` (2,); the loss is supplied by :class:`BatchQuadratic`."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(2))

    def forward(self, x, with_features=False):
        h, logits = torch.zeros(len(x), 1), torch.zeros(len(x), 2)
        return (h, logits) if with_features else logits


def quad_coeffs(index):
    """A (2x2, symmetric positive definite) and b (2,) fixed by the batch's positions."""
    s = float(index.sum())
    A = torch.tensor([[1.0 + 0.1 * s, 0.3], [0.3, 2.0]])
    b = torch.tensor([1.0, -0.5 + 0.05 * s])
    return A, b


class BatchQuadratic(LossTerm):
    """f(w; D) = 0.5 (w - b_D)^T A_D (w - b_D): gradient A_D (w - b_D), Hessian A_D."""

    name = "quad"

    def __call__(self, out, batch, weights):
        A, b = quad_coeffs(batch.index)
        d = weights["w"] - b
        return 0.5 * d @ A @ d


def tiny_data(n=10, d_in=3, classes=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (n, d_in, 1, 1), dtype=torch.uint8, generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    return ClientData(x, y, torch.arange(n), torch.full((1, 1, 1, 1), 0.5), torch.full((1, 1, 1, 1), 0.25))


class Runtime:
    """A ClientRuntime running real ``train_local``; ``data_loss`` replaces the cross-entropy term."""

    def __init__(self, model, data, settings, data_loss=None, cid=0, init=None, classes=2):
        self.cid, self.round, self.arch, self.num_classes = cid, 0, "tiny", classes
        self.model, self.data, self.settings, self.data_loss = model, data, settings, data_loss
        self.buffer_names = [n for n, _ in model.named_buffers()]
        self.num_samples = len(data.train_idx)
        self.init = init if init is not None else {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.accounted = []

    def train(self, weights, terms=None, *, epochs=None, carry_optimizer_state=True, data=None, settings=None,
              stream="batches", **kw):
        # no optimizer state is carried across rounds here, so carry_optimizer_state changes nothing
        terms = list(terms or [CrossEntropy()])
        if self.data_loss is not None:
            terms = [self.data_loss if isinstance(t, CrossEntropy) else t for t in terms]
        data, s = train_call_view(self, epochs, data, settings)
        result = train_local(self.model, weights, data, terms, s,
                             lambda e: self.generator(stream, e), **kw)
        self.account(result)
        return result

    def account(self, result):
        self.accounted.append(result)

    def generator(self, *purpose):
        return torch_generator(0, self.cid, *purpose)

    def init_weights(self):
        return {k: v.clone() for k, v in self.init.items()}


class QuadPerFedAvg(PerFedAvg):
    """Per-FedAvg whose data term is the batch quadratic."""

    def data_terms(self, msg, state, client):
        return [BatchQuadratic()]


def quad_runtime(n, batch_size, epochs=1, lr=0.1):
    data = ClientData(torch.zeros(n, 1, 1, 1, dtype=torch.uint8), torch.zeros(n, dtype=torch.long), torch.arange(n),
                      torch.zeros(1, 1, 1, 1), torch.ones(1, 1, 1, 1))
    return Runtime(VecNet(), data, TrainSettings(epochs=epochs, batch_size=batch_size, lr=lr))


def split_net(seed=0, d_in=3, hidden=4, classes=2):
    torch.manual_seed(seed)
    stages = [("fc0", nn.Sequential(nn.Flatten(), nn.Linear(d_in, hidden), nn.ReLU())),
              ("fc1", nn.Linear(hidden, classes))]
    return SplitModel(stages, "fc1", (d_in, 1, 1))


def ctx(clients, num_clients=4, evaluating=False, sizes=None, num_classes=2):
    return RoundContext(round=0, clients=clients, num_clients=num_clients, num_classes=num_classes,
                        client_sizes=sizes or {c: 1 for c in range(num_clients)}, rng=np.random.default_rng(0),
                        evaluating=evaluating)


def drive(algo, state, context, *all_replies):
    """Run one server round, answering each phase with the next replies; returns (phases, new state)."""
    gen = algo.round(state, context)
    phases = [next(gen)]
    for replies in all_replies:
        try:
            phases.append(gen.send(replies))
        except StopIteration as stop:
            return phases, stop.value
    raise AssertionError(f"the round yielded more phases than answered: {len(phases)}")


def reply(model, n=1, **groups):
    return Message("update", {"model": model, **groups}, {"num_samples": n})


# --- Per-FedAvg ---------------------------------------------------------------------------
@pytest.mark.parametrize("hvp", ["exact", "finite_difference"])
def test_perfedavg_local_steps_match_closed_form(hvp):
    """Two epochs of Algorithm 1's local step on batch quadratics, FO (2 batches/step) and HF (3 batches)."""
    alpha, beta, w0 = 0.3, 0.2, torch.tensor([0.5, -1.0])
    for variant, group in (("fo", 2), ("hf", 3)):
        rt = quad_runtime(n=6, batch_size=1, epochs=2)       # 6 batches/epoch: 3 FO steps or 2 HF steps
        algo = QuadPerFedAvg(PerFedAvg.Params(perfedavg_variant=variant, perfedavg_alpha=alpha,
                                              perfedavg_beta=beta, perfedavg_hvp=hvp))
        rep, st = algo.client_update(Message("train", {"model": {"w": w0.clone()}}), None, rt)
        w = w0.double()
        losses = []
        for e in range(2):
            batches = epoch_batches(6, 1, False, rt.generator("batches", e))
            for i in range(6 // group):
                coeffs = [tuple(t.double() for t in quad_coeffs(batches[i * group + j])) for j in range(group)]
                (A1, b1), (A2, b2) = coeffs[0], coeffs[1]
                w_tmp = w - alpha * A1 @ (w - b1)                        # w - alpha grad f(w; D)
                g2 = A2 @ (w_tmp - b2)                                   # grad f(w_tmp; D')
                losses.append(float(0.5 * (w_tmp - b2) @ A2 @ (w_tmp - b2)))
                if variant == "hf":
                    A3 = coeffs[2][0]                                    # Hessian on D''
                    g2 = g2 - alpha * A3 @ g2                            # (I - alpha H) g2
                w = w - beta * g2
        tol = 1e-5 if hvp == "exact" or variant == "fo" else 1e-3    # fp32 central difference: ~eps/delta
        torch.testing.assert_close(rep.arrays["model"]["w"].double(), w, rtol=tol, atol=tol)
        assert rep.scalars["steps"] == 2 * (6 // group)
        assert rep.scalars["loss"] == pytest.approx(np.mean(losses), rel=tol)
        assert len(rt.accounted) == 1 and rt.accounted[0].samples == 2 * (6 // group) * group
        assert st is None                                                 # FedAvg-like: no client state


def test_perfedavg_hvp_exact_on_a_network_matches_autograd_hessian():
    torch.manual_seed(0)
    model, data = split_net(), tiny_data()
    w = {k: v.detach().clone() for k, v in model.state_dict().items()}
    batch = data.batch(torch.arange(10))
    v = {k: torch.randn_like(t) for k, t in w.items()}
    hv = hessian_vector_product(model, w, {}, [CrossEntropy()], batch, v)
    names = list(w)
    flat = torch.cat([w[k].flatten() for k in names])

    def f(theta):
        parts, i = {}, 0
        for k in names:
            parts[k] = theta[i:i + w[k].numel()].view_as(w[k])
            i += w[k].numel()
        return CrossEntropy()(forward(model, parts, batch.x), batch, parts)

    H = torch.autograd.functional.hessian(f, flat)
    expect = H @ torch.cat([v[k].flatten() for k in names])
    torch.testing.assert_close(torch.cat([hv[k].flatten() for k in names]), expect, rtol=1e-4, atol=1e-6)
    fd = hessian_vector_product(model, w, {}, [CrossEntropy()], batch, v, "finite_difference", 1e-3)
    torch.testing.assert_close(torch.cat([fd[k].flatten() for k in names]), expect, rtol=1e-2, atol=1e-3)


def test_perfedavg_defaults_follow_the_run_learning_rate_and_params_are_specific():
    p = PerFedAvg.Params()
    assert p.perfedavg_variant == "fo" and p.perfedavg_alpha is None and p.perfedavg_beta is None
    rt = quad_runtime(4, 2, lr=0.07)
    assert PerFedAvg().alpha(rt) == PerFedAvg().beta(rt) == 0.07
    with pytest.raises(pydantic.ValidationError):
        PerFedAvg.Params(perfedavg_variant="so")
    with pytest.raises(pydantic.ValidationError):
        PerFedAvg.Params(alpha=0.1)                       # generic names are rejected
    algorithm_class("perfedavg+fedprox")                  # no parameter clash with FedProx


def test_perfedavg_adaptation_phase_only_when_evaluating_and_server_state_unchanged():
    algo, fedavg = PerFedAvg(), FedAvg()
    init = {"w": torch.tensor([1.0, 2.0])}
    replies = {1: reply({"w": torch.tensor([3.0, 0.0])}, 1), 2: reply({"w": torch.tensor([5.0, 4.0])}, 3)}
    _, expect = drive(fedavg, fedavg.init_server_state({"m": init}), ctx([1, 2]), replies)

    phases, state = drive(algo, algo.init_server_state({"m": init}), ctx([1, 2], evaluating=False), replies)
    assert len(phases) == 1
    torch.testing.assert_close(state["model"]["w"], expect["model"]["w"])

    adapted_replies = {c: Message("adapted", scalars={"num_samples": 1}) for c in range(4)}
    phases, state = drive(algo, algo.init_server_state({"m": init}), ctx([1, 2], evaluating=True), replies, adapted_replies)
    assert len(phases) == 2 and sorted(phases[1]) == [0, 1, 2, 3]          # ALL clients adapt
    assert {m.kind for m in phases[1].values()} == {"adapt"}
    assert all(m.arrays["eval_model"] is state["model"] for m in phases[1].values())
    assert set(state) == {"model"} and torch.equal(state["model"]["w"], expect["model"]["w"])


def test_perfedavg_client_adapts_one_step_and_training_ignores_it():
    alpha = 0.25
    rt = quad_runtime(n=4, batch_size=2)
    algo = QuadPerFedAvg(PerFedAvg.Params(perfedavg_alpha=alpha, perfedavg_beta=0.1))
    w = torch.tensor([0.5, -1.0])
    rep, st = algo.client_update(Message("adapt", {"eval_model": {"w": w}}), {"other": 1}, rt)
    assert rep.arrays == {} and rep.scalars == {"num_samples": 4}
    assert rt.accounted == []                                              # evaluation, not training
    batch = epoch_batches(4, 2, False, rt.generator("perfedavg_adapt"))[0]
    A, b = quad_coeffs(batch)
    torch.testing.assert_close(st[ADAPTED]["w"], w - alpha * A @ (w - b))
    assert st["other"] == 1
    assert algo.client_model(0, {"model": {"w": w}}, st) is st[ADAPTED]
    assert algo.client_model(0, {"model": {"w": w}}, None)["w"] is w     # never adapted: the global model
    # the next training starts from the received model, not the adapted one, and drops it
    rep2, st2 = algo.client_update(Message("train", {"model": {"w": w}}), st, rt)
    rep3, _ = algo.client_update(Message("train", {"model": {"w": w}}), None, quad_runtime(n=4, batch_size=2))
    assert torch.equal(rep2.arrays["model"]["w"], rep3.arrays["model"]["w"])
    assert st2 == {"other": 1}


# --- FedBABU ------------------------------------------------------------------------------
def test_fedbabu_head_stays_bitwise_frozen_in_training_and_aggregation():
    model = split_net(seed=1)
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    algo = FedBABU()
    state = algo.init_server_state({"tiny": {k: v.clone() for k, v in init.items()}})
    head = [k for k in init if k.startswith("head.")]
    assert head == ["head.fc1.weight", "head.fc1.bias"]
    phase = {c: algo.train_message(state, c, ctx([0, 1])) for c in (0, 1)}
    assert all(not (set(m.arrays["model"]) & set(head)) for m in phase.values())      # head never sent
    replies = {}
    for c in (0, 1):
        rt = Runtime(model, tiny_data(seed=c), TrainSettings(epochs=2, batch_size=4, lr=0.5, momentum=0.9), cid=c, init=init)
        rep, _ = algo.client_update(phase[c], None, rt)
        trained = rt.accounted[0].weights
        for k in head:
            assert torch.equal(trained[k], init[k]), k                              # bitwise unchanged
        assert not torch.equal(trained["body.fc0.1.weight"], init["body.fc0.1.weight"])
        assert set(rep.arrays["model"]) == {"body.fc0.1.weight", "body.fc0.1.bias"}  # head never uploaded
        replies[c] = Message("update", rep.arrays, {"num_samples": 1 + 2 * c})
    _, new = drive(algo, state, ctx([0, 1]), replies)
    for k in head:
        assert torch.equal(new["model"][k], init[k])
    body = "body.fc0.1.weight"
    torch.testing.assert_close(new["model"][body], (replies[0].arrays["model"][body] + 3 * replies[1].arrays["model"][body]) / 4)
    assert list(new["model"]) == list(init)


def test_fedbabu_finetuning_is_per_client_and_never_reaches_the_global_model():
    model = split_net(seed=2)
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    algo = FedBABU(FedBABU.Params(finetune_epochs=2))
    state = algo.init_server_state({"tiny": {k: v.clone() for k, v in init.items()}})
    replies = {0: Message("update", {"model": {k: v + 0.1 for k, v in init.items() if k.startswith("body.")}},
                          {"num_samples": 1})}
    phases, _ = drive(algo, state, ctx([0], num_clients=3, evaluating=False), replies)
    assert len(phases) == 1
    done = {c: Message("finetuned", scalars={"num_samples": 1}) for c in range(3)}
    phases, new = drive(algo, state, ctx([0], num_clients=3, evaluating=True), replies, done)
    assert len(phases) == 2 and sorted(phases[1]) == [0, 1, 2]
    msg = phases[1][1]
    assert msg.kind == "finetune" and not any(k.startswith("head.") for k in msg.arrays["eval_model"])
    before = {k: v.clone() for k, v in new["model"].items()}
    rt = Runtime(model, tiny_data(seed=5), TrainSettings(epochs=1, batch_size=4, lr=0.5), cid=1, init=init)
    rep, st = algo.client_update(msg, {"buffers": {}}, rt)
    assert rep.arrays == {} and rep.scalars == {"num_samples": 10}
    assert len(rt.accounted) == 1 and rt.accounted[0].steps == 2 * 3               # client compute: counted
    tuned = st[FINETUNED]
    assert st["buffers"] == {}
    for k, v in new["model"].items():
        assert torch.equal(v, before[k])                                           # global model untouched
        assert not torch.equal(tuned[k], v), k                                     # full fine-tuning moved all
    assert algo.client_model(1, new, st) is tuned
    assert algo.client_model(2, new, None) is new["model"]
    # the fine-tune equals train_local on the full model, epochs numbered after the E training epochs
    ref = train_local(model, new["model"], rt.data, [CrossEntropy()],
                      TrainSettings(epochs=2, batch_size=4, lr=0.5), lambda e: rt.generator("batches", e), start_epoch=1)
    for k in tuned:
        torch.testing.assert_close(tuned[k], ref.weights[k])
    # the official personalized evaluation's lr and momentum (analysis.ipynb: 1e-3, 0.9) instead of the run's
    official = FedBABU(FedBABU.Params(finetune_epochs=2, finetune_lr=1e-3, finetune_momentum=0.9))
    _, st_o = official.client_update(msg, None, rt)
    ref_o = train_local(model, new["model"], rt.data, [CrossEntropy()],
                        TrainSettings(epochs=2, batch_size=4, lr=1e-3, momentum=0.9), lambda e: rt.generator("batches", e),
                        start_epoch=1)
    for k in tuned:
        torch.testing.assert_close(st_o[FINETUNED][k], ref_o.weights[k])
    assert not torch.allclose(st_o[FINETUNED]["head.fc1.weight"], tuned["head.fc1.weight"])
    # head-only fine-tuning leaves the body; the next training drops the fine-tuned model
    head_only = FedBABU(FedBABU.Params(finetune_epochs=1, finetune_part="head"))
    _, st_h = head_only.client_update(msg, None, rt)
    assert torch.equal(st_h[FINETUNED]["body.fc0.1.weight"], new["model"]["body.fc0.1.weight"])
    assert not torch.equal(st_h[FINETUNED]["head.fc1.weight"], new["model"]["head.fc1.weight"])
    _, st2 = algo.client_update(algo.train_message(new, 1, ctx([1])), st, rt)
    assert st2 == {"buffers": {}}                                               # fine-tuned model dropped


# --- FedDistill ---------------------------------------------------------------------------
def test_feddistill_global_logits_unweighted_mean_with_a_missing_class():
    a = (torch.tensor([[1.0, 0.0, 0.0], [0.0, 2.0, 0.0], [0.0, 0.0, 0.0]]), torch.tensor([5, 1, 0]))
    b = (torch.tensor([[3.0, 2.0, 1.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]), torch.tensor([1, 0, 0]))
    mean, defined = aggregate_prototypes([a, b], "uniform")       # FedDistill's server rule
    assert defined.tolist() == [True, True, False]
    torch.testing.assert_close(mean[0], torch.tensor([2.0, 1.0, 0.5]))             # (a + b)/2, counts ignored
    torch.testing.assert_close(mean[1], torch.tensor([0.0, 2.0, 0.0]))             # only a saw class 1
    torch.testing.assert_close(mean[2], torch.zeros(3))
    assert aggregate_prototypes([], "uniform") is None
    # server: rebuilt from this round's uploads only; kept when nobody replied
    algo = FedDistill()
    state = algo.init_server_state({})
    assert algo.train_message(state, 0, ctx([0])).arrays == {}
    _, state = drive(algo, state, ctx([0, 1], num_classes=3),
                     {0: Message("update", {"logits": {"mean": a[0], "count": a[1]}}),
                      1: Message("update", {"logits": {"mean": b[0], "count": b[1]}})})
    torch.testing.assert_close(state["logits"], mean)
    msg = algo.train_message(state, 0, ctx([0]))
    assert torch.equal(msg.arrays["global_logits"]["defined"], defined)
    _, kept = drive(algo, state, ctx([0], num_classes=3), {})
    assert kept["logits"] is state["logits"]
    _, fresh = drive(algo, state, ctx([1], num_classes=3), {1: Message("update", {"logits": {"mean": b[0], "count": b[1]}})})
    assert fresh["defined"].tolist() == [True, False, False]


def test_feddistill_leave_one_out_sends_each_client_the_others_mean():
    """Jeong et al.'s global ensembling: client i distils towards the others' uploads only."""
    a = (torch.tensor([[1.0, 0.0, 0.0], [0.0, 2.0, 0.0], [0.0, 0.0, 0.0]]), torch.tensor([5, 1, 0]))
    b = (torch.tensor([[3.0, 2.0, 1.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]), torch.tensor([1, 0, 0]))
    c = (torch.tensor([[5.0, 4.0, 2.0], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0]]), torch.tensor([2, 0, 3]))
    algo = FedDistill(FedDistill.Params(leave_one_out=True))
    state = algo.init_server_state({})
    _, state = drive(algo, state, ctx([0, 1, 2], num_classes=3),
                     {i: Message("update", {"logits": {"mean": u[0], "count": u[1]}}) for i, u in enumerate((a, b, c))})
    sent = {i: algo.train_message(state, i, ctx([i], num_clients=4)).arrays["global_logits"] for i in range(4)}
    # client 0: class 0 from b and c, (3+5)/2, (2+4)/2, (1+2)/2; class 1 only it saw: none; class 2 from c
    torch.testing.assert_close(sent[0]["mean"][0], torch.tensor([4.0, 3.0, 1.5]))
    assert sent[0]["defined"].tolist() == [True, False, True]
    torch.testing.assert_close(sent[0]["mean"][2], torch.tensor([1.0, 1.0, 1.0]))
    # client 2: class 0 from a and b, (1+3)/2, (0+2)/2, (0+1)/2; class 1 from a; class 2 only it saw
    torch.testing.assert_close(sent[2]["mean"][0], torch.tensor([2.0, 1.0, 0.5]))
    assert sent[2]["defined"].tolist() == [True, True, False]
    # client 3 did not reply: the mean over all, as PFLlib sends everyone
    torch.testing.assert_close(sent[3]["mean"], state["logits"])
    torch.testing.assert_close(state["logits"][0], torch.tensor([3.0, 2.0, 1.0]))
    # PFLlib's rule (the default) sends client 0 the mean with its own upload
    plain = FedDistill()
    _, st = drive(plain, plain.init_server_state({}), ctx([0, 1, 2], num_classes=3),
                  {i: Message("update", {"logits": {"mean": u[0], "count": u[1]}}) for i, u in enumerate((a, b, c))})
    torch.testing.assert_close(plain.train_message(st, 0, ctx([0])).arrays["global_logits"]["mean"][0],
                               torch.tensor([3.0, 2.0, 1.0]))


def test_feddistill_loss_values_hand_computed():
    z = torch.tensor([[1.0, 0.0], [0.0, 2.0]], requires_grad=True)
    y = torch.tensor([0, 1])
    g = torch.tensor([[2.0, 0.0], [9.0, 9.0]])
    batch = Batch(torch.zeros(2, 1), y, torch.arange(2))
    out = Forward(torch.zeros(2, 1), z)
    # class 1 undefined: sample 2's target is its own logits
    term = Distillation(0.5, 2, g, torch.tensor([True, False]), "soft_ce")
    p0 = [math.exp(2) / (math.exp(2) + 1), 1 / (math.exp(2) + 1)]                    # softmax(g[0])
    ls0 = [1 - math.log(math.e + 1), -math.log(math.e + 1)]                         # log softmax([1, 0])
    q1 = [1 / (1 + math.exp(2)), math.exp(2) / (1 + math.exp(2))]                    # softmax([0, 2])
    ce0 = -(p0[0] * ls0[0] + p0[1] * ls0[1])
    ce1 = -(q1[0] * math.log(q1[0]) + q1[1] * math.log(q1[1]))                    # own entropy
    value = term(out, batch, {})
    assert value.item() == pytest.approx(0.5 * (ce0 + ce1) / 2, rel=1e-6)
    (grad,) = torch.autograd.grad(value, z)
    assert torch.allclose(grad[1], torch.zeros(2), atol=1e-7)                       # no pull without a target
    torch.testing.assert_close(grad[0], 0.5 / 2 * (torch.tensor(ls0).exp() - torch.tensor(p0)).float())
    mse = Distillation(2.0, 2, g, torch.tensor([True, False]), "mse")
    # ((1-2)^2 + (0-0)^2 + 0 + 0) / 4 entries
    assert mse(out, batch, {}).item() == pytest.approx(2.0 * 1 / 4)
    none = Distillation(1.0, 2)
    assert none(out, batch, {}).item() == 0.0
    stats = {f"distill.{k}": v for k, v in none.statistics(out, batch).items()}     # statistics only
    means, counts = local_logits(stats, 2)
    assert counts.tolist() == [1, 1] and torch.equal(means, z.detach())


def test_feddistill_client_uploads_mean_logits_and_keeps_its_model():
    model, data = split_net(seed=3, classes=3), tiny_data(n=9, classes=3, seed=4)
    rt = Runtime(model, data, TrainSettings(epochs=2, batch_size=4, lr=0.0), classes=3)
    algo = FedDistill()
    rep, st = algo.client_update(Message("train"), None, rt)
    assert set(rep.arrays) == {"logits"} and set(st) == {"model"}
    logits = forward(model, rt.init, data.inputs(data.train_idx)).logits.detach()
    counts = torch.bincount(data.y, minlength=3)
    assert rep.arrays["logits"]["count"].tolist() == (2 * counts).tolist()         # every sample of both epochs
    for c in range(3):
        if counts[c]:
            torch.testing.assert_close(rep.arrays["logits"]["mean"][c], logits[data.y == c].mean(0))
    assert algo.client_model(0, {}, st) is st["model"] and algo.client_model(1, {}, None) is None
    # with lr > 0 the client continues from its own model on the next round
    rt2 = Runtime(model, data, TrainSettings(epochs=1, batch_size=4, lr=0.1), classes=3)
    _, st2 = algo.client_update(Message("train"), {"model": {k: v + 1 for k, v in rt.init.items()}}, rt2)
    ref = train_local(model, {k: v + 1 for k, v in rt.init.items()}, data, [CrossEntropy()], rt2.settings,
                      lambda e: rt2.generator("batches", e))
    for k in ref.weights:
        torch.testing.assert_close(st2["model"][k], ref.weights[k])
    # the server's logits reach the distillation term with their classes and the method's weight and loss
    g = {"mean": torch.randn(3, 3), "defined": torch.tensor([True, False, True])}
    rt3 = Runtime(model, data, TrainSettings(epochs=1, batch_size=4, lr=0.0), classes=3)
    seen, real_train = [], rt3.train
    rt3.train = lambda weights, terms=None, **kw: (seen.append(list(terms)), real_train(weights, terms, **kw))[1]
    FedDistill(FedDistill.Params(distill_weight=0.3, distill_loss="mse")).client_update(
        Message("train", {"global_logits": g}), None, rt3)
    (ce, term), = seen
    assert isinstance(ce, CrossEntropy) and isinstance(term, Distillation)
    assert term.global_logits is g["mean"] and term.defined.tolist() == [True, False, True]
    assert (term.weight, term.kind) == (0.3, "mse")


# --- end to end ---------------------------------------------------------------------------
def e2e(small_config, tmp_path, name, params, evaluation=None):
    cfg = copy.deepcopy(small_config)
    cfg["algorithm"] = {"name": name, "params": params}
    cfg["train"]["rounds"] = 2
    cfg["eval"] = {**cfg["eval"], **(evaluation or {})}
    exp = Experiment.create(load_config(raw=cfg), tmp_path / name)
    exp.run(progress=False)
    return exp, read_metrics(exp.run_dir)


@pytest.mark.parametrize("name,params", [("perfedavg", {}), ("fedbabu", {"finetune_epochs": 1})])
def test_the_adaptation_before_an_evaluation_serves_the_evaluated_clients_only(small_config, tmp_path, name,
                                                                               params):
    """eval.clients: sampled: only the round's sampled clients adapt (the ledger's eval_model
    traffic, the states that hold an adapted model); without personalized metrics nobody does."""
    exp, rows = e2e(small_config, tmp_path / "sampled", name, params, {"clients": "sampled"})
    n = sum(v.numel() for k, v in exp.loop.server_state["model"].items()
            if name == "perfedavg" or not k.startswith("head."))
    key = ADAPTED if name == "perfedavg" else FINETUNED
    for row in rows:
        assert row["phases"] == 2 and row["personal_clients"] == len(row["clients"]) == 3
        assert row["comm"]["down/eval_model"]["floats"] == 3 * n
    # an adapted model stays in a state until that client trains again: those of both rounds' evaluations
    assert {c for c, s in exp.loop.client_states.items() if key in s} == {c for r in rows for c in r["clients"]} != \
        set(range(small_config["data"]["num_clients"]))
    exp, rows = e2e(small_config, tmp_path / "global_only", name, params, {"personalized": False})
    assert all(row["phases"] == 1 and "down/eval_model" not in row["comm"] for row in rows)
    assert not any(key in s for s in exp.loop.client_states.values())


@pytest.mark.parametrize("name,params", [
    ("perfedavg", {"perfedavg_variant": "hf"}),
    ("fedbabu", {"finetune_epochs": 1}),
    ("feddistill", {}),
])
def test_end_to_end_produces_personal_accuracy(small_config, tmp_path, name, params):
    exp, rows = e2e(small_config, tmp_path, name, params)
    assert [r["round"] for r in rows] == [1, 2]
    assert exp.summary["headline_metric"] == "personal_acc" and exp.summary["status"] == "completed"
    for r in rows:
        assert math.isfinite(r["personal_acc"]) and r["personal_acc"] > 0.1           # 10 classes
        assert math.isfinite(r["train_loss"])
    K = small_config["data"]["num_clients"]
    comm = rows[-1]["comm"]
    if name == "feddistill":
        assert "global_acc" not in rows[-1] and rows[-1]["feddistill_classes_defined"] > 0
        assert set(comm) == {"down/global_logits", "up/logits"}
        assert len(exp.loop.client_states) == len({c for r in rows for c in r["clients"]})
    else:
        assert "global_acc" in rows[-1] and rows[-1]["phases"] == 2
        n = sum(v.numel() for v in exp.loop.server_state["model"].values())
        shared = n if name == "perfedavg" else n - sum(v.numel() for k, v in exp.loop.server_state["model"].items()
                                                          if k.startswith("head."))
        assert comm["down/eval_model"]["floats"] == K * shared                          # all clients, every eval
        assert comm["up/model"]["floats"] == 3 * shared
        key = ADAPTED if name == "perfedavg" else FINETUNED
        assert all(key in s for s in exp.loop.client_states.values()) and len(exp.loop.client_states) == K
    if name == "fedbabu":
        init = exp.loop.host.init_models["cnn2"]
        for k, v in exp.loop.server_state["model"].items():
            if k.startswith("head."):
                assert torch.equal(v, init[k]), k


def test_perfedavg_weights_overflowing_in_the_only_step_are_a_numerical_error(small_config):
    """One meta-step (batches larger than any client): its losses are finite, its outer update
    (beta = inf) is not, so only the finite check of the weights can stop the client."""
    from helpers import build_loop, config

    from fedhet.core.errors import NumericalError

    cfg = config(small_config, "perfedavg", {"perfedavg_alpha": 0.01, "perfedavg_beta": 1.0}, batch_size=100_000)
    loop = build_loop(cfg)
    loop.algorithm.params.perfedavg_beta = float("inf")     # set after building: the config refuses inf
    with pytest.raises(NumericalError, match=r"parameter '.*' became non-finite"):
        loop.run_round(0)


def test_perfedavg_names_the_training_settings_its_plain_sgd_meta_steps_leave_out():
    algo = PerFedAvg(PerFedAvg.Params())
    plain = TrainSettings(epochs=1, batch_size=8, lr=0.01)
    assert algo.settings_not_applied(plain) == {}
    fedrema_t1 = TrainSettings(epochs=1, batch_size=8, lr=0.01, momentum=0.9, clip_grad_norm=10.0,
                               optimizer_state="keep", precision="bf16")
    # bf16 with run.memory_format auto trains in channels_last, which the meta steps do not
    assert set(algo.settings_not_applied(fedrema_t1)) == {"train.momentum", "train.clip_grad_norm",
                                                           "train.optimizer_state", "run.precision",
                                                           "run.memory_format"}
    assert FedAvg(FedAvg.Params()).settings_not_applied(fedrema_t1) == {}
    assert algo.settings_not_applied(dataclasses.replace(plain, memory_format="channels_last")) == {
        "run.memory_format": "Per-FedAvg's meta steps run in the default layout"}


def test_a_run_warns_of_the_settings_its_method_leaves_out_and_records_them(small_config, tmp_path):
    cfg = copy.deepcopy(small_config)
    cfg["algorithm"] = {"name": "perfedavg"}
    cfg["train"].update(rounds=1, momentum=0.9, weight_decay=1e-4)
    with pytest.warns(UserWarning, match=r"perfedavg does not apply train.momentum \(Per-FedAvg's meta steps are "
                                         r"plain SGD.*; train.weight_decay \("):
        exp = Experiment.create(load_config(raw=cfg), tmp_path / "run")
    exp.run(progress=False)
    assert set(exp.summary["settings_not_applied"]) == {"train.momentum", "train.weight_decay"}
    cfg["algorithm"] = {"name": "fedavg"}
    fedavg = Experiment.create(load_config(raw=cfg), tmp_path / "fedavg")
    fedavg.run(progress=False)
    assert "settings_not_applied" not in fedavg.summary
