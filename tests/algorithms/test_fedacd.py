"""FedACD (Zhou et al.) against hand computations, and the local-model risk metric."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import build_loop, config, conv_layouts, ctx, runtime

import fedhet
from fedhet.algorithms.fedacd import (
    FedACD,
    FedACDBase,
    Flattening,
    MarginAdjustedCE,
    aggregation_score,
    flattening_kl,
    log_adjustment,
    pair_flattening_kl,
    probability_matrix,
    template_kl,
    updated_probability_matrix,
)
from fedhet.core.contract import Batch, Forward, Message
from fedhet.core.errors import ConfigError
from fedhet.metrics.evaluate import local_model_risk
from fedhet.training.augment import Mixup, label_weights, mixed


def batch(y, extras=None):
    y = torch.tensor(y)
    return Batch(torch.zeros(len(y), 1, 2, 2), y, torch.arange(len(y)), extras or {})


# --- the probability matrix P -----------------------------------------------------------------

def test_probability_matrix_from_the_terms_statistics_hand_computed():
    # three samples, C = 3: two of class 0, one of class 2; class 1 absent
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1], [0.8, 0.1, 0.1], [0.2, 0.2, 0.6]]))
    term = MarginAdjustedCE(torch.zeros(3, 3))
    stats = term.statistics(Forward(torch.zeros(3, 4), logits), batch([0, 0, 2]))
    P = probability_matrix(stats["sums"], stats["counts"])
    expected = torch.tensor([[0.7, 0.2, 0.1], [0.0, 0.0, 0.0], [0.2, 0.2, 0.6]], dtype=torch.float64)
    torch.testing.assert_close(P, expected)
    assert stats["counts"].tolist() == [2.0, 0.0, 1.0]


def test_probability_matrix_of_a_mixed_batch_splits_each_sample_between_its_two_labels():
    logits = torch.log(torch.tensor([[0.5, 0.5], [0.9, 0.1]]))
    b = batch([0, 1], {"mix_y": torch.tensor([1, 0]), "mix_lam": torch.tensor([0.75, 0.25], dtype=torch.float64)})
    stats = MarginAdjustedCE(torch.zeros(2, 2)).statistics(Forward(torch.zeros(2, 1), logits), b)
    # row 0 gets 0.75 of sample 0 and 0.25 of sample 1; row 1 the rest
    assert stats["counts"].tolist() == [1.0, 1.0]
    torch.testing.assert_close(stats["sums"][0], torch.tensor([0.75 * 0.5 + 0.25 * 0.9, 0.75 * 0.5 + 0.25 * 0.1],
                                                              dtype=torch.float64))
    torch.testing.assert_close(label_weights(b, 2), torch.tensor([[0.75, 0.25], [0.25, 0.75]], dtype=torch.float64))


def test_probability_matrix_divides_by_fractional_counts_below_one():
    # a class seen only as the partner of one mixed sample (weight 0.25): its row is that sample's p
    sums = torch.tensor([[0.45, 0.3], [0.1, 0.15]], dtype=torch.float64)
    P = probability_matrix(sums, torch.tensor([0.75, 0.25], dtype=torch.float64))
    torch.testing.assert_close(P, torch.tensor([[0.6, 0.4], [0.4, 0.6]], dtype=torch.float64))


def test_an_epoch_without_a_present_classs_samples_keeps_that_classs_row_of_the_previous_estimate():
    """drop_last can drop every sample of a class the client holds: the epoch's statistics have no
    count for it, and its row of P stays the previous estimate instead of turning to zeros (a
    class "never predicted": log Delta at its clip, a perfect row in the score)."""
    previous = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.8, 0.1], [0.3, 0.3, 0.4]], dtype=torch.float64)
    sums = torch.tensor([[1.2, 0.6, 0.2], [0.0, 0.0, 0.0], [0.1, 0.2, 0.7]], dtype=torch.float64)
    P = updated_probability_matrix(previous, sums, torch.tensor([2.0, 0.0, 1.0], dtype=torch.float64))
    expected = torch.tensor([[0.6, 0.3, 0.1], [0.1, 0.8, 0.1], [0.1, 0.2, 0.7]], dtype=torch.float64)
    torch.testing.assert_close(P, expected)


# --- L1: flattening ---------------------------------------------------------------------------

def test_flattening_is_zero_when_the_wrong_class_mass_is_already_flat():
    p = torch.tensor([[0.7, 0.1, 0.1, 0.1]])
    assert float(flattening_kl(p.log(), torch.tensor([0]))) == pytest.approx(0.0, abs=1e-6)


def test_flattening_hand_value_when_not_flat():
    p = torch.tensor([[0.6, 0.3, 0.1]])
    # q = (0.6, 0.2, 0.2): KL = 0.3 log(0.3/0.2) + 0.1 log(0.1/0.2)
    expected = 0.3 * math.log(1.5) + 0.1 * math.log(0.5)
    assert float(flattening_kl(p.log(), torch.tensor([0]))) == pytest.approx(expected, abs=1e-6)


def test_flattening_is_per_sample_and_finite_when_the_true_class_probability_underflows():
    p = torch.tensor([[0.6, 0.3, 0.1], [0.7, 0.1, 0.2]], dtype=torch.float64)
    per_sample = flattening_kl(p.log(), torch.tensor([0, 0]))
    q2 = 0.15          # (1 - 0.7) / 2
    expected = [0.3 * math.log(1.5) + 0.1 * math.log(0.5), 0.1 * math.log(0.1 / q2) + 0.2 * math.log(0.2 / q2)]
    assert per_sample.shape == (2,)
    torch.testing.assert_close(per_sample, torch.tensor(expected, dtype=torch.float64))
    # p_y = 0 in float64: log(p_y + eps) stays finite, and so does the term
    value = flattening_kl(torch.tensor([[-1000.0, 0.0, 0.0]], dtype=torch.float64), torch.tensor([0]))
    assert torch.isfinite(value).all()


def test_flattening_gradient_with_a_detached_target_hand_computed():
    # q constant: d KL / d f_k = p_k (d_k - KL) with d_k = log(p_k / q_k) (d_y = 0) through the softmax
    p = torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64)
    logits = p.log().unsqueeze(0).requires_grad_(True)
    (g,) = torch.autograd.grad(flattening_kl(logits, torch.tensor([0]), detach_target=True, eps=0).sum(), logits)
    d = torch.log(p / torch.tensor([0.6, 0.2, 0.2], dtype=torch.float64))
    kl = float((p * d).sum())
    torch.testing.assert_close(g[0], p * (d - kl))
    # Found here: q is the closest distribution to p with q_y = p_y and flat wrong classes, so
    # KL's derivative through q vanishes and detaching it does not change the gradient (the
    # naive expectation is an extra push on p_y without the detach).
    (g2,) = torch.autograd.grad(flattening_kl(logits, torch.tensor([0]), detach_target=False, eps=0).sum(), logits)
    torch.testing.assert_close(g, g2)


# --- L2: the pairwise margin adjustment -------------------------------------------------------

def test_adjusted_ce_equals_plain_ce_when_P_is_symmetric():
    P = torch.tensor([[0.8, 0.1, 0.1], [0.1, 0.7, 0.2], [0.1, 0.2, 0.7]], dtype=torch.float64)
    log_delta = log_adjustment(P, torch.ones(3, dtype=torch.bool))
    assert torch.count_nonzero(log_delta) == 0
    logits = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))
    y = torch.tensor([0, 1, 2, 1, 0])
    out = Forward(torch.zeros(5, 1), logits)
    torch.testing.assert_close(MarginAdjustedCE(log_delta)(out, batch(y.tolist()), {}), F.cross_entropy(logits, y))


def test_adjusted_ce_adds_log_P_yi_over_P_iy_to_the_other_logits_hand_computed():
    P = torch.tensor([[0.9, 0.1], [0.3, 0.7]], dtype=torch.float64)
    log_delta = log_adjustment(P, torch.ones(2, dtype=torch.bool))
    # [0, 1] = log(0.1 / 0.3), [1, 0] = log(0.3 / 0.1)
    torch.testing.assert_close(log_delta, torch.tensor([[0.0, math.log(1 / 3)], [math.log(3), 0.0]]))
    logits = torch.tensor([[1.0, 0.5]])
    value = MarginAdjustedCE(log_delta, weight=2.0)(Forward(torch.zeros(1, 1), logits), batch([0]), {})
    expected = 2.0 * math.log(1 + math.exp(0.5 - 1.0 + math.log(1 / 3)))   # Eq. 8, one other class
    assert float(value) == pytest.approx(expected, rel=1e-6)


def test_adjusted_ce_keeps_the_logits_precision():
    # log Delta is float32; under bf16 autocast-free training the term must follow the logits' dtype
    P = torch.tensor([[0.9, 0.1], [0.3, 0.7]], dtype=torch.float64)
    logits = torch.tensor([[1.0, 0.5], [0.2, 0.4]], dtype=torch.bfloat16)
    value = MarginAdjustedCE(log_adjustment(P, torch.ones(2, dtype=torch.bool)))(
        Forward(torch.zeros(2, 1), logits), batch([0, 1]), {})
    assert value.dtype == torch.bfloat16


def test_missing_classes_get_delta_missing_and_absent_rows_are_never_used():
    P = torch.tensor([[0.8, 0.2, 0.0], [0.0, 0.0, 0.0], [0.3, 0.0, 0.7]], dtype=torch.float64)
    present = torch.tensor([True, False, True])
    log_delta = log_adjustment(P, present)                         # delta_missing 1e-2 by default
    assert float(log_delta[0, 1]) == pytest.approx(math.log(1e-2))
    assert float(log_delta[2, 1]) == pytest.approx(math.log(1e-2))
    assert torch.count_nonzero(log_delta[1]) == 0 and torch.count_nonzero(torch.diagonal(log_delta)) == 0
    # present pair with a zero entry: clamped to the floor and clipped
    assert float(log_delta[0, 2]) == -10.0                      # log(1e-6 / 0.3) = -12.6, clipped
    assert float(log_adjustment(P, present, clip=20.0)[0, 2]) == pytest.approx(math.log(1e-6 / 0.3))
    assert float(log_adjustment(P, present, clip=20.0)[2, 0]) == pytest.approx(-math.log(1e-6 / 0.3))
    assert float(log_delta[2, 0]) == 10.0                       # clipped from above too


# --- mixup ------------------------------------------------------------------------------------

def test_mixup_is_reproducible_and_mixes_inputs_and_labels():
    b = Batch(torch.arange(8.0).view(4, 1, 1, 2), torch.tensor([0, 1, 2, 3]), torch.arange(4))
    m1 = Mixup(1.0)(b, torch.Generator().manual_seed(5))
    m2 = Mixup(1.0)(b, torch.Generator().manual_seed(5))
    assert torch.equal(m1.x, m2.x) and torch.equal(m1.extras["mix_lam"], m2.extras["mix_lam"])
    (lam, rest), partner = m1.extras["mix_lam"].tolist(), m1.extras["mix_y"]
    assert 0 < lam < 1 and rest == 1.0 - lam and sorted(partner.tolist()) == [0, 1, 2, 3]
    torch.testing.assert_close(m1.x, lam * b.x + (1 - lam) * b.x[partner])
    with pytest.raises(ValueError, match="positive"):
        Mixup(0.0)


def test_both_terms_use_both_labels_of_a_mixed_batch():
    logits = torch.tensor([[2.0, 0.0, -1.0], [0.5, 0.2, 0.1]])
    out = Forward(torch.zeros(2, 1), logits)
    b = batch([0, 1], {"mix_y": torch.tensor([2, 0]), "mix_lam": torch.tensor([0.3, 0.7], dtype=torch.float64)})
    P = torch.tensor([[0.8, 0.15, 0.05], [0.2, 0.6, 0.2], [0.1, 0.3, 0.6]], dtype=torch.float64)
    log_delta = log_adjustment(P, torch.ones(3, dtype=torch.bool))
    ce = MarginAdjustedCE(log_delta)(out, b, {})
    def adjusted(y):
        return F.cross_entropy(logits + log_delta[y], y)
    torch.testing.assert_close(ce, 0.3 * adjusted(torch.tensor([0, 1])) + 0.7 * adjusted(torch.tensor([2, 0])))
    fl = Flattening(flatten_mixed="per_label")(out, b, {})
    torch.testing.assert_close(fl, 0.3 * flattening_kl(logits, torch.tensor([0, 1])).mean()
                               + 0.7 * flattening_kl(logits, torch.tensor([2, 0])).mean())
    assert float(mixed(lambda y: y.float().sum(), batch([1, 1]))) == 2.0


def test_pair_flattening_keeps_both_labels_of_a_mixed_pair_hand_computed():
    # labels (0, 1): the rest 0.3 spread over the 3 other classes -> q = (0.5, 0.2, 0.1, 0.1, 0.1)
    p = torch.tensor([[0.5, 0.2, 0.2, 0.05, 0.05]], dtype=torch.float64)
    value = pair_flattening_kl(p.log(), torch.tensor([0]), torch.tensor([1]), eps=0)
    assert float(value) == pytest.approx(0.2 * math.log(2) + 2 * 0.05 * math.log(0.5), abs=1e-9)
    # already flat outside the pair: zero, where the per-label form counts the partner's 0.3 as wrong
    flat = torch.tensor([[0.5, 0.3, 0.1, 0.1]], dtype=torch.float64)
    assert float(pair_flattening_kl(flat.log(), torch.tensor([0]), torch.tensor([1]))) == pytest.approx(0.0, abs=1e-7)
    assert float(flattening_kl(flat.log(), torch.tensor([0]))) > 0.05
    # a pair of one class is Eq. 7 itself
    q = torch.tensor([[0.6, 0.3, 0.1]], dtype=torch.float64)
    torch.testing.assert_close(pair_flattening_kl(q.log(), torch.tensor([0]), torch.tensor([0])),
                               flattening_kl(q.log(), torch.tensor([0])))


def test_pair_flattening_takes_each_samples_own_rest_hand_computed():
    # a batch of two: each sample's rest mass and rest classes are its own, not the batch's
    p = torch.tensor([[0.4, 0.3, 0.2, 0.1],       # labels (0, 1): the rest 0.3 over classes 2, 3
                      [0.1, 0.2, 0.6, 0.1]], dtype=torch.float64)   # labels (2, 2): the rest 0.4 over 3 classes
    value = pair_flattening_kl(p.log(), torch.tensor([0, 2]), torch.tensor([1, 2]), eps=0)
    first = 0.2 * math.log(0.2 / 0.15) + 0.1 * math.log(0.1 / 0.15)
    second = 2 * 0.1 * math.log(0.1 / (0.4 / 3)) + 0.2 * math.log(0.2 / (0.4 / 3))
    torch.testing.assert_close(value, torch.tensor([first, second], dtype=torch.float64))
    # three classes, two labels: the one class left takes the whole rest, so q = p and nothing to flatten
    three = torch.tensor([[0.5, 0.3, 0.2]], dtype=torch.float64)
    assert float(pair_flattening_kl(three.log(), torch.tensor([0]), torch.tensor([1]))) == pytest.approx(0.0, abs=1e-7)


def test_pair_flattening_stays_finite_when_probabilities_underflow():
    # fp32 logits whose classes 2 and 3 have probability exactly 0: eps keeps every log finite
    logits = torch.tensor([[0.0, 0.0, -200.0, -200.0]] * 2)
    assert float(logits.softmax(1)[0, 2]) == 0.0
    value = pair_flattening_kl(logits, torch.tensor([0, 0]), torch.tensor([1, 2]))
    # (0, 1): all the mass on the pair, no rest to flatten; (0, 2): p_2 = 0 kept, the rest 0.5 over 1 and 3
    torch.testing.assert_close(value, torch.tensor([0.0, 0.5 * math.log(2)]), atol=1e-6, rtol=0)


def test_pair_flattening_gradient_is_the_same_with_the_target_detached():
    # q is the closest distribution to p that keeps p on both labels and spreads the rest evenly
    # (an I-projection), so KL's derivative through q vanishes, as for Eq. 7 (test above)
    logits = torch.randn(5, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0), requires_grad=True)
    y, partner = torch.tensor([0, 1, 2, 3, 3]), torch.tensor([1, 1, 4, 5, 3])
    grads = [torch.autograd.grad(pair_flattening_kl(logits, y, partner, detach_target=d, eps=0).sum(), logits)[0]
             for d in (True, False)]
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=1e-12)


def test_pair_flattening_of_two_classes_has_nothing_to_flatten_and_no_nan():
    logits = torch.tensor([[0.3, -0.2]], requires_grad=True)
    value = pair_flattening_kl(logits, torch.tensor([0]), torch.tensor([1]), detach_target=False)
    (grad,) = torch.autograd.grad(value.sum(), logits)
    assert float(value) == pytest.approx(0.0, abs=1e-6) and torch.isfinite(grad).all()


def test_flatten_mixed_pair_applies_to_mixed_batches_only_and_ignores_lam():
    logits = torch.tensor([[2.0, 0.0, -1.0, 0.5], [0.5, 0.2, 0.1, -0.3]], dtype=torch.float64)
    out = Forward(torch.zeros(2, 1), logits)
    y, partner = torch.tensor([0, 1]), torch.tensor([2, 0])
    expected = pair_flattening_kl(logits, y, partner).mean()
    for lam in (0.3, 0.9):
        b = batch([0, 1], {"mix_y": partner, "mix_lam": torch.tensor([lam, 1 - lam], dtype=torch.float64)})
        torch.testing.assert_close(Flattening(flatten_mixed="pair")(out, b, {}), expected)
    plain = batch([0, 1])
    torch.testing.assert_close(Flattening(flatten_mixed="pair")(out, plain, {}), flattening_kl(logits, y).mean())
    with pytest.raises(ValueError, match="per_label' or 'pair"):
        Flattening(flatten_mixed="both")


def test_flatten_mixed_reaches_the_flattening_term(small_config):
    # the default is the pair form (the rule in benchmarks/fedacd_fmnist_e5.sweep.yaml chose it)
    assert FedACD.Params().flatten_mixed == "pair" and Flattening().flatten_mixed == "pair"
    for choice in ("per_label", "pair"):
        loop = build_loop(config(small_config, "fedacd", {"flatten_mixed": choice}))
        terms = loop.algorithm.acd_terms(torch.eye(10, dtype=torch.float64), torch.ones(10, dtype=torch.bool))
        assert terms[0].flatten_mixed == choice


# --- the aggregation score V and the server rule -----------------------------------------------

def test_template_kl_and_score_on_hand_made_P():
    tau = 1 - 1e-5
    eye = torch.eye(4, dtype=torch.float64)
    assert template_kl(eye, torch.ones(4, dtype=torch.bool), tau) == pytest.approx(-math.log(tau))
    assert aggregation_score(template_kl(eye, torch.ones(4, dtype=torch.bool), tau)) == pytest.approx(1.0)
    uniform = torch.full((4, 4), 0.25, dtype=torch.float64)
    q_off = (1 - tau) / 3
    row = 0.25 * math.log(0.25 / tau) + 3 * 0.25 * math.log(0.25 / q_off)
    assert template_kl(uniform, torch.ones(4, dtype=torch.bool), tau) == pytest.approx(row)
    # the mean over present rows only: an absent row (zeros) does not count
    mixed_P = torch.stack([eye[0], uniform[1], torch.zeros(4, dtype=torch.float64), uniform[3]])
    present = torch.tensor([True, True, False, True])
    assert template_kl(mixed_P, present, tau) == pytest.approx((-math.log(tau) + 2 * row) / 3)
    assert aggregation_score(row) == pytest.approx(1 / (1 + math.exp(-1 / row)))
    # Q in double whatever P's dtype: -log(tau) = 1.00000500e-5 needs more than float32's 7 digits
    assert template_kl(eye.float(), torch.ones(4, dtype=torch.bool), tau) == pytest.approx(-math.log(tau), rel=1e-9)
    with pytest.raises(ValueError, match=r"^KL\(P \|\| Q\) needs at least one present class$"):
        template_kl(eye, torch.zeros(4, dtype=torch.bool), tau)
    # KL = 0 (a P equal to the template) scores the limit 1 instead of dividing by zero
    assert aggregation_score(0.0) == 1.0 and aggregation_score(1.0) == pytest.approx(1 / (1 + math.exp(-1)))


def fedacd_replies():
    return {
        0: Message("update", {"model": {"w": torch.tensor([0.0])}}, {"num_samples": 10, "kl": 0.5, "score": 0.9}),
        1: Message("update", {"model": {"w": torch.tensor([1.0])}}, {"num_samples": 30, "kl": 5.0, "score": 0.55}),
    }


def test_fedacd_server_weights_models_by_their_scores_not_sizes():
    state = FedACD().aggregate({"model": {"w": torch.tensor([7.0])}}, fedacd_replies(), ctx([0, 1]))
    assert float(state["model"]["w"]) == pytest.approx(0.55 / (0.9 + 0.55))
    assert FedACD().round_metrics(state)["fedacd_kl_mean"] == pytest.approx(2.75)


def test_fedacd_round_metrics_give_the_spread_of_the_scores():
    replies = fedacd_replies()
    replies[2] = Message("update", {"model": {"w": torch.tensor([5.0])}},
                         {"num_samples": 0, "kl": math.inf, "score": 0.0})    # a client without data
    m = FedACD().round_metrics(FedACD().aggregate({"model": {"w": torch.tensor([7.0])}}, replies, ctx([0, 1, 2])))
    assert (m["fedacd_score_min"], m["fedacd_score_max"]) == (0.55, 0.9)
    assert m["fedacd_weight_ratio"] == pytest.approx(0.9 / 0.55)
    assert m["fedacd_kl_mean"] == pytest.approx(2.75) and m["fedacd_kl_by_client"][2] is None
    assert m["fedacd_kl_by_client"][0] == 0.5 and m["fedacd_score_by_client"] == {0: 0.9, 1: 0.55, 2: 0.0}


def test_fedacd_base_weights_uniformly():
    state = FedACDBase().aggregate({"model": {"w": torch.tensor([7.0])}}, fedacd_replies(), ctx([0, 1]))
    assert float(state["model"]["w"]) == pytest.approx(0.5)


# --- the client: P per epoch, uploads -----------------------------------------------------------

def test_client_uses_the_received_models_P_first_then_each_epochs_estimate(small_config):
    cfg = config(small_config, "fedacd", local_epochs=2)
    loop = build_loop(cfg)
    client = runtime(loop, 0)
    seen = []
    real_train = client.train

    def spy(weights, terms=None, **kw):
        seen.append(terms[1].log_delta.clone())
        result = real_train(weights, terms, **kw)
        seen.append(result.statistics)
        return result

    client.train = spy
    algo = loop.algorithm
    weights = loop.server_state["model"]
    reply, _ = algo.client_update(Message("train", {"model": weights}), None, client)
    present = torch.bincount(client.data.y[client.data.train_idx], minlength=10) > 0
    from fedhet.algorithms.fedacd import local_probability_matrix

    P0, _ = local_probability_matrix(client.model, weights, client.data, 10)
    torch.testing.assert_close(seen[0], log_adjustment(P0, present))
    P1 = probability_matrix(seen[1]["adjusted_ce.sums"], seen[1]["adjusted_ce.counts"])
    torch.testing.assert_close(seen[2], log_adjustment(P1, present))
    P2 = probability_matrix(seen[3]["adjusted_ce.sums"], seen[3]["adjusted_ce.counts"])
    assert reply.scalars["kl"] == pytest.approx(template_kl(P2, present))
    assert reply.scalars["score"] == pytest.approx(aggregation_score(reply.scalars["kl"]))
    assert reply.scalars["steps"] == 2 * math.ceil(client.num_samples / 32)


def test_score_from_clean_uses_a_clean_pass_of_the_trained_local_model(small_config):
    """score_from: clean scores the P of the returned local weights on the client's un-mixed
    training data; the default scores the last epoch's estimate on the mixed training inputs,
    and the two differ."""
    from fedhet.algorithms.fedacd import local_probability_matrix

    replies = {}
    for source in ("training", "clean"):
        loop = build_loop(config(small_config, "fedacd", {"score_from": source}, local_epochs=2))
        client = runtime(loop, 0)
        weights = loop.server_state["model"]
        replies[source], _ = loop.algorithm.client_update(Message("train", {"model": weights}), None, client)
    present = torch.bincount(client.data.y[client.data.train_idx], minlength=10) > 0
    P, _ = local_probability_matrix(client.model, replies["clean"].arrays["model"], client.data, 10)
    assert replies["clean"].scalars["kl"] == pytest.approx(template_kl(P, present))
    assert replies["clean"].scalars["score"] == pytest.approx(aggregation_score(template_kl(P, present)))
    # the local training itself is the same: only the score's P differs
    for k, v in replies["training"].arrays["model"].items():
        torch.testing.assert_close(replies["clean"].arrays["model"][k], v, rtol=0, atol=0)
    assert replies["clean"].scalars["kl"] != pytest.approx(replies["training"].scalars["kl"], rel=1e-3)


def test_a_users_fedacd_gets_its_train_options_arguments_and_its_optimizer_state_honoured(small_config):
    """A method of the user's own built on FedACD: its train_options gets the round's message, state
    and client, and an optimizer state it returns (momentum carried across rounds) starts the
    first epoch's call, whose momentum the later epochs continue."""
    from fedhet.algorithms.fedacd import FedACD
    from fedhet.experiment.build import make_algorithm

    seen = []

    class CarriedMomentum(FedACD):
        def train_options(self, msg, state, client):
            seen.append((msg, state, client))
            return {**super().train_options(msg, state, client), "optimizer_state": state["momentum"]}

    cfg = config(small_config, "fedacd", {"mixup": False}, local_epochs=2, momentum=0.9)
    weights = build_loop(cfg).server_state["model"]
    buffers = {k: torch.full_like(v, 0.01) for k, v in weights.items() if v.is_floating_point()}
    trained = {}
    for name, algorithm in (("carried", CarriedMomentum(make_algorithm(cfg).params)), ("default", None)):
        loop = build_loop(cfg, algorithm=algorithm)
        client, msg, state = runtime(loop, 1), Message("train", {"model": weights}), {"momentum": buffers}
        calls = []
        real_train = client.train
        client.train = lambda *a, **k: calls.append(k.get("optimizer_state")) or real_train(*a, **k)
        reply, _ = loop.algorithm.client_update(msg, state, client)
        trained[name] = reply.arrays["model"]
        if name == "carried":
            assert seen == [(msg, state, client)]
            assert calls[0] is buffers and calls[1] is not buffers and calls[1] is not None
        else:
            assert calls[0] is None
    assert any(not torch.equal(trained["carried"][k], trained["default"][k]) for k in buffers)


