"""FedFM and FedFM-Lite (Ye et al.) against hand-computed cases: the CG and l2 matching losses,
anchors (Eq. 8) and their aggregation (Eq. 9, Table VIII), the warm-up, the matching term after
it, Lite's schedule and its communication, and composition with other methods."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import build_loop, config, ctx, runtime

from fedhet.algorithms import algorithm_class
from fedhet.algorithms import fedfm as fedfm_module
from fedhet.algorithms.fedavg import FedAvg
from fedhet.algorithms.fedfm import AnchorMatching, FedFM, FedFMLite, aggregate_anchors, local_anchors
from fedhet.core.contract import Batch, Forward, Message
from fedhet.core.errors import ConfigError
from fedhet.training.local import forward
from fedhet.training.objective import CrossEntropy
from fedhet.training.terms import Proximal


def out_of(h: torch.Tensor) -> Forward:
    return Forward(h, torch.zeros(len(h), 3))


def batch_of(y) -> Batch:
    y = torch.tensor(y)
    return Batch(torch.zeros(len(y), 1), y, torch.arange(len(y)))


# --- the matching losses ------------------------------------------------------------------
def test_cg_loss_hand_computed():
    # normalised features (1,0) and (0,1); normalised anchors (1,0), (0,1), (1,1)/sqrt2; tau 0.5
    h = torch.tensor([[3.0, 0.0], [0.0, 0.5]])
    anchors = torch.tensor([[2.0, 0.0], [0.0, 7.0], [1.0, 1.0]])
    term = AnchorMatching(anchors, torch.ones(3, dtype=torch.bool), lam=2.0, kind="cg", temperature=0.5)
    r = 1 / math.sqrt(2) / 0.5
    loss0 = -2.0 + math.log(math.exp(2.0) + math.exp(0.0) + math.exp(r))   # sample 0, class 0
    loss1 = -2.0 + math.log(math.exp(0.0) + math.exp(2.0) + math.exp(r))   # sample 1, class 1
    value = term(out_of(h), batch_of([0, 1]), {})
    assert float(value) == pytest.approx(2.0 * (loss0 + loss1) / 2, rel=1e-6)


def test_cg_loss_is_cross_entropy_over_scaled_cosine_similarities():
    g = torch.Generator().manual_seed(0)
    h, anchors = torch.randn(16, 8, generator=g), torch.randn(5, 8, generator=g)
    y = torch.randint(0, 5, (16,), generator=g)
    cos = F.cosine_similarity(h.unsqueeze(1), anchors.unsqueeze(0), dim=-1)          # (16, 5)
    expected = F.cross_entropy(cos / 0.1, y)
    term = AnchorMatching(anchors, torch.ones(5, dtype=torch.bool), lam=1.0, kind="cg", temperature=0.1)
    assert float(term(out_of(h), Batch(torch.zeros(16), y, torch.arange(16)), {})) == pytest.approx(
        float(expected), rel=1e-5)


def test_l2_variant_averages_over_batch_and_feature_dims():
    # h (3,4) -> (0.6, 0.8); its anchor (5,0) -> (1, 0): squared distance 0.16 + 0.64 = 0.8, over d=2 -> 0.4
    # h (0,2) -> (0, 1); its anchor (0,9) -> (0, 1): 0.  Mean over the batch: 0.2; lam 3 -> 0.6
    term = AnchorMatching(torch.tensor([[5.0, 0.0], [0.0, 9.0]]), torch.ones(2, dtype=torch.bool), lam=3.0, kind="l2")
    value = term(out_of(torch.tensor([[3.0, 4.0], [0.0, 2.0]])), batch_of([0, 1]), {})
    assert float(value) == pytest.approx(0.6, rel=1e-6)


def test_classes_without_anchor_are_left_out():
    anchors = torch.tensor([[1.0, 0.0], [0.0, 1.0], [123.0, -5.0]])
    defined = torch.tensor([True, True, False])
    h = torch.tensor([[1.0, 0.2], [0.3, 1.0], [4.0, 4.0]])
    full = AnchorMatching(anchors[:2], torch.ones(2, dtype=torch.bool), 1.0, "cg", 0.1)
    masked = AnchorMatching(anchors, defined, 1.0, "cg", 0.1)
    # the third sample (class 2, no anchor) is dropped and anchor 2 is not in the softmax
    assert float(masked(out_of(h), batch_of([0, 1, 2]), {})) == pytest.approx(
        float(full(out_of(h[:2]), batch_of([0, 1]), {})), rel=1e-6)


def test_configured_l2_matching_reaches_the_training_term():
    """matching: l2 (the l2 variant of Sec. IV-C) is the kind of the term the client trains with,
    beside the configured lambda and temperature."""
    algo = FedFM(FedFM.Params(start_round=0, matching="l2", lam=2.0, temperature=0.3))
    anchors = {"mean": torch.zeros(2, 3), "defined": torch.ones(2, dtype=torch.bool)}
    (term,) = algo.local_terms(Message("train", {"anchors": anchors}), None, object())
    assert isinstance(term, AnchorMatching) and (term.kind, term.lam, term.temperature) == ("l2", 2.0, 0.3)


# --- anchors -------------------------------------------------------------------------------
def test_weighted_anchor_aggregation_and_a_missing_class():
    prev = torch.tensor([[9.0, 9.0], [8.0, 8.0], [7.0, 7.0]])
    prev_def = torch.tensor([True, True, False])
    a = (torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.0, 0.0]]), torch.tensor([3, 0, 0]))
    b = (torch.tensor([[3.0, 4.0], [0.0, 0.0], [0.0, 0.0]]), torch.tensor([1, 0, 0]))
    anchors, defined = aggregate_anchors(prev, prev_def, [a, b], "weighted")
    assert torch.allclose(anchors[0], torch.tensor([(3 * 1 + 1 * 3) / 4, (0 + 4) / 4]))  # Eq. 9
    assert torch.equal(anchors[1], prev[1])            # nobody has class 1: the previous anchor stays
    assert defined.tolist() == [True, True, False]     # class 2 never had one


def test_uniform_anchor_aggregation_fills_missing_with_the_previous_anchor():
    prev = torch.tensor([[10.0, 0.0], [0.0, 6.0]])
    prev_def = torch.tensor([True, True])
    a = (torch.tensor([[1.0, 0.0], [0.0, 3.0]]), torch.tensor([50, 1]))
    b = (torch.tensor([[4.0, 0.0], [0.0, 0.0]]), torch.tensor([1, 0]))
    anchors, defined = aggregate_anchors(prev, prev_def, [a, b], "uniform")
    assert torch.allclose(anchors[0], torch.tensor([2.5, 0.0]))        # plain mean, counts ignored
    assert torch.allclose(anchors[1], torch.tensor([0.0, 4.5]))        # (3 + previous 6) / 2
    weighted, _ = aggregate_anchors(prev, prev_def, [a, b], "weighted")
    assert torch.allclose(weighted[0], torch.tensor([54 / 51, 0.0]))   # the same uploads, Eq. 9


def test_first_aggregation_leaves_unseen_classes_undefined():
    a = (torch.tensor([[1.0, 2.0], [0.0, 0.0]]), torch.tensor([2, 0]))
    anchors, defined = aggregate_anchors(None, None, [a], "uniform")
    assert defined.tolist() == [True, False] and torch.equal(anchors[0], torch.tensor([1.0, 2.0]))


def test_local_anchors_use_every_training_sample_in_eval_mode(small_config):
    cfg = config(small_config, "fedfm", {"start_round": 1}, batch_size=7, drop_last=True)
    loop = build_loop(cfg)
    client = runtime(loop, 0)
    weights = client.init_weights()
    means, counts = local_anchors(client.model, weights, client.data, client.num_classes, batch_size=5)
    x = client.data.inputs(client.data.train_idx)
    y = client.data.y[client.data.train_idx]
    client.model.eval()
    with torch.no_grad():
        h = forward(client.model, weights, x).features.double()
    assert int(counts.sum()) == client.num_samples          # no drop_last: every sample counted once
    assert torch.equal(counts, torch.bincount(y, minlength=client.num_classes))
    for c in range(client.num_classes):
        if counts[c]:
            torch.testing.assert_close(means[c], h[y == c].mean(0).float(), atol=1e-5, rtol=1e-5)
        else:
            assert not means[c].any()


# --- the round -----------------------------------------------------------------------------
def run_rounds(loop, rounds, num_rounds=None):
    return [loop.run_round(r, num_rounds=num_rounds) for r in range(rounds)]


def test_warm_up_rounds_are_fedavg_bit_for_bit(small_config):
    fedavg = build_loop(config(small_config, "fedavg"))
    fedfm = build_loop(config(small_config, "fedfm", {"start_round": 2}))
    for rnd in range(2):
        a, b = fedavg.run_round(rnd), fedfm.run_round(rnd)
        assert a.phases == b.phases == 1
        assert fedavg.ledger.take_round(rnd) == fedfm.ledger.take_round(rnd)
    for k, v in fedavg.server_state["model"].items():
        assert torch.equal(v, fedfm.server_state["model"][k]), k
    assert fedfm.server_state["anchors"] is None
    assert fedfm.run_round(2).phases == 2                  # from T_s on: anchors, then training


def test_anchors_are_computed_in_eval_mode(small_config, monkeypatch):
    import fedhet.algorithms.prototypes as prototypes_module  # local_anchors are the clients' prototypes

    loop = build_loop(config(small_config, "fedfm", {"start_round": 1}))
    client = runtime(loop, 0)
    modes = []
    real = prototypes_module.forward

    def spy(model, weights, x):
        modes.append(model.training)
        return real(model, weights, x)

    monkeypatch.setattr(prototypes_module, "forward", spy)
    client.model.train()
    local_anchors(client.model, client.init_weights(), client.data, client.num_classes)
    assert modes and not any(modes)            # BatchNorm/dropout must not act while anchors are taken
    assert client.model.training               # and the model is left as it was found


def test_round_anchors_are_the_aggregate_of_each_clients_anchors_with_the_global_model(small_config):
    loop = build_loop(config(small_config, "fedfm", {"start_round": 0, "lam": 1.0}))
    w0 = {k: v.clone() for k, v in loop.server_state["model"].items()}
    clients = loop.sample_clients(0)
    loop.run_round(0)
    uploads = []
    for cid in clients:
        c = runtime(loop, cid)
        uploads.append(local_anchors(c.model, w0, c.data, c.num_classes))
    anchors, defined = aggregate_anchors(None, None, uploads, "weighted")
    torch.testing.assert_close(loop.server_state["anchors"], anchors, atol=0, rtol=0)
    assert torch.equal(loop.server_state["anchors_defined"], defined)


def test_matching_term_trains_after_the_warm_up(small_config):
    """Fails if the term is dropped, weighted by zero, or fed anchors other than the server's."""
    cfg = config(small_config, "fedfm", {"start_round": 0, "lam": 5.0})
    loop = build_loop(cfg)
    algo: FedFM = loop.algorithm
    state = loop.server_state
    client = runtime(loop, 0)
    reply, cstate = algo.client_update(Message("anchors", {"model": state["model"]}), None, client)
    anchors, defined = aggregate_anchors(None, None, [(reply.arrays["anchors"]["mean"],
                                                       reply.arrays["anchors"]["count"])])
    c = ctx([0], num_classes=client.num_classes)
    msg = algo.train_message({**state, "anchors": anchors, "anchors_defined": defined}, 0, c)
    msg.arrays.pop("model")
    terms = algo.local_terms(Message("train", {**msg.arrays, "model": state["model"]}), None, client)
    (term,) = [t for t in terms if isinstance(t, AnchorMatching)]
    assert term.lam == 5.0 and torch.equal(term.anchors, anchors)
    trained, _ = algo.client_update(msg, cstate, runtime(loop, 0))
    # exactly CE + lam * L_FM with the server's anchors, from the model of the anchor phase
    expect = runtime(loop, 0).train(state["model"], [CrossEntropy(), AnchorMatching(anchors, defined, 5.0, "cg", 0.1)])
    for k, w in expect.weights.items():
        assert torch.equal(trained.arrays["model"][k], w), k
    plain = runtime(loop, 0).train(state["model"], [CrossEntropy()])
    diff = sum(float((trained.arrays["model"][k] - plain.weights[k]).abs().sum()) for k in plain.weights)
    assert diff > 1e-3, "FedFM after T_s trained like plain cross-entropy"
    assert trained.scalars["loss"] > plain.mean_loss + 1.0     # lam * L_FM is part of the objective


