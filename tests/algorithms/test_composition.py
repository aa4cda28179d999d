"""Composition (``fedprox+scaffold``): a combination in which one method's hook would cut off another's
is refused, naming the hook and both methods; everything else composes."""

from __future__ import annotations

import copy
import itertools
import re

import pytest
import torch
from helpers import build_loop, config, runtime

from fedhet.algorithms import ALGORITHMS, algorithm_class, compose
from fedhet.algorithms.fedavg import FedAvg
from fedhet.algorithms.perfedavg import PerFedAvg
from fedhet.core.contract import Message
from fedhet.core.errors import ConfigError
from fedhet.core.split import is_head
from fedhet.training.objective import LossTerm


class Named(LossTerm):
    def __init__(self, name):
        self.name = name


class Replacing(FedAvg):
    """local_terms without super(): what comes after it in a combination is cut off."""
    name = "replacing"

    def local_terms(self, msg, state, client):
        return [Named("replacing")]


class Chaining(FedAvg):
    name = "chaining"

    def local_terms(self, msg, state, client):
        return [*super().local_terms(msg, state, client), Named("chaining")]


class OwnLoop(FedAvg):
    """A client_update that trains without local_training."""
    name = "own_loop"

    def client_update(self, msg, state, client):
        return msg, state


class OwnTraining(FedAvg):
    name = "own_training"

    def local_training(self, weights, msg, state, client):
        return super().local_training(weights, msg, state, client)


def test_a_hook_without_super_may_not_cut_off_a_hook_named_after_it():
    with pytest.raises(ConfigError, match=r"cannot combine replacing\+chaining: replacing's local_terms does not "
                                          r"call super\(\).local_terms, so chaining's local_terms would never run; "
                                          r"name chaining first \(its local_terms calls super\(\)\)"):
        compose([Replacing, Chaining])
    both = compose([Chaining, Replacing])()          # the order the message names: both parts run
    assert [t.name for t in both.local_terms(None, None, None)] == ["replacing", "chaining"]


class ChainingThroughHelper(FedAvg):
    """local_terms that reaches super() through a helper of its own, which may call it by name."""
    name = "chaining_helper"

    def local_terms(self, msg, state, client):
        return self._with_mine(msg, state, client)

    def _with_mine(self, msg, state, client):
        return [*super().local_terms(msg, state, client), Named("chaining_helper")]


def test_a_hook_that_calls_super_through_its_own_helper_chains():
    both = compose([ChainingThroughHelper, Chaining])()
    assert [t.name for t in both.local_terms(None, None, None)] == ["chaining", "chaining_helper"]
    with pytest.raises(ConfigError, match="replacing's local_terms does not call super"):   # a helper not calling it
        compose([Replacing, ChainingThroughHelper])


def test_a_client_update_that_never_calls_local_training_cuts_off_every_local_training():
    for classes in ([OwnLoop, OwnTraining], [OwnTraining, OwnLoop]):
        with pytest.raises(ConfigError, match="own_loop's client_update does not call local_training as FedAvg's "
                                              "does, so own_training's local_training would never run"):
            compose(classes)


class OwnUpload(FedAvg):
    name = "own_upload"

    def uploaded_model(self, weights):
        return weights


class Weighing(FedAvg):
    name = "weighing"

    def aggregation_weights(self, replies, cids):
        return [1.0] * len(cids)


class HelperLoop(FedAvg):
    """A client_update that uploads through a helper of its own, as FedCME's ``final_update`` does."""
    name = "helper_loop"

    def client_update(self, msg, state, client):
        return self.finish(self.local_training(msg.arrays["model"], msg, state, client)), state

    def finish(self, result):
        return self.uploaded_model(result.weights)


class OwnAggregate(FedAvg):
    name = "own_aggregate"

    def aggregate(self, state, replies, ctx):
        return state


