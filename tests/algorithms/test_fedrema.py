"""FedReMa (Liang et al., Algorithms 1-2, Eq. 5-10): MDS, CCP, G, personalization."""

import math

import numpy as np
import pytest
import torch

from fedhet.algorithms.fedrema import (
    FedReMa,
    ccp_continues,
    dependency_average,
    mds,
    probe_feature,
    similarity_matrix,
    soft_logits,
)
from fedhet.core.contract import Message, RoundContext
from fedhet.experiment.config import load_config
from fedhet.experiment.runner import Experiment, read_metrics
from fedhet.models import build_model

T = torch.tensor


# --- MDS (Algorithm 1, as in the official code) ---------------------------------------------
def test_mds_cuts_at_the_largest_gap_below_the_top_pair():
    # positions: 0..3 peers, 4 self. Sorted: .1 .2 .8 .85 1.0; gaps .1 .6 .05 (.15 self-gap ignored)
    members, gap = mds(np.array([0.1, 0.2, 0.8, 0.85, 1.0]), 4)
    assert members == [2, 3, 4] and gap == pytest.approx(0.6)


def test_mds_one_huge_gap_keeps_self_and_best_peer():
    members, gap = mds(np.array([0.99, 0.0, 1.0, 0.01, 0.02]), 2)
    # sorted .0(1) .01(3) .02(4) .99(0) 1.0(2); gaps .01 .01 .97 (last .01 ignored)
    assert members == [0, 2] and gap == pytest.approx(0.97)


def test_mds_ignores_the_gap_between_self_and_its_best_peer():
    # Without ignoring it, the largest gap (.5 -> 1.0) would leave the client alone.
    members, gap = mds(np.array([0.4, 0.45, 0.5, 1.0]), 3)
    # sorted .4 .45 .5 1.0; gaps .05 .05 (.5 ignored) -> tie: first gap, the largest set
    assert members == [1, 2, 3] and gap == pytest.approx(0.05)


def test_mds_all_peers_equally_similar_means_everybody_is_relevant():
    members, gap = mds(np.array([0.5, 0.5, 1.0, 0.5]), 2)
    assert members == [0, 1, 2, 3] and gap == 0.0


def test_mds_self_is_last_when_a_peer_ties_with_it():
    members, gap = mds(np.array([1.0, 0.2, 1.0]), 2)
    # sorted .2(1) 1.0(0) 1.0(2, self last); gaps .8 (0 ignored) -> {0, 2}
    assert members == [0, 2] and gap == pytest.approx(0.8)


def test_mds_with_two_clients_takes_both():
    assert mds(np.array([1.0, 0.3]), 0) == ([0, 1], 0.0)


# --- CCP (Eq. 8-9) ----------------------------------------------------------------------------
def test_ccp_ends_when_mean_gap_drops_below_delta_of_its_peak():
    history = [0.4, 0.5, 0.3, 0.24]
    assert [ccp_continues(history[:t + 1], 0.5) for t in range(4)] == [True, True, True, False]
    assert ccp_continues([0.0, 0.0], 0.5)                  # no gap yet: undefined ratio, keep going
    assert not ccp_continues([0.2, 0.1], 0.5)              # exactly delta is not "> delta"


# --- relevance measurement (Sec. 4.1, Eq. 5) -------------------------------------------------
def test_soft_logits_are_the_tempered_softmax_of_the_classifier_on_the_probe():
    torch.manual_seed(0)
    model = build_model("cnn2", in_channels=1, num_classes=10, image_size=28, split="fc1")
    head = {k: v for k, v in model.state_dict().items() if k.startswith("head.")}
    probe = probe_feature(7, model.feature_dim)
    assert probe.shape == (1024,) and 0 <= float(probe.min()) and float(probe.max()) < 1
    assert torch.equal(probe, probe_feature(7, 1024))
    expected = torch.softmax(model.head(probe.unsqueeze(0)).double() / 0.5, dim=1)[0]
    assert torch.allclose(soft_logits(model, head, probe, 0.5), expected, atol=1e-6)


