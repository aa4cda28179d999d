"""FedReMa (Liang et al., Algorithms 1-2, Eq. 5-10): MDS, CCP, G, personalization."""

import math

import numpy as np
import pytest
import torch

from fedhet.algorithms.fedavg import FedAvg
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
    assert "optimizer_state" in (exp.loop.client_states.get(0) or {})     # momentum kept
    # the dependency map is the count of each client's relevant peers over the rows
    counted: dict[int, dict[int, int]] = {}
    for r in rows:
        for k, peers in r["fedrema_relevant"].items():
            for i in peers:
                counted.setdefault(int(k), {})[i] = counted.setdefault(int(k), {}).get(i, 0) + 1
    assert counted and exp.loop.server_state["G"] == counted
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


# --- pinned by mutation testing: MDS precision, the probe, G, metrics, the round, composition ----
def _cos(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_mds_measures_gaps_in_double_precision_for_a_single_precision_row():
    """Delta s* is the exact difference of the two similarities around the cut, also when the row
    arrives in float32: the difference of two float32 numbers is exact in float64, not in float32."""
    row = np.array([0.1, 0.7, 0.95, 1.0], dtype=np.float32)
    members, gap = mds(row, 3)
    # sorted .1 .7 .95 1.0; gaps .6 .25 (.05 self-gap ignored) -> cut above .1
    assert members == [1, 2, 3]
    assert gap == float(np.float64(row[1]) - np.float64(row[0]))
    assert gap != float(row[1] - row[0])                    # float32 arithmetic would round it


def test_soft_logits_evaluate_the_probe_on_the_classifiers_device():
    """The probe h~ (drawn on the CPU) is moved to the device of the classifier's weights before
    phi(h~) is computed; the meta device stands in for an accelerator."""
    torch.manual_seed(0)
    model = build_model("cnn2", in_channels=1, num_classes=10, image_size=28, split="fc1")
    head = {k: v.to("meta") for k, v in model.state_dict().items() if k.startswith("head.")}
    p = soft_logits(model, head, probe_feature(3, model.feature_dim), 0.5)
    assert p.device.type == "meta" and p.shape == (10,) and p.dtype == torch.float64


def test_soft_logits_complete_a_partial_classifier_with_the_models_own_weights():
    """Entries missing from the given classifier come from the model itself (non-strict functional
    call); with no entries at all, the model's own classifier is probed."""
    torch.manual_seed(0)
    model = build_model("cnn2", in_channels=1, num_classes=10, image_size=28, split="fc1")
    probe = probe_feature(5, model.feature_dim)
    own = torch.softmax(model.head(probe.unsqueeze(0)).double() / 0.5, dim=1)[0]
    assert torch.allclose(soft_logits(model, {}, probe, 0.5), own, atol=1e-12)
    zero_out = {"head.fc2.weight": torch.zeros(10, 512), "head.fc2.bias": torch.zeros(10)}
    # fc2 = 0 gives equal logits whatever fc1 is: the uniform distribution
    assert torch.allclose(soft_logits(model, zero_out, probe, 0.5), torch.full((10,), 0.1, dtype=torch.float64),
                          atol=1e-12)


def test_uniform_head_weighting_averages_relevant_classifiers_equally():
    """head_weighting: uniform (the official code) replaces the sample sizes of Eq. 7 by equal weights."""
    algo = FedReMa(FedReMa.Params(head_weighting="uniform"))
    state = algo.init_server_state({"m": {"body.w": T([0.0]), "head.w": T([0.0])}})
    replies = _replies({c: 1.0 for c in range(4)}, {0: 1.0, 1: 5.0, 2: 10.0, 3: 20.0}, SOFT,
                       {0: 10, 1: 30, 2: 20, 3: 60})
    new = algo.aggregate(dict(state), replies, _ctx([0, 1, 2, 3]))
    assert new["relevant"] == {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]}
    assert float(new["heads"][0]["head.w"]) == pytest.approx(3.0)         # (1 + 5) / 2, not (10 + 150) / 40
    assert float(new["heads"][3]["head.w"]) == pytest.approx(15.0)        # (10 + 20) / 2, not (200 + 1200) / 80