def test_fedacd_epochs_split_equal_one_unsplit_run_when_P_is_fixed(small_config):
    """The per-epoch calls continue momentum and batch order: with the adjustment switched off
    (a floor above every entry and delta_missing = 1 make log Delta = 0) FedACD's two calls
    give the weights of one two-epoch call on the same terms."""
    cfg = config(small_config, "fedacd", {"prob_floor": 0.99, "delta_missing": 1.0, "mixup": False}, local_epochs=2, momentum=0.9)
    loop = build_loop(cfg)
    weights = loop.server_state["model"]
    reply, _ = loop.algorithm.client_update(Message("train", {"model": weights}), None, runtime(loop, 1))
    one = runtime(loop, 1).train(weights, [Flattening(), MarginAdjustedCE(torch.zeros(10, 10))])
    for k, v in one.weights.items():
        torch.testing.assert_close(reply.arrays["model"][k], v, rtol=0, atol=0)


def test_fedacd_runs_end_to_end_with_local_risk(small_config, tmp_path):
    raw = {**small_config, "algorithm": {"name": "fedacd"}, "eval": {"every": 1, "local_risk": True}}
    res = fedhet.run(raw)
    row = res.rows[-1]
    assert 0 <= row["local_risk"] <= 1 and row["local_kl"] > 0
    assert set(row["local_risk_by_client"]) == {str(c) for c in row["clients"]} or \
        set(map(int, row["local_risk_by_client"])) == set(row["clients"])
    assert set(map(int, row["fedacd_kl_by_client"])) == set(row["clients"])