def test_training_phase_matches_against_this_rounds_anchors_not_the_previous_ones():
    """Alg. 1: the anchors a round trains against are A^(t), aggregated from this round's anchor
    phase, not those the state carried in from the previous round."""
    algo = FedFM(FedFM.Params(start_round=0))
    state = algo.init_server_state({"m": {"w": torch.zeros(2)}})
    state["anchors"], state["anchors_defined"] = torch.full((2, 2), 9.0), torch.ones(2, dtype=torch.bool)
    gen = algo.round(state, ctx([0, 1], num_classes=2))
    next(gen)
    train = gen.send({0: anchor_reply([[1.0, 0.0], [0.0, 0.0]], [4, 0]),
                      1: anchor_reply([[0.0, 0.0], [0.0, 3.0]], [0, 2])})
    for msg in train.values():
        assert torch.equal(msg.arrays["anchors"]["mean"], torch.tensor([[1.0, 0.0], [0.0, 3.0]]))


def test_fedfm_round_sends_the_model_once_and_anchors_both_ways(small_config):
    cfg = config(small_config, "fedfm", {"start_round": 0, "lam": 1.0})
    loop = build_loop(cfg)
    loop.run_round(0)
    comm = loop.ledger.take_round(0)
    n_model = sum(v.numel() for v in loop.server_state["model"].values())
    k = cfg.train.clients_per_round
    c, d = loop.server_state["anchors"].shape
    assert comm["down/model"]["floats"] == k * n_model
    assert comm["up/model"]["floats"] == k * n_model
    assert comm["up/anchors"]["floats"] == k * (c * d + c)        # means + counts
    assert comm["down/anchors"]["floats"] == k * (c * d + c)      # anchors + defined mask


