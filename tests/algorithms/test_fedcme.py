"""FedCME (Nie et al., Algorithms 1-2): matching, swap, alignment, memory, evaluation."""

import copy

import numpy as np
import pytest
import torch
from helpers import deliver, runtime
from torch import nn

from fedhet.algorithms import compose, register
from fedhet.algorithms.fedavg import FedAvg
from fedhet.algorithms.fedcme import (
    MID,
    FeatureAlignment,
    FedCME,
    aggregate_features,
    cosine,
    eval_subset,
    evaluation_vector,
    local_features,
    make_many_to_one,
    make_matching,
)
from fedhet.core.contract import Batch, ClientData, Forward, LocalResult, Message, RoundContext, TrainSettings
from fedhet.core.errors import ConfigError
from fedhet.engine.loop import RoundStats
from fedhet.experiment.config import load_config
from fedhet.experiment.runner import Experiment, read_metrics
from fedhet.models.base import SplitModel
from fedhet.training.objective import LossTerm, accumulate_statistics

register(FedCME)

T = torch.tensor
HEAD = 10 * 512 + 10          # cnn2's classifier fc2 (512 -> 10): weight + bias
FEAT = 10 * 512 + 10          # zeta (10 x 512) + its defined mask / counts (10)


# --- matching (Algorithm 1 lines 11-24) ----------------------------------------------------
def test_least_typical_client_pairs_with_its_least_similar_peer():
    v = {0: T([1.0, 0, 0]), 1: T([0.9, 0.1, 0]), 2: T([0.0, 1, 1]), 3: T([0.5, 0.5, 0.5])}
    # eps_g = [2.4, 1.6, 1.5]/4; cos(v, eps_g) is proportional to v.[2.4,1.6,1.5]/|v|:
    #   0: 2.4, 1: 2.32/0.906 = 2.56, 2: 3.1/1.414 = 2.19, 3: 2.75/0.866 = 3.18  -> order 2, 0, 1, 3.
    # Pop 2: cos(2,0)=0 < cos(2,1)=0.08 < cos(2,3)=0.82 -> (2,0). Pop 1: only 3 left -> (1,3).
    # (Sampling-order pairing would give (0,1), (2,3).)
    assert make_matching(v, [0, 1, 2, 3]) == {0: 2, 1: 3, 2: 0, 3: 1}
    # A case where the typicality sort decides: eps_g = [5,5,4]/4, cos(v, eps_g) ~ v.[5,5,4]/|v|:
    #   0: 14/1.73 = 8.08, 1: 9/1.41 = 6.36, 2: 19/2.45 = 7.76, 3: 10/1.41 = 7.07 -> order 1, 3, 2, 0.
    # Pop 1: cos(1,3) = .5 < cos(1,2) = .58 < cos(1,0) = .82 -> (1,3); then (2,0).
    # (Greedy in sampling order would start with 0 and pair (0,1), (2,3).)
    v = {0: T([1.0, 1, 1]), 1: T([1.0, 0, 1]), 2: T([1.0, 2, 1]), 3: T([1.0, 1, 0])}
    assert make_matching(v, [0, 1, 2, 3]) == {0: 2, 1: 3, 2: 0, 3: 1}


def test_matching_ties_go_to_the_earliest_in_sorted_order():
    v = {5: T([1.0, 0, 0]), 6: T([1.0, 0, 0]), 7: T([1.0, 0, 0]), 8: T([0.0, 1, 0])}
    # eps_g = [0.75, 0.25, 0]: client 8 is least typical; cos(8, .) = 0 for 5, 6, 7 -> the first, 5.
    # Then 6 (first left) pairs with 7.
    assert make_matching(v, [5, 6, 7, 8]) == {8: 5, 5: 8, 6: 7, 7: 6}


def test_matching_none_and_zero_vectors_have_cosine_zero_and_odd_count_leaves_one_unpaired():
    v = {0: None, 1: T([0.0, 0.0]), 2: T([1.0, 0.0])}
    # eps_g = [1/3, 0] (None counted as zeros): cos = 0, 0, 1 -> order 0, 1, 2. Pop 0: cos(0,1) =
    # cos(0,2) = 0, tie -> 1. Client 2 is left alone.
    assert make_matching(v, [0, 1, 2]) == {0: 1, 1: 0, 2: None}
    # Never-seen clients only: pairs in sampling order.
    assert make_matching({}, [4, 2, 9, 1]) == {4: 2, 2: 4, 9: 1, 1: 9}
    assert make_matching({}, [3]) == {3: None}


def test_many_to_one_takes_the_most_dissimilar_with_duplicates():
    v = {0: T([1.0, 0, 0]), 1: T([0.9, 0.1, 0]), 2: T([0.0, 1, 1]), 3: T([0.5, 0.5, 0.5])}
    # cos rows: 0: (1: .99, 2: 0, 3: .58) -> 2; 1: (0: .99, 2: .08, 3: .64) -> 2;
    # 2: (0: 0, 1: .08, 3: .82) -> 0; 3: (0: .58, 1: .64, 2: .82) -> 0.
    assert make_many_to_one(v, [0, 1, 2, 3]) == {0: 2, 1: 2, 2: 0, 3: 0}
    v2 = {0: T([1.0, 0]), 1: T([0.0, 1]), 2: T([1.0, 0.1])}
    assert make_many_to_one(v2, [0, 1, 2]) == {0: 1, 1: 0, 2: 1}
    assert make_many_to_one({}, [7]) == {7: None}


def test_zero_evaluation_vector_is_dissimilar_to_every_client():
    """A client that got every evaluated class wrong (eps_k = 0) has cosine 0 with everyone, so it
    is the least typical client and takes the first counterpart in sorted order."""
    assert cosine(T([0.0, 0.0]), T([1.0, 0.0])) == 0.0 and cosine(T([1.0, 0.0]), T([0.0, 0.0])) == 0.0
    v = {0: T([1.0, 0]), 1: T([1.0, 0]), 2: T([0.0, 0]), 3: T([0.0, 1])}
    # eps_g = [2, 1]/4: cos(v, eps_g) = .894, .894, 0, .447 -> order 2, 3, 0, 1. Pop 2: cos 0 with
    # 3, 0 and 1 alike -> 3 (first); then (0, 1). (Zero vector as cosine 1 would pair (3,0), (1,2).)
    assert make_matching(v, [0, 1, 2, 3]) == {0: 1, 1: 0, 2: 3, 3: 2}


