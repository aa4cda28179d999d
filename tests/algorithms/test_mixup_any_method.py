"""Input Mixup for any method (``algorithm.params.mixup``): the FedACD paper (Zhou et al.) Table 5 runs
FedAvg, FedROD, FedLC and FedNH "w/ Input Mixup". Hand-computed mixed losses of their data terms, the
refusal of terms and methods mixup would not reach, and the plumbing into local training."""

from __future__ import annotations

import copy
import math
import re

import pytest
import torch
import torch.nn.functional as F
from helpers import build_loop, config, runtime

from fedhet.algorithms import ALGORITHMS
from fedhet.algorithms.fedavg import FedAvg
from fedhet.algorithms.fednh import CosineCrossEntropy
from fedhet.algorithms.fedper import FedPer
from fedhet.core.contract import Batch, Forward, Message
from fedhet.core.errors import ConfigError
from fedhet.experiment.build import make_algorithm
from fedhet.training.augment import Mixup
from fedhet.training.objective import CrossEntropy, LossTerm, check_terms_take_mixup
from fedhet.training.terms import OffsetCrossEntropy, Proximal

# one sample, two classes, logits (0, ln 3): p = (1/4, 3/4)
LOGITS = torch.tensor([[0.0, math.log(3.0)]])


def mixed_batch(lam: float) -> Batch:
    # own label 0, partner label 1, (lam, 1 - lam) as Mixup records it
    return Batch(torch.zeros(1, 1, 2, 2), torch.tensor([0]), torch.tensor([0]),
                 {"mix_y": torch.tensor([1]), "mix_lam": torch.tensor([lam, 1 - lam], dtype=torch.float64)})


def plain_batch() -> Batch:
    return Batch(torch.zeros(1, 1, 2, 2), torch.tensor([0]), torch.tensor([0]), {})


def forward(logits: torch.Tensor, features: torch.Tensor | None = None) -> Forward:
    return Forward(features if features is not None else torch.zeros(len(logits), 2), logits)


def test_cross_entropy_of_a_mixed_batch_weighs_both_labels_hand_computed():
    # CE(y=0) = -ln(1/4) = ln 4, CE(y=1) = -ln(3/4) = ln(4/3); lam = 0.25
    expected = 0.25 * math.log(4.0) + 0.75 * math.log(4.0 / 3.0)
    value = CrossEntropy()(forward(LOGITS), mixed_batch(0.25), {})
    assert float(value) == pytest.approx(expected, rel=1e-6)
    # an unmixed batch: plain CE of its own label
    assert float(CrossEntropy()(forward(LOGITS), plain_batch(), {})) == pytest.approx(math.log(4.0), rel=1e-6)


def test_offset_cross_entropy_mixes_with_the_offset_applied_to_both_labels_hand_computed():
    # offset (ln 3, 0) makes the logits (ln 3, ln 3): p = (1/2, 1/2), so CE is ln 2 for either label
    term = OffsetCrossEntropy(torch.tensor([math.log(3.0), 0.0]))
    assert float(term(forward(LOGITS), mixed_batch(0.3), {})) == pytest.approx(math.log(2.0), rel=1e-6)
    # offset (0, ln 3): logits (0, 2 ln 3), p = (1/10, 9/10)
    term = OffsetCrossEntropy(torch.tensor([0.0, math.log(3.0)]))
    expected = 0.6 * math.log(10.0) + 0.4 * math.log(10.0 / 9.0)
    assert float(term(forward(LOGITS), mixed_batch(0.6), {})) == pytest.approx(expected, rel=1e-6)