def test_ccp_round_adds_to_earlier_dependency_counts_and_reports_them():
    """G[k, i] += 1 for i in A_k (Algorithm 2) on top of the earlier rounds' counts; the round's
    metrics report G, A_k and the mean maximum gap of Eq. 8 (own peer's cosine minus the best other's)."""
    algo, state = _server()
    state["G"] = {0: {0: 2, 1: 1}, 2: {3: 4}}
    replies = _replies({c: 1.0 for c in range(4)}, {c: float(c) for c in range(4)}, SOFT, {c: 10 for c in range(4)})
    new = algo.aggregate(dict(state), replies, _ctx([0, 1, 2, 3]))
    assert new["G"] == {0: {0: 3, 1: 2}, 1: {0: 1, 1: 1}, 2: {2: 1, 3: 5}, 3: {2: 1, 3: 1}}
    assert state["G"] == {0: {0: 2, 1: 1}, 2: {3: 4}}                      # the old state is not modified
    peer = {0: 1, 1: 0, 2: 3, 3: 2}
    others = {0: (2, 3), 1: (2, 3), 2: (0, 1), 3: (0, 1)}
    gaps = [_cos(SOFT[k], SOFT[peer[k]]) - max(_cos(SOFT[k], SOFT[o]) for o in others[k]) for k in range(4)]
    assert new["mean_gap"] == pytest.approx(np.mean(gaps), rel=1e-6)
    metrics = algo.round_metrics(new)
    assert metrics["fedrema_mean_gap"] == new["mean_gap"]
    assert metrics["fedrema_relevant"] == {"0": [0, 1], "1": [0, 1], "2": [2, 3], "3": [2, 3]}
    assert "fedrema_G" not in metrics          # the rows' relevant sets add up to it (the run test)


def test_after_ccp_rounds_report_no_mean_gap():
    """After the CCP no MDS runs, so the round has no Delta s_bar: the last CCP round's value is cleared."""
    algo, state = _server(ccp=False)
    state["mean_gap"], state["G"] = 0.42, {c: {c: 1} for c in range(4)}
    replies = _replies({c: 1.0 for c in range(4)}, {c: float(c) for c in range(4)}, SOFT, {c: 10 for c in range(4)})
    new = algo.aggregate(dict(state), replies, _ctx([0, 1, 2, 3]))
    assert new["mean_gap"] is None and algo.round_metrics(new)["fedrema_mean_gap"] is None


def test_fresh_server_state_has_no_matching_yet():
    """Before round 1: no classifiers, an empty dependency map, CCP on, no gap and no prototypes."""
    algo = FedReMa()
    state = algo.init_server_state({"m": {"body.w": T([0.0]), "head.w": T([0.0])}})
    assert state["heads"] == {} and state["G"] == {} and state["ccp"] and state["gaps"] == []
    assert state["prototypes"] is None and state["defined"] is None
    assert algo.round_metrics(state) == {"fedrema_ccp": True, "fedrema_ccp_end_round": None, "fedrema_mean_gap": None,
                                         "fedrema_relevant": {}}


def test_client_without_a_classifier_yet_views_and_evaluates_the_shared_model():
    """A client that has not been aggregated yet gets an empty head set in its view and is
    evaluated (and trained) with the shared model."""
    algo, state = _server()
    state["heads"] = {0: {"head.w": T([7.0])}}
    view = algo.client_view(state, 3)
    assert view["heads"] == {} and view["model"] is state["model"]
    assert algo.client_model(3, view, None) is state["model"]
    assert torch.equal(algo.client_model(0, algo.client_view(state, 0), None)["head.w"], T([7.0]))