# --- the local-model risk (Table 3) and KL (Table 9) ----------------------------------------------

def test_local_model_risk_of_a_model_that_always_answers_class_0(small_config):
    cfg = config(small_config)
    loop = build_loop(cfg)
    fed = loop.host.federation
    arch = loop.host.client_arch[0]
    w = {k: torch.zeros_like(v) for k, v in loop.host.init_models[arch].items()}
    bias = torch.zeros(10)
    bias[0] = 2.0
    w["head.fc2.bias"] = bias          # logits = bias for every input: always class 0
    layouts = conv_layouts(loop.host.models[arch])
    res = local_model_risk(loop.host.models, loop.host.client_arch, {3: w}, fed)
    assert layouts and all(layouts)    # both passes (test set, the client's P) are evaluation's, in channels_last
    counts = fed.train_counts().astype(float)
    pi_mean = (counts / counts.sum(1, keepdims=True)).mean(0)
    # per-class error: 0 for class 0, 1 elsewhere (classes in the test set); R = sum_c pi_mean_c eps_c
    present_in_test = torch.bincount(fed.test.y, minlength=10).numpy() > 0
    assert res["local_risk"] == pytest.approx(float(pi_mean[1:][present_in_test[1:]].sum()))
    # KL: every row of P is softmax(bias); mean over the client's present rows of sum_j q_j log(q_j / Q_ij)
    q = torch.softmax(bias.double(), 0)
    tau = 1 - 1e-5
    rows = [i for i in range(10) if counts[3, i] > 0]
    def row_kl(i):
        Q = torch.full((10,), (1 - tau) / 9, dtype=torch.float64)
        Q[i] = tau
        return float((q * (q / Q).log()).sum())
    assert res["local_kl"] == pytest.approx(np.mean([row_kl(i) for i in rows]), rel=1e-5)