@pytest.mark.parametrize("every", [1, 2, 5])
def test_lite_schedule_and_floats_per_round(small_config, every):
    rounds = 6
    # what travels does not depend on how much each client trains: a quarter of the pool is enough
    raw = {**small_config, "data": {**small_config["data"], "pool_fraction": 0.25}}
    cfg = config(raw, "fedfm_lite", {"start_round": 0, "model_every": every, "lam": 1.0},
                 clients_per_round=small_config["data"]["num_clients"])
    loop = build_loop(cfg)
    k = cfg.train.clients_per_round
    n_model = sum(v.numel() for v in loop.server_state["model"].values())
    for rnd in range(rounds):
        before = {n: t.clone() for n, t in loop.server_state["model"].items()}
        stats = loop.run_round(rnd, num_rounds=rounds)
        assert stats.phases == 1                                    # one handshake per round
        comm = loop.ledger.take_round(rnd)
        c, d = loop.server_state["anchors"].shape
        down_model = k * n_model if rnd % every == 0 else 0
        up_model = k * n_model if (rnd + 1) % every == 0 or rnd == rounds - 1 else 0
        down_anchors = k * (c * d + c) if rnd > 0 else 0            # nothing aggregated before round 0
        expected = {"down/model": down_model, "up/model": up_model, "up/anchors": k * (c * d + c),
                    "down/anchors": down_anchors}
        assert {g: v["floats"] for g, v in comm.items()} == {g: v for g, v in expected.items() if v}, rnd
        changed = any(not torch.equal(before[n], t) for n, t in loop.server_state["model"].items())
        assert changed == bool(up_model), rnd                       # the global model moves only on uploads


def test_a_lite_run_whose_last_round_uploaded_only_as_the_last_is_not_extended(small_config, tmp_path):
    """model_every 2 from round 0: rounds 2, 4, 6 (1-based) upload. A 3-round run's round 3 uploaded
    only as its last; extended to 4 it would have averaged a model a 4-round run never does: refused,
    nothing touched. A run that ended on an upload round extends."""
    import copy

    from fedhet.core.errors import CheckpointError
    from fedhet.experiment.config import load_config
    from fedhet.experiment.runner import Experiment, read_metrics

    lite = FedFMLite(FedFMLite.Params(start_round=0, model_every=2))
    assert lite.extension_problem(3, 4) and lite.extension_problem(2, 4) is None
    assert lite.extension_problem(3, 3) is None                         # not extended: nothing to say
    raw = copy.deepcopy(small_config)
    raw["algorithm"] = {"name": "fedfm_lite", "params": {"start_round": 0, "model_every": 2, "lam": 1.0}}
    raw["train"]["rounds"] = 3
    raw["data"]["pool_fraction"] = 0.25
    Experiment.create(load_config(raw=raw), tmp_path / "r").run(progress=False)
    before = (tmp_path / "r" / "metrics.jsonl").read_bytes()
    with pytest.raises(CheckpointError, match=r"cannot be extended to 4 rounds: fedfm_lite \(model_every 2, "
                                              r"start_round 0\): round 3 uploaded and averaged the models only"):
        Experiment.resume(tmp_path / "r", run_settings=["train.rounds=4"])
    assert (tmp_path / "r" / "metrics.jsonl").read_bytes() == before
    assert load_config(tmp_path / "r" / "config.yaml").train.rounds == 3
    assert [r["round"] for r in read_metrics(tmp_path / "r")] == [1, 2, 3]


def test_lite_warm_up_is_fedavg_and_anchors_come_from_the_trained_models(small_config):
    k = small_config["data"]["num_clients"]
    fedavg = build_loop(config(small_config, "fedavg", clients_per_round=k))
    lite = build_loop(config(small_config, "fedfm_lite", {"start_round": 2, "model_every": 2, "lam": 1.0},
                             clients_per_round=k))
    for rnd in range(2):
        fedavg.run_round(rnd, num_rounds=6)
        lite.run_round(rnd, num_rounds=6)
        a, b = fedavg.ledger.take_round(rnd), lite.ledger.take_round(rnd)
        if rnd == 0:
            assert a == b                                  # plain FedAvg before T_s - 1
        else:
            assert set(b) - set(a) == {"up/anchors"}       # anchors for round T_s ride along
            assert all(b[g] == a[g] for g in a)
        for name, w in fedavg.server_state["model"].items():
            assert torch.equal(w, lite.server_state["model"][name]), (rnd, name)
    assert lite.server_state["anchors"] is not None
    # Sec. VI: a client's anchors are those of the model it has just trained and uploads with them
    algo: FedFMLite = lite.algorithm
    msg = Message("train", {"model": lite.server_state["model"]}, {"upload_model": True, "upload_anchors": True})
    reply, _ = algo.client_update(msg, None, runtime(lite, 0, rnd=2))
    c = runtime(lite, 0, rnd=2)
    means, counts = local_anchors(c.model, reply.arrays["model"], c.data, c.num_classes)
    assert torch.equal(reply.arrays["anchors"]["mean"], means) and torch.equal(reply.arrays["anchors"]["count"], counts)
    received, _ = local_anchors(c.model, lite.server_state["model"], c.data, c.num_classes)
    assert not torch.equal(means, received)


def test_lite_sends_the_model_to_clients_that_missed_the_previous_round(small_config):
    cfg = config(small_config, "fedfm_lite", {"start_round": 0, "model_every": 2, "lam": 1.0}, clients_per_round=3)
    loop = build_loop(cfg)
    n_model = sum(v.numel() for v in loop.server_state["model"].values())
    loop.run_round(0, num_rounds=4)                       # model round: everyone gets it, nobody uploads
    loop.ledger.take_round(0)
    previous = set(loop.sample_clients(0))
    loop.run_round(1, num_rounds=4)                       # no broadcast: only newcomers need the model
    newcomers = [c for c in loop.sample_clients(1) if c not in previous]
    assert 0 < len(newcomers) < 3                         # else "only the newcomers" is not told apart
    assert loop.ledger.take_round(1).get("down/model", {"floats": 0})["floats"] == len(newcomers) * n_model