def test_a_replacing_hook_must_call_every_hook_fedavgs_calls_that_another_method_defines():
    """FedAvg's client_update calls uploaded_model (FedPer: the body only) and its aggregate calls
    aggregation_weights (FedACD: the scores): a replacement that skips one cuts off that part."""
    with pytest.raises(ConfigError, match="own_loop's client_update does not call uploaded_model as FedAvg's does, "
                                          "so own_upload's uploaded_model would never run"):
        compose([OwnLoop, OwnUpload])
    with pytest.raises(ConfigError, match=r"own_aggregate's aggregate does not call average_models \(which calls "
                                          r"aggregation_weights\) as FedAvg's does, so weighing's aggregation_weights "
                                          "would never run"):
        compose([OwnAggregate, Weighing])
    compose([HelperLoop, OwnUpload])             # called through its own helper: both parts run
    # without local_training, FedAvg's local_training's own callees (local_terms) never run either
    with pytest.raises(ConfigError, match="own_loop's client_update does not call local_training \\(which calls "
                                          "local_terms\\) as FedAvg's does, so chaining's local_terms would never run"):
        compose([OwnLoop, Chaining])
    compose([HelperLoop, Chaining])              # HelperLoop trains through local_training: local_terms runs


def test_a_replaced_client_model_need_not_call_global_model_which_evaluation_calls_itself():
    class GlobalOwn(FedAvg):
        name = "global_own"
        reads_no_global_model = True       # so that it combines with FedProto, which sends none

        def global_model(self, state):
            return super().global_model(state)

    for other in ("fedproto", "fedrema", "fedper"):
        compose([GlobalOwn, ALGORITHMS[other]])          # the order the first rule asks for


# (FedProto's pairs with MOON, FedDyn and FedNova, which these rules refused, are refused before them now:
# FedProto sends no global model, test_fedproto_combines_only_with_methods_that_read_no_global_model)
@pytest.mark.parametrize("name, message", [
    ("perfedavg+fedper", "perfedavg's client_update does not call start_weights as FedAvg's does, so fedper's "
                         "start_weights would never run"),
    ("fednova+fedrema", "fedrema's aggregate does not call average_models as FedAvg's does, so fednova's "
                        "average_models would never run")])
def test_built_in_pairs_that_would_drop_a_part_are_refused(name, message):
    with pytest.raises(ConfigError, match=f"cannot combine {name.replace('+', r'[+]')}: {message}"):
        algorithm_class(name)


def test_creff_composes_in_either_order_now_that_its_evaluation_is_fedavgs():
    for pair in ("creff+fedrod", "fedrod+creff", "creff+perfedavg", "creff+fedbabu"):
        assert algorithm_class(pair).name == pair


def test_fedper_averages_the_bodies_with_fedacds_scores():
    """fedacd+fedper: FedPer's body average takes FedACD's aggregation weights (the scores 1 and 3),
    not the sample sizes (equal here): body = (1 * 0 + 3 * 4) / 4 = 3; the server's head stays."""
    algo = algorithm_class("fedacd+fedper")(algorithm_class("fedacd+fedper").Params())
    replies = {c: Message("update", {"model": {"body.w": torch.full((2,), value)}},
                          {"num_samples": 10, "score": score, "kl": 0.0})
               for c, (value, score) in enumerate([(0.0, 1.0), (4.0, 3.0)])}
    state = algo.aggregate({"model": {"body.w": torch.zeros(2), "head.w": torch.ones(2)}}, replies, None)
    torch.testing.assert_close(state["model"]["body.w"], torch.full((2,), 3.0))
    torch.testing.assert_close(state["model"]["head.w"], torch.ones(2))


def test_fedfm_lite_with_fedper_trains_from_the_clients_own_head_and_uploads_the_body(small_config):
    """FedPer's start_weights (received body + the client's own head) and uploaded_model (the body)
    run inside FedFM-Lite's client_update."""
    raw = copy.deepcopy(small_config)
    loop = build_loop(config(raw, "fedfm_lite+fedper", {"start_round": 0}))
    algo, client = loop.algorithm, runtime(loop, 0)
    w = loop.server_state["model"]
    own_head = {k: v + 1.0 for k, v in w.items() if is_head(k)}
    started = []
    train = algo.local_training
    algo.local_training = lambda weights, msg, state, client: started.append(weights) or train(weights, msg, state,
                                                                                                 client)
    msg = Message("train", {"model": {k: v for k, v in w.items() if not is_head(k)}},
                  {"upload_model": True, "upload_anchors": True})
    reply, after = algo.client_update(msg, {"head": own_head}, client)
    assert all(torch.equal(started[0][k], own_head[k]) for k in own_head)
    assert set(reply.arrays["model"]) == {k for k in w if not is_head(k)} and "anchors" in reply.arrays
    assert set(after["head"]) == set(own_head) and not torch.equal(after["head"][next(iter(own_head))],
                                                                   own_head[next(iter(own_head))])