# --- feature alignment (Eq. 9, Algorithm 2 lines 8-13) ---------------------------------------
def test_alignment_loss_value_gradient_and_accumulators():
    h = T([[1.0, 0.0], [3.0, 2.0], [0.0, 1.0], [5.0, 5.0]], requires_grad=True)
    y = T([0, 0, 1, 2])
    zeta = T([[1.0, 1.0], [0.0, 0.0], [9.0, 9.0]])
    term = FeatureAlignment(0.5, 3, zeta, T([True, True, False]))
    loss = term(Forward(h, torch.zeros(4, 3)), Batch(torch.zeros(4), y, torch.arange(4)), {})
    # class 0: mean [2,1] - [1,1] = [1,0] -> 1; class 1: [0,1] - [0,0] -> 1; class 2 undefined: skipped.
    assert float(loss.detach()) == pytest.approx(0.5 * 2.0)
    loss.backward()
    # d/dh_i = mu * 2 (mean_c - zeta_c) / n_c: class 0 -> 0.5*2*[1,0]/2, class 1 -> 0.5*2*[0,1]/1, class 2 -> 0.
    assert torch.allclose(h.grad, T([[0.5, 0.0], [0.5, 0.0], [0.0, 1.0], [0.0, 0.0]]))
    st = term.statistics(Forward(h, torch.zeros(4, 3)), Batch(torch.zeros(4), y, torch.arange(4)))
    assert torch.equal(st["sums"], T([[4.0, 2.0], [0.0, 1.0], [5.0, 5.0]], dtype=torch.float64))
    assert torch.equal(st["counts"], T([2, 1, 1]))
    # Two batches accumulate (as local training adds statistics up); a class missing from both
    # stays zero with count 0.
    term4 = FeatureAlignment(0.5, 4, None)
    out = Forward(h.detach(), torch.zeros(4, 4))
    assert float(term4(out, Batch(None, y, None), {})) == 0.0     # nothing defined yet: no loss
    totals = {}
    for labels in (y, T([3, 3, 3, 3])):
        accumulate_statistics([term4], out, Batch(None, labels, None), totals)
    means, counts = local_features(totals)
    assert torch.equal(counts, T([2, 1, 1, 4]))
    assert torch.allclose(means, T([[2.0, 1.0], [0.0, 1.0], [5.0, 5.0], [2.25, 2.0]]))


# --- server memory aggregation (Algorithm 1 lines 27-35) -----------------------------------
def test_feature_memory_aggregation():
    prev = T([[10.0, 10.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]])
    prev_def = T([True, False, False, False])
    a = (T([[0.0, 0.0], [2.0, 2.0], [4.0, 0.0], [0.0, 0.0]]), T([0, 3, 1, 0]))
    b = (T([[4.0, 2.0], [0.0, 0.0], [8.0, 2.0], [0.0, 0.0]]), T([5, 0, 2, 0]))
    zeta, defined = aggregate_features(prev, prev_def, [a, b])
    # class 0: a lacks it -> previous [10,10]; mean with b's [4,2] -> [7, 6].
    # class 1: no previous value, only a has it -> [2, 2]. class 2: both -> [6, 1]. class 3: nobody -> undefined.
    assert torch.equal(defined, T([True, True, True, False]))
    assert torch.allclose(zeta[:3], T([[7.0, 6.0], [2.0, 2.0], [6.0, 1.0]]))
    # First round (no previous features at all).
    zeta, defined = aggregate_features(None, None, [a])
    assert torch.equal(defined, T([False, True, True, False]))
    assert torch.allclose(zeta[1:3], T([[2.0, 2.0], [4.0, 0.0]]))


# --- evaluation vector (Eq. 4, Algorithm 2 lines 19-20) -------------------------------------
def test_evaluation_vector_is_per_class_accuracy_with_zero_for_absent_classes():
    model = SplitModel([("flat", nn.Flatten()), ("fc", nn.Linear(2, 4))], "fc", (1, 1, 2))
    # logits = [x0, x1, 0.5, -1]: pred 0 if x0=1, 1 if x1=1, 2 if both are 0; never 3.
    w = {"head.fc.weight": T([[1.0, 0], [0, 1], [0, 0], [0, 0]]), "head.fc.bias": T([0.0, 0, 0.5, -1])}
    pix = T([[255, 0], [0, 255], [0, 255], [0, 0], [255, 0], [0, 255], [255, 0]], dtype=torch.uint8)
    data = ClientData(pix.view(-1, 1, 1, 2), T([0, 0, 1, 1, 0, 2, 1]), torch.arange(7),
                      torch.zeros(1, 1, 1, 1), torch.ones(1, 1, 1, 1))
    eps = evaluation_vector(model, w, data, 4, T([0, 1, 2, 3, 4]))
    # preds 0,1,1,2,0 vs labels 0,0,1,1,0: class 0 2/3, class 1 1/2, classes 2, 3 absent -> 0.
    assert torch.allclose(eps, T([2 / 3, 0.5, 0.0, 0.0]))
    assert torch.allclose(evaluation_vector(model, w, data, 4, T([5, 6])), T([0.0, 0.0, 0.0, 0.0]))
    sub = eval_subset(10, 0.2, torch.Generator().manual_seed(0))
    assert len(sub) == 2 and len(set(sub.tolist())) == 2 and int(sub.max()) < 10
    assert [len(eval_subset(n, 0.2, torch.Generator().manual_seed(1))) for n in (1, 3, 7, 100)] == [1, 1, 1, 20]


# --- the round, driven by hand on the synthetic federation ----------------------------------
def make_sim(small_config, tmp_path, epochs=2, **params):
    cfg = copy.deepcopy(small_config)
    cfg["algorithm"] = {"name": "fedcme", "params": params}
    cfg["train"]["local_epochs"] = epochs
    return Experiment(load_config(raw=cfg), tmp_path / "run").loop


def spy(sim, cid, stats, seen):
    """A SimClient whose train() records the weights and options it starts from."""
    client = runtime(sim, cid)
    real = client.train

    def train(weights, terms=None, **kw):
        seen[cid] = ({k: v.clone() for k, v in weights.items()}, kw)
        return real(weights, terms, **kw)

    client.train = train
    return client