def test_uniform_anchors_upload_presence_not_counts(small_config):
    loop = build_loop(config(small_config, "fedfm", {"start_round": 0, "anchor_weighting": "uniform"}))
    client = runtime(loop, 0)
    reply, _ = loop.algorithm.client_update(Message("anchors", {"model": loop.server_state["model"]}), None, client)
    up = reply.arrays["anchors"]
    assert set(up) == {"mean", "present"} and up["present"].dtype == torch.bool
    counts = torch.bincount(client.data.y[client.data.train_idx], minlength=client.num_classes)
    assert torch.equal(up["present"], counts > 0)


def test_lite_continues_from_its_own_model_between_uploads(small_config):
    cfg = config(small_config, "fedfm_lite", {"start_round": 0, "model_every": 2, "lam": 1.0},
                 clients_per_round=small_config["data"]["num_clients"])
    loop = build_loop(cfg)
    loop.run_round(0, num_rounds=4)                  # no upload: every client keeps its trained model
    kept = {c: s["fedfm_local"] for c, s in loop.client_states.items()}
    assert len(kept) == cfg.train.clients_per_round
    algo: FedFMLite = loop.algorithm
    msg = Message("train", {}, {"upload_model": True, "upload_anchors": False})
    reply, _ = algo.client_update(msg, {"fedfm_local": kept[0]}, runtime(loop, 0, rnd=1))
    expect = runtime(loop, 0, rnd=1).train(kept[0], [CrossEntropy()])
    for name, w in expect.weights.items():
        assert torch.equal(reply.arrays["model"][name], w), name
    with pytest.raises(RuntimeError, match="no model"):
        algo.client_update(msg, None, runtime(loop, 0, rnd=1))


# --- composition (paper Fig. 8(a)) --------------------------------------------------------
@pytest.mark.parametrize("name", ["fedprox+fedfm", "moon+fedfm", "fedfm+fednova", "fednova+fedfm", "scaffold+fedfm"])
def test_compositions_run_with_partial_participation(small_config, name):
    cls = algorithm_class(name)
    assert issubclass(cls, FedFM) and "lam" in cls.Params.model_fields
    loop = build_loop(config(small_config, name, {"start_round": 0, "lam": 1.0}, clients_per_round=3))
    for rnd in range(2):
        assert loop.run_round(rnd).phases == 2
        comm = loop.ledger.take_round(rnd)
        n_model = sum(v.numel() for v in loop.server_state["model"].values())
        assert comm["up/model"]["floats"] == comm["down/model"]["floats"] == 3 * n_model
        if "scaffold" in name:                 # control deltas go up once per client, with the model
            n_control = sum(v.numel() for v in loop.server_state["control"].values())
            assert comm["up/control"]["floats"] == comm["down/control"]["floats"] == 3 * n_control


def test_fedprox_fedfm_trains_on_both_terms(small_config):
    loop = build_loop(config(small_config, "fedprox+fedfm", {"start_round": 0, "mu": 0.5}))
    algo = loop.algorithm
    client = runtime(loop, 0)
    state = loop.server_state
    reply, cstate = algo.client_update(Message("anchors", {"model": state["model"]}), None, client)
    anchors, defined = aggregate_anchors(None, None, [(reply.arrays["anchors"]["mean"], reply.arrays["anchors"]["count"])])
    msg = Message("train", {"model": state["model"], "anchors": {"mean": anchors, "defined": defined}})
    terms = algo.local_terms(msg, None, client)
    prox = next(t for t in terms if isinstance(t, Proximal))
    match = next(t for t in terms if isinstance(t, AnchorMatching))
    # each part's own settings reach its term: FedProx's mu around the received model, FedFM's
    # lambda (default 50) against the aggregated anchors
    assert prox.mu == 0.5 and prox.anchor.keys() == state["model"].keys()
    assert all(torch.equal(prox.anchor[k], state["model"][k]) for k in prox.anchor)
    assert match.lam == 50.0 and match.kind == "cg"
    assert torch.equal(match.anchors, anchors) and torch.equal(match.defined, defined.bool())


def test_fednova_composition_runs_both_phases(small_config):
    loop = build_loop(config(small_config, "fedfm+fednova", {"start_round": 0, "lam": 1.0}))
    assert loop.run_round(0).phases == 2
    assert loop.server_state["anchors"] is not None


@pytest.mark.parametrize("name", ["fedfm+fednova", "fednova+fedfm"])
def test_fedfm_with_fednova_aggregates_by_the_normalised_average(name):
    """FedNova's server rule (Wang et al., Eq. 6) replaces FedAvg's in either order, and the anchors
    pass through. By hand: w = 1, clients at 0 and 1 with 10 and 30 samples (p = 1/4, 3/4) after
    a_i = 2 and 4 steps: tau_eff = 3.5, d = (1/4)/2 (1 - 0) + (3/4)/4 (1 - 1) = 1/8, so
    w' = 1 - 3.5/8 = 0.5625 (FedAvg's average would be 0.75)."""
    anchors = {"mean": torch.ones(2, 3), "defined": torch.tensor([True, False])}
    replies = {0: Message("update", {"model": {"w": torch.tensor([0.0])}}, {"num_samples": 10, "a_i": 2.0}),
               1: Message("update", {"model": {"w": torch.tensor([1.0])}}, {"num_samples": 30, "a_i": 4.0})}
    new = algorithm_class(name)().aggregate({"model": {"w": torch.tensor([1.0])}, "anchors": anchors}, replies,
                                            ctx([0, 1]))
    assert float(new["model"]["w"]) == pytest.approx(0.5625, abs=1e-7)
    assert new["anchors"] is anchors


# --- the round's messages, driven by hand (no training) -----------------------------------
def anchor_reply(means, counts) -> Message:
    return Message("anchors", {"anchors": {"mean": torch.tensor(means), "count": torch.tensor(counts)}})


def presence_reply(means, present) -> Message:
    """An anchor reply under uniform weighting: which classes the client has, not how many."""
    return Message("anchors", {"anchors": {"mean": torch.tensor(means), "present": torch.tensor(present)}})