def test_round_sends_each_client_its_own_classifier_and_one_probe_seed():
    """Step 5 of the round: client k trains {theta, phi_k} (the shared model before it has a
    classifier), in a "train" message with the round's probe seed, the same for everybody."""
    algo, state = _server()
    state["model"] = {"body.w": T([2.0]), "head.w": T([0.0])}
    state["heads"] = {0: {"head.w": T([7.0])}, 1: {"head.w": T([8.0])}}
    msgs = next(algo.round(state, _ctx([0, 1, 2])))
    assert all(m.kind == "train" for m in msgs.values())
    assert [float(msgs[c].arrays["model"]["head.w"]) for c in (0, 1, 2)] == [7.0, 8.0, 0.0]
    assert all(float(m.arrays["model"]["body.w"]) == 2.0 for m in msgs.values())
    assert len({m.scalars["probe_seed"] for m in msgs.values()}) == 1
    direct = algo.train_message({**state, "probe_seed": 5}, 1, _ctx([1]))
    assert direct.kind == "train" and float(direct.arrays["model"]["head.w"]) == 8.0


def test_every_round_draws_a_new_probe():
    """h~ is redrawn each round (Sec. 4.1): 130 rounds give 130 different probe seeds."""
    algo, state = _server()
    ctx = _ctx([0])
    seeds = [next(algo.round(state, ctx))[0].scalars["probe_seed"] for _ in range(130)]
    assert len(set(seeds)) == 130


def test_round_ends_the_ccp_with_its_own_round_number():
    """Driven through the round generator, the CCP switch is stamped with the round's context
    (ccp_end_round = round + 1)."""
    algo = FedReMa(FedReMa.Params(delta=0.7))
    state = algo.init_server_state({"m": {"body.w": T([0.0]), "head.w": T([0.0])}})
    state["gaps"] = [1.0]
    replies = _replies({c: 1.0 for c in range(4)}, {c: float(c) for c in range(4)}, SOFT, {c: 10 for c in range(4)})
    gen = algo.round(state, _ctx([0, 1, 2, 3], rnd=4))
    next(gen)
    with pytest.raises(StopIteration) as stop:
        gen.send(replies)
    assert not stop.value.value["ccp"] and stop.value.value["ccp_end_round"] == 5


# --- the +F / +A&F variants' loss terms ----------------------------------------------------------
PROTOS = torch.arange(6.0).reshape(3, 2)
DEFINED = T([True, False, True])


def _with_prototypes():
    return Message("train", {"model": {}, "prototypes": {"mean": PROTOS, "defined": DEFINED}}, {"probe_seed": 1})


def _is_alignment(term, weight):
    from fedhet.algorithms.prototypes import PrototypeAlignment

    return (isinstance(term, PrototypeAlignment) and torch.equal(term.prototypes, PROTOS)
            and torch.equal(term.defined, DEFINED) and term.weight == weight)


def test_feature_alignment_adds_the_prototype_term_to_joint_training_only():
    """FedReMa+F (Eq. 11): CE + lambda * MSE(h, proto[y]) in the one joint phase; under +A&F the
    alignment belongs to the extractor phase, so the joint terms do not carry it."""
    plus_f = FedReMa(FedReMa.Params(feature_alignment=True, align_weight=0.25))
    (term,) = plus_f.local_terms(_with_prototypes(), None, None)
    assert _is_alignment(term, 0.25)
    assert plus_f.local_terms(Message("train", {"model": {}}), None, None) == []
    plus_af = FedReMa(FedReMa.Params(feature_alignment=True, alternating=True, align_weight=0.25))
    assert plus_af.local_terms(_with_prototypes(), None, None) == []
    assert FedReMa().local_terms(_with_prototypes(), None, None) == []


def _capture_head_then_body(monkeypatch):
    import fedhet.algorithms.fedrema as fedrema_module

    calls = []

    def fake(client, weights, head_terms, body_terms, **kw):
        calls.append((head_terms, body_terms, kw))
        return "result"

    monkeypatch.setattr(fedrema_module, "train_head_then_body", fake)
    return calls