def part(w, prefix):
    return {k: v for k, v in w.items() if k.startswith(prefix)}


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("exchange", ["classifier", "extractor", "whole"])
def test_phase_b_starts_from_the_partners_mid_round_part(small_config, tmp_path, exchange):
    sim = make_sim(small_config, tmp_path, exchange=exchange)
    algo, ctx = sim.algorithm, sim.round_context(0)
    c0, c1, c2 = ctx.clients                       # round 0: no vectors -> (c0, c1), c2 unpaired
    stats = RoundStats(0, ctx.clients)
    gen = algo.round(sim.server_state, ctx)
    phase_a = next(gen)
    assert [phase_a[c].scalars["partner"] for c in ctx.clients] == [c1, c0, None]
    assert "features" not in phase_a[c0].arrays    # nothing defined before the first aggregation
    replies_a = {c: deliver(sim, c, m, 0, stats) for c, m in phase_a.items()}
    assert "exchange" not in replies_a[c2].arrays  # nobody takes the unpaired client's part
    mid = {c: sim.client_states[c][MID]["weights"] for c in ctx.clients}
    glob = sim.server_state["model"]
    assert not torch.equal(mid[c0]["body.fc1.0.weight"], glob["body.fc1.0.weight"])   # phase A trained
    assert not torch.equal(mid[c0]["head.fc2.weight"], mid[c1]["head.fc2.weight"])

    phase_b = gen.send(replies_a)
    assert phase_b[c0].kind == "exchange" and phase_b[c2].kind == "continue" and not phase_b[c2].arrays
    seen = {}
    replies_b = {c: algo.client_update(phase_b[c], sim.client_states[c], spy(sim, c, stats, seen))[0]
                 for c in ctx.clients}
    for k, j in ((c0, c1), (c1, c0)):
        w, kw = seen[k]
        assert kw["epochs"] == 1 and kw["start_epoch"] == 1
        if exchange == "classifier":
            assert same(part(w, "head."), part(mid[j], "head.")) and same(part(w, "body."), part(mid[k], "body."))
            assert sum(t.numel() for t in phase_b[k].arrays["exchange"].values()) == HEAD
        elif exchange == "extractor":
            assert same(part(w, "body."), part(mid[j], "body.")) and same(part(w, "head."), part(mid[k], "head."))
        else:
            assert same(w, mid[j])
    assert same(seen[c2][0], mid[c2])              # unpaired: continues with its own model

    # Final replies: model, feature means over both phases, evaluation vector on the 20% subset.
    client = runtime(sim, c0)
    r = replies_b[c0]
    pos = eval_subset(client.num_samples, 0.2, client.generator("eval_subset"))
    expect = evaluation_vector(client.model, r.arrays["model"], client.data, 10, pos)
    assert torch.equal(r.arrays["evaluation"]["accuracy"], expect)
    counts = torch.bincount(client.data.y[client.data.train_idx], minlength=10)
    assert torch.equal(r.arrays["features"]["count"], 2 * counts)          # E = 2 epochs accumulated
    with pytest.raises(StopIteration) as stop:
        gen.send(replies_b)
    new = stop.value.value
    assert set(new["eval"]) == set(ctx.clients) and new["defined"].any()
    assert new["matching"] == [[c0, c1], [c2, None]]


def test_exchange_none_is_a_single_phase_of_e_epochs(small_config, tmp_path):
    sim = make_sim(small_config, tmp_path, exchange="none")
    ctx = sim.round_context(0)
    stats = RoundStats(0, ctx.clients)
    gen = sim.algorithm.round(sim.server_state, ctx)
    phase = next(gen)
    seen = {}
    replies = {c: sim.algorithm.client_update(m, None, spy(sim, c, stats, seen))[0] for c, m in phase.items()}
    assert all(kw["epochs"] == 2 and kw["start_epoch"] == 0 for _, kw in seen.values())
    assert all(set(r.arrays) == {"model", "features", "evaluation"} for r in replies.values())
    with pytest.raises(StopIteration):
        gen.send(replies)


class Recorder(LossTerm):
    name = "rec"

    def __init__(self):
        self.feats, self.labels = [], []

    def __call__(self, out, batch, weights):
        self.feats.append(out.features.detach().clone())
        self.labels.append(batch.y.clone())
        return out.logits.sum() * 0.0


def test_feature_accumulation_is_the_mean_over_all_epochs_batches(small_config, tmp_path):
    sim = make_sim(small_config, tmp_path, epochs=3, mu=0.1)
    rec = Recorder()

    class Recording(FedCME):
        def local_terms(self, msg, state, client):
            return [*super().local_terms(msg, state, client), rec]

    algo = Recording(FedCME.Params(mu=0.1))
    zeta = torch.rand(10, 512, generator=torch.Generator().manual_seed(0)) * 0.1
    defined = torch.arange(10) % 2 == 0
    msg = Message("train", {"model": sim.server_state["model"], "features": {"mean": zeta, "defined": defined}},
                  {"partner": None, "share": False})
    reply_a, state = algo.client_update(msg, None, runtime(sim, 1))
    assert reply_a.kind == "mid" and not reply_a.arrays
    assert reply_a.scalars["loss"] > 0 and len(rec.feats) > 0
    n_a = len(rec.feats)
    reply, state = algo.client_update(Message("continue"), state, runtime(sim, 1))
    assert state is None                            # nothing kept after the round (bn_buffers: average)
    assert len(rec.feats) == 3 * n_a          # floor(3/2) = 1 epoch, then 2 more
    h, y = torch.cat(rec.feats), torch.cat(rec.labels)
    got = reply.arrays["features"]
    for c in range(10):
        if (y == c).any():
            assert int(got["count"][c]) == int((y == c).sum())
            assert torch.allclose(got["mean"][c], h[y == c].mean(0), atol=1e-5)
        else:
            assert int(got["count"][c]) == 0 and not got["mean"][c].any()
    assert reply.scalars["steps"] == len(rec.feats)


# --- the server side alone: dropped clients, memory across a round ------------------------
def test_server_round_with_a_dropped_partner_and_feature_memory():
    algo = FedCME()
    w0 = {"body.w": T([0.0]), "head.w": T([0.0])}
    state = algo.init_server_state({"cnn": w0})
    state["features"] = T([[1.0, 1.0], [0.0, 0.0]])
    state["defined"] = T([True, False])
    state["eval"] = {0: T([1.0, 0.0]), 1: T([1.0, 0.0]), 2: T([0.0, 1.0]), 3: T([0.0, 1.0])}
    ctx = RoundContext(round=3, clients=[0, 1, 2, 3], num_clients=4, num_classes=2,
                       client_sizes={c: 1 for c in range(4)}, rng=np.random.default_rng(0))
    gen = algo.round(state, ctx)
    phase_a = next(gen)
    # eps_g = [.5,.5]: every cos = .707 -> order 0,1,2,3; 0 pairs with 2 (cos 0), then 1 with 3.
    assert {c: m.scalars["partner"] for c, m in phase_a.items()} == {0: 2, 1: 3, 2: 0, 3: 1}
    assert torch.equal(phase_a[0].arrays["features"]["defined"], T([True, False]))
    head = {c: {"head.w": T([float(c)])} for c in range(4)}
    # Client 3 drops out in phase A: its partner 1 continues without a swap.
    phase_b = gen.send({c: Message("mid", {"exchange": head[c]}, {"num_samples": 1}) for c in (0, 1, 2)})
    assert set(phase_b) == {0, 1, 2}
    assert phase_b[0].arrays["exchange"] is head[2] and phase_b[2].arrays["exchange"] is head[0]
    assert phase_b[1].kind == "continue"

    def final(model, mean, count, acc, n):
        return Message("update", {"model": {"body.w": T([model]), "head.w": T([model])},
                                  "features": {"mean": T(mean), "count": T(count)},
                                  "evaluation": {"accuracy": T(acc)}}, {"num_samples": n})

    with pytest.raises(StopIteration) as stop:
        gen.send({0: final(1.0, [[0.0, 0.0], [4.0, 2.0]], [0, 3], [0.0, 0.9], 1),
                  1: final(4.0, [[3.0, 5.0], [0.0, 0.0]], [2, 0], [0.8, 0.0], 3)})
    new = stop.value.value
    assert torch.equal(new["model"]["body.w"], T([(1.0 + 12.0) / 4]))
    # class 0: client 0 lacks it -> previous [1,1]; mean with [3,5] -> [2,3]. class 1: only client 0 -> [4,2].
    assert torch.allclose(new["features"], T([[2.0, 3.0], [4.0, 2.0]])) and new["defined"].all()
    assert torch.equal(new["eval"][0], T([0.0, 0.9])) and torch.equal(new["eval"][3], T([0.0, 1.0]))
    assert new["matching"] == [[0, 2], [1, 3]]
    assert algo.round_metrics(new) == {"fedcme_pairs": [[0, 2], [1, 3]]}