def test_fedfm_trains_every_client_that_answered_the_anchor_phase():
    """A client dropped in the anchor phase is left out of training, and only it: the clients
    after it in the sampling order still get their training message (anchors, no second model)."""
    algo = FedFM(FedFM.Params(start_round=0))
    state = algo.init_server_state({"m": {"w": torch.zeros(2)}})
    gen = algo.round(state, ctx([0, 1, 2], num_classes=2))
    first = next(gen)
    assert set(first) == {0, 1, 2} and all(m.kind == "anchors" for m in first.values())
    # client 0 does not answer; 1 and 2 each have one class (Eq. 9 with disjoint classes)
    train = gen.send({1: anchor_reply([[1.0, 0.0], [0.0, 0.0]], [4, 0]),
                      2: anchor_reply([[0.0, 0.0], [0.0, 3.0]], [0, 2])})
    assert set(train) == {1, 2}
    for msg in train.values():
        assert msg.kind == "train" and "model" not in msg.arrays
        assert torch.equal(msg.arrays["anchors"]["mean"], torch.tensor([[1.0, 0.0], [0.0, 3.0]]))
        assert msg.arrays["anchors"]["defined"].tolist() == [True, True]


def test_fedfm_training_phase_carries_each_clients_own_message(small_config):
    """The training phase asks ``train_message`` for each client by its id: in ``fedfm+fedpac``
    every client gets its own personalised head (FedPAC's ``server_head(state, cid)``)."""
    loop = build_loop(config(small_config, "fedfm+fedpac", {"start_round": 0}))
    algo = loop.algorithm
    heads = {0: {"h": torch.zeros(3)}, 1: {"h": torch.ones(3)}}
    state = {**loop.server_state, "heads": heads}
    gen = algo.round(state, ctx([0, 1], num_classes=10, num_clients=6))
    next(gen)
    up = [[0.0] * 4] * 10
    train = gen.send({0: anchor_reply(up, [1] + [0] * 9), 1: anchor_reply(up, [0, 1] + [0] * 8)})
    assert set(train) == {0, 1}
    for cid in (0, 1):
        assert train[cid].arrays["head"] is heads[cid]


def test_lite_asks_for_each_clients_own_message():
    """FedFM-Lite builds each client's message with that client's id (the hook a composed method
    such as FedPAC personalises by)."""

    class Tagged(FedFMLite):
        def train_message(self, state, cid, ctx):
            msg = super().train_message(state, cid, ctx)
            msg.scalars["to"] = cid
            return msg

    algo = Tagged(FedFMLite.Params(start_round=0))
    state = algo.init_server_state({"m": {"w": torch.zeros(2)}})
    phase = next(algo.round(state, ctx([4, 1], num_classes=2, num_clients=6)))
    assert {cid: m.scalars["to"] for cid, m in phase.items()} == {4: 4, 1: 1}


def lite_reply(msg: Message, w: float) -> Message:
    """What a FedFM-Lite client sends back under ``msg``'s flags (two classes, 2-d anchors)."""
    arrays = {}
    if msg.scalars["upload_anchors"]:
        arrays["anchors"] = {"mean": torch.tensor([[w, 0.0], [0.0, w]]), "count": torch.tensor([1, 1])}
    if msg.scalars["upload_model"]:
        arrays["model"] = {"w": torch.full((2,), w)}
    return Message("update", arrays, {"num_samples": 10})


def test_lite_schedule_counts_rounds_from_the_warm_up_end():
    """Sec. VI with T_s = 1 and a = 3, counting s = t - T_s: the model goes down when s % a == 0
    (rounds 1, 4) and in the warm-up (round 0), comes up when (s + 1) % a == 0 (round 3), in the
    warm-up and in the last round (5); in between, clients keep their own models."""
    algo = FedFMLite(FedFMLite.Params(start_round=1, model_every=3))
    state = algo.init_server_state({"m": {"w": torch.zeros(2)}})
    assert state["lite_participants"] == []            # nobody trained before round 0
    assert set(state) == {"model", "anchors", "anchors_defined", "lite_participants"}
    clients = [0, 1]
    down, up = [], []
    for rnd in range(6):
        gen = algo.round(state, dataclasses.replace(ctx(clients, num_classes=2, rnd=rnd), num_rounds=6))
        phase = next(gen)
        down.append(all("model" in m.arrays for m in phase.values()))
        assert down[-1] or not any("model" in m.arrays for m in phase.values()), rnd
        up.append(phase[0].scalars["upload_model"])
        with pytest.raises(StopIteration) as done:
            gen.send({cid: lite_reply(m, float(rnd + 1)) for cid, m in phase.items()})
        state = done.value.value
    assert down == [True, True, False, False, True, False]
    assert up == [True, False, False, True, False, True]


def test_lite_between_model_uploads_refuses_scaffold_whose_server_control_needs_every_round():
    from fedhet.algorithms import algorithm_class
    from fedhet.core.errors import ConfigError

    both = algorithm_class("scaffold+fedfm_lite")
    assert both(both.Params(model_every=1)).params.model_every == 1          # aggregates every round
    with pytest.raises(ConfigError, match=r"model_every 2: scaffold\+fedfm_lite aggregates only in the rounds whose "
                                          r"models come up, and scaffold's server state takes every round's uploads"):
        both(both.Params(model_every=2))


@pytest.mark.parametrize(("warmup", "transfers"), [("every_round", 36), ("schedule", 20)])
def test_lite_models_keep_the_schedule_through_the_warm_up_as_the_papers_saving_counts(warmup, transfers):
    """Sec. VI: models every a rounds give "roughly a times less" communication than FedAvg over T
    rounds. T=100, T_s=20, a=5: with the warm-up's models every round, 20 + 80/5 = 36 transfers each
    way (2.8x less); keeping the schedule from round 0, 100/5 = 20 (5x less)."""
    lite = FedFMLite(FedFMLite.Params(start_round=20, model_every=5, warmup_models=warmup))
    assert sum(lite.model_down(t) for t in range(100)) == transfers
    assert sum(lite.model_up(t, 100) for t in range(100)) == transfers
    if warmup == "schedule":
        assert [t for t in range(12) if lite.model_down(t)] == [0, 5, 10]
        assert [t for t in range(12) if lite.model_up(t, 12)] == [4, 9, 11]      # 11: the run's last


# --- the client side -------------------------------------------------------------------------
def test_training_message_without_the_anchor_phase_model_is_refused_with_a_reason(small_config):
    loop = build_loop(config(small_config, "fedfm", {"start_round": 0}))
    with pytest.raises(RuntimeError) as err:
        loop.algorithm.client_update(Message("train", {}), None, runtime(loop, 0))
    assert str(err.value) == ("fedfm client 0 got a training message without a model and "
                              "has no model from this round's anchor phase")


def test_rebuilt_training_message_keeps_the_servers_scalars(small_config, monkeypatch):
    """The training phase's message, rebuilt with the stored model, still carries the scalars the
    server sent, so a composed method's hooks (local terms, options) see them."""
    loop = build_loop(config(small_config, "fedfm", {"start_round": 0}))
    algo = loop.algorithm
    seen = []
    real = algo.local_terms

    def spy(msg, state, client):
        seen.append(msg)
        return real(msg, state, client)

    monkeypatch.setattr(algo, "local_terms", spy)
    w = loop.server_state["model"]
    algo.client_update(Message("train", {}, {"probe_seed": 7}), {"fedfm_received": w}, runtime(loop, 0))
    (msg,) = seen
    assert msg.scalars == {"probe_seed": 7} and msg.arrays["model"] is w