def test_similarity_is_cosine_of_soft_logits_with_unit_diagonal():
    p = T([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    s = similarity_matrix(p)
    assert s[0, 1] == pytest.approx(1 / math.sqrt(2)) and s[1, 2] == 0.0 and np.allclose(np.diag(s), 1)


# --- server aggregation: Eq. 6, 7, G, Eq. 10 --------------------------------------------------
def _ctx(clients, rnd=0):
    return RoundContext(round=rnd, clients=clients, num_clients=4, num_classes=2,
                        client_sizes={c: 10 for c in clients}, rng=np.random.default_rng(0))


def _replies(bodies, heads, soft, sizes):
    return {c: Message("update", {"model": {"body.w": T([bodies[c]]), "head.w": T([heads[c]])},
                                  "relevance": {"soft_logits": T(soft[c])}},
                       {"num_samples": sizes[c]})
            for c in bodies}


# Two groups: {0, 1} predict class 0, {2, 3} class 1 (client 1 a little less sharply).
SOFT = {0: [0.9, 0.1], 1: [0.8, 0.2], 2: [0.1, 0.9], 3: [0.15, 0.85]}


def _server(ccp=True):
    algo = FedReMa()
    state = algo.init_server_state({"m": {"body.w": T([0.0]), "head.w": T([0.0])}})
    state["ccp"] = ccp
    return algo, state


def test_ccp_round_averages_bodies_and_heads_over_relevant_sets_and_counts_G():
    algo, state = _server()
    sizes = {0: 10, 1: 30, 2: 20, 3: 20}
    replies = _replies({0: 1.0, 1: 2.0, 2: 3.0, 3: 4.0}, {0: 1.0, 1: 5.0, 2: 10.0, 3: 20.0}, SOFT, sizes)
    new = algo.aggregate(dict(state), replies, _ctx([0, 1, 2, 3]))
    # Eq. 6: (10*1 + 30*2 + 20*3 + 20*4) / 80 = 2.625
    assert float(new["model"]["body.w"]) == pytest.approx(2.625)
    assert new["relevant"] == {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]}
    # Eq. 7 with |D_i| weights: (10*1 + 30*5)/40 = 4.0 ; (20*10 + 20*20)/40 = 15
    assert float(new["heads"][0]["head.w"]) == pytest.approx(4.0)
    assert float(new["heads"][1]["head.w"]) == pytest.approx(4.0)
    assert float(new["heads"][3]["head.w"]) == pytest.approx(15.0)
    assert new["G"] == {0: {0: 1, 1: 1}, 1: {0: 1, 1: 1}, 2: {2: 1, 3: 1}, 3: {2: 1, 3: 1}}
    # Personalized models differ only in their heads.
    m0, m2 = algo.client_model(0, new, None), algo.client_model(2, new, None)
    assert torch.equal(m0["body.w"], m2["body.w"]) and not torch.equal(m0["head.w"], m2["head.w"])
    assert new["ccp"] and len(new["gaps"]) == 1


def test_weights_are_keyed_by_client_id_not_by_upload_order():
    algo, state = _server()
    sizes = {0: 10, 1: 30, 2: 20, 3: 20}
    replies = _replies({0: 1.0, 1: 2.0, 2: 3.0, 3: 4.0}, {0: 1.0, 1: 5.0, 2: 10.0, 3: 20.0}, SOFT, sizes)
    shuffled = {c: replies[c] for c in [3, 1, 2, 0]}
    a = algo.aggregate(dict(state), replies, _ctx([0, 1, 2, 3]))
    b = algo.aggregate(dict(state), shuffled, _ctx([2, 0, 3, 1]))
    for c in range(4):
        assert torch.equal(a["heads"][c]["head.w"], b["heads"][c]["head.w"])


def test_after_ccp_heads_follow_the_dependency_map():
    algo, state = _server(ccp=False)
    state["G"] = {0: {0: 3, 1: 1}, 1: {1: 2}, 2: {0: 1, 2: 1, 3: 2}}
    replies = _replies({0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0}, {0: 1.0, 1: 5.0, 2: 10.0, 3: 20.0}, SOFT,
                       {0: 10, 1: 10, 2: 10, 3: 10})
    new = algo.aggregate(dict(state), replies, _ctx([0, 1, 2, 3]))
    assert float(new["heads"][0]["head.w"]) == pytest.approx((3 * 1 + 1 * 5) / 4)      # Eq. 10
    assert float(new["heads"][1]["head.w"]) == pytest.approx(5.0)
    assert float(new["heads"][2]["head.w"]) == pytest.approx((1 * 1 + 10 + 2 * 20) / 4)
    assert float(new["heads"][3]["head.w"]) == pytest.approx(20.0)    # no dependencies: its own upload
    assert new["G"] == state["G"] and new["relevant"] == {}


def test_dependency_average_uses_only_uploaded_clients():
    heads = {0: {"w": T([2.0])}, 1: {"w": T([4.0])}}
    assert float(dependency_average(heads, {0: 1, 1: 3, 5: 10})["w"]) == pytest.approx(3.5)
    assert dependency_average(heads, {5: 2}) is None


def test_ccp_switch_happens_once_and_is_recorded():
    algo, state = _server()
    algo = FedReMa(FedReMa.Params(delta=0.7))
    state["gaps"] = [1.0]                       # an earlier round had the largest possible mean gap
    replies = _replies({c: 1.0 for c in range(4)}, {c: float(c) for c in range(4)}, SOFT, {c: 10 for c in range(4)})
    new = algo.aggregate(dict(state), replies, _ctx([0, 1, 2, 3], rnd=6))
    # every client's cut is between the groups: gap = cos(own group) - cos(other group) ~ 0.63 < 0.7 * 1.0
    assert 0.6 < new["mean_gap"] < 0.7 and not new["ccp"] and new["ccp_end_round"] == 7
    metrics = algo.round_metrics(new)
    assert metrics["fedrema_ccp"] is False and metrics["fedrema_ccp_end_round"] == 7
    forever = FedReMa(FedReMa.Params(delta=0.7, ccp="forever"))
    kept = forever.aggregate(dict(state), replies, _ctx([0, 1, 2, 3], rnd=6))
    assert kept["ccp"]


# --- end to end -------------------------------------------------------------------------------
def test_fedrema_run_records_matching_and_keeps_momentum(small_config):
    small_config["algorithm"] = {"name": "fedrema"}
    small_config["model"] = {"arch": "cnn2", "split": "fc1"}
    small_config["train"].update({"clients_per_round": 6, "momentum": 0.9, "rounds": 3})
    exp = Experiment.create(load_config(raw=small_config))
    summary = exp.run(progress=False)
    rows = read_metrics(exp.run_dir)
    assert summary["headline_metric"] == "personal_acc" and "global_acc" not in rows[-1]
    assert all(set(r["fedrema_relevant"]) == {str(c) for c in range(6)} for r in rows if r["fedrema_ccp"]
               or r["round"] == 1)
    assert rows[-1]["fedrema_G"] and "optimizer_state" in exp.loop.client_states[0]     # momentum kept
    # every client's evaluated model = the shared feature extractor + its own classifier
    s = exp.loop.server_state
    bodies = [exp.loop.client_model(c) for c in range(6)]
    for name in bodies[0]:
        if name.startswith("body."):
            assert all(torch.equal(b[name], bodies[0][name]) for b in bodies)
    assert len(s["heads"]) == 6
    # a distributed engine sends client c only its view of the server state: enough for its model
    for c in range(6):
        view = exp.algorithm.client_view(s, c)
        assert set(view["heads"]) == {c}
        mine, full = exp.algorithm.client_model(c, view, None), exp.algorithm.client_model(c, s, None)
        assert all(torch.equal(mine[k], full[k]) for k in full)


@pytest.mark.parametrize("alternating", [False, True])
def test_feature_alignment_variants_send_prototypes_and_train_with_them(small_config, alternating):
    small_config["algorithm"] = {"name": "fedrema", "params": {"feature_alignment": True, "alternating": alternating}}
    small_config["model"] = {"arch": "cnn2", "split": "fc1"}
    small_config["train"].update({"clients_per_round": 6, "rounds": 2})
    exp = Experiment.create(load_config(raw=small_config))
    exp.run(progress=False)
    rows = read_metrics(exp.run_dir)
    state = exp.loop.server_state
    assert state["prototypes"].shape == (10, 1024) and bool(state["defined"].any())
    assert "up/prototypes" in rows[0]["comm"] and "down/prototypes" in rows[1]["comm"]
    assert "down/prototypes" not in rows[0]["comm"]                 # nothing to align to in round 1
    plain = Experiment.create(load_config(raw={**small_config, "algorithm": {"name": "fedrema"}}),
                              exp.run_dir.parent / "plain")
    plain.run(progress=False)
    # +A&F trains the classifier E epochs, then the extractor E epochs (official code).
    ratio = rows[0]["samples"] / read_metrics(plain.run_dir)[0]["samples"]
    assert ratio == (2 if alternating else 1)


def test_alternating_without_alignment_is_refused():
    with pytest.raises(ValueError, match="feature_alignment"):
        FedReMa.Params(alternating=True)


# --- what survives across rounds and what clients share (mutations a review found untested) ----
def _fedrema_loop(small_config):
    from helpers import build_loop, config

    cfg = config(small_config, "fedrema", momentum=0.9)
    return build_loop(cfg)


def test_kept_momentum_is_what_the_next_round_trains_with(small_config):
    """FedReMa keeps each client's SGD momentum across rounds (as the official code, which creates
    its optimizer once; train.optimizer_state auto): the buffers stored after one round must be the
    optimizer state the client's next training starts from."""
    from fedhet.engine.host import OPTIMIZER_STATE, Job, Tally

    loop = _fedrema_loop(small_config)
    algo = loop.algorithm
    ctx = loop.round_context(0)
    cid = ctx.clients[0]
    msg = algo.train_message({**loop.server_state, "probe_seed": 7}, cid, ctx)
    momentum = {"body.conv1.0.weight": torch.full_like(loop.server_state["model"]["body.conv1.0.weight"], 0.5)}
    client = loop.host.runtime(cid, 0, Tally())
    seen = []
    real = client.fit

    def fit(weights, terms, settings, **kw):
        seen.append(dict(kw["optimizer_state"]))
        return real(weights, terms, settings, **kw)

    client.fit = fit
    result = loop.host.run(0, Job(cid, msg, {OPTIMIZER_STATE: momentum}, Tally()), client)
    assert seen and torch.equal(seen[0]["body.conv1.0.weight"], momentum["body.conv1.0.weight"])
    kept = result.state[OPTIMIZER_STATE]
    assert set(kept) >= {"body.conv1.0.weight", "head.fc2.weight"}
    assert not torch.equal(kept["body.conv1.0.weight"], momentum["body.conv1.0.weight"])
    assert "momentum" not in result.state


def test_every_client_of_a_round_probes_the_same_feature(small_config):
    """The relevance vectors are only comparable when every client evaluates its head on the same
    probe h~ (paper Sec. 4.2): one seed per round for all, and equal heads give equal vectors."""
    from helpers import runtime

    loop = _fedrema_loop(small_config)
    algo = loop.algorithm
    ctx = loop.round_context(0)
    phase = next(algo.round(loop.server_state, ctx))
    assert len({m.scalars["probe_seed"] for m in phase.values()}) == 1
    a, b = ctx.clients[:2]
    msg = phase[a]

    class Result:
        weights = loop.server_state["model"]

    up_a = algo.uploads(Result(), msg, None, runtime(loop, a))
    up_b = algo.uploads(Result(), msg, None, runtime(loop, b))
    assert torch.equal(up_a["relevance"]["soft_logits"], up_b["relevance"]["soft_logits"])