# --- composition and edge cases -------------------------------------------------------------------

def test_fedacd_refuses_a_partner_that_replaces_the_data_term_and_composes_with_server_rules():
    from fedhet.algorithms import algorithm_class

    for name in ("fedacd+fedrs", "fedlc+fedacd", "fedacd+fednh"):
        with pytest.raises(ConfigError, match="builds its own data term"):
            algorithm_class(name)
    # SCAFFOLD's control variate and FedACD's score weights both apply, in either order
    for name in ("fedacd+scaffold", "scaffold+fedacd"):
        algo = algorithm_class(name)()
        state = {"model": {"w": torch.tensor([7.0])}, "control": {"w": torch.tensor([0.0])}}
        replies = fedacd_replies()
        for c, delta in ((0, 2.0), (1, 4.0)):
            replies[c].arrays["control"] = {"w": torch.tensor([delta])}
        new = algo.aggregate(state, replies, ctx([0, 1], num_clients=4))
        assert float(new["model"]["w"]) == pytest.approx(0.55 / 1.45)
        assert float(new["control"]["w"]) == pytest.approx((2.0 + 4.0) / 4)
        assert set(new["fedacd_kl"]) == {0, 1}


def test_fedacd_with_fednova_uses_the_scores_in_the_normalised_average_in_either_order():
    from fedhet.algorithms import algorithm_class

    results = []
    for name in ("fedacd+fednova", "fednova+fedacd"):
        replies = fedacd_replies()
        for c, a in ((0, 2.0), (1, 4.0)):
            replies[c].scalars["a_i"] = a
        new = algorithm_class(name)().aggregate({"model": {"w": torch.tensor([1.0])}}, replies, ctx([0, 1]))
        assert set(new["fedacd_kl"]) == {0, 1}
        results.append(float(new["model"]["w"]))
    p = [0.9 / 1.45, 0.55 / 1.45]
    tau_eff = p[0] * 2.0 + p[1] * 4.0
    expected = 1.0 - tau_eff * (p[0] / 2.0 * (1.0 - 0.0) + p[1] / 4.0 * (1.0 - 1.0))
    assert results == pytest.approx([expected, expected])


