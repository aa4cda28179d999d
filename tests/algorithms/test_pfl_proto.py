"""Prototypes, FedPer, FedRep, FedProto and FedPAC: hand-computed cases against the papers' equations
and the reference code, then a short run of each method."""

import copy
import itertools
import math

import numpy as np
import pytest
import torch
from helpers import train_call_view
from torch import nn

from fedhet.algorithms.fedpac import (
    FedPAC,
    classifier_weights,
    combine_heads,
    feature_statistics,
    head_objective,
    simplex_qp,
)
from fedhet.algorithms.fedper import FedPer
from fedhet.algorithms.fedproto import FedProto, nearest_prototype_head
from fedhet.algorithms.fedrep import FedRep
from fedhet.algorithms.prototypes import (
    ClassStatistics,
    PrototypeAlignment,
    aggregate_prototypes,
    class_means,
    class_statistics,
)
from fedhet.core.contract import (
    Batch,
    ClientData,
    Forward,
    Message,
    RoundContext,
    TrainSettings,
)
from fedhet.core.errors import ConfigError, NumericalError
from fedhet.core.seeding import torch_generator
from fedhet.core.split import is_body, is_head
from fedhet.experiment.config import load_config
from fedhet.experiment.runner import Experiment, read_metrics
from fedhet.models.base import SplitModel
from fedhet.training.local import train_local
from fedhet.training.objective import CrossEntropy
from fedhet.training.phases import train_head_then_body


# --- tiny fixtures ------------------------------------------------------------------------
def tiny_model(d_in=3, hidden=4, classes=2, dropout=False):
    body = [nn.Flatten(), nn.Linear(d_in, hidden), nn.ReLU()] if hidden else [nn.Flatten()]
    if dropout:
        body.append(nn.Dropout(0.5))
    return SplitModel([("enc", nn.Sequential(*body)), ("fc", nn.Linear(hidden or d_in, classes))], "fc", (d_in, 1, 1))


def raw_data(x, y):
    """ClientData whose normalised inputs equal ``x`` (mean 0, std 1/255)."""
    x = torch.as_tensor(x, dtype=torch.uint8).reshape(len(y), -1, 1, 1)
    return ClientData(x, torch.as_tensor(y), torch.arange(len(y)), torch.zeros(1, 1, 1, 1), torch.full((1, 1, 1, 1), 1 / 255))