def shifted_buffers(weights, names):
    """A client's own BatchNorm statistics, different from the global ones in ``weights``."""
    return {k: (weights[k] + 0.5 if weights[k].is_floating_point() else weights[k] + 3) for k in names}


def assert_trained_from_own_buffers(loop, model, after, weights, own, names):
    """``model`` is plain CE training from ``weights`` with the client's ``own`` statistics, and the
    trained statistics (only they) stay in the client's state ``after``."""
    expect = runtime(loop, 0).train({**weights, **own}, [CrossEntropy()])
    for k, v in expect.weights.items():
        assert torch.equal(model[k], v), k
    assert set(after) == {"buffers"}
    for k in names:
        assert torch.equal(after["buffers"][k], expect.weights[k]), k


def test_local_batchnorm_statistics_serve_both_phases(small_config):
    """With ``bn_buffers: local`` a client's own BatchNorm statistics replace the global ones for
    its anchors (Eq. 8 on its own model) and for training, and stay in its state."""
    from helpers import bn_model

    loop = build_loop(config(small_config, "fedfm", {"start_round": 0, "bn_buffers": "local"}),
                      models={"cnn2": bn_model()})
    algo, client = loop.algorithm, runtime(loop, 0)
    w = loop.server_state["model"]
    own = shifted_buffers(w, client.buffer_names)
    reply, cstate = algo.client_update(Message("anchors", {"model": w}), {"buffers": own}, client)
    means, counts = local_anchors(client.model, {**w, **own}, client.data, client.num_classes)
    assert torch.equal(reply.arrays["anchors"]["mean"], means)
    assert not torch.equal(means, local_anchors(client.model, w, client.data, client.num_classes)[0])
    assert cstate["buffers"] is own and cstate["fedfm_received"] is w
    trained, after = algo.client_update(Message("train", {}), cstate, runtime(loop, 0))
    assert_trained_from_own_buffers(loop, trained.arrays["model"], after, w, own, client.buffer_names)


# --- recorded metrics -------------------------------------------------------------------------
def test_round_metrics_count_the_classes_with_an_anchor(small_config):
    """``fedfm_anchor_classes``: None before any anchor, then the number of defined classes; a
    composed method's own metrics (SCAFFOLD's control norm) are still recorded."""
    loop = build_loop(config(small_config, "fedfm+scaffold", {"start_round": 0}))
    algo, state = loop.algorithm, loop.server_state
    before = algo.round_metrics(state)
    assert before == {"fedfm_anchor_classes": None, "scaffold_control_norm": 0.0}
    after = algo.round_metrics({**state, "anchors_defined": torch.tensor([True, False, True, True])})
    assert after["fedfm_anchor_classes"] == 3 and isinstance(after["fedfm_anchor_classes"], int)


def test_l2_variant_is_a_squared_distance_and_skips_classes_without_anchor():
    # h (1,0); its anchor (0,2) -> (0,1): squared distance 1 + 1 = 2, over d=2 -> 1.0. The second
    # sample's class has no anchor: it is left out of the mean (and of no feature average). lam 2 -> 2.0
    term = AnchorMatching(torch.tensor([[0.0, 2.0], [5.0, 5.0]]), torch.tensor([True, False]), lam=2.0, kind="l2")
    value = term(out_of(torch.tensor([[1.0, 0.0], [3.0, 4.0]])), batch_of([0, 1]), {})
    assert float(value) == pytest.approx(2.0, rel=1e-6)


@pytest.mark.parametrize("kind", ["cg", "l2"])
def test_float64_anchors_match_like_float32_ones(kind):
    """Anchors are matched in the features' float32 whatever dtype they arrive in (a float64
    aggregate or checkpoint must not break the matmul or change the value)."""
    g = torch.Generator().manual_seed(1)
    h, anchors = torch.randn(4, 3, generator=g), torch.randn(2, 3, generator=g)
    defined = torch.ones(2, dtype=torch.bool)
    single = AnchorMatching(anchors, defined, 1.0, kind)(out_of(h), batch_of([0, 1, 1, 0]), {})
    double = AnchorMatching(anchors.double(), defined, 1.0, kind)(out_of(h), batch_of([0, 1, 1, 0]), {})
    assert double.dtype == torch.float32 and float(double) == pytest.approx(float(single), rel=1e-6)


def test_lite_client_uploads_anchors_and_model_unless_told_otherwise(small_config):
    """A message without FedFM-Lite's flags (``upload_model``, ``upload_anchors``) gets the full
    reply: the trained model and its anchors."""
    loop = build_loop(config(small_config, "fedfm_lite", {"start_round": 0}))
    reply, _ = loop.algorithm.client_update(Message("train", {"model": loop.server_state["model"]}), None,
                                            runtime(loop, 0))
    assert {"model", "anchors"} <= set(reply.arrays)


def test_lite_client_trains_with_its_own_batchnorm_statistics(small_config):
    """FedFM-Lite with ``bn_buffers: local``: the received model gets the client's own BatchNorm
    statistics before training, and the trained ones stay in its state."""
    from helpers import bn_model

    loop = build_loop(config(small_config, "fedfm_lite", {"start_round": 0, "bn_buffers": "local"}),
                      models={"cnn2": bn_model()})
    client = runtime(loop, 0)
    w = loop.server_state["model"]
    own = shifted_buffers(w, client.buffer_names)
    msg = Message("train", {"model": w}, {"upload_model": True, "upload_anchors": True})
    reply, after = loop.algorithm.client_update(msg, {"buffers": own}, client)
    assert_trained_from_own_buffers(loop, reply.arrays["model"], after, w, own, client.buffer_names)


# --- defaults, errors and the replies' fields ---------------------------------------------------
def test_default_matching_is_contrastive_guiding_at_temperature_0_1():
    """``AnchorMatching(anchors, defined, lam)`` is CG with the paper's alpha = 0.1. Normalised
    anchors (1,0), (0,1); both samples are class 1. Sample (1,0): s = (10, 0), CE = log(1 + e^10);
    sample (0,2) -> (0,1): s = (0, 10), CE = log(1 + e^-10). Mean: 5 + log(1 + e^-10)."""
    term = AnchorMatching(torch.tensor([[3.0, 0.0], [0.0, 0.5]]), torch.ones(2, dtype=torch.bool), lam=1.0)
    assert term.kind == "cg" and term.temperature == 0.1
    value = term(out_of(torch.tensor([[1.0, 0.0], [0.0, 2.0]])), batch_of([1, 1]), {})
    assert float(value) == pytest.approx(5.0 + math.log1p(math.exp(-10.0)), rel=1e-6)