def test_alternating_trains_the_classifier_then_the_extractor_with_alignment(monkeypatch):
    """FedReMa+A&F: E epochs of the classifier on CE, then E epochs of the extractor on CE plus the
    prototype alignment (official train_separately_with_proto); without prototypes only CE."""
    from types import SimpleNamespace

    from fedhet.training.objective import CrossEntropy

    calls = _capture_head_then_body(monkeypatch)
    algo = FedReMa(FedReMa.Params(feature_alignment=True, alternating=True, align_weight=0.25))
    client = SimpleNamespace(settings=SimpleNamespace(epochs=3))
    assert algo.local_training({}, _with_prototypes(), None, client) == "result"
    head_terms, body_terms, kw = calls[0]
    assert [type(t) for t in head_terms] == [CrossEntropy] and kw == {"head_epochs": 3, "body_epochs": 3}
    assert isinstance(body_terms[0], CrossEntropy) and len(body_terms) == 2 and _is_alignment(body_terms[1], 0.25)
    algo.local_training({}, Message("train", {"model": {}}), None, client)
    head_terms, body_terms, _ = calls[1]
    assert [type(t) for t in head_terms] == [CrossEntropy] and [type(t) for t in body_terms] == [CrossEntropy]


# --- composition: FedReMa's hooks chain through super() ------------------------------------------
class _SpyBase(FedAvg):
    class Params(FedAvg.Params):
        pass

    def _seen(self, hook, *args):
        self.__dict__.setdefault("seen", []).append((hook, *args))


class _ServerSpy(_SpyBase):
    """A partner method that records what its server hooks receive (named before FedReMa, whose
    train_message and aggregate replace what comes after them)."""

    name = "server_spy"

    def train_message(self, state, cid, ctx):
        self._seen("train_message", cid, ctx)
        return super().train_message(state, cid, ctx)

    def aggregate(self, state, replies, ctx):
        self._seen("aggregate", ctx)
        return super().aggregate(state, replies, ctx)


class _Spy(_SpyBase):
    """A partner method that records what its client hooks receive (fedhet.algorithms.compose);
    named after FedReMa, whose client hooks chain."""

    name = "spy"

    def local_training(self, weights, msg, state, client):
        self._seen("local_training", weights, msg, state, client)
        # the terms and options FedAvg's would train with: a replacement must ask for them (compose)
        self.terms = [*self.data_terms(msg, state, client), *self.local_terms(msg, state, client)]
        self.train_options(msg, state, client)
        return "trained"

    def data_terms(self, msg, state, client):
        self._seen("data_terms", msg, state, client)
        return super().data_terms(msg, state, client)

    def local_terms(self, msg, state, client):
        self._seen("local_terms", msg, state, client)
        return [*super().local_terms(msg, state, client), "spy-term"]

    def train_options(self, msg, state, client):
        self._seen("train_options", msg, state, client)
        return {**super().train_options(msg, state, client), "augment": "spy-augment"}

    def uploads(self, result, msg, state, client):
        self._seen("uploads", result, msg, state, client)
        return {**super().uploads(result, msg, state, client), "spy": {"x": T([1.0])}}


def _combined(first, second, **params):
    from fedhet.algorithms import compose

    cls = compose([first, second])
    return cls(cls.Params(**params))