def test_many_to_one_round_sends_one_classifier_to_several_clients():
    algo = FedCME(FedCME.Params(matching="many_to_one"))
    state = algo.init_server_state({"cnn": {"head.w": T([0.0])}})
    state["eval"] = {0: T([1.0, 0]), 1: T([0.0, 1]), 2: T([1.0, 0.1])}
    ctx = RoundContext(round=1, clients=[0, 1, 2], num_clients=3, num_classes=2,
                       client_sizes={c: 1 for c in range(3)}, rng=np.random.default_rng(0))
    gen = algo.round(state, ctx)
    phase_a = next(gen)
    assert {c: (m.scalars["partner"], m.scalars["share"]) for c, m in phase_a.items()} == \
        {0: (1, True), 1: (0, True), 2: (1, False)}          # 2's classifier is used by nobody
    head = {c: {"head.w": T([float(c)])} for c in range(3)}
    phase_b = gen.send({c: Message("mid", {"exchange": head[c]} if c < 2 else {}) for c in range(3)})
    assert phase_b[0].arrays["exchange"] is head[1] and phase_b[2].arrays["exchange"] is head[1]
    assert phase_b[1].arrays["exchange"] is head[0]


def test_only_exchange_sends_no_features():
    algo = FedCME(FedCME.Params(mu=0.0))
    state = algo.init_server_state({"cnn": {"head.w": T([0.0])}})
    state["features"], state["defined"] = torch.ones(2, 3), T([True, True])
    ctx = RoundContext(round=1, clients=[0], num_clients=1, num_classes=2, client_sizes={0: 1},
                       rng=np.random.default_rng(0))
    assert set(algo.train_message(state, 0, ctx).arrays) == {"model"}
    assert algo.local_terms(Message("train"), None, None) == []
    assert "features" in FedCME().train_message(state, 0, ctx).arrays


def server_setup(algo, evals, clients):
    """A server state with the given last evaluation vectors and a RoundContext sampling ``clients``."""
    state = algo.init_server_state({"cnn": {"body.w": T([0.0]), "head.w": T([0.0])}})
    state["eval"] = dict(evals)
    ctx = RoundContext(round=2, clients=list(clients), num_clients=len(clients), num_classes=2,
                       client_sizes={c: 1 for c in clients}, rng=np.random.default_rng(0))
    return state, ctx


def update(model):
    """A final (phase-B or single-phase) reply with a model and no features or evaluation."""
    return Message("update", {"model": {"body.w": T([model]), "head.w": T([model])}}, {"num_samples": 1})


def finish(gen, replies):
    """Send the last phase's replies and return the round's new server state."""
    with pytest.raises(StopIteration) as stop:
        gen.send(replies)
    return stop.value.value


def test_client_dropped_mid_list_in_phase_a_leaves_the_others_their_exchange():
    """A client missing from the phase-A replies gets no phase-B message, but every later client
    still does; each exchange message carries the counterpart's part and names that counterpart."""
    algo = FedCME()
    evals = {0: T([1.0, 0.0]), 1: T([1.0, 0.0]), 2: T([0.0, 1.0]), 3: T([0.0, 1.0])}
    state, ctx = server_setup(algo, evals, [0, 1, 2, 3])
    gen = algo.round(state, ctx)
    phase_a = next(gen)
    # every cos(eps_k, eps_g) is equal -> order 0,1,2,3: (0,2) (cosine 0), then (1,3).
    assert {c: m.scalars["partner"] for c, m in phase_a.items()} == {0: 2, 1: 3, 2: 0, 3: 1}
    head = {c: {"head.w": T([float(c)])} for c in range(4)}
    # Client 1 (second in sampling order) drops out in phase A.
    phase_b = gen.send({c: Message("mid", {"exchange": head[c]}, {"num_samples": 1}) for c in (0, 2, 3)})
    assert set(phase_b) == {0, 2, 3}
    assert phase_b[0].kind == "exchange" and phase_b[0].arrays["exchange"] is head[2]
    assert phase_b[0].scalars == {"partner": 2}
    assert phase_b[2].kind == "exchange" and phase_b[2].arrays["exchange"] is head[0]
    assert phase_b[2].scalars == {"partner": 0}
    assert phase_b[3].kind == "continue" and not phase_b[3].arrays      # its counterpart 1 is gone
    new = finish(gen, {c: update(float(c)) for c in (0, 2, 3)})
    assert torch.allclose(new["model"]["body.w"], T([5.0 / 3]))      # FedAvg over the three replies
    assert new["matching"] == [[0, 2], [1, 3]]


def test_only_alignment_round_has_one_phase_no_partners_and_no_matching():
    """FedCME-OL (exchange: none): no client matching at all - no partner, nothing to share,
    a single phase - and the round records an empty matching."""
    algo = FedCME(FedCME.Params(exchange="none"))
    evals = {0: T([1.0, 0.0]), 1: T([0.0, 1.0]), 2: T([1.0, 1.0])}
    state, ctx = server_setup(algo, evals, [0, 1, 2])
    assert algo.match(state, ctx) == {0: None, 1: None, 2: None}
    gen = algo.round(state, ctx)
    phase = next(gen)
    assert {c: (m.kind, m.scalars["partner"], m.scalars["share"]) for c, m in phase.items()} == \
        {c: ("train", None, False) for c in (0, 1, 2)}
    new = finish(gen, {c: update(float(c)) for c in (0, 1, 2)})
    assert new["matching"] == []
    assert set(new) == set(state)                      # the round adds no state entry
    assert algo.round_metrics(new) == {"fedcme_pairs": []}


def test_many_to_one_round_records_every_clients_source():
    """FedCME-MTO: the round records one ``[k, source]`` entry per sampled client (a source may
    repeat), reported as the ``fedcme_sources`` metric."""
    algo = FedCME(FedCME.Params(matching="many_to_one"))
    state, ctx = server_setup(algo, {0: T([1.0, 0]), 1: T([0.0, 1]), 2: T([1.0, 0.1])}, [0, 1, 2])
    gen = algo.round(state, ctx)
    next(gen)                                          # sources 0 <- 1, 1 <- 0, 2 <- 1 (as above)
    head = {c: {"head.w": T([float(c)])} for c in range(3)}
    gen.send({c: Message("mid", {"exchange": head[c]} if c < 2 else {}) for c in range(3)})
    new = finish(gen, {c: update(float(c)) for c in range(3)})
    assert new["matching"] == [[0, 1], [1, 0], [2, 1]]
    assert set(new) == set(state)
    assert algo.round_metrics(new) == {"fedcme_sources": [[0, 1], [1, 0], [2, 1]]}


class ArgumentProbe(FedAvg):
    """A FedAvg-family component that records the client id and round context its hooks receive."""

    name = "probe"

    def __init__(self, params=None):
        super().__init__(params)
        self.calls = []

    def train_message(self, state, cid, ctx):
        self.calls.append(("train_message", cid, ctx))
        return super().train_message(state, cid, ctx)

    def aggregate(self, state, replies, ctx):
        self.calls.append(("aggregate", None, ctx))
        return super().aggregate(state, replies, ctx)