def test_a_hook_whose_source_cannot_be_read_counts_as_replacing():
    namespace: dict = {}
    exec("def local_terms(self, msg, state, client):\n    return []", namespace)   # no source file
    opaque = type("Opaque", (FedAvg,), {"name": "opaque", "local_terms": namespace["local_terms"]})
    with pytest.raises(ConfigError, match=r"opaque's local_terms has no source to read \(counted as not calling "
                                          r"super\(\).local_terms\), so chaining's local_terms would never run"):
        compose([opaque, Chaining])


def test_methods_that_disagree_on_where_the_head_lives_are_refused(small_config):
    """FedNH's clients train against the server's prototypes, FedPer's, FedRep's, FedPAC's and FedBABU's
    with a head of their own: fednh+fedrep used to train every body against the initial head while the
    server smoothed prototypes no client used. CReFF's server re-trains the averaged model's head, which
    FedNH and FedBABU put back only after the methods named after them: named after them it stopped
    with no head to read after the first round's training."""
    for other in ("fedper", "fedrep", "fedpac", "fedbabu"):
        for name in (f"fednh+{other}", f"{other}+fednh"):
            with pytest.raises(ConfigError, match=rf"cannot combine {re.escape(name)}: fednh's clients train against "
                                                  rf"the head the server keeps, and {other}'s clients train with a "
                                                  "head of their own"):
                algorithm_class(name)
    for other in ("fednh", "fedbabu"):
        with pytest.raises(ConfigError, match=rf"creff's aggregate reads the averaged model's head, which {other}'s "
                                              "clients do not upload.*name creff first"):
            algorithm_class(f"{other}+creff")
    # the order that works reads the head FedBABU put back
    raw = copy.deepcopy(small_config)
    raw["model"] = {"arch": "simple_cnn"}
    loop = build_loop(config(raw, "creff+fedbabu", {"creff_features": 4, "creff_match_iters": 2, "creff_crt_epochs": 1}))
    before = {k: v.clone() for k, v in loop.server_state["creff_head"].items()}
    loop.run_round(0)
    assert any(not torch.equal(v, before[k]) for k, v in loop.server_state["creff_head"].items())


def test_fedbabu_passes_another_methods_phase_on_and_keeps_its_head(small_config):
    """fedbabu+fedfm: FedFM's anchor phase uploads anchors and no model (FedBABU stopped with a KeyError
    on 'model' trimming it); the training phase's upload is still the shared part only."""
    loop = build_loop(config(copy.deepcopy(small_config), "fedbabu+fedfm", {"start_round": 0}))
    init = {k: v.clone() for k, v in loop.server_state["model"].items()}
    result = loop.run_round(0)
    assert result.phases == 2
    for k, v in loop.server_state["model"].items():
        assert torch.equal(v, init[k]) == is_head(k), k                 # the head stays, the body moved


def test_a_method_that_evaluates_a_model_of_its_own_comes_after_those_that_change_the_evaluated_model():
    """Per-FedAvg's client_model returns its adapted model as it is (FedBABU's its fine-tuned one):
    perfedavg+fedrod evaluated without FedROD's personal head. FedROD first adds it to the adapted
    model; two such methods never combine."""
    for first in ("perfedavg", "fedbabu"):
        with pytest.raises(ConfigError, match=rf"cannot combine {first}\+fedrod: {first}'s client_model evaluates a "
                                              "model of its own making as it is, so fedrod's client_model would "
                                              "never change it; name fedrod first"):
            algorithm_class(f"{first}+fedrod")
        assert algorithm_class(f"fedrod+{first}").name == f"fedrod+{first}"
    for name in ("fedbabu+perfedavg", "fedbabu+fedper"):
        with pytest.raises(ConfigError, match="run them apart \\(no order combines them\\)"):
            algorithm_class(name)
    # the other order is refused for a hook Per-FedAvg's client_update skips, and names no order: none works
    with pytest.raises(ConfigError, match="fedbabu's client_update would never run$"):
        algorithm_class("perfedavg+fedbabu")