def test_combined_fedrema_hands_its_client_hooks_arguments_to_the_partner(monkeypatch):
    """Hooks call super() so methods compose (fedavg module): FedReMa's local terms, local training
    (joint and +A&F) and uploads pass the partner the message, client state, client and result
    they received, and keep the partner's contribution."""
    from types import SimpleNamespace

    calls = _capture_head_then_body(monkeypatch)
    msg, cstate = _with_prototypes(), {"c": 1}
    client = SimpleNamespace(settings=SimpleNamespace(epochs=2))
    joint = _combined(FedReMa, _Spy)
    assert joint.local_terms(msg, cstate, client) == ["spy-term"]
    assert joint.local_training({"w": 1}, msg, cstate, client) == "trained"
    assert joint.seen == [("local_terms", msg, cstate, client), ("local_training", {"w": 1}, msg, cstate, client),
                          ("data_terms", msg, cstate, client), ("local_terms", msg, cstate, client),
                          ("train_options", msg, cstate, client)]

    alt = _combined(FedReMa, _Spy, feature_alignment=True, alternating=True)
    alt.local_training({}, msg, cstate, client)
    assert [s[1:] for s in alt.seen] == [(msg, cstate, client)] * 3
    assert [s[0] for s in alt.seen] == ["data_terms", "local_terms", "train_options"]
    head_terms, body_terms, kw = calls[0]
    assert "spy-term" in head_terms and "spy-term" in body_terms and kw["augment"] == "spy-augment"

    torch.manual_seed(0)
    model = build_model("cnn2", in_channels=1, num_classes=10, image_size=28, split="fc1")
    result, runtime_ = SimpleNamespace(weights=model.state_dict()), SimpleNamespace(model=model)
    up = joint.uploads(result, msg, cstate, runtime_)
    assert joint.seen[-1] == ("uploads", result, msg, cstate, runtime_)
    assert torch.equal(up["spy"]["x"], T([1.0])) and up["relevance"]["soft_logits"].shape == (10,)


def test_combined_fedrema_round_passes_client_and_context_to_the_partner():
    """A partner listed first sees FedReMa's round through its own train_message and aggregate hooks,
    with the real client id and round context (FedFM's train_message reads ctx.round)."""
    algo = _combined(_ServerSpy, FedReMa)
    state = algo.init_server_state({"m": {"body.w": T([0.0]), "head.w": T([0.0])}})
    ctx = _ctx([0, 1, 2, 3])
    gen = algo.round(state, ctx)
    next(gen)
    replies = _replies({c: 1.0 for c in range(4)}, {c: float(c) for c in range(4)}, SOFT, {c: 10 for c in range(4)})
    with pytest.raises(StopIteration):
        gen.send(replies)
    assert algo.seen == [("train_message", c, ctx) for c in range(4)] + [("aggregate", ctx)]


# --- what each step reads: the round's probe, the trained classifier, the configured M --------------
def test_each_round_draws_its_probe_from_that_rounds_stream_not_from_the_state():
    """h~ is drawn afresh every round (Sec. 4.1): the seed of a round comes from that round's server
    stream, also when the state handed to it is the one the previous round returned (which carries
    the previous seed)."""
    algo, state = _server()
    replies = _replies({c: 1.0 for c in range(4)}, {c: float(c) for c in range(4)}, SOFT, {c: 10 for c in range(4)})
    seeds = []
    for rnd in range(3):
        ctx = RoundContext(round=rnd, clients=[0, 1, 2, 3], num_clients=4, num_classes=2,
                           client_sizes={c: 10 for c in range(4)}, rng=np.random.default_rng(100 + rnd))
        gen = algo.round(state, ctx)
        seeds.append(next(gen)[0].scalars["probe_seed"])
        with pytest.raises(StopIteration) as stop:
            gen.send(replies)
        state = stop.value.value
    assert seeds == [int(np.random.default_rng(100 + r).integers(2**62)) for r in range(3)]
    assert len(set(seeds)) == 3


def test_probe_is_uniform_on_the_unit_interval():
    """h~ ~ U[0,1)^d (Sec. 4.1), not the reference code's U[0,0.5): over 4096 entries the mean is
    about 1/2 and the largest entry close to 1."""
    probe = probe_feature(11, 4096).double()
    assert 0 <= float(probe.min()) and float(probe.max()) < 1
    assert float(probe.max()) > 0.99 and abs(float(probe.mean()) - 0.5) < 0.03