def test_round_passes_client_ids_and_context_down_the_composition():
    """Composed after FedCME (``compose`` chains hooks by ``super()``), a component's
    ``train_message`` gets each sampled client's id and the round context, and its ``aggregate``
    gets the round context."""
    algo = compose([FedCME, ArgumentProbe])(FedCME.Params(exchange="none"))
    state, ctx = server_setup(algo, {}, [4, 7])
    gen = algo.round(state, ctx)
    next(gen)
    finish(gen, {c: update(1.0) for c in (4, 7)})
    assert [(hook, cid) for hook, cid, _ in algo.calls] == \
        [("train_message", 4), ("train_message", 7), ("aggregate", None)]
    assert all(c is ctx for _, _, c in algo.calls)


class ScriptedClient:
    """A client runtime (id 3) whose ``train`` records the weights and options it starts from and
    returns the scripted ``(steps, mean loss)`` results in turn, weights unchanged; the model is a
    tiny flatten -> BatchNorm -> linear net on 2-pixel images (4 classes, 3 samples)."""

    def __init__(self, epochs=2, results=((3, 0.5), (1, 0.25))):
        self.cid, self.round, self.num_classes, self.num_samples = 3, 0, 4, 3
        self.model = SplitModel([("flat", nn.Flatten()), ("bn", nn.BatchNorm1d(2)), ("fc", nn.Linear(2, 4))],
                                "fc", (1, 1, 2))
        self.weights = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        self.buffer_names = [k for k, _ in self.model.named_buffers()]
        pix = T([[255, 0], [0, 255], [0, 0]], dtype=torch.uint8)
        self.data = ClientData(pix.view(-1, 1, 1, 2), T([0, 1, 2]), torch.arange(3),
                               torch.zeros(1, 1, 1, 1), torch.ones(1, 1, 1, 1))
        self.settings = TrainSettings(epochs=epochs, batch_size=3, lr=0.1)
        self.results, self.calls = list(results), []

    def generator(self, *purpose):
        return torch.Generator().manual_seed(0)

    def train(self, weights, terms=None, **kw):
        self.calls.append(({k: v.clone() for k, v in weights.items()}, kw))
        steps, loss = self.results[len(self.calls) - 1]
        return LocalResult(dict(weights), {}, steps, 3 * steps, loss)


class ClientStateProbe(FedAvg):
    """A FedAvg-family component with client state of its own (a counter, as SCAFFOLD keeps its
    control variate) that records what its schedule check and client hooks receive."""

    name = "stateprobe"

    def __init__(self, params=None):
        super().__init__(params)
        self.seen = []
        self.messages = []                  # the round messages after_training gets

    def check_schedule(self, rounds, local_epochs):
        self.seen.append(("check_schedule", rounds, local_epochs))
        super().check_schedule(rounds, local_epochs)

    def check_round_size(self, clients_per_round):
        self.seen.append(("check_round_size", clients_per_round))
        super().check_round_size(clients_per_round)

    def with_local_buffers(self, weights, state, client):
        self.seen.append(("with_local_buffers", state, client))
        return super().with_local_buffers(weights, state, client)

    def after_training(self, result, msg, state, client):
        self.seen.append(("after_training", state, client))
        self.messages.append(msg)
        state = super().after_training(result, msg, state, client)
        return {**(state or {}), "probe_rounds": (state or {}).get("probe_rounds", 0) + 1}


def test_exchange_with_fewer_than_two_local_epochs_is_refused_with_both_fixes():
    """An exchange after floor(E/2) epochs needs E >= 2 (else phase A trains nothing); the refusal
    says why and names both fixes, E >= 2 or FedCME-OL. Without an exchange E = 1 is fine."""
    with pytest.raises(ConfigError) as err:
        FedCME(FedCME.Params(exchange="whole")).check_schedule(10, 1)
    msg = str(err.value)
    assert msg.startswith("algorithm fedcme: the exchange (whole) happens after floor(E/2) local epochs")
    assert ("train.local_epochs is 1, so the first phase would train no epoch and the exchange would swap "
            "untrained parts; ") in msg
    assert msg.endswith("; set train.local_epochs to 2 or more (the paper: 6), "
                        "or algorithm.params.exchange: none (FedCME-OL)")
    FedCME().check_schedule(10, 2)
    FedCME(FedCME.Params(exchange="none")).check_schedule(10, 1)


def test_an_exchange_without_a_partner_is_refused_with_both_fixes():
    """The exchange needs a partner: one client a round would leave FedCME-OL under FedCME's name. The
    refusal names both fixes; two clients, or no exchange, are fine."""
    for exchange in ("classifier", "whole"):
        with pytest.raises(ConfigError) as err:
            FedCME(FedCME.Params(exchange=exchange)).check_round_size(1)
        assert str(err.value) == (
            f"algorithm fedcme: train.clients_per_round is 1, so no client has a partner to exchange its {exchange} "
            "with and the run would be FedCME-OL (alignment only) under FedCME's name; sample 2 or more clients a "
            "round (the paper: 10 of 50), or set algorithm.params.exchange: none (FedCME-OL)")
        FedCME(FedCME.Params(exchange=exchange)).check_round_size(2)
    FedCME(FedCME.Params(exchange="none")).check_round_size(1)


def test_round_size_check_reaches_every_composed_part_with_the_runs_value():
    """Composed, FedCME's round-size check passes the run's clients per round on (``super()``)."""
    algo = compose([FedCME, ClientStateProbe])()
    algo.check_round_size(10)
    assert algo.seen == [("check_round_size", 10)]


def test_schedule_check_reaches_every_composed_part_with_the_runs_values():
    """Composed, FedCME's schedule check passes the run's rounds and local epochs on to the next
    part (``super()``), so every part of the combination checks the same schedule."""
    algo = compose([FedCME, ClientStateProbe])()
    algo.check_schedule(7, 6)
    assert algo.seen == [("check_schedule", 7, 6)]


def test_local_batchnorm_statistics_enter_phase_a_and_survive_both_phases():
    """With ``bn_buffers: local`` phase A starts from the global model with the client's own
    BatchNorm statistics, the phase-A client state keeps them beside the mid-round model, and the
    round ends with them as the client's state (phase B continues from the mid-round model)."""
    algo = FedCME(FedCME.Params(bn_buffers="local"))
    client = ScriptedClient()
    glob = client.weights
    own = {"body.bn.running_mean": T([5.0, -5.0]), "body.bn.running_var": T([4.0, 9.0]),
           "body.bn.num_batches_tracked": T(7)}
    reply_a, state = algo.client_update(Message("train", {"model": glob}, {"partner": 1, "share": True}),
                                        {"buffers": own}, client)
    start, kw = client.calls[0]
    assert same(start, {**glob, **own}) and kw["epochs"] == 1 and kw["start_epoch"] == 0
    assert set(state) == {"buffers", MID} and state["buffers"] is own
    assert same(reply_a.arrays["exchange"], part(glob, "head."))
    _, final = algo.client_update(Message("continue"), state, client)
    assert same(client.calls[1][0], {**glob, **own}) and set(final) == {"buffers"}
    assert same(final["buffers"], own)