def test_a_fedacd_client_without_a_full_batch_or_without_data_still_answers(small_config):
    cfg = config(small_config, "fedacd", drop_last=True, batch_size=10_000)
    loop = build_loop(cfg)
    weights = loop.server_state["model"]
    reply, _ = loop.algorithm.client_update(Message("train", {"model": weights}), None, runtime(loop, 0))
    assert reply.scalars["steps"] == 0 and math.isfinite(reply.scalars["kl"]) and reply.scalars["score"] > 0.5
    client = runtime(loop, 1)
    client.data = type(client.data)(client.data.x, client.data.y, client.data.train_idx[:0], client.data.mean,
                                    client.data.std)
    reply, _ = loop.algorithm.client_update(Message("train", {"model": weights}), None, client)
    assert reply.scalars["score"] == 0.0 and reply.scalars["kl"] == math.inf
    metrics = FedACD().round_metrics({"fedacd_kl": {0: 2.0, 1: math.inf}, "fedacd_score": {0: 0.6, 1: 0.0}})
    assert metrics["fedacd_kl_mean"] == 2.0 and metrics["fedacd_kl_by_client"][1] is None


@pytest.mark.parametrize("partner", ["fedprox", "moon"])
def test_every_epoch_trains_with_mixup_the_methods_parameters_and_a_partners_terms(small_config, partner):
    """Each client.train call of FedACD gets its mixup (Beta(mixup_alpha)), its two terms built with
    the method's parameters (log Delta clipped at log_delta_clip, L2 weighted by margin_weight, over
    every class with at least one sample), a composed partner's local terms (FedProx's pull towards
    the received model, MOON's contrast with the client's previous model), and the score's KL uses
    template_tau."""
    from fedhet.algorithms.fedacd import local_probability_matrix
    from fedhet.algorithms.fedprox import Proximal
    from fedhet.algorithms.moon import ModelContrastive

    params = {"margin_weight": 2.0, "log_delta_clip": 0.05, "mixup_alpha": 0.5, "template_tau": 0.9}
    loop = build_loop(config(small_config, f"{partner}+fedacd", params, local_epochs=2))
    client = runtime(loop, 0)
    # class 9 keeps exactly one training sample: it is present (a label the client has)
    idx, y = client.data.train_idx, client.data.y
    keep = torch.cat([idx[y[idx] != 9], idx[y[idx] == 9][:1]])
    client.data = type(client.data)(client.data.x, client.data.y, keep, client.data.mean, client.data.std)
    present = torch.bincount(y[keep], minlength=10) > 0
    assert bool(present[9]) and int((y[keep] == 9).sum()) == 1
    calls = []
    real_train = client.train

    def spy(weights, terms=None, **kw):
        result = real_train(weights, terms, **kw)
        calls.append((terms, kw, result.statistics))
        return result

    client.train = spy
    weights = loop.server_state["model"]
    previous = {k: v + 1.0 for k, v in weights.items()}
    state = {"moon_prev": previous} if partner == "moon" else None
    reply, _ = loop.algorithm.client_update(Message("train", {"model": weights}), state, client)
    assert len(calls) == 2
    P0, _ = local_probability_matrix(client.model, weights, client.data, 10)
    for terms, kw, _ in calls:
        assert isinstance(kw["augment"], Mixup) and kw["augment"].alpha == 0.5
        assert isinstance(terms[0], Flattening) and isinstance(terms[1], MarginAdjustedCE)
        assert terms[1].weight == 2.0
        (extra,) = terms[2:]
        if partner == "fedprox":
            assert isinstance(extra, Proximal)
            for k, a in extra.anchor.items():
                assert torch.equal(a, weights[k])
        else:
            assert isinstance(extra, ModelContrastive) and extra.prev_weights is previous
    torch.testing.assert_close(calls[0][0][1].log_delta, log_adjustment(P0, present, clip=0.05))
    assert float(calls[0][0][1].log_delta.abs().max()) == pytest.approx(0.05)   # clipped (unclipped: ~0.1)
    P_last = probability_matrix(calls[1][2]["adjusted_ce.sums"], calls[1][2]["adjusted_ce.counts"])
    assert reply.scalars["kl"] == pytest.approx(template_kl(P_last, present, 0.9))


def test_the_methods_defaults_are_the_papers_settings():
    """FedACD (Zhou et al.) Sec. 4.1: "lambda is set as 1 and tau is set as 1 - 10^-5"; Input Mixup on
    (the method as proposed; Table 5 ablates it) and score-weighted aggregation (Eq. 10-11;
    FedACD_base is the uniform one, Table 8)."""
    params = FedACD.Params()
    assert (params.margin_weight, params.template_tau, params.mixup, params.weighting) == (1.0, 1 - 1e-5, True, "score")
    assert FedACDBase.Params().weighting == "uniform"
