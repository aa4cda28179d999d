"""FedClassAvg (Jang et al., ICPP 2022): SupCon against its formula, the views, and the protocol."""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_identical, build_loop, config, ctx, runtime

from fedhet.algorithms.fedclassavg import (
    FedClassAvg,
    FirstViewCrossEntropy,
    HeadProximal,
    SupervisedContrastive,
    supcon_loss,
)
from fedhet.core.contract import Batch, ClientData, Forward, LocalResult, Message
from fedhet.training.augment import SupConViews, _affine_grid, _rotate_hue


def test_supcon_matches_a_direct_formula_on_a_tiny_batch():
    f = torch.tensor([[1.0, 0.0], [0.8, 0.6], [0.0, 1.0], [-1.0, 0.5]])
    y = torch.tensor([0, 0, 1, 1])
    T, base = 0.5, 0.07
    total, anchors = 0.0, 0
    for i in range(4):
        s = {a: float(f[i] @ f[a]) / T for a in range(4) if a != i}
        log_den = math.log(sum(math.exp(v) for v in s.values()))
        pos = [p for p in range(4) if p != i and y[p] == y[i]]
        total += -(T / base) * sum(s[p] - log_den for p in pos) / len(pos)
        anchors += 1
    assert float(supcon_loss(f, y, T, base)) == pytest.approx(total / anchors, rel=1e-5)


def test_supcon_masks_self_and_skips_anchors_without_positives():
    f = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0]])
    y = torch.tensor([0, 0, 1])          # anchor 2 has no positive: left out of the mean
    T, base = 1.0, 1.0
    def anchor(i, p):
        others = [a for a in range(3) if a != i]
        log_den = math.log(sum(math.exp(float(f[i] @ f[a]) / T) for a in others))
        return -(float(f[i] @ f[p]) / T - log_den)
    expected = (anchor(0, 1) + anchor(1, 0)) / 2
    assert float(supcon_loss(f, y, T, base)) == pytest.approx(expected, rel=1e-5)
    # the temperature scales the similarities (100 with base 0.07: the authors' code)
    assert float(supcon_loss(f, y, 100.0, 0.07)) != pytest.approx(float(supcon_loss(f, y, 1.0, 0.07)))


def test_first_view_ce_and_head_proximal():
    logits = torch.tensor([[2.0, 0.0], [0.0, 2.0], [5.0, -5.0], [5.0, -5.0]])
    b = Batch(torch.zeros(4, 1, 2, 2), torch.tensor([0, 1, 0, 1]), torch.arange(2), {"views": 2})
    ce = FirstViewCrossEntropy()(Forward(torch.zeros(4, 1), logits), b, {})
    torch.testing.assert_close(ce, torch.nn.functional.cross_entropy(logits[:2], torch.tensor([0, 1])))
    anchor = {"head.classifier.1.weight": torch.zeros(2, 3), "head.classifier.1.bias": torch.zeros(2)}
    w = {"head.classifier.1.weight": torch.ones(2, 3), "head.classifier.1.bias": torch.full((2,), 2.0),
         "body.fcin.weight": torch.full((3, 3), 9.0)}
    value = HeadProximal(anchor, rho=0.5)(Forward(torch.zeros(1, 1), torch.zeros(1, 2)), b, w)
    assert float(value) == pytest.approx(0.25 * (1.0 + 4.0))   # rho/2 * (mean 1 + mean 4); the body is not in it