def test_composed_components_client_state_and_runtime_pass_through_both_phases():
    """Composed after FedCME, a component's client state (without FedCME's mid-round entry) and
    the client runtime reach its hooks: ``with_local_buffers`` at the start of phase A,
    ``after_training`` at the end of phase B, and its updated state is the client's next state."""
    algo = compose([FedCME, ClientStateProbe])()
    client = ScriptedClient()
    msg = Message("train", {"model": client.weights}, {"partner": None, "share": False})
    _, state = algo.client_update(msg, {"probe_rounds": 4}, client)
    assert set(state) == {"probe_rounds", MID}
    _, final = algo.client_update(Message("continue"), state, client)
    assert algo.seen == [("with_local_buffers", {"probe_rounds": 4}, client),
                         ("after_training", {"probe_rounds": 4}, client)]
    assert final == {"probe_rounds": 5}


def test_fedcme_ols_single_phase_hands_the_round_message_and_client_state_to_composed_parts():
    """Without an exchange the round ends after phase A: a composed component's ``after_training``
    gets the round's message (SCAFFOLD's server control variate rides on it) and its own state."""
    cls = compose([FedCME, ClientStateProbe])
    algo = cls(cls.Params(exchange="none"))
    client = ScriptedClient()
    msg = Message("train", {"model": client.weights}, {"partner": None, "share": False})
    reply, state = algo.client_update(msg, {"probe_rounds": 4}, client)
    assert reply.kind == "update"
    assert algo.seen == [("with_local_buffers", {"probe_rounds": 4}, client),
                         ("after_training", {"probe_rounds": 4}, client)]
    assert algo.messages == [msg]
    assert state == {"probe_rounds": 5}


def test_reported_steps_and_loss_cover_the_whole_round():
    """A client reports its optimizer steps and mean loss over all E epochs: one phase for
    FedCME-OL, phase A's and phase B's together (step-weighted mean) for a split round."""
    msg = Message("train", {"model": ScriptedClient().weights}, {"partner": None, "share": False})
    single = ScriptedClient(results=[(4, 0.5)])
    reply, _ = FedCME(FedCME.Params(exchange="none")).client_update(msg, None, single)
    assert single.calls[0][1]["epochs"] == 2
    assert reply.kind == "update" and reply.scalars == {"num_samples": 3, "steps": 4, "loss": 0.5}
    split = ScriptedClient(results=[(3, 0.5), (1, 0.25)])
    reply_a, state = FedCME().client_update(msg, None, split)
    assert reply_a.scalars == {"num_samples": 3, "steps": 3, "loss": 0.5}
    reply, _ = FedCME().client_update(Message("continue"), state, split)
    assert reply.scalars == {"num_samples": 3, "steps": 4, "loss": (3 * 0.5 + 0.25) / 4}


def test_phase_b_message_without_a_phase_a_state_is_an_error_naming_client_and_kind():
    """A phase-B message (``continue`` or ``exchange``) reaching a client that kept no mid-round
    state is an error that names the client and the message kind."""
    client = ScriptedClient()
    with pytest.raises(RuntimeError, match=r"^fedcme client 3 got a 'continue' message without a phase-A state$"):
        FedCME().client_update(Message("continue"), None, client)
    with pytest.raises(RuntimeError, match=r"^fedcme client 3 got a 'exchange' message without a phase-A state$"):
        FedCME().client_update(Message("exchange", {"exchange": {}}), {"buffers": {}}, client)
    assert client.calls == []


# --- end to end ------------------------------------------------------------------------------
def test_fedcme_end_to_end_ledger_and_learning(small_config, tmp_path):
    cfg = copy.deepcopy(small_config)
    cfg["algorithm"] = {"name": "fedcme", "params": {"mu": 0.01}}
    cfg["train"]["local_epochs"] = 2
    exp = Experiment.create(load_config(raw=cfg), tmp_path / "r")
    exp.run(progress=False)
    rows = read_metrics(exp.run_dir)
    assert [r["round"] for r in rows] == [1, 2, 3]
    for i, row in enumerate(rows):
        comm = row["comm"]
        assert row["phases"] == 2
        assert comm["down/exchange"]["floats"] == 2 * HEAD      # 3 clients: one pair, one unpaired
        assert comm["up/exchange"]["floats"] == 2 * HEAD
        assert comm["up/features"]["floats"] == 3 * FEAT
        assert comm["up/evaluation"]["floats"] == 3 * 10
        assert comm.get("down/features", {}).get("floats", 0) == (0 if i == 0 else 3 * FEAT)
        assert len(row["fedcme_pairs"]) == 2 and row["fedcme_pairs"][1][1] is None
    assert rows[-1]["train_loss"] < rows[0]["train_loss"]
    assert rows[-1]["global_acc"] > 0.3                          # chance is 0.1


class HookArgumentProbe(FedAvg):
    """A FedAvg-family component that records the message, client state and client runtime its
    training hooks (``data_terms``, ``local_terms``, ``train_options``) receive."""

    name = "hookprobe"

    def __init__(self, params=None):
        super().__init__(params)
        self.seen = []

    def data_terms(self, msg, state, client):
        self.seen.append(("data_terms", msg, state, client))
        return super().data_terms(msg, state, client)

    def local_terms(self, msg, state, client):
        self.seen.append(("local_terms", msg, state, client))
        return super().local_terms(msg, state, client)

    def train_options(self, msg, state, client):
        self.seen.append(("train_options", msg, state, client))
        return super().train_options(msg, state, client)


def test_training_hooks_see_the_round_message_client_state_and_runtime_in_both_phases():
    """Both phases build their loss terms and training options from the round's ``train`` message
    (phase B from the one kept since phase A, with its partner and share flag), with the client
    state a composed component keeps and the client runtime."""
    algo = compose([FedCME, HookArgumentProbe])()
    client = ScriptedClient()
    msg = Message("train", {"model": client.weights}, {"partner": 1, "share": True})
    _, state = algo.client_update(msg, {"probe_rounds": 4}, client)
    algo.client_update(Message("exchange", {"exchange": {}}, {"partner": 1}), state, client)
    hooks = ["data_terms", "local_terms", "train_options"]
    assert [h for h, *_ in algo.seen] == hooks + hooks
    for _, seen_msg, seen_state, seen_client in algo.seen:
        assert seen_msg.kind == "train" and seen_msg.arrays is msg.arrays
        assert seen_msg.scalars == {"partner": 1, "share": True}
        assert seen_state["probe_rounds"] == 4
        assert seen_client is client


def test_unknown_message_kind_is_an_error_naming_the_kind():
    """A client message that is neither ``train`` nor a phase-B ``exchange``/``continue`` is refused
    with its kind named, before any training."""
    client = ScriptedClient()
    with pytest.raises(ValueError, match=r"^fedcme client got an unknown message kind 'evaluate'$"):
        FedCME().client_update(Message("evaluate"), None, client)
    assert client.calls == []