def test_fedcme_whose_training_spans_two_messages_is_refused_beside_scaffold_and_fednova():
    """SCAFFOLD's control variate and FedNova's a_i read the training of one message; FedCME trains
    before and after its exchange (they stopped with a KeyError on 'control' and 'a_i')."""
    for other in ("scaffold", "fednova"):
        for name in (f"fedcme+{other}", f"{other}+fedcme"):
            with pytest.raises(ConfigError, match=rf"cannot combine {re.escape(name)}: fedcme's local training runs "
                                                  rf"over two messages, and {other}'s client rule reads the training "
                                                  "of one; run them apart"):
                algorithm_class(name)
    assert algorithm_class("feddyn+fedcme").name == "feddyn+fedcme"


def test_fedproto_combines_only_with_methods_that_read_no_global_model():
    """FedProto's clients receive prototypes, no model: FedProx's anchor, FedNTD's teacher, FedAvgM's and
    FedBABU's server state and FedFM's anchors all read one (they stopped with a KeyError on 'model')."""
    for other in ("fedprox", "fedntd", "fedavgm", "fedbabu", "fedfm", "scaffold", "moon"):
        for name in (f"fedproto+{other}", f"{other}+fedproto"):
            with pytest.raises(ConfigError, match=rf"cannot combine {re.escape(name)}: fedproto's clients receive no "
                                                  rf"global model, and {other} reads.*read none \(feddecorr, fedlc, "
                                                  r"fedrs, or one of your own"):
                algorithm_class(name)
    for other in ("fedlc", "fedrs", "feddecorr"):
        assert algorithm_class(f"fedproto+{other}").name == f"fedproto+{other}"


def test_naming_a_method_twice_or_with_its_own_variant_is_refused():
    with pytest.raises(ConfigError, match=r"cannot combine fedprox\+fedprox: it names fedprox twice"):
        algorithm_class("fedprox+fedprox")
    with pytest.raises(ConfigError, match="fedfm_lite is built on fedfm already; name only fedfm_lite"):
        algorithm_class("fedfm+fedfm_lite")


def test_a_method_without_parameters_of_its_own_composes():
    # FedROD's Params is FedAvg's: a base of FedProx's, which pydantic could not merge as two bases
    for name in ("fedrod+fedprox", "fedprox+fedrod"):
        cls = algorithm_class(name)
        assert cls.Params().mu == pytest.approx(ALGORITHMS["fedprox"].Params().mu)


def test_every_pair_of_built_in_methods_composes_or_is_refused_with_a_config_error():
    family = [cls for name, cls in ALGORITHMS.items() if issubclass(cls, FedAvg) and name != "fedavg"]
    refused = 0
    for first, second in itertools.permutations(family, 2):
        try:
            compose([first, second])
        except ConfigError as e:
            refused += 1
            assert str(e).startswith(f"cannot combine {first.name}+{second.name}: "), str(e)
    assert 0 < refused < len(family) * (len(family) - 1)
    for name in ("fedprox+scaffold", "fedprox+fedfm", "moon+fedfm", "fedfm+fednova", "fedfm+fedpac",
                 "fednh+perfedavg", "scaffold+perfedavg", "fedacd+scaffold", "scaffold+fedacd"):
        assert algorithm_class(name).name == name
    # FedNH trims its upload in client_update, which Per-FedAvg's own does not pass on
    with pytest.raises(ConfigError, match="perfedavg's client_update does not call super.*name fednh first"):
        algorithm_class("perfedavg+fednh")


def test_perfedavg_refuses_a_train_option_its_meta_steps_would_drop():
    class WantsStatistics(FedAvg):
        name = "wants_statistics"

        def train_options(self, msg, state, client):
            return {**super().train_options(msg, state, client), "statistics": {}}

    algo = compose([WantsStatistics, PerFedAvg])()
    with pytest.raises(ValueError, match="wants_statistics\\+perfedavg: Per-FedAvg's meta steps take no train "
                                         "option but trainable, and a combined method asks for statistics"):
        algo.meta_train_restriction(None, None, None)
    assert compose([ALGORITHMS["fednh"], PerFedAvg])().meta_train_restriction(None, None, None)("body.fc1.weight")


def test_a_combinations_round_metrics_hold_every_components_values(small_config):
    """FedACD's, FedCME's and FedReMa's round_metrics call super(): named first, they keep SCAFFOLD's."""
    loop = build_loop(config(copy.deepcopy(small_config), "fedacd+scaffold"))
    loop.run_round(0)
    values = loop.algorithm.round_metrics(loop.server_state)
    assert "scaffold_control_norm" in values and "fedacd_kl_mean" in values, sorted(values)