def random_data(n=12, d_in=3, classes=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return ClientData(torch.randint(0, 256, (n, d_in, 1, 1), dtype=torch.uint8, generator=g),
                      torch.arange(n) % classes, torch.arange(n), torch.full((1, 1, 1, 1), 0.5), torch.full((1, 1, 1, 1), 0.25))


def weights_of(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class Runtime:
    """A ClientRuntime running the real ``train_local``; records every ``train`` call."""

    def __init__(self, model, data, settings, classes=2, cid=0):
        self.cid, self.round, self.arch, self.num_classes = cid, 0, "tiny", classes
        self.model, self.data, self.settings = model, data, settings
        self.buffer_names = [n for n, _ in model.named_buffers()]
        self.num_samples = len(data.train_idx)
        self.init = weights_of(model)
        self.calls = []

    def train(self, weights, terms=None, *, epochs=None, start_epoch=0, trainable=None, optimizer_state=None, augment=None,
              statistics=None, carry_optimizer_state=True, data=None, settings=None, stream="batches"):
        # ClientRuntime.train's options; no optimizer state is carried across rounds here
        data, s = train_call_view(self, epochs, data, settings)
        names = [n for n, _ in self.model.named_parameters()]
        self.calls.append({"epochs": s.epochs, "start": start_epoch, "terms": list(terms or []), "start_weights": weights,
                           "trainable": [n for n in names if trainable is None or trainable(n)]})
        return train_local(self.model, weights, data, list(terms or [CrossEntropy()]),
                           s, lambda e: torch_generator(0, "b" if stream == "batches" else stream, self.cid, e),
                           start_epoch=start_epoch, trainable=trainable, optimizer_state=optimizer_state,
                           augment=augment, statistics=statistics)

    def init_weights(self):
        return {k: v.clone() for k, v in self.init.items()}

    def generator(self, *purpose):
        return torch_generator(0, *purpose)

    def account(self, result):
        pass


def ctx(clients, num_clients=4):
    return RoundContext(round=0, clients=clients, num_clients=num_clients, num_classes=2,
                        client_sizes={c: 1 for c in range(num_clients)}, rng=np.random.default_rng(0))


def drive(algo, state, context, replies):
    gen = algo.round(state, context)
    phase = next(gen)
    with pytest.raises(StopIteration) as stop:
        gen.send(replies)
    return phase, stop.value.value


def t(*v):
    return torch.tensor(v, dtype=torch.float32)


# --- prototypes ---------------------------------------------------------------------------
def test_class_means_are_eval_mode_means_with_counts():
    model = tiny_model(d_in=2, hidden=0, classes=3, dropout=True)      # body = flatten + dropout
    model.train()
    x = [[1, 2], [10, 0], [3, 4], [20, 6], [0, 3]]
    data = raw_data(x, [0, 2, 0, 2, 2])                               # class 1 absent
    means, counts = class_means(model, weights_of(model), data, 3, batch_size=2)
    assert model.training                                             # mode restored
    assert counts.tolist() == [2, 0, 3]
    torch.testing.assert_close(means, t([2, 3], [0, 0], [10, 3]), atol=1e-4, rtol=0)   # dropout off (eval)
    stats = class_statistics(model, weights_of(model), data, 3)
    # mean ||h||^2: class 0 (5 + 25)/2 = 15, class 2 (100 + 436 + 9)/3
    torch.testing.assert_close(stats.sq_norms, torch.tensor([15.0, 0.0, 545 / 3], dtype=torch.float64), atol=1e-3, rtol=0)


def test_aggregate_prototypes_uniform_and_count_weighted_with_a_missing_class():
    a = (t([1, 1], [2, 0], [0, 0]), torch.tensor([1, 3, 0]))
    b = (t([9, 9], [4, 2], [0, 0]), torch.tensor([0, 1, 0]))         # b has class 1 only (row 0 is junk)
    protos, defined = aggregate_prototypes([a, b], "uniform")
    assert defined.tolist() == [True, True, False]
    torch.testing.assert_close(protos, t([1, 1], [3, 1], [0, 0]))     # class 1: ([2,0] + [4,2]) / 2
    protos, defined = aggregate_prototypes([a, b], "counts")
    torch.testing.assert_close(protos, t([1, 1], [2.5, 0.5], [0, 0]))  # class 1: (3*[2,0] + [4,2]) / 4
    assert aggregate_prototypes([], "uniform") is None
    with pytest.raises(ValueError):
        aggregate_prototypes([a], "median")


def test_prototype_alignment_matches_the_references_mse():
    h = t([1, 2], [3, 4], [5, 6]).requires_grad_(True)
    y = torch.tensor([0, 1, 2])
    protos, defined = t([0, 0], [3, 3], [9, 9]), torch.tensor([True, True, False])
    term = PrototypeAlignment(protos, defined, weight=0.5)
    value = term(Forward(h, torch.zeros(3, 2)), Batch(None, y, torch.arange(3)), {})
    # (||[1,2]||^2 + ||[0,1]||^2) / (B*d = 6) * 0.5 = 0.5 ; class 2 has no prototype
    assert value.item() == pytest.approx(0.5)
    (g,) = torch.autograd.grad(value, h)
    # PFLlib: target = h.detach() with rows of defined classes replaced, nn.MSELoss() (mean over B*d)
    h2 = h.detach().clone().requires_grad_(True)
    target = h2.detach().clone()
    target[0], target[1] = protos[0], protos[1]
    ref = 0.5 * nn.MSELoss()(h2, target)
    (g_ref,) = torch.autograd.grad(ref, h2)
    assert ref.item() == pytest.approx(value.item())
    torch.testing.assert_close(g, g_ref)
    assert float(PrototypeAlignment(protos, torch.tensor([False, False, True]), 1.0)(
        Forward(h.detach(), None), Batch(None, torch.tensor([0, 1, 0]), None), {})) == 0.0


def test_prototype_alignment_ignores_whatever_a_class_without_prototype_holds():
    """The masked form must not let an undefined row leak in (0 * nan would be nan)."""
    h = t([1, 2], [3, 4]).requires_grad_(True)
    protos = t([0, 0], [float("nan"), float("inf")])
    value = PrototypeAlignment(protos, torch.tensor([True, False]), 1.0)(
        Forward(h, None), Batch(None, torch.tensor([0, 1]), None), {})
    (g,) = torch.autograd.grad(value, h)
    assert value.item() == pytest.approx(5 / 4)          # ||[1,2]||^2 / (B*d = 4)
    torch.testing.assert_close(g, t([0.5, 1.0], [0.0, 0.0]))


# --- FedPer -------------------------------------------------------------------------------
def test_fedper_server_averages_bodies_only_and_heads_stay_with_clients():
    algo = FedPer()
    state = algo.init_server_state({"m": {"body.w": t(0), "body.bn.running_mean": t(0), "head.w": t(7)}})
    phase, new = drive(algo, state, ctx([0, 1]), {
        0: Message("update", {"model": {"body.w": t(1), "body.bn.running_mean": t(2)}}, {"num_samples": 1}),
        1: Message("update", {"model": {"body.w": t(3), "body.bn.running_mean": t(6)}}, {"num_samples": 3})})
    assert all(set(m.arrays) == {"model"} and set(m.arrays["model"]) == {"body.w", "body.bn.running_mean"}
               for m in phase.values())
    assert new["model"]["body.w"].item() == pytest.approx(2.5)             # (1 + 9) / 4
    assert new["model"]["body.bn.running_mean"].item() == pytest.approx(5.0)
    assert new["model"]["head.w"].item() == 7.0                             # the server never touches a head
    assert algo.global_model(new) is None
    # personalized models: the same global body, each client's own head; never sampled: global
    m0 = algo.client_model(0, new, {"head": {"head.w": t(9)}})
    m1 = algo.client_model(1, new, {"head": {"head.w": t(-1)}})
    assert m0["body.w"] is m1["body.w"] is new["model"]["body.w"]
    assert (m0["head.w"].item(), m1["head.w"].item()) == (9.0, -1.0)
    assert algo.client_model(3, new, None) is new["model"]


def test_fedper_client_starts_from_its_own_head_and_uploads_the_body():
    torch.manual_seed(0)
    model = tiny_model()
    client = Runtime(model, random_data(), TrainSettings(epochs=1, batch_size=4, lr=0.1))
    algo = FedPer()
    body = {k: v for k, v in weights_of(model).items() if is_body(k)}
    reply, state = algo.client_update(Message("train", {"model": body}), None, client)
    start = client.calls[-1]["start_weights"]
    assert all(torch.equal(start[k], client.init[k]) for k in start)       # first time: initial head
    assert set(reply.arrays) == {"model"} and all(is_body(k) for k in reply.arrays["model"])
    assert all(not torch.equal(reply.arrays["model"][k], body[k]) for k in body)  # body and head train together
    assert set(state) == {"head"} and all(is_head(k) for k in state["head"])
    assert not torch.equal(state["head"]["head.fc.weight"], client.init["head.fc.weight"])
    new_body = {k: v + 1 for k, v in body.items()}
    algo.client_update(Message("train", {"model": new_body}), state, client)
    start = client.calls[-1]["start_weights"]
    assert all(torch.equal(start[k], new_body[k]) for k in new_body)
    assert all(torch.equal(start[k], state["head"][k]) for k in state["head"])


# --- alternating training (FedRep, FedPAC) -------------------------------------------------
def test_head_phase_leaves_the_body_bitwise_and_body_phase_the_head():
    torch.manual_seed(1)
    model = tiny_model()
    w0 = weights_of(model)
    client = Runtime(model, random_data(), TrainSettings(epochs=1, batch_size=4, lr=0.5, momentum=0.9))
    head_only = train_head_then_body(client, w0, [CrossEntropy()], [CrossEntropy()], head_epochs=2, body_epochs=0)
    assert all(torch.equal(head_only.weights[k], w0[k]) for k in w0 if is_body(k))
    assert all(not torch.equal(head_only.weights[k], w0[k]) for k in w0 if is_head(k))
    body_only = train_head_then_body(client, w0, [CrossEntropy()], [CrossEntropy()], head_epochs=0, body_epochs=2)
    assert all(torch.equal(body_only.weights[k], w0[k]) for k in w0 if is_head(k))
    assert all(not torch.equal(body_only.weights[k], w0[k]) for k in w0 if is_body(k))
    # both: head from w0, then body from the new head; batches of epochs 0-1 then 2-4; momentum of both kept
    client.calls.clear()
    both = train_head_then_body(client, w0, [CrossEntropy()], [CrossEntropy()], head_epochs=2, body_epochs=3)
    assert [(c["epochs"], c["start"]) for c in client.calls] == [(2, 0), (3, 2)]
    assert [all(map(is_head, c["trainable"])) for c in client.calls] == [True, False]
    assert all(is_body(n) for n in client.calls[1]["trainable"])
    assert all(torch.equal(both.weights[k], head_only.weights[k]) for k in w0 if is_head(k))
    assert set(both.optimizer_state) == {n for n, _ in model.named_parameters()}
    assert both.steps == 5 * 3


def test_fedrep_trains_head_epochs_then_body_epochs_and_keeps_its_head():
    torch.manual_seed(2)
    model = tiny_model()
    client = Runtime(model, random_data(), TrainSettings(epochs=2, batch_size=6, lr=0.1))
    algo = FedRep(FedRep.Params(rep_head_epochs=3))
    body = {k: v for k, v in weights_of(model).items() if is_body(k)}
    reply, state = algo.client_update(Message("train", {"model": body}), None, client)
    assert [(c["epochs"], c["start"]) for c in client.calls] == [(3, 0), (2, 3)]
    assert all(is_head(n) for n in client.calls[0]["trainable"]) and all(is_body(n) for n in client.calls[1]["trainable"])
    assert reply.scalars["steps"] == 5 * 2
    assert set(reply.arrays["model"]) == set(body) and set(state) == {"head"}
    # the head it keeps is the one its head epochs trained (the body phase starts from it, frozen)
    trained_head = {k: v for k, v in client.calls[1]["start_weights"].items() if is_head(k)}
    assert set(state["head"]) == set(trained_head)
    assert all(torch.equal(state["head"][k], v) and not torch.equal(v, client.init[k]) for k, v in trained_head.items())
    assert FedRep.Params().rep_head_epochs == 10


# --- FedPAC ---------------------------------------------------------------------------------
def test_feature_statistics_match_the_official_formula():
    # d = 1; class 0: {2}, class 1: {1, 1, 4}, class 2 absent; n = 4, p = (1/4, 3/4, 0)
    stats = ClassStatistics(torch.tensor([1, 3, 0]), torch.tensor([[2.0], [2.0], [0.0]], dtype=torch.float64),
                            torch.tensor([4.0, 6.0, 0.0], dtype=torch.float64))
    v, h = feature_statistics(stats)
    # [1/4*4 - 1/16*4 + 3/4*6 - 9/16*4] / 4 = (1 - 0.25 + 4.5 - 2.25) / 4
    assert v == pytest.approx(0.75)
    torch.testing.assert_close(h, t([0.5], [1.5], [0.0]))


def test_fedpac_qp_two_clients_closed_form():
    # V = (1, 2); H_0 = [[1, 0]], H_1 = [[0, 2]]: ||H_0 - H_1||^2 = 5
    h = torch.tensor([[[1.0, 0.0]], [[0.0, 2.0]]])
    np.testing.assert_allclose(head_objective([1.0, 2.0], h, 0), [[1, 0], [0, 7]])
    np.testing.assert_allclose(head_objective([1.0, 2.0], h, 1), [[6, 0], [0, 2]])
    # min a^2 V_0 + (1-a)^2 (V_1 + 5): a = 7/8 ; for client 1: (2/8, 6/8)
    np.testing.assert_allclose(classifier_weights([1.0, 2.0], h), [[7 / 8, 1 / 8], [1 / 4, 3 / 4]], atol=1e-12)


def test_simplex_qp_refuses_diverged_statistics_with_a_fix():
    with pytest.raises(NumericalError, match="non-finite feature statistics: local training diverged; lower train.lr"):
        simplex_qp(np.array([[1.0, np.nan], [np.nan, 1.0]]))


def test_simplex_qp_exact_on_singular_and_active_cases():
    # points z = (1,0), (-1,0), (0,1): the min-norm point of the hull is the origin at (1/2, 1/2, 0)
    np.testing.assert_allclose(simplex_qp(np.array([[1.0, -1, 0], [-1, 1, 0], [0, 0, 1]])), [0.5, 0.5, 0.0], atol=1e-12)
    # weights below 1e-3 are zeroed and the rest renormalised: diag(1, 1, 10001) -> (.5, .5, ~5e-5) -> (.5, .5, 0)
    h = torch.tensor([[[0.0]], [[0.0]], [[100.0]]])
    np.testing.assert_allclose(classifier_weights([1.0, 1.0, 1.0], h)[0], [0.5, 0.5, 0.0], atol=1e-12)
    assert simplex_qp(np.zeros((3, 3))).tolist() == [1 / 3] * 3
    # against enumerating every support's KKT point
    rng = np.random.default_rng(0)
    for _ in range(60):
        k = int(rng.integers(2, 6))
        z = rng.normal(size=(int(rng.integers(1, k + 1)), k))
        p = z.T @ z + np.diag(rng.random(k) * rng.choice([0.0, 1.0]))
        best = math.inf
        for r in range(1, k + 1):
            for s in map(list, itertools.combinations(range(k), r)):
                kkt = np.block([[p[np.ix_(s, s)], np.ones((r, 1))], [np.ones((1, r)), np.zeros((1, 1))]])
                v = np.linalg.lstsq(kkt, np.eye(r + 1)[-1], rcond=None)[0][:r]
                if (v >= -1e-12).all():
                    best = min(best, float(v @ p[np.ix_(s, s)] @ v))
        x = simplex_qp(p)
        assert x.min() >= 0 and x.sum() == pytest.approx(1.0)
        assert float(x @ p @ x) <= best + 1e-9 * np.abs(p).max()


def pac_reply(body, head, v, h, means, counts, n):
    return Message("update", {"model": {"body.w": t(body)}, "head": {"head.w": t(head)},
                              "statistics": {"variance": torch.tensor([v], dtype=torch.float64), "h": h},
                              "prototypes": {"mean": means, "count": counts}}, {"num_samples": n})


def test_fedpac_server_round_combines_heads_and_builds_prototypes():
    algo = FedPAC()
    state = algo.init_server_state({"m": {"body.w": t(0), "head.w": t(0)}})
    h = torch.tensor([[[1.0, 0.0]], [[0.0, 2.0]]])
    phase, new = drive(algo, state, ctx([2, 0]), {
        0: pac_reply(1.0, 10.0, 1.0, h[0], t([1, 1], [2, 0]), torch.tensor([3, 0]), 1),
        2: pac_reply(5.0, 2.0, 2.0, h[1], t([3, 3], [4, 2]), torch.tensor([1, 5]), 3)})
    assert all(set(m.arrays) == {"model"} for m in phase.values())           # round 0: no head, no prototypes
    assert new["model"]["body.w"].item() == pytest.approx(4.0)               # (1 + 15) / 4
    torch.testing.assert_close(new["prototypes"], t([1.5, 1.5], [4, 2]))     # class 0: (3*[1,1] + [3,3]) / 4
    assert new["defined"].tolist() == [True, True]
    assert new["heads"][0]["head.w"].item() == pytest.approx(7 / 8 * 10 + 1 / 8 * 2)
    assert new["heads"][2]["head.w"].item() == pytest.approx(1 / 4 * 10 + 3 / 4 * 2)
    assert algo.round_metrics(new)["fedpac_head_weights"]["0"] == {"0": 0.875, "2": 0.125}
    msg = algo.train_message(new, 0, ctx([0]))
    assert msg.arrays["head"] is new["heads"][0] and set(msg.arrays["prototypes"]) == {"mean", "defined"}
    assert algo.client_model(0, new, None)["head.w"] is new["heads"][0]["head.w"]
    assert algo.client_model(1, new, None) is new["model"]
    torch.testing.assert_close(combine_heads([{"a": t(1)}, {"a": t(3)}], [0.0, 2.0])["a"], t(3))
    # PFLlib's serverpac (FedReMa's code base): the plain mean of the prototypes of the clients with a class
    uniform = FedPAC(FedPAC.Params(pac_proto_weighting="uniform"))
    _, new = drive(uniform, uniform.init_server_state({"m": {"body.w": t(0), "head.w": t(0)}}), ctx([2, 0]), {
        0: pac_reply(1.0, 10.0, 1.0, h[0], t([1, 1], [2, 0]), torch.tensor([3, 0]), 1),
        2: pac_reply(5.0, 2.0, 2.0, h[1], t([3, 3], [4, 2]), torch.tensor([1, 5]), 3)})
    torch.testing.assert_close(new["prototypes"], t([2, 2], [4, 2]))     # class 0: ([1,1] + [3,3]) / 2


def test_fedpac_client_head_epoch_then_aligned_body_and_uploads():
    torch.manual_seed(3)
    model = tiny_model()
    data = random_data()
    client = Runtime(model, data, TrainSettings(epochs=2, batch_size=6, lr=0.1))
    algo = FedPAC(FedPAC.Params(pac_proto_weight=0.7))
    w = weights_of(model)
    protos = {"mean": torch.randn(2, 4), "defined": torch.tensor([True, False])}
    msg = Message("train", {"model": {k: v for k, v in w.items() if is_body(k)},
                            "head": {k: v + 1 for k, v in w.items() if is_head(k)}, "prototypes": protos})
    reply, state = algo.client_update(msg, None, client)
    head_call, body_call = client.calls
    assert (head_call["epochs"], head_call["start"], body_call["epochs"], body_call["start"]) == (1, 0, 2, 1)
    assert all(is_head(n) for n in head_call["trainable"]) and all(is_body(n) for n in body_call["trainable"])
    assert [type(x) for x in head_call["terms"]] == [CrossEntropy]
    align = body_call["terms"][-1]
    assert isinstance(align, PrototypeAlignment) and align.weight == 0.7 and align.defined.tolist() == [True, False]
    start = head_call["start_weights"]
    assert all(torch.equal(start[k], w[k] + 1) for k in w if is_head(k))    # the server's head
    # statistics of the received model (before training), prototypes of the trained one
    v, h = feature_statistics(class_statistics(model, start, data, 2))
    assert reply.arrays["statistics"]["variance"].item() == pytest.approx(v) and torch.equal(reply.arrays["statistics"]["h"], h)
    trained = {**reply.arrays["model"], **reply.arrays["head"]}
    means, counts = class_means(model, trained, data, 2)
    assert torch.equal(reply.arrays["prototypes"]["mean"], means) and counts.tolist() == [6, 6]
    assert state is None                                                       # heads live on the server


# --- FedProto -------------------------------------------------------------------------------
def test_nearest_prototype_head_is_exactly_nearest_prototype():
    torch.manual_seed(4)
    protos, defined = torch.randn(4, 5), torch.tensor([True, False, True, True])
    head = {"head.fc.weight": torch.zeros(4, 5), "head.fc.bias": torch.zeros(4)}
    new = nearest_prototype_head(head, protos, defined)
    feats = torch.randn(200, 5)
    logits = feats @ new["head.fc.weight"].T + new["head.fc.bias"]
    dist = torch.cdist(feats, protos).masked_fill(~defined, math.inf)
    assert torch.equal(logits.argmax(1), dist.argmin(1))
    assert nearest_prototype_head({"head.fc.weight": torch.zeros(4, 5)}, protos, defined) is None          # no bias
    assert nearest_prototype_head({**head, "head.fc0.weight": torch.zeros(5, 5)}, protos, defined) is None  # deeper head


def test_fedproto_client_and_server():
    torch.manual_seed(5)
    model = tiny_model()
    data = random_data()
    client = Runtime(model, data, TrainSettings(epochs=1, batch_size=4, lr=0.1))
    algo = FedProto()
    state0 = algo.init_server_state({"tiny": weights_of(model)})
    assert algo.train_message(state0, 0, ctx([0])).arrays == {}                      # nothing to send yet
    reply, cstate = algo.client_update(Message("train"), None, client)
    assert [type(x) for x in client.calls[0]["terms"]] == [CrossEntropy]             # no prototypes: CE only
    assert all(torch.equal(client.calls[0]["start_weights"][k], client.init[k]) for k in client.init)
    assert set(reply.arrays) == {"prototypes"} and set(cstate) == {"model"}
    means, counts = class_means(model, cstate["model"], data, 2)
    assert torch.equal(reply.arrays["prototypes"]["mean"], means)
    # server: plain mean over the clients that have a class (class 1 only from client 0)
    other = Message("update", {"prototypes": {"mean": torch.ones(2, 4), "count": torch.tensor([2, 0])}}, {"num_samples": 2})
    _, new = drive(algo, state0, ctx([0, 1]), {0: reply, 1: other})
    torch.testing.assert_close(new["prototypes"], torch.stack([(means[0] + 1) / 2, means[1]]))
    # next round: CE + lambda * alignment from the client's own model
    msg = algo.train_message(new, 0, ctx([0]))
    algo.client_update(msg, cstate, client)
    ce, align = client.calls[1]["terms"]
    assert isinstance(align, PrototypeAlignment) and align.weight == 1.0
    assert all(torch.equal(client.calls[1]["start_weights"][k], cstate["model"][k]) for k in cstate["model"])
    # evaluation: nearest global prototype through the client's own body
    ev = algo.client_model(0, new, cstate)
    torch.testing.assert_close(ev["head.fc.weight"], 2 * new["prototypes"])
    assert all(torch.equal(ev[k], cstate["model"][k]) for k in cstate["model"] if is_body(k))
    assert FedProto(FedProto.Params(proto_eval="classifier")).client_model(0, new, cstate) is cstate["model"]
    assert algo.client_model(3, new, None) is None
    # each round's row says how many classes the nearest-prototype evaluation had (0: own classifiers)
    assert algo.round_metrics(state0) == {"fedproto_prototype_classes": 0}
    assert algo.round_metrics(new) == {"fedproto_prototype_classes": 2}
    assert FedProto(FedProto.Params(proto_eval="classifier")).round_metrics(new) == {}


# --- end to end -------------------------------------------------------------------------------
@pytest.mark.parametrize("name,params", [("fedper", {}), ("fedrep", {"rep_head_epochs": 1}), ("fedproto", {}),
                                         ("fedpac", {})])
def test_method_learns_end_to_end(small_config, tmp_path, name, params):
    raw = copy.deepcopy(small_config)
    raw["algorithm"] = {"name": name, "params": params}
    exp = Experiment.create(load_config(raw=raw), tmp_path / name)
    exp.run(progress=False)
    rows = read_metrics(exp.run_dir)
    assert [r["round"] for r in rows] == [1, 2, 3]
    assert "global_acc" not in rows[-1] and exp.summary["headline_metric"] == "personal_acc"
    assert rows[-1]["personal_acc"] > max(0.5, rows[0]["personal_acc"])
    sim = exp.loop
    trained = sorted(sim.client_states) if name != "fedpac" else sorted(sim.server_state["heads"])
    a, b = sim.client_model(trained[0]), sim.client_model(trained[1])
    if name == "fedproto":
        assert set(sim.client_states[trained[0]]) == {"model"}
        assert "down/prototypes" in rows[-1]["comm"] and "up/prototypes" in rows[-1]["comm"]
        return
    # head-personalized: the same global body, different heads
    assert all(a[k] is b[k] is sim.server_state["model"][k] for k in a if is_body(k))
    assert any(not torch.equal(a[k], b[k]) for k in a if is_head(k))
    assert set(rows[-1]["comm"]) >= {"down/model", "up/model"}
    n_body = sum(v.numel() for k, v in sim.server_state["model"].items() if is_body(k))
    assert rows[-1]["comm"]["up/model"]["floats"] == 3 * n_body          # bodies only
    if name == "fedpac":
        weights = rows[-1]["fedpac_head_weights"]
        assert set(weights) == {str(c) for c in rows[-1]["clients"]}
        assert all(sum(r.values()) == pytest.approx(1.0, abs=1e-3) for r in weights.values())


def test_fedproto_on_fedclassavg_models_needs_relu_features(small_config):
    """FedClassAvg's heads are ReLU + Linear: nearest-prototype evaluation needs the ReLU in the
    body (model option relu_features), else the run is refused before round 1."""
    from helpers import build_loop, config

    raw = copy.deepcopy(small_config)
    raw["model"] = {"arch": ["fca_cnn_a", "fca_cnn_b"], "options": {"relu_features": True}}
    loop = build_loop(config(raw, "fedproto", rounds=1, clients_per_round=6))
    loop.run_round(0)
    state, cstate = loop.server_state, loop.client_states[1]
    ev = loop.algorithm.client_model(1, state, cstate)
    torch.testing.assert_close(ev["head.classifier.1.weight"], 2 * state["prototypes"])
    model = loop.host.models["fca_cnn_b"]
    x = torch.randn(30, 1, 28, 28)
    with torch.no_grad():
        model.load_state_dict(ev)
        model.eval()
        logits, feats = model(x), model.body(x)
    assert torch.equal(logits.argmax(1), torch.cdist(feats, state["prototypes"]).argmin(1))

    raw["model"]["options"] = {}      # the ReLU in the head: refused when the run is built, with the fix
    with pytest.raises(ConfigError, match=r"head applies ReLU besides its Linear layer.*relu_features: true"):
        build_loop(config(raw, "fedproto", rounds=1, clients_per_round=6))


# --- the prototype term and messages with their defaults ----------------------------------------
def test_prototype_term_without_a_defined_mask_uses_every_class_hand_computed():
    """No ``defined`` mask: every class has its prototype. 3 classes, 2-d features (fewer features
    than classes), batch of 2: value = weight * sum ||h_i - proto[y_i]||^2 / (B * d)."""
    from fedhet.algorithms.prototypes import PrototypeAlignment
    from fedhet.core.contract import Batch, Forward

    protos = torch.tensor([[0.0, 0.0], [1.0, 1.0], [2.0, 0.0]])
    term = PrototypeAlignment(protos, None, weight=0.5)
    assert term.defined.dtype == torch.bool and term.defined.tolist() == [True, True, True]
    h = torch.tensor([[1.0, 2.0], [0.0, 1.0]])
    y = torch.tensor([2, 1])
    value = term(Forward(h, torch.zeros(2, 3)), Batch(h, y, torch.arange(2)), {})
    # (1-2)^2 + (2-0)^2 = 5 and (0-1)^2 + (1-1)^2 = 1: 0.5 * 6 / 4
    assert float(value) == pytest.approx(0.75)


def test_prototype_terms_default_mask_lives_on_the_prototypes_device():
    from fedhet.algorithms.prototypes import PrototypeAlignment

    protos = torch.zeros(3, 2, device="meta")
    assert PrototypeAlignment(protos, None, weight=1.0).defined.device.type == "meta"


def test_received_prototypes_without_a_mask_are_all_defined_and_uploads_need_counts():
    from fedhet.algorithms.prototypes import received_prototypes, uploaded_prototypes
    from fedhet.core.contract import Message

    means = torch.ones(3, 4)
    got = received_prototypes(Message("train", {"prototypes": {"mean": means}}))
    assert got is not None and got[0] is means
    assert got[1].dtype == torch.bool and got[1].tolist() == [True, True, True]
    assert uploaded_prototypes(Message("reply", {"prototypes": {"mean": means}})) is None   # no counts: none
    counts = torch.tensor([1, 0, 2])
    assert uploaded_prototypes(Message("reply", {"prototypes": {"mean": means, "count": counts}})) == (means, counts)


def test_aggregate_prototypes_defaults_to_the_uniform_rule():
    """Without a weighting the plain mean over the clients that have a class (FedProto's rule)."""
    a = (t([2, 0]), torch.tensor([3]))
    b = (t([4, 2]), torch.tensor([1]))
    protos, defined = aggregate_prototypes([a, b])
    torch.testing.assert_close(protos, t([3, 1]))                     # uniform; counts would give [2.5, 0.5]
    assert defined.tolist() == [True]


def test_aggregate_prototypes_with_nothing_uploaded_hands_back_a_complete_previous_pair():
    prev, prev_defined = t([1, 2], [0, 0]), torch.tensor([True, False])
    got = aggregate_prototypes([], "uniform", previous=(prev, prev_defined))
    assert got is not None and got[0] is prev and got[1] is prev_defined
    # half a previous pair is no pair: nothing to hand back
    assert aggregate_prototypes([], "uniform", previous=(prev, None)) is None
    assert aggregate_prototypes([], "uniform", previous=(None, prev_defined)) is None
    assert aggregate_prototypes([], "uniform", previous=(None, None)) is None


def test_class_means_over_given_positions_only():
    model = tiny_model(d_in=2, hidden=0, classes=2)
    data = raw_data([[1, 2], [3, 4], [10, 20]], [0, 0, 1])
    means, counts = class_means(model, weights_of(model), data, 2, positions=torch.tensor([1, 2]))
    assert counts.tolist() == [1, 1]
    torch.testing.assert_close(means, t([3, 4], [10, 20]))             # sample 0 left out


def test_received_prototypes_with_no_class_defined_are_none():
    from fedhet.algorithms.prototypes import received_prototypes

    msg = Message("train", {"prototypes": {"mean": torch.ones(2, 3), "defined": torch.tensor([False, False])}})
    assert received_prototypes(msg) is None


def test_prototype_alignment_target_takes_the_features_dtype():
    """Under bf16 features the prototypes are rounded to bf16 before the difference: bf16(1.001) is
    exactly 1, so h = 0 gives a bf16 loss of exactly weight * 1. A float32 target would make the loss
    float32 (2 * 1.002001)."""
    h = torch.zeros(3, 1, dtype=torch.bfloat16)
    term = PrototypeAlignment(torch.full((2, 1), 1.001), None, weight=2.0)
    value = term(Forward(h, None), Batch(None, torch.tensor([0, 1, 0]), torch.arange(3)), {})
    assert value.dtype == torch.bfloat16 and float(value) == 2.0


def test_aggregate_prototypes_refusals_say_what_is_wrong():
    a = (t([1, 1], [2, 0], [0, 0]), torch.tensor([1, 3, 0]))
    with pytest.raises(ValueError, match=r"unknown prototype weighting 'median'; use 'uniform' or 'counts'"):
        aggregate_prototypes([a], "median")
    short_counts = (t([1, 1], [2, 0], [0, 0]), torch.tensor([1, 3]))         # means fit, counts do not
    with pytest.raises(ValueError, match=r"disagree in shape: \(3, 2\) / \(2,\) vs \(3, 2\)"):
        aggregate_prototypes([a, short_counts])
    short_means = (t([1, 1], [2, 0]), torch.tensor([1, 3, 0]))
    with pytest.raises(ValueError, match=r"disagree in shape: \(2, 2\) / \(3,\) vs \(3, 2\)"):
        aggregate_prototypes([a, short_means])


def test_aggregate_prototypes_with_half_a_previous_pair_is_memoryless():
    a = (t([1, 1], [0, 0]), torch.tensor([2, 0]))
    protos, defined = aggregate_prototypes([a], "uniform", previous=(t([5, 5], [7, 7]), None))
    torch.testing.assert_close(protos, t([1, 1], [0, 0]))
    assert defined.tolist() == [True, False]


def test_aggregate_prototypes_accumulates_the_class_mass_in_double():
    """2^24 + 3 samples of one class: in float32 the mass would round to 2^24 + 4 and the prototype
    to (2^24 + 3) / (2^24 + 4) = 0.99999994; in double it is exactly the uploaded mean."""
    n = 2 ** 24 + 3
    protos, _ = aggregate_prototypes([(t([1.0]), torch.tensor([n]))], "counts")
    assert protos.item() == 1.0