def test_fednh_cosine_cross_entropy_mixes_both_labels_hand_computed():
    # feature (1, 0), prototypes e1 and e2, scale 2: cosine logits (2, 0)
    term = CosineCrossEntropy("w", 2.0)
    weights = {"w": torch.eye(2)}
    out = forward(torch.zeros(1, 2), torch.tensor([[3.0, 0.0]]))
    ce0 = math.log(1 + math.exp(-2.0))          # -ln softmax_0 of (2, 0)
    ce1 = math.log(1 + math.exp(2.0))           # -ln softmax_1
    assert float(term(out, mixed_batch(0.75), weights)) == pytest.approx(0.75 * ce0 + 0.25 * ce1, rel=1e-6)


class FirstLabelOnly(LossTerm):
    """A term written before mixup: reads batch.y as it is."""

    name = "first_label_only"

    def __call__(self, out, batch, weights):
        return F.cross_entropy(out.logits, batch.y)


def test_a_term_that_reads_only_the_first_label_is_refused_under_mixup_and_named():
    terms = [CrossEntropy(), Proximal({"w": torch.zeros(1)}, 0.1), FirstLabelOnly()]
    message = ("mixup (somewhere): the loss terms first_label_only (FirstLabelOnly) do not say they take mixed "
               "batches (LossTerm.takes_mixup); one that reads the labels as they are would learn only the first "
               "image's label of each mixed pair. Turn algorithm.params.mixup off for this method, or read the "
               "labels through fedhet.extend.mixed or label_weights (or none) and set takes_mixup = True")
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        check_terms_take_mixup(terms, Mixup(1.0), "(somewhere)")
    with pytest.raises(ConfigError, match=r"^mixup: the loss terms first_label_only \(FirstLabelOnly\) do not say"):
        check_terms_take_mixup(terms, Mixup(1.0))                 # no place named
    check_terms_take_mixup(terms, None)                       # no mixup: any term
    check_terms_take_mixup(terms[:2], Mixup(1.0))             # both opt in
    with pytest.raises(ConfigError, match=r"^mixup: the loss terms first_label_only \(FirstLabelOnly\), "
                                         r"first_label_only \(FirstLabelOnly\) do not say"):
        check_terms_take_mixup([*terms, FirstLabelOnly()], Mixup(1.0))   # two refused: each named, comma-separated


def test_fedavg_with_mixup_trains_on_mixed_batches_the_way_train_local_does(small_config):
    """The reply of a FedAvg client with mixup is local training with the Mixup augmentation on
    cross-entropy, nothing else: the same weights as that call made by hand, and not the unmixed ones."""
    cfg = config(small_config, "fedavg", {"mixup": True, "mixup_alpha": 0.4})
    loop = build_loop(cfg)
    weights = loop.server_state["model"]
    reply, _ = loop.algorithm.client_update(Message("train", {"model": weights}), None, runtime(loop, 0))
    by_hand = runtime(loop, 0).train(weights, [CrossEntropy()], augment=Mixup(0.4))
    unmixed = runtime(loop, 0).train(weights, [CrossEntropy()])
    for name, tensor in by_hand.weights.items():
        assert torch.equal(reply.arrays["model"][name], tensor), name
    assert any(not torch.equal(reply.arrays["model"][k], v) for k, v in unmixed.weights.items())


class WithAFirstLabelTerm(FedAvg):
    """A method of one's own adding a term that reads the labels as they are."""

    name = "with_a_first_label_term"

    def local_terms(self, msg, state, client):
        return [*super().local_terms(msg, state, client), FirstLabelOnly()]


def test_a_method_whose_term_reads_only_the_first_label_stops_at_its_first_client(small_config):
    loop = build_loop(config(small_config, "fedavg"))
    algorithm = WithAFirstLabelTerm(WithAFirstLabelTerm.Params(mixup=True))
    with pytest.raises(ConfigError, match=r"mixup \(in round 1, client 0, algorithm fedavg\): the loss terms "
                                         r"first_label_only \(FirstLabelOnly\) do not say"):
        algorithm.client_update(Message("train", {"model": loop.server_state["model"]}), None, runtime(loop, 0))