def test_supcon_views_shapes_ranges_determinism_and_crop_scales():
    mean, std = torch.full((1, 1, 1, 1), 0.3), torch.full((1, 1, 1, 1), 0.4)
    x01 = torch.rand(16, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    b = Batch((x01 - mean) / std, torch.arange(16) % 4, torch.arange(16))
    aug = SupConViews(mean, std)
    v1 = aug(b, torch.Generator().manual_seed(3))
    v2 = aug(b, torch.Generator().manual_seed(3))
    v3 = aug(b, torch.Generator().manual_seed(4))
    assert v1.x.shape == (32, 1, 28, 28) and torch.equal(v1.y, torch.cat([b.y, b.y])) and v1.extras["views"] == 2
    assert torch.equal(v1.x, v2.x) and not torch.equal(v1.x, v3.x)
    back = v1.x * std + mean
    assert float(back.min()) >= -1e-6 and float(back.max()) <= 1 + 1e-6
    assert not torch.equal(v1.x[:16], v1.x[16:])                    # two different views
    boxes = aug.crop_boxes(20000, torch.Generator().manual_seed(1))
    area = boxes[:, 0] * boxes[:, 1]
    assert float(area.min()) >= 0.2 - 1e-9 and float(area.max()) <= 1.0 + 1e-9
    # area ~ U(0.2, 1) except where a side had to be shrunk to fit: the median is close to 0.6
    assert abs(float(area.median()) - 0.6) < 0.03
    assert float((boxes[:, 2] - boxes[:, 0] / 2).min()) >= -1e-9 and float((boxes[:, 2] + boxes[:, 0] / 2).max()) <= 1 + 1e-9
    # crop geometry: the whole image unflipped is the identity, a flip mirrors, a half box a quadrant
    img = torch.arange(16.0).view(1, 1, 4, 4) / 16

    def view(box, flip):      # one view with a given crop box, no colour jitter
        return SupConViews(mean, std, jitter_p=0.0).view(img, torch.tensor([box], dtype=torch.float64),
                                                        torch.tensor([flip]), torch.zeros(1, 6))

    torch.testing.assert_close(view((1.0, 1.0, 0.5, 0.5), False), img)
    torch.testing.assert_close(view((1.0, 1.0, 0.5, 0.5), True), img.flip(-1))
    quadrant = view((0.5, 0.5, 0.25, 0.75), False)      # left half across, lower half down
    # By hand: the output's pixel centres fall at input columns -0.25, 0.25, 0.75, 1.25 and rows 1.75,
    # 2.25, 2.75, 3.25 (align_corners=False); border padding clamps -0.25 to 0 and 3.25 to 3. Bilinear
    # interpolation of the linear image (4 row + col) / 16 is exact, so the mean is
    # (4 x mean row 2.4375 + mean col 0.5625) / 16 = 165/256.
    torch.testing.assert_close(quadrant.mean(), torch.tensor(165 / 256), rtol=0, atol=1e-6)
    # the written-out sampling grid is torch's affine_grid (align_corners=False)
    theta = torch.randn(5, 2, 3, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(_affine_grid(theta, 7, 9), F.affine_grid(theta, [5, 1, 7, 9], align_corners=False))
    # the draws' order on the stream (what the vectorized engine replays): per view the crop
    # boxes, the flips, the colour draws
    draws, g = aug.draw(16, torch.Generator().manual_seed(3)), torch.Generator().manual_seed(3)
    for v in range(2):
        assert torch.equal(draws["box"][v], aug.crop_boxes(16, g))
        assert torch.equal(draws["flip"][v], torch.rand(16, generator=g) < aug.flip_p)
        assert torch.equal(draws["colour"][v], torch.rand(16, 6, generator=g))
    # the hue shift is a rotation of YIQ's chroma plane, written with Python-float constants
    rgb_images = torch.rand(4, 3, 5, 5, generator=torch.Generator().manual_seed(6))
    angle = torch.tensor([0.0, 0.5, -1.0, math.pi])
    to_yiq = torch.tensor([[0.299, 0.587, 0.114], [0.596, -0.274, -0.322], [0.211, -0.523, 0.312]])
    yiq = torch.einsum("ij,njhw->nihw", to_yiq, rgb_images)
    c, s = torch.cos(angle).view(-1, 1, 1), torch.sin(angle).view(-1, 1, 1)
    turned = torch.stack([yiq[:, 0], c * yiq[:, 1] - s * yiq[:, 2], s * yiq[:, 1] + c * yiq[:, 2]], 1)
    expected = torch.einsum("ij,njhw->nihw", torch.linalg.inv(to_yiq), turned)
    torch.testing.assert_close(_rotate_hue(rgb_images, angle), expected)
    torch.testing.assert_close(_rotate_hue(rgb_images, torch.zeros(4)), rgb_images)
    rgb = SupConViews(torch.full((1, 3, 1, 1), 0.5), torch.full((1, 3, 1, 1), 0.25))
    out = rgb(Batch(torch.randn(8, 3, 32, 32), torch.zeros(8, dtype=torch.long), torch.arange(8)),
              torch.Generator().manual_seed(0))
    assert out.x.shape == (16, 3, 32, 32) and torch.isfinite(out.x).all()


def mixed_config(small_config, clients_per_round=3, **params):
    raw = copy.deepcopy(small_config)
    raw["model"] = {"arch": ["fca_tiny_a", "fca_tiny_b", "fca_tiny_c"]}
    raw["train"].update(optimizer="adam", betas=[0.5, 0.999], lr=1e-3, momentum=0.0)
    return config(raw, "fedclassavg", params, rounds=2, clients_per_round=clients_per_round)


def test_only_the_classifier_travels_and_bodies_never_mix(small_config):
    loop = build_loop(mixed_config(small_config, clients_per_round=6))      # everyone, every round
    assert loop.host.client_arch[:4] == ["fca_tiny_a", "fca_tiny_b", "fca_tiny_c", "fca_tiny_a"]
    for rnd in range(2):
        loop.run_round(rnd)
    totals = loop.ledger.totals()
    head_floats = 10 * 512 + 10
    assert {k for k in totals if "/" in k} == {"up/head", "down/head"}
    assert totals["up"]["floats"] == head_floats * 6 * 2          # 6 clients a round, 2 rounds
    # each client's body is its own: clients 0 and 3 (same architecture, same initial weights)
    # differ after training on their own data, and neither equals the initialisation
    a, b = loop.client_states[0]["model"], loop.client_states[3]["model"]
    init = loop.host.init_models["fca_tiny_a"]
    for k in ("body.fcin.weight", "body.conv1.0.weight"):
        assert not torch.equal(a[k], b[k]) and not torch.equal(a[k], init[k]), k


def test_in_a_one_architecture_federation_only_the_classifier_travels_too(small_config):
    """Sec. 4.1: clients upload their classifiers alone, also where the bodies could be averaged (a
    federation of one architecture): the server state holds a head, and each body stays the client's."""
    raw = copy.deepcopy(small_config)
    raw["model"] = {"arch": "fca_tiny_a"}
    raw["train"].update(optimizer="adam", betas=[0.5, 0.999], lr=1e-3, momentum=0.0)
    loop = build_loop(config(raw, "fedclassavg", {}, rounds=2, clients_per_round=6))
    for rnd in range(2):
        loop.run_round(rnd)
    head_floats = 10 * 512 + 10
    assert loop.ledger.totals()["up"]["floats"] == head_floats * 6 * 2
    assert all(k.startswith("head.") for k in loop.server_state["head"])
    a, b = loop.client_states[0]["model"], loop.client_states[1]["model"]
    assert not torch.equal(a["body.fcin.weight"], b["body.fcin.weight"])


def test_the_server_averages_classifiers_by_size_and_clients_start_from_it(small_config):
    loop = build_loop(mixed_config(small_config, pretrain=False))
    algo = loop.algorithm
    head = loop.server_state["head"]
    replies = {
        0: Message("update", {"head": {k: torch.zeros_like(v) for k, v in head.items()}}, {"num_samples": 10}),
        1: Message("update", {"head": {k: torch.ones_like(v) for k, v in head.items()}}, {"num_samples": 30}),
    }
    new = algo.aggregate(dict(loop.server_state), replies, ctx([0, 1], num_clients=6))
    for v in new["head"].values():
        torch.testing.assert_close(v, torch.full_like(v, 0.75))
    # a client trains from the received classifier: with lr 0 its reply is exactly that classifier
    cfg = mixed_config(small_config, pretrain=False)
    cfg.train.lr = 1e-12
    loop = build_loop(cfg)
    glob = {k: torch.full_like(v, 0.01) for k, v in loop.server_state["head"].items()}
    reply, state = loop.algorithm.client_update(Message("train", {"head": glob}), None, runtime(loop, 1))
    for k, v in glob.items():
        torch.testing.assert_close(reply.arrays["head"][k], v, atol=1e-9, rtol=0)
    init_body = {k: v for k, v in loop.host.init_models["fca_tiny_b"].items() if k.startswith("body.")}
    for k, v in init_body.items():
        torch.testing.assert_close(state["model"][k], v, atol=1e-9, rtol=0)


def test_the_proximal_term_touches_only_the_classifier(small_config):
    """The proximal term's gradient is rho/numel * (w - w_g) on the head and exactly zero on the body."""
    loop = build_loop(mixed_config(small_config, contrastive=False, pretrain=False, rho=10.0))
    terms = loop.algorithm.terms(loop.server_state["head"])
    prox = [t for t in terms if isinstance(t, HeadProximal)][0]
    w = {k: (v + 0.1).requires_grad_(True) for k, v in loop.host.init_models["fca_tiny_a"].items()}
    value = prox(Forward(torch.zeros(1, 1), torch.zeros(1, 10)), Batch(torch.zeros(1, 1, 2, 2), torch.zeros(1, dtype=torch.long), torch.arange(1)), w)
    grads = torch.autograd.grad(value, list(w.values()), allow_unused=True)
    for (k, v), g in zip(w.items(), grads):
        if k.startswith("head."):
            expected = 10.0 * (v.detach() - loop.server_state["head"][k]) / v.numel()
            torch.testing.assert_close(g, expected)
        else:
            assert g is None or torch.count_nonzero(g) == 0, k


def test_pretraining_runs_one_extra_epoch_on_first_participation(small_config):
    for pretrain, expected_calls in ((True, 2), (False, 1)):
        loop = build_loop(mixed_config(small_config, pretrain=pretrain))
        client = runtime(loop, 0)
        calls = []
        real = client.train

        def spy(weights, terms=None, **kw):
            calls.append(kw.get("epochs"))
            return real(weights, terms, **kw)

        client.train = spy
        _, state = loop.algorithm.client_update(Message("train", {"head": loop.server_state["head"]}), None, client)
        assert len(calls) == expected_calls
        calls.clear()
        loop.algorithm.client_update(Message("train", {"head": loop.server_state["head"]}), state, client)
        assert len(calls) == 1                                  # never again


def test_average_body_variant_needs_one_architecture(small_config):
    with pytest.raises(ValueError, match="same architecture"):
        build_loop(mixed_config(small_config, average_body=True))
    raw = copy.deepcopy(small_config)
    raw["model"] = {"arch": "fca_cnn_a"}
    raw["train"].update(optimizer="adam", momentum=0.0, lr=1e-3)
    loop = build_loop(config(raw, "fedclassavg", {"average_body": True}, rounds=1))
    loop.run_round(0)
    assert {k for k in loop.ledger.totals() if k.startswith("up/")} == {"up/head", "up/body"}
    assert FedClassAvg.personalized and not FedClassAvg.has_global_model


def test_one_view_is_the_first_of_fedclassavgs_two():
    """``views=1`` (the baselines' ``augment: supcon_view``) is FedClassAvg's first view: the same
    draws from the same stream, B rows, labels unchanged."""
    mean, std = torch.full((1, 1, 1, 1), 0.3), torch.full((1, 1, 1, 1), 0.4)
    x01 = torch.rand(8, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    b = Batch((x01 - mean) / std, torch.arange(8) % 3, torch.arange(8))
    one = SupConViews(mean, std, views=1)(b, torch.Generator().manual_seed(5))
    two = SupConViews(mean, std)(b, torch.Generator().manual_seed(5))
    assert one.x.shape == b.x.shape and torch.equal(one.y, b.y) and one.extras["views"] == 1
    assert torch.equal(one.x, two.x[:8]) and not torch.equal(one.x, b.x)
    with pytest.raises(ValueError, match="at least one view"):
        SupConViews(mean, std, views=0)


@pytest.mark.parametrize("method", ["local", "fedproto"])
def test_baselines_can_train_on_fedclassavgs_augmentation(small_config, method, monkeypatch):
    """``augment: supcon_view`` hands client.train one FedClassAvg view per image; the default, none."""
    for augment, expected in (("none", None), ("supcon_view", 1)):
        loop = build_loop(config(small_config, method, {"augment": augment}))
        client = runtime(loop, 0)
        seen = []
        train = client.train

        def spy(*args, **kwargs):
            seen.append(kwargs.get("augment"))
            return train(*args, **kwargs)

        monkeypatch.setattr(client, "train", spy)
        loop.algorithm.client_update(Message("train"), None, client)
        (aug,) = seen
        if expected is None:
            assert aug is None
        else:
            assert isinstance(aug, SupConViews) and aug.views == expected
            assert aug.mean is client.data.mean and aug.std is client.data.std


# --- SupCon: the formula's averaging, its defaults, the loss term, numerical care -----------------


def supcon_by_hand(f, y, T, base):
    """Khosla et al.'s L_out, written out: for every anchor i with positives P(i),
    -(T/base) * mean_{p in P(i)} [s_ip - log sum_{a != i} exp(s_ia)], s = f.f/T; mean over those anchors."""
    n, per_anchor = len(y), []
    for i in range(n):
        pos = [p for p in range(n) if p != i and int(y[p]) == int(y[i])]
        if not pos:
            continue
        s = {a: float(f[i] @ f[a]) / T for a in range(n) if a != i}
        log_den = math.log(sum(math.exp(v) for v in s.values()))
        per_anchor.append(-(T / base) * sum(s[p] - log_den for p in pos) / len(pos))
    return sum(per_anchor) / len(per_anchor)


UNEVEN_F = torch.tensor([[1.0, 0.0], [0.8, 0.6], [0.6, -0.8], [0.0, 1.0], [-1.0, 0.5], [0.3, 0.3]])
UNEVEN_Y = torch.tensor([0, 0, 0, 1, 1, 2])      # 2, 2, 2, 1, 1 positives; the last anchor has none


def test_supcon_averages_each_anchors_own_positives_then_the_anchors():
    """Classes of unequal size: an anchor's log-probabilities are averaged over its own positives
    (|P(i)| = 2 or 1) and normalised by its own denominator, then over the anchors that have any -
    not one pooled mean over all positive pairs (which equal class sizes cannot tell apart)."""
    expected = supcon_by_hand(UNEVEN_F, UNEVEN_Y, 0.5, 0.07)
    assert float(supcon_loss(UNEVEN_F, UNEVEN_Y, 0.5, 0.07)) == pytest.approx(expected, rel=1e-5)


def test_supcon_defaults_are_the_authors_temperatures():
    """The code's T = 100 and base T = 0.07 are supcon_loss's defaults (features of norm ~10, so
    that s = f.f / 100 is of order one)."""
    f, y = 10 * UNEVEN_F, UNEVEN_Y
    assert float(supcon_loss(f, y)) == pytest.approx(supcon_by_hand(f, y, 100.0, 0.07), rel=1e-5)


def test_supervised_contrastive_term_passes_both_temperatures():
    """The loss term evaluates supcon on the body's features with its own T and base T."""
    batch = Batch(torch.zeros(6, 1, 2, 2), UNEVEN_Y, torch.arange(6), {"views": 2})
    value = SupervisedContrastive(2.0, 0.5)(Forward(UNEVEN_F, torch.zeros(6, 3)), batch, {})
    assert float(value) == pytest.approx(supcon_by_hand(UNEVEN_F, UNEVEN_Y, 2.0, 0.5), rel=1e-5)


def test_supcon_row_max_shift_keeps_large_similarities_exact():
    """The stabilising row-max shift is a subtraction: with integer similarities near 9e6 (exact in
    float32) the shifted values are the exact small differences. Anchor 0: positive s = 9e6,
    negative 9e6 + 1, so its term is 1 + log(1 + e^-1); anchor 1: both others at 9e6, log 2;
    anchor 2 has no positive. (Adding the max would round 2 * 9e6 + 1 in float32.)"""
    f = torch.tensor([[3000.0, 1.0], [3000.0, 0.0], [3000.0, 1.0]])
    y = torch.tensor([0, 0, 1])
    expected = ((1.0 + math.log(1.0 + math.exp(-1.0))) + math.log(2.0)) / 2
    assert float(supcon_loss(f, y, 1.0, 1.0)) == pytest.approx(expected, rel=1e-6)


def ce_by_hand(logits, labels):
    rows = [-(row[c] - math.log(sum(math.exp(v) for v in row))) for row, c in zip(logits, labels)]
    return sum(rows) / len(rows)


def test_first_view_ce_uses_the_first_of_the_stacked_views_and_all_rows_without_views():
    """views = 2 over 4 rows: CE of rows 0-1 (the row count, not the class count, is split);
    no ``views`` in the batch (no augmentation): one view, CE over every row."""
    logits = [[2.0, 0.0, -1.0], [0.5, 0.0, 1.5], [3.0, -3.0, 0.0], [0.0, 0.0, 4.0]]
    y = [0, 2, 1, 0]
    lt, yt = torch.tensor(logits), torch.tensor(y)
    two = FirstViewCrossEntropy()(Forward(torch.zeros(4, 1), lt), Batch(torch.zeros(4, 1), yt, torch.arange(4),
                                                                        {"views": 2}), {})
    assert float(two) == pytest.approx(ce_by_hand(logits[:2], y[:2]), rel=1e-6)
    plain = FirstViewCrossEntropy()(Forward(torch.zeros(4, 1), lt), Batch(torch.zeros(4, 1), yt, torch.arange(4)), {})
    assert float(plain) == pytest.approx(ce_by_hand(logits, y), rel=1e-6)


# --- the protocol, against a recording client (no training) --------------------------------------


class RecordingClient:
    """A ClientRuntime stand-in: records each ``train`` call and returns the weights plus one
    (4 steps, mean loss 0.25), so that which weights, terms and options reach training are visible."""

    def __init__(self, init, epochs=3):
        self.init, self.calls, self.num_samples = init, [], 17
        self.data = ClientData(torch.zeros(1, 1, 2, 2, dtype=torch.uint8), torch.zeros(1, dtype=torch.long),
                               torch.arange(1), torch.full((1, 1, 1, 1), 0.3), torch.full((1, 1, 1, 1), 0.4))
        self.settings = SimpleNamespace(epochs=epochs)

    def init_weights(self):
        return {k: v.clone() for k, v in self.init.items()}

    def train(self, weights, terms=None, **kw):
        self.calls.append((dict(weights), terms, kw))
        return LocalResult({k: v + 1 for k, v in weights.items()}, {}, steps=4, samples=68, mean_loss=0.25)


def small_weights(value=0.0):
    return {"body.w": torch.full((2, 2), value), "head.w": torch.full((3, 2), value), "head.b": torch.full((3,), value)}


def assert_views(augment, client):
    assert isinstance(augment, SupConViews) and augment.views == 2
    assert augment.mean is client.data.mean and augment.std is client.data.std


def assert_terms(terms, anchor):
    """L_CL + L_CE + L_R (Eq. 4), the proximal term anchored at ``anchor``'s classifier."""
    assert sorted(t.name for t in terms) == ["ce", "prox", "supcon"]
    (prox,) = [t for t in terms if isinstance(t, HeadProximal)]
    assert set(prox.anchor) == {"head.w", "head.b"}
    for k, v in prox.anchor.items():
        assert torch.equal(v, anchor[k]), k


def test_the_configured_temperatures_and_rho_reach_the_loss_terms():
    """Every hyper-parameter of Eq. 4 reaches the term it configures (not the term's default)."""
    anchor = {"head.w": torch.zeros(3, 2), "head.b": torch.zeros(3)}
    terms = FedClassAvg(FedClassAvg.Params(temperature=5.0, base_temperature=0.5, rho=2.0)).terms(anchor)
    (supcon,) = [t for t in terms if isinstance(t, SupervisedContrastive)]
    (prox,) = [t for t in terms if isinstance(t, HeadProximal)]
    assert (supcon.temperature, supcon.base_temperature, prox.rho) == (5.0, 0.5, 2.0)


def test_first_participation_pretrains_then_trains_from_the_global_classifier():
    """Pre-training: one epoch (its own stream, after the round's epochs) from the initial model,
    proximal to its own classifier, on two views; then the round's training from the pre-trained
    body with the global classifier, proximal to it, on two views. The reply carries the trained
    classifier and the statistics; the client keeps its whole model."""
    client = RecordingClient(small_weights(0.0), epochs=3)
    glob = {"head.w": torch.full((3, 2), 5.0), "head.b": torch.full((3,), 5.0)}
    reply, state = FedClassAvg().client_update(Message("train", {"head": glob}), None, client)
    (w_pre, t_pre, kw_pre), (w_main, t_main, kw_main) = client.calls
    assert_identical(w_pre, small_weights(0.0))
    assert_terms(t_pre, small_weights(0.0))
    assert kw_pre["epochs"] == 1 and kw_pre["start_epoch"] == 3
    assert_views(kw_pre["augment"], client)
    assert torch.equal(w_main["body.w"], torch.ones(2, 2))                  # the pre-trained body
    assert torch.equal(w_main["head.w"], glob["head.w"]) and torch.equal(w_main["head.b"], glob["head.b"])
    assert_terms(t_main, glob)
    assert kw_main.get("epochs") is None and kw_main.get("start_epoch", 0) == 0     # the run's epochs
    assert_views(kw_main["augment"], client)
    assert reply.kind == "update" and set(reply.arrays) == {"head"}
    assert_identical(reply.arrays["head"], {"head.w": torch.full((3, 2), 6.0), "head.b": torch.full((3,), 6.0)})
    assert reply.scalars == {"num_samples": 17, "steps": 4, "loss": 0.25}
    assert_identical(state, {"model": {"body.w": torch.full((2, 2), 2.0), **reply.arrays["head"]}})


def test_a_returning_client_resumes_its_own_model_and_a_state_without_one_starts_fresh():
    glob = {"head.w": torch.full((3, 2), 5.0), "head.b": torch.full((3,), 5.0)}
    msg = Message("train", {"head": glob})
    client = RecordingClient(small_weights(0.0))
    FedClassAvg().client_update(msg, {"model": small_weights(7.0)}, client)
    ((weights, terms, _),) = client.calls                                   # no second pre-training
    assert torch.equal(weights["body.w"], torch.full((2, 2), 7.0)) and torch.equal(weights["head.w"], glob["head.w"])
    assert_terms(terms, glob)           # proximal to the received global classifier, not its own last one
    client = RecordingClient(small_weights(0.0))
    FedClassAvg().client_update(msg, {}, client)                            # a state without a model
    (weights, _, _), _ = client.calls
    assert_identical(weights, small_weights(0.0))


def test_average_body_sends_loads_and_averages_the_feature_extractor():
    """'+weight': the server's body travels with the classifier, the client trains from it (no
    pre-training), uploads its body, and the server averages bodies by sample count."""
    algo = FedClassAvg(FedClassAvg.Params(average_body=True))
    state = algo.init_server_state({"a": small_weights(0.5)})
    msg = algo.train_message(state, 0, ctx([0]))
    assert msg.kind == "train" and set(msg.arrays) == {"head", "body"}
    assert_identical(msg.arrays["body"], {"body.w": torch.full((2, 2), 0.5)})
    sent = Message("train", {"head": {"head.w": torch.full((3, 2), 5.0), "head.b": torch.full((3,), 5.0)},
                             "body": {"body.w": torch.full((2, 2), 3.0)}})
    client = RecordingClient(small_weights(0.0))
    reply, _ = algo.client_update(sent, None, client)
    ((weights, _, _),) = client.calls
    assert torch.equal(weights["body.w"], torch.full((2, 2), 3.0))
    assert_identical(reply.arrays["body"], {"body.w": torch.full((2, 2), 4.0)})
    body = {"body.w": torch.zeros(2, 2)}
    replies = {0: Message("update", {"head": small_weights(0.0), "body": body}, {"num_samples": 10}),
               1: Message("update", {"head": small_weights(1.0), "body": {"body.w": torch.ones(2, 2)}},
                          {"num_samples": 30})}
    new = algo.aggregate(dict(state), replies, ctx([0, 1]))
    assert set(new) == {"head", "body"}
    torch.testing.assert_close(new["body"]["body.w"], torch.full((2, 2), 0.75))


def test_evaluation_uses_the_clients_own_model_or_none():
    algo, w = FedClassAvg(), small_weights(2.0)
    # not the new global classifier on the client's body (the authors' code tests the client's model)
    server = {"head": {k: torch.full_like(v, 9.0) for k, v in w.items() if k.startswith("head.")}}
    assert algo.client_model(0, server, {"model": w}) is w
    assert algo.client_model(0, {}, {"model": w}) is w
    assert algo.client_model(0, {}, None) is None
    assert algo.client_model(0, {}, {}) is None
    assert algo.client_model(0, {}, {"other": 1}) is None


def test_architectures_with_different_classifiers_are_refused_with_their_shapes():
    a = small_weights()
    b = {**small_weights(), "head.w": torch.zeros(4, 2), "head.b": torch.zeros(4)}
    with pytest.raises(ValueError, match=r"same head.*\(4, 2\)"):
        FedClassAvg().init_server_state({"a": a, "b": b})


def test_the_methods_defaults_are_the_papers_and_its_codes_settings():
    """FedClassAvg (Jang et al.) Table 1, Fashion-MNIST: rho = 0.4662; the paper gives no SupCon
    temperature, the authors' code uses SupConLoss(temperature=100, base_temperature=0.07); every
    term of Eq. 4 on, the classifier alone averaged (Eq. 3), the code's pre-training epoch on."""
    params = FedClassAvg.Params()
    assert (params.rho, params.temperature, params.base_temperature) == (0.4662, 100.0, 0.07)
    assert params.contrastive and params.proximal and params.pretrain and not params.average_body