def test_uploaded_soft_logits_are_the_trained_classifiers_at_the_configured_temperature(small_config):
    """p_k = softmax(phi_k(h~) / M) of the classifier the client uploads (its locally trained one,
    Sec. 4.1 and Eq. 5), with the configured M: recomputed from the uploaded model they agree, and
    the received classifier or the default M would give other vectors."""
    from helpers import build_loop, config, runtime

    from fedhet.core.split import HEAD, select

    loop = build_loop(config(small_config, "fedrema", {"temperature": 0.25}))
    algo = loop.algorithm
    ctx = loop.round_context(0)
    cid = ctx.clients[0]
    msg = algo.train_message({**loop.server_state, "probe_seed": 9}, cid, ctx)
    client = runtime(loop, cid)
    reply, _ = algo.client_update(msg, None, client)
    probe = probe_feature(9, client.model.feature_dim)
    got = reply.arrays["relevance"]["soft_logits"].double()
    trained = soft_logits(client.model, select(reply.arrays["model"], HEAD), probe, 0.25)
    assert torch.allclose(got, trained, atol=1e-6)
    received = soft_logits(client.model, select(msg.arrays["model"], HEAD), probe, 0.25)
    default_m = soft_logits(client.model, select(reply.arrays["model"], HEAD), probe, 0.5)
    assert float((got - received).abs().max()) > 1e-4 and float((got - default_m).abs().max()) > 1e-4


def test_after_ccp_a_client_with_no_dependency_on_the_uploads_keeps_its_own_upload():
    """Eq. 10 with partial participation: a client whose dependency row has no weight on this
    round's uploads gets its own uploaded classifier, not the personalized one of its last round."""
    algo, state = _server(ccp=False)
    state["G"] = {0: {0: 1, 1: 1}, 3: {5: 2}}                 # client 3 depends on a client not uploading
    state["heads"] = {c: {"head.w": T([99.0 + c])} for c in range(4)}
    replies = _replies({c: 1.0 for c in range(4)}, {0: 1.0, 1: 5.0, 2: 10.0, 3: 20.0}, SOFT, {c: 10 for c in range(4)})
    new = algo.aggregate(dict(state), replies, _ctx([0, 1, 2, 3]))
    assert float(new["heads"][0]["head.w"]) == pytest.approx(3.0)
    assert float(new["heads"][2]["head.w"]) == 10.0 and float(new["heads"][3]["head.w"]) == 20.0


def test_feature_alignment_uploads_the_trained_models_class_means_and_averages_them_uniformly(small_config):
    """FedReMa+F: a client uploads the per-class mean features of its locally trained model (not of
    the model it received), and the server's prototypes are the plain mean over the clients that
    have the class (the official code), not a count-weighted one."""
    from helpers import build_loop, config, runtime

    from fedhet.algorithms.prototypes import GROUP, class_means

    loop = build_loop(config(small_config, "fedrema", {"feature_alignment": True}))
    algo = loop.algorithm
    ctx = loop.round_context(0)
    replies = {}
    for cid in ctx.clients[:2]:
        msg = algo.train_message({**loop.server_state, "probe_seed": 3}, cid, ctx)
        client = runtime(loop, cid)
        replies[cid], _ = algo.client_update(msg, None, client)
        up = replies[cid].arrays[GROUP]
        trained, counts = class_means(client.model, replies[cid].arrays["model"], client.data, client.num_classes)
        received, _ = class_means(client.model, msg.arrays["model"], client.data, client.num_classes)
        assert torch.equal(up["count"], counts)
        assert torch.allclose(up["mean"], trained, atol=1e-5)
        assert float((up["mean"] - received).abs().max()) > 1e-3
    a, b = (replies[c].arrays[GROUP] for c in ctx.clients[:2])
    both = (a["count"] > 0) & (b["count"] > 0) & (a["count"] != b["count"])
    assert bool(both.any())                      # a class both clients have, in different numbers
    state = algo.aggregate(dict(loop.server_state), replies, ctx)
    assert torch.allclose(state["prototypes"][both], (a["mean"][both] + b["mean"][both]) / 2, atol=1e-6)