def test_unknown_matching_kind_is_refused_naming_it():
    with pytest.raises(ValueError) as err:
        AnchorMatching(torch.zeros(2, 2), torch.ones(2, dtype=torch.bool), 1.0, kind="cos")
    assert str(err.value) == "unknown feature-matching loss 'cos'; use 'cg' or 'l2'"


class BufferProbe(FedFM):
    """FedFM recording what its ``with_local_buffers`` hook receives."""

    def __init__(self, params=None):
        super().__init__(params)
        self.seen = []

    def with_local_buffers(self, weights, state, client):
        self.seen.append((weights, state, client))
        return super().with_local_buffers(weights, state, client)


def test_anchor_reply_is_an_anchors_message_with_the_sample_count(small_config):
    """The anchor phase's reply: kind ``anchors``, scalars ``{"num_samples": n_k}`` (nothing else),
    and the model it takes the anchors with comes through ``with_local_buffers`` with the client."""
    cfg = config(small_config, "fedfm", {"start_round": 0})
    algo = BufferProbe(FedFM.Params(start_round=0))
    loop = build_loop(cfg, algorithm=algo)
    client = runtime(loop, 0)
    w = loop.server_state["model"]
    reply, cstate = algo.client_update(Message("anchors", {"model": w}), {"own": 1}, client)
    assert reply.kind == "anchors"
    assert reply.scalars == {"num_samples": client.num_samples} and client.num_samples > 0
    assert set(reply.arrays) == {"anchors"}
    assert algo.seen == [(w, {"own": 1}, client)]
    assert cstate == {"own": 1, "fedfm_received": w}


def test_uniform_round_aggregates_present_masks():
    """Under ``anchor_weighting: uniform`` clients upload only which classes they have; the server
    averages over the clients that have each class (no previous anchors): class 0 from both,
    (1 + 3) / 2 = 2; class 1 from the second client only, 4."""
    algo = FedFM(FedFM.Params(start_round=0, anchor_weighting="uniform"))
    state = algo.init_server_state({"m": {"w": torch.zeros(2)}})

    replies = {3: presence_reply([[1.0, 0.0], [9.0, 9.0]], [True, False]),
               5: presence_reply([[3.0, 0.0], [0.0, 4.0]], [True, True])}
    new = algo.update_anchors(dict(state), replies)
    assert torch.allclose(new["anchors"], torch.tensor([[2.0, 0.0], [0.0, 4.0]]))
    assert new["anchors_defined"].tolist() == [True, True]


class LiteProbe(FedFMLite):
    """FedFM-Lite recording what its training hooks receive; ``after_training`` adds a key."""

    def __init__(self, params=None):
        super().__init__(params)
        self.seen = []

    def local_training(self, weights, msg, state, client):
        result = super().local_training(weights, msg, state, client)
        self.seen.append(("local_training", weights, msg, state, client, result))
        return result

    def after_training(self, result, msg, state, client):
        self.seen.append(("after_training", result, msg, state, client))
        return {**(super().after_training(result, msg, state, client) or {}), "probe": 1}

    def uploads(self, result, msg, state, client):
        self.seen.append(("uploads", result, msg, state, client))
        return super().uploads(result, msg, state, client)


def test_lite_hooks_see_the_kept_model_the_message_the_state_and_the_client(small_config):
    """Between model downloads a Lite client trains its own kept model: the hooks get a ``train``
    message carrying that model as ``"model"`` and the server's scalars, the client state without
    the kept model, the new state from ``after_training`` (in ``uploads``) and the client; the reply
    reports the training's steps and mean loss."""
    algo = LiteProbe(FedFMLite.Params(start_round=0))
    loop = build_loop(config(small_config, "fedfm_lite", {"start_round": 0}), algorithm=algo)
    client = runtime(loop, 0)
    kept = loop.server_state["model"]
    scalars = {"upload_model": True, "upload_anchors": False, "tag": 7}
    reply, after = algo.client_update(Message("train", {}, dict(scalars)), {"fedfm_local": kept, "own": 1}, client)
    assert [h[0] for h in algo.seen] == ["local_training", "after_training", "uploads"]
    (_, weights, m1, s1, c1, result), (_, r2, m2, s2, c2), (_, r3, m3, s3, c3) = algo.seen
    assert weights is kept and result is r2 is r3
    for m in (m1, m2, m3):
        assert m.kind == "train" and set(m.arrays) == {"model"} and m.arrays["model"] is kept
        assert m.scalars == scalars
    assert s1 == s2 == {"own": 1} and s3 == {"own": 1, "probe": 1} == after
    assert c1 is client and c2 is client and c3 is client
    assert reply.kind == "update" and set(reply.arrays) == {"model"}
    assert reply.scalars == {"num_samples": client.num_samples, "steps": result.steps, "loss": result.mean_loss}
    assert result.steps > 0 and result.mean_loss > 0


class LiteAggregateProbe(FedFMLite):
    """FedFM-Lite recording the round context its ``aggregate`` hook receives."""

    def __init__(self, params=None):
        super().__init__(params)
        self.contexts = []

    def aggregate(self, state, replies, ctx):
        self.contexts.append(ctx)
        return super().aggregate(state, replies, ctx)


def test_lite_round_bookkeeping_after_an_upload():
    """T_s = 0, a = 3. Round 0 sends the model, nobody uploads: both clients keep their models and
    are remembered. Round 1 (the planned last, so models come up) sends no model to them, and
    ``aggregate`` gets the round context. Having uploaded, nobody keeps a model: the server forgets
    the participants, so if the run goes on (round 2, s % a != 0) every client gets the model."""
    algo = LiteAggregateProbe(FedFMLite.Params(start_round=0, model_every=3))
    state = algo.init_server_state({"m": {"w": torch.zeros(2)}})

    def play(state, rnd, num_rounds):
        c = dataclasses.replace(ctx([0, 1], num_classes=2, rnd=rnd), num_rounds=num_rounds)
        gen = algo.round(state, c)
        phase = next(gen)
        with pytest.raises(StopIteration) as done:
            gen.send({cid: lite_reply(m, float(rnd + 1)) for cid, m in phase.items()})
        return phase, c, done.value.value

    phase, _, state = play(state, 0, 2)
    assert all("model" in m.arrays for m in phase.values()) and state["lite_participants"] == [0, 1]
    phase, c1, state = play(state, 1, 2)
    assert not any("model" in m.arrays for m in phase.values())
    assert all(m.scalars["upload_model"] for m in phase.values())
    assert algo.contexts == [c1] and state["lite_participants"] == []
    assert torch.equal(state["model"]["w"], torch.full((2,), 2.0))
    phase, _, state = play(state, 2, 6)
    assert set(phase) == {0, 1} and all("model" in m.arrays for m in phase.values())