def test_exchange_with_tensors_the_model_lacks_is_refused_naming_the_first_three():
    """A counterpart's part with tensor names the mid-round model does not have is refused (no
    phase-B training); the error lists the first three unknown names in sorted order."""
    client = ScriptedClient()
    msg = Message("train", {"model": client.weights}, {"partner": 1, "share": True})
    _, state = FedCME().client_update(msg, None, client)
    bad = {**part(client.weights, "head."), **{f"head.x{i}": T([0.0]) for i in (4, 2, 3, 1)}}
    with pytest.raises(ValueError) as err:
        FedCME().client_update(Message("exchange", {"exchange": bad}, {"partner": 1}), state, client)
    assert str(err.value) == \
        "fedcme exchange carries tensors the model does not have: ['head.x1', 'head.x2', 'head.x3']"
    assert len(client.calls) == 1                           # phase A only


class OtherTermStatisticsClient(ScriptedClient):
    """A ScriptedClient whose results also carry per-class statistics of another composed loss
    term (FedDistill's logit sums), as local training reports them."""

    def train(self, weights, terms=None, **kw):
        result = super().train(weights, terms, **kw)
        result.statistics = {"distill.sums": torch.ones(4, 4, dtype=torch.float64),
                             "distill.counts": T([1, 1, 1, 0])}
        return result


def test_only_exchange_client_swaps_but_uploads_no_features():
    """FedCME-OE (``mu: 0``): no alignment term, so the client still hands over and receives the
    classifier but collects and uploads no class features - only the model and eps_k - even when
    another composed term's statistics come back from training."""
    algo = FedCME(FedCME.Params(mu=0.0))
    client = OtherTermStatisticsClient()
    msg = Message("train", {"model": client.weights}, {"partner": 1, "share": True})
    reply_a, state = algo.client_update(msg, None, client)
    assert same(reply_a.arrays["exchange"], part(client.weights, "head."))
    theirs = {k: v + 1 for k, v in part(client.weights, "head.").items()}
    reply, _ = algo.client_update(Message("exchange", {"exchange": theirs}, {"partner": 1}), state, client)
    assert same(client.calls[1][0], {**client.weights, **theirs})
    assert set(reply.arrays) == {"model", "evaluation"}
    assert all("statistics" not in kw for _, kw in client.calls)


@pytest.mark.parametrize("results", [[(1, 0.75)], [(1, 0.75), (0, 0.0)]])
def test_a_round_of_one_optimizer_step_reports_that_steps_loss(results):
    """With one optimizer step in the whole round (FedCME-OL, or a split round whose phase B
    trains no batch) the reported mean loss is that step's loss."""
    exchange = "none" if len(results) == 1 else "classifier"
    algo = FedCME(FedCME.Params(exchange=exchange))
    client = ScriptedClient(results=results)
    msg = Message("train", {"model": client.weights}, {"partner": None, "share": False})
    reply, state = algo.client_update(msg, None, client)
    if len(results) == 2:
        reply, _ = algo.client_update(Message("continue"), state, client)
    assert reply.kind == "update" and reply.scalars == {"num_samples": 3, "steps": 1, "loss": 0.75}


def test_split_round_loss_weights_each_phase_mean_by_its_steps():
    """Phase A's and phase B's mean losses combine weighted by their step counts:
    (2 * 0.5 + 2 * 0.25) / 4 = 0.375."""
    client = ScriptedClient(results=[(2, 0.5), (2, 0.25)])
    msg = Message("train", {"model": client.weights}, {"partner": None, "share": False})
    _, state = FedCME().client_update(msg, None, client)
    reply, _ = FedCME().client_update(Message("continue"), state, client)
    assert reply.scalars == {"num_samples": 3, "steps": 4, "loss": 0.375}


@pytest.mark.parametrize("scalars, shares", [
    ({"partner": 1, "share": False}, False),     # paired, but nobody takes its part (FedCME-MTO)
    ({"partner": None, "share": True}, True),    # the server's flag decides, not the partner
    ({"partner": 1}, True),                      # no flag: share exactly when paired
    ({"partner": None}, False),
])
def test_phase_a_uploads_its_part_exactly_when_it_is_needed(scalars, shares):
    """The phase-A reply carries the mid-round part iff the server's ``share`` flag says another
    client takes it; a message without the flag shares iff the client has a counterpart."""
    client = ScriptedClient()
    reply, _ = FedCME().client_update(Message("train", {"model": client.weights}, scalars), None, client)
    assert reply.kind == "mid"
    if shares:
        assert set(reply.arrays) == {"exchange"} and same(reply.arrays["exchange"], part(client.weights, "head."))
    else:
        assert reply.arrays == {}


# --- feature alignment and client-side details (hand-computed cases) -------------------------
def alignment_loss(term, h, y):
    """The alignment term on a batch whose features are ``h`` (the logits are unused)."""
    return term(Forward(h, h), Batch(h, y, torch.arange(len(y))), {})


def test_alignment_with_mu_one_without_a_mask_aligns_every_present_class():
    """Eq. 9-10 with mu = 1 and no ``defined`` mask given (every zeta row defined): the loss is
    sum_c ||mean_{y_i=c} h_i - zeta_c||^2 and dL/dh_i = 2 (mean_c - zeta_c) / n_c.
    h = [1,2], [3,0], [2,4], y = 0, 1, 0, zeta = [0,1], [1,1]:
    class 0 mean [1.5,3] - [0,1] = [1.5,2] -> 6.25; class 1: [3,0] - [1,1] = [2,-1] -> 5."""
    zeta = T([[0.0, 1.0], [1.0, 1.0]])
    term = FeatureAlignment(1.0, 2, zeta)
    assert torch.equal(term.defined, T([True, True]))            # a (C,) boolean mask, all defined
    h = T([[1.0, 2.0], [3.0, 0.0], [2.0, 4.0]], requires_grad=True)
    loss = alignment_loss(term, h, T([0, 1, 0]))
    assert loss.item() == 11.25
    loss.backward()
    assert torch.equal(h.grad, T([[1.5, 2.0], [4.0, -2.0], [1.5, 2.0]]))


def test_alignment_casts_zeta_to_the_features_precision():
    """zeta is a constant in the features' dtype: float32 features equal to a float64 zeta of the
    same value (0.1) give exactly 0, a float32 loss (not the float64 rounding gap 1.5e-9 squared)."""
    term = FeatureAlignment(1.0, 1, T([[0.1]], dtype=torch.float64))
    loss = alignment_loss(term, T([[0.1]]), T([0]))
    assert loss.dtype == torch.float32 and loss.item() == 0.0


def test_alignment_runs_on_the_features_device_with_the_mask_beside_zeta():
    """The term moves zeta and its mask to the device of the features (the meta device stands in
    for an accelerator here), and a mask built for a zeta keeps zeta's device."""
    zeta = T([[0.0, 1.0], [1.0, 1.0]])
    h = torch.zeros(2, 2, device="meta")
    y = torch.zeros(2, dtype=torch.long, device="meta")
    loss = alignment_loss(FeatureAlignment(1.0, 2, zeta, T([True, False])), h, y)
    assert loss.device.type == "meta" and loss.shape == ()
    assert FeatureAlignment(1.0, 2, zeta.to("meta")).defined.device.type == "meta"