def test_per_fedavg_with_mixup_is_refused_when_made(small_config):
    message = ("algorithm.params.mixup: perfedavg cannot train with mixup (a loss term of its own reads the labels "
               "as they are, or its local steps take no augmentation); turn mixup off for it")
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        make_algorithm(config(small_config, "perfedavg", {"mixup": True}))


# What each registered method does with mixup on over two rounds (the second is where the methods that
# receive prototypes or anchors first build their terms): refused when made, or trained on mixed batches.
REFUSED_WHEN_MADE = {"perfedavg", "fedntd", "fedrs", "fedcme", "fedfm", "fedfm_lite", "fedpac", "fedproto",
                     "fedclassavg", "feddistill", "ktpfl", "ktpfl_weight", "local"}     # the last five have no such parameter


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_method_either_refuses_mixup_when_made_or_trains_every_client_on_mixed_batches(small_config, name,
                                                                                              monkeypatch):
    raw = copy.deepcopy(small_config)
    raw["model"] = {"arch": "simple_cnn"}                        # FedNH's bias-free head; every method runs on it
    raw["data"]["pool_fraction"] = 0.25                          # clients of about 50 images, batches of 16
    # FedRep's default 10 head-only epochs a round would only repeat what one shows
    params = {"mixup": True, **({"rep_head_epochs": 1} if name == "fedrep" else {})}
    cfg = config(raw, name, params, rounds=2, clients_per_round=2, batch_size=16)
    if name in REFUSED_WHEN_MADE:
        with pytest.raises(ConfigError, match="algorithm.params.mixup"):
            make_algorithm(cfg)
        return
    mixed_batches = []
    real_apply = Mixup.apply
    monkeypatch.setattr(Mixup, "apply", lambda self, b, d: mixed_batches.append(len(b.y)) or real_apply(self, b, d))
    loop = build_loop(cfg)
    for rnd in range(2):
        result = loop.run_round(rnd)
        assert sum(mixed_batches) >= result.samples > 0, (rnd, sum(mixed_batches), result.samples)
        mixed_batches.clear()


def test_fedrema_with_feature_alignment_refuses_mixup_when_made(small_config):
    # its prototype term first appears in round 2: refused before round 1 instead
    with pytest.raises(ConfigError, match="algorithm.params.mixup: fedrema cannot train with mixup"):
        make_algorithm(config(small_config, "fedrema", {"mixup": True, "feature_alignment": True}))
    assert make_algorithm(config(small_config, "fedrema", {"mixup": True})).params.mixup


class SkipsTrainOptions(FedAvg):
    """A method of one's own whose local training forgets train_options."""

    name = "skips_train_options"

    def local_training(self, weights, msg, state, client):
        return client.train(weights, [CrossEntropy()])


class PersonalSkipsTrainOptions(FedPer):
    """The same on FedPer, which starts from its own head and sends back only the body."""

    name = "personal_skips_train_options"

    def local_training(self, weights, msg, state, client):
        return client.train(weights, [CrossEntropy()])


@pytest.mark.parametrize("method", [SkipsTrainOptions, PersonalSkipsTrainOptions])
def test_a_method_of_ones_own_that_drops_train_options_is_refused_not_run_without_mixup(small_config, method):
    cfg = config(small_config, "fedavg")
    loop = build_loop(cfg)
    algorithm = method(method.Params(mixup=True))
    with pytest.raises(ConfigError, match=f"{method.name}'s local training does not pass its train_options"):
        algorithm.client_update(Message("train", {"model": loop.server_state["model"]}), None, runtime(loop, 0))


@pytest.mark.parametrize(("name", "default"), [("fedprox+fedacd", True), ("fedacd+fedprox", True),
                                               ("fedprox+scaffold", False)])
def test_a_combination_keeps_the_mixup_default_of_the_component_that_changes_it(name, default):
    from fedhet.algorithms import algorithm_class

    params = algorithm_class(name).Params()
    assert params.mixup is default
    assert type(params)(mixup=not default).mixup is (not default)      # still settable