# --- defaults, the uniform upload and the hooks a composed method sees --------------------
def test_anchor_aggregation_weights_by_counts_unless_told_otherwise():
    """Eq. 9 is the default rule: (3 x [1, 0] + 1 x [5, 4]) / 4 = [2, 1]; the uniform mean would
    be [3, 2]."""
    uploads = [(torch.tensor([[1.0, 0.0]]), torch.tensor([3])), (torch.tensor([[5.0, 4.0]]), torch.tensor([1]))]
    anchors, defined = aggregate_anchors(None, None, uploads)
    assert torch.allclose(anchors, torch.tensor([[2.0, 1.0]])) and defined.tolist() == [True]


def test_uniform_upload_marks_a_class_present_from_its_first_sample(small_config, monkeypatch):
    """Under uniform weighting the upload says which classes the client has: one sample is enough,
    none is not (the counts are set by hand: 3, 1 and 0 samples)."""
    loop = build_loop(config(small_config, "fedfm", {"start_round": 0, "anchor_weighting": "uniform"}))
    means = torch.arange(6.0).reshape(3, 2)
    monkeypatch.setattr(fedfm_module, "local_anchors", lambda *args, **kwargs: (means, torch.tensor([3, 1, 0])))
    up = loop.algorithm.anchor_upload(loop.server_state["model"], runtime(loop, 0))
    assert up["present"].tolist() == [True, True, False]
    assert torch.equal(up["mean"], means)


def with_previous_anchors(algo, anchors, defined):
    state = algo.init_server_state({"m": {"w": torch.zeros(2)}})
    state["anchors"], state["anchors_defined"] = torch.tensor(anchors), torch.tensor(defined)
    return state


def test_round_keeps_the_previous_anchor_of_a_class_nobody_uploads():
    """The server's anchors carry over: class 1, which no client of this round has, keeps its
    anchor from the last round and stays defined; class 0 is the new upload's."""
    algo = FedFM(FedFM.Params(start_round=0))
    state = with_previous_anchors(algo, [[9.0, 9.0], [7.0, 5.0]], [True, True])
    new = algo.update_anchors(state, {2: anchor_reply([[1.0, 0.0], [0.0, 0.0]], [4, 0])})
    assert torch.allclose(new["anchors"], torch.tensor([[1.0, 0.0], [7.0, 5.0]]))
    assert new["anchors_defined"].tolist() == [True, True]


def test_uniform_round_lets_a_client_without_the_class_contribute_the_previous_anchor():
    """``anchor_weighting: uniform`` reaches the server's rule (Table VIII): class 1 is the mean of
    client 3's 3 and the previous anchor 6 that client 5 (without class 1) contributes, 4.5; Eq. 9
    with the presence masks as counts would give 3."""
    algo = FedFM(FedFM.Params(start_round=0, anchor_weighting="uniform"))
    state = with_previous_anchors(algo, [[10.0, 0.0], [0.0, 6.0]], [True, True])

    new = algo.update_anchors(state, {3: presence_reply([[1.0, 0.0], [0.0, 3.0]], [True, True]),
                                      5: presence_reply([[4.0, 0.0], [9.0, 9.0]], [True, False])})
    assert torch.allclose(new["anchors"], torch.tensor([[2.5, 0.0], [0.0, 4.5]]))


class HookParent(FedAvg):
    """A method FedFM may be composed with (FedFM first in the bases): records what FedFM's
    ``super()`` calls hand on."""

    def __init__(self, params=None):
        super().__init__(params)
        self.local_terms_args = None
        self.train_message_args = None

    def local_terms(self, msg, state, client):
        self.local_terms_args = (msg, state, client)
        return super().local_terms(msg, state, client)

    def train_message(self, state, cid, ctx):
        self.train_message_args = (state, cid, ctx)
        return super().train_message(state, cid, ctx)

    def check_schedule(self, rounds, local_epochs):
        self.check_schedule_args = (rounds, local_epochs)
        super().check_schedule(rounds, local_epochs)


class ComposedFM(FedFM, HookParent):
    pass


def test_a_composed_parent_sees_the_message_state_client_and_round_fedfm_got():
    algo = ComposedFM(FedFM.Params(start_round=0))
    msg, state, client = Message("train", {}), {"own": 1}, object()
    assert algo.local_terms(msg, state, client) == []               # no anchors: no matching term
    assert algo.local_terms_args == (msg, state, client)
    server = algo.init_server_state({"m": {"w": torch.zeros(2)}})
    round_ctx = ctx([0, 1], num_classes=2, rnd=3)
    algo.train_message(server, 1, round_ctx)
    assert algo.train_message_args[1] == 1 and algo.train_message_args[2] is round_ctx
    assert algo.train_message_args[0] is server


def test_a_composed_parent_checks_the_same_schedule():
    algo = ComposedFM(FedFM.Params(start_round=2))
    algo.check_schedule(10, 3)
    assert algo.check_schedule_args == (10, 3)


def test_a_warm_up_as_long_as_the_run_is_refused_naming_both():
    """T_s = T would leave no round with matching: the run would be FedAvg under FedFM's name."""
    FedFM(FedFM.Params(start_round=4)).check_schedule(5, 1)           # one matching round: fine
    with pytest.raises(ConfigError) as err:
        FedFM(FedFM.Params(start_round=5)).check_schedule(5, 1)
    assert "start_round (5" in str(err.value) and "train.rounds (5)" in str(err.value)


@pytest.mark.parametrize("lam,expected", [(0.0, False), (0.5, True)])
def test_matching_term_is_added_for_any_positive_lambda_only(lam, expected):
    """lambda 0 turns matching off (no term at all); any positive lambda, also below 1, adds it
    with the configured temperature."""
    algo = FedFM(FedFM.Params(start_round=0, lam=lam, temperature=0.5))
    anchors = {"mean": torch.zeros(2, 3), "defined": torch.ones(2, dtype=torch.bool)}
    terms = algo.local_terms(Message("train", {"anchors": anchors}), None, object())
    assert len(terms) == int(expected)
    if expected:
        assert isinstance(terms[0], AnchorMatching)
        assert (terms[0].lam, terms[0].temperature, terms[0].kind) == (0.5, 0.5, "cg")



def test_the_methods_defaults_are_the_papers_settings():
    """FedFM (Ye et al.) Sec. VII-A: "for FedFM, lambda = 50.0 and T_s = 20", CG with alpha = 0.1 on
    class-size-weighted anchors (Eq. 9) - what a config without algorithm.params runs."""
    params = FedFM.Params()
    assert (params.lam, params.temperature, params.start_round) == (50.0, 0.1, 20)
    assert (params.matching, params.anchor_weighting) == ("cg", "weighted")
    assert FedFMLite.Params().lam == 50.0