def test_unseen_class_mean_is_zero_even_if_diverged_features_poison_its_sum():
    """Algorithm 2 line 18: a class with count 0 gets mean 0, even when an infinite feature made
    its (masked) sum 0 * inf = NaN; seen classes get sum / count."""
    h = T([[float("inf"), 1.0], [float("inf"), 3.0]])
    y = T([0, 0])
    stats = FeatureAlignment(1.0, 2).statistics(Forward(h, h), Batch(h, y, torch.arange(2)))
    means, counts = local_features({f"l2.{k}": v for k, v in stats.items()})
    assert torch.equal(counts, T([2, 0]))
    assert torch.equal(means, T([[float("inf"), 2.0], [0.0, 0.0]]))


def test_eval_subset_of_an_empty_split_is_an_empty_index_tensor():
    """A client without training samples evaluates on no position: an empty int64 index vector."""
    positions = eval_subset(0, 0.2, torch.Generator().manual_seed(0))
    assert positions.dtype == torch.long and positions.shape == (0,)


def test_fresh_server_state_has_no_evaluations_features_or_matching():
    """Before round 1 the server knows no eps_k, no global feature (zeta and its mask undefined)
    and no matching."""
    state = FedCME().init_server_state({"cnn": {"head.w": T([0.0])}})
    assert state["eval"] == {} and state["features"] is None and state["defined"] is None
    assert state["matching"] == []


def test_local_alignment_term_skips_classes_the_server_has_not_defined():
    """The client's term takes the server's ``defined`` mask: with class 1 undefined only class
    0 is aligned, mu * ||[1,2] - [0,1]||^2 = 0.5 * 2 = 1 (class 1's [3,0] vs [1,1] would add 2.5)."""
    zeta = T([[0.0, 1.0], [1.0, 1.0], [0.0, 0.0], [0.0, 0.0]])          # ScriptedClient: 4 classes
    msg = Message("train", {"model": {}, "features": {"mean": zeta, "defined": T([True, False, True, True])}})
    [term] = FedCME(FedCME.Params(mu=0.5)).local_terms(msg, None, ScriptedClient())
    assert alignment_loss(term, T([[1.0, 2.0], [3.0, 0.0]]), T([0, 1])).item() == 1.0


class UploadHookProbe(FedAvg):
    """A FedAvg-family component that records what ``after_training`` and ``uploads`` receive and
    uploads the number of steps its result reports."""

    name = "uploadprobe"

    def __init__(self, params=None):
        super().__init__(params)
        self.seen = []

    def after_training(self, result, msg, state, client):
        self.seen.append(("after_training", result, msg, state, client))
        return {**(super().after_training(result, msg, state, client) or {}), "probe": 1}

    def uploads(self, result, msg, state, client):
        self.seen.append(("uploads", result, msg, state, client))
        return {**super().uploads(result, msg, state, client), "probe": {"steps": T(result.steps)}}


class PurposeClient(ScriptedClient):
    """A ScriptedClient that records the purposes of the random streams it hands out."""

    def generator(self, *purpose):
        self.purposes = [*getattr(self, "purposes", []), purpose]
        return super().generator(*purpose)


def test_final_hooks_see_phase_bs_result_the_round_message_and_the_new_state():
    """At the end of the round the composed ``after_training`` gets phase B's result, the round's
    ``train`` message and the client state, and ``uploads`` gets the same result and message with
    the state ``after_training`` returned; its arrays are uploaded. eps_k's subset comes from the
    client's ``"eval_subset"`` stream."""
    algo = compose([FedCME, UploadHookProbe])()
    client = PurposeClient(results=[(3, 0.5), (1, 0.25)])
    msg = Message("train", {"model": client.weights}, {"partner": None, "share": False})
    _, state = algo.client_update(msg, {"own": 2}, client)
    reply, final = algo.client_update(Message("continue"), state, client)
    assert [h for h, *_ in algo.seen] == ["after_training", "uploads"]
    (_, r1, m1, s1, c1), (_, r2, m2, s2, c2) = algo.seen
    assert r1 is r2 and r1.steps == 1 and c1 is client and c2 is client
    assert m1.kind == m2.kind == "train" and m1.arrays is msg.arrays and m2.arrays is msg.arrays
    assert s1 == {"own": 2} and s2 == {"own": 2, "probe": 1} == final
    assert torch.equal(reply.arrays["probe"]["steps"], T(1))
    assert getattr(client, "purposes", []) == [("eval_subset",)]


# --- what each step reads: eps_g of the sampled clients, D_eval's size and its stream ------------
def test_typicality_is_measured_against_the_mean_of_the_sampled_clients_vectors():
    """eps_g is the mean of the sampled clients' vectors (Algorithm 1 line 15), not any one client's:
    v = 0: [1,0,0], 1: [0,1,0], 2: [0,1,0], 3: [0,1,.2]; eps_g = [.25,.75,.05] gives cos .32, .947,
    .947, .941 -> order 0, 3, 1, 2; pop 0: cosine 0 with all three, the first (3) -> (0,3), (1,2).
    Against client 0's own vector every other client has cosine 0 and 0 comes last: (1,0), (2,3)."""
    v = {0: T([1.0, 0, 0]), 1: T([0.0, 1, 0]), 2: T([0.0, 1, 0]), 3: T([0.0, 1, 0.2])}
    assert make_matching(v, [0, 1, 2, 3]) == {0: 3, 3: 0, 1: 2, 2: 1}


def test_evaluation_subset_is_the_configured_fraction_drawn_from_each_rounds_stream(small_config, tmp_path,
                                                                                   monkeypatch):
    """D_eval (Algorithm 2 line 19) is a random eval_fraction of the training split, drawn from the
    client's "eval_subset" stream of the round: a new subset each round, of the configured size."""
    import fedhet.algorithms.fedcme as fedcme_module

    seen = []
    real = fedcme_module.evaluation_vector

    def recording(model, weights, data, num_classes, positions, *args, **kw):
        seen.append(positions.clone())
        return real(model, weights, data, num_classes, positions, *args, **kw)

    monkeypatch.setattr(fedcme_module, "evaluation_vector", recording)
    sim = make_sim(small_config, tmp_path, exchange="none", eval_fraction=0.5)
    algo = sim.algorithm
    cid = sim.round_context(0).clients[0]
    expected = []
    for rnd in (0, 1):
        client = runtime(sim, cid, rnd)
        algo.client_update(algo.train_message(sim.server_state, cid, sim.round_context(rnd)), None, client)
        expected.append(eval_subset(client.num_samples, 0.5, runtime(sim, cid, rnd).generator("eval_subset")))
    n = runtime(sim, cid).num_samples
    assert [len(p) for p in seen] == [round(0.5 * n)] * 2
    assert all(torch.equal(p, e) for p, e in zip(seen, expected))
    assert not torch.equal(seen[0], seen[1])
