"""The algorithm contract, checked on hand-computed cases without any engine."""

import warnings

import numpy as np
import pydantic
import pytest
import torch

from fedhet.algorithms.aggregate import weighted_average
from fedhet.algorithms.fedavg import FedAvg
from fedhet.core.contract import LocalResult, Message, RoundContext
from fedhet.core.errors import ConfigError
from fedhet.engine.ledger import CommLedger
from fedhet.metrics.evaluate import labeldist_accuracy


def ctx(clients):
    return RoundContext(round=0, clients=clients, num_clients=5, num_classes=2,
                        client_sizes={c: 1 for c in range(5)}, rng=np.random.default_rng(0))


def test_weighted_average_hand_computed():
    a = {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(2)}
    b = {"w": torch.tensor([3.0, 6.0]), "n": torch.tensor(5)}
    out = weighted_average([a, b], [1, 3])
    # (1*[1,2] + 3*[3,6]) / 4 = [2.5, 5.0]; integer buffer: (2 + 15)/4 = 4.25 -> 4
    assert torch.equal(out["w"], torch.tensor([2.5, 5.0]))
    assert out["n"].dtype == torch.int64 and int(out["n"]) == 4


def test_weighted_average_rejects_bad_weights():
    with pytest.raises(ValueError, match="must be non-negative with a positive sum"):
        weighted_average([{"w": torch.zeros(1)}], [0])
    with pytest.raises(ValueError, match="must be non-negative with a positive sum"):
        weighted_average([{"w": torch.zeros(1)}, {"w": torch.ones(1)}], [2.0, -1.0])


def test_fedavg_round_is_sample_size_weighted():
    """Drive FedAvg's server generator by hand: one phase, replies weighted by num_samples."""
    algo = FedAvg()
    state = algo.init_server_state({"cnn": {"w": torch.tensor([0.0]), "running_mean": torch.tensor([0.0])}})
    gen = algo.round(state, ctx([4, 1]))
    phase = next(gen)
    assert set(phase) == {4, 1}
    assert all(m.kind == "train" and m.arrays["model"] is state["model"] for m in phase.values())
    replies = {
        4: Message("update", {"model": {"w": torch.tensor([1.0]), "running_mean": torch.tensor([10.0])}}, {"num_samples": 100}),
        1: Message("update", {"model": {"w": torch.tensor([5.0]), "running_mean": torch.tensor([30.0])}}, {"num_samples": 300}),
    }
    with pytest.raises(StopIteration) as stop:
        gen.send(replies)
    new = stop.value.value
    assert torch.equal(new["model"]["w"], torch.tensor([4.0]))            # (100*1 + 300*5)/400
    assert torch.equal(new["model"]["running_mean"], torch.tensor([25.0]))  # BN stats averaged like weights
    assert algo.global_model(new) is new["model"]


def test_fedavg_round_with_a_dropped_client_averages_the_answers_only():
    algo = FedAvg()
    state = algo.init_server_state({"cnn": {"w": torch.tensor([0.0])}})
    gen = algo.round(state, ctx([0, 1, 2]))
    next(gen)
    with pytest.raises(StopIteration) as stop:
        gen.send({2: Message("update", {"model": {"w": torch.tensor([7.0])}}, {"num_samples": 3})})
    assert torch.equal(stop.value.value["model"]["w"], torch.tensor([7.0]))


class FakeClient:
    """A ClientRuntime whose training adds 1 to every tensor (so buffer handling is visible)."""

    cid, round, arch, num_classes, num_samples = 0, 0, "cnn", 2, 10
    buffer_names = ["bn.running_mean"]

    def train(self, weights, terms=None, **kw):
        return LocalResult({k: v + 1 for k, v in weights.items()}, {}, 1, 10, 0.0)


def test_bn_policy_local_keeps_client_statistics():
    algo = FedAvg(FedAvg.Params(bn_buffers="local"))
    msg = Message("train", {"model": {"w": torch.tensor([0.0]), "bn.running_mean": torch.tensor([100.0])}})
    reply, state = algo.client_update(msg, None, FakeClient())
    assert torch.equal(state["buffers"]["bn.running_mean"], torch.tensor([101.0]))
    # Next round the client trains from the global weights but ITS OWN statistics.
    reply, state = algo.client_update(msg, state, FakeClient())
    assert torch.equal(reply.arrays["model"]["w"], torch.tensor([1.0]))
    assert torch.equal(reply.arrays["model"]["bn.running_mean"], torch.tensor([102.0]))
    server = {"model": {"w": torch.tensor([0.5]), "bn.running_mean": torch.tensor([7.0])}}
    own = algo.client_model(0, server, state)
    assert torch.equal(own["bn.running_mean"], torch.tensor([102.0])) and torch.equal(own["w"], torch.tensor([0.5]))


def test_bn_policy_average_keeps_no_client_state():
    algo = FedAvg()
    msg = Message("train", {"model": {"w": torch.tensor([0.0]), "bn.running_mean": torch.tensor([100.0])}})
    reply, state = algo.client_update(msg, None, FakeClient())
    assert state is None
    assert torch.equal(reply.arrays["model"]["bn.running_mean"], torch.tensor([101.0]))
    assert reply.scalars["num_samples"] == 10


def test_fedavg_rejects_mixed_architectures():
    with pytest.raises(ValueError, match="same architecture"):
        FedAvg().init_server_state({"a": {}, "b": {}})


def test_ledger_counts_floats_and_bytes_by_direction_and_group():
    ledger = CommLedger()
    msg = Message("train", {"model": {"w": torch.zeros(3, 4), "b": torch.zeros(2, dtype=torch.float64)},
                            "anchors": {"a": torch.zeros(5)}})
    ledger.record(0, "down", msg)
    ledger.record(0, "up", Message("update", {"model": {"w": torch.zeros(3, 4)}}))
    r = ledger.take_round(0)
    assert r["down/model"] == {"floats": 14, "bytes": 12 * 4 + 2 * 8}
    assert r["down/anchors"] == {"floats": 5, "bytes": 20}
    assert ledger.totals()["up"] == {"floats": 12, "bytes": 48}
    assert ledger.take_round(0) == {} and ledger.totals()["up"]["floats"] == 12
    clone = CommLedger()
    clone.load_state_dict(ledger.state_dict())
    assert clone.totals() == ledger.totals()
    assert "evaluation" not in ledger.totals()
    # evaluation-only traffic (FedBABU's fine-tuning sends eval_model) is listed, and summed apart
    ledger.record(1, "down", Message("finetune", {"eval_model": {"w": torch.zeros(3, 4)}}))
    totals = ledger.totals()
    assert totals["down/eval_model"] == totals["evaluation"] == {"floats": 12, "bytes": 48}
    assert totals["down"] == {"floats": 19, "bytes": 12 * 4 + 2 * 8 + 20}


def test_labeldist_accuracy_hand_computed():
    counts = np.array([[10, 0], [5, 5]])        # client 0 only has class 0; client 1 balanced
    correct, total = np.array([8, 1]), np.array([10, 10])
    acc = labeldist_accuracy(counts, correct, total)
    assert acc == pytest.approx([0.8, 0.45])
    # a test set without class 1 (held-out writers'): client 2, of class 1 only, has no accuracy;
    # client 1 is judged on class 0 alone
    with warnings.catch_warnings():
        warnings.simplefilter("error")                 # no division by zero on the way
        acc = labeldist_accuracy(np.array([[10, 0], [5, 5], [0, 4]]), np.array([8, 0]), np.array([10, 0]))
    assert acc[:2] == pytest.approx([0.8, 0.8]) and np.isnan(acc[2])


def test_composed_methods_chain_their_terms_and_merge_params():
    from fedhet.algorithms import algorithm_class, compose
    from fedhet.training.objective import LossTerm

    class TermA(LossTerm):
        name = "a"

    class TermB(LossTerm):
        name = "b"

    class A(FedAvg):
        name = "a"

        class Params(FedAvg.Params):
            alpha: float = 1.0

        def local_terms(self, msg, state, client):
            return [*super().local_terms(msg, state, client), TermA()]

    class B(FedAvg):
        name = "b"

        class Params(FedAvg.Params):
            beta: float = 2.0

        def local_terms(self, msg, state, client):
            return [*super().local_terms(msg, state, client), TermB()]

    AB = compose([A, B])
    algo = AB(AB.Params(alpha=3.0))
    assert AB.name == "a+b" and algo.params.alpha == 3.0 and algo.params.beta == 2.0
    assert [t.name for t in algo.local_terms(None, None, None)] == ["b", "a"]
    with pytest.raises(pydantic.ValidationError, match="gamma"):
        AB.Params(gamma=1)
    with pytest.raises(ConfigError, match="unknown algorithm 'nope'"):
        algorithm_class("fedavg+nope")


def test_composition_refuses_clashing_parameter_names():
    from fedhet.algorithms import algorithm_class

    with pytest.raises(ConfigError, match="both fedprox and moon have a parameter 'mu'"):
        algorithm_class("fedprox+moon")
    assert algorithm_class("fedprox+scaffold").name == "fedprox+scaffold"


def test_to_device_moves_every_tensor_and_keeps_what_is_already_there():
    """Through messages, dicts, lists, tuples and namedtuples; on the CPU the very same objects come
    back (the client host calls it for every job, so a CPU run must not copy anything); moved to
    another device ('meta' stands in for a GPU here) every tensor is there, containers are rebuilt
    and values that are not tensors are kept as they are."""
    from collections import namedtuple

    from fedhet.core.contract import to_device

    Pair = namedtuple("Pair", "a b")
    t = torch.ones(3)
    obj = {"msg": Message("train", {"model": {"w": t}}, {"lr": 0.1, "mask": torch.zeros(2)}),
           "list": [t, 1, "x"], "tuple": (t, None), "pair": Pair(t, 2.0), "n": 5}
    same = to_device(obj, "cpu")
    assert same is obj and same["msg"] is obj["msg"] and same["pair"] is obj["pair"]

    moved = to_device(obj, "meta")
    assert moved["msg"] is not obj["msg"] and moved["msg"].kind == "train"
    assert moved["msg"].arrays["model"]["w"].device.type == "meta"
    assert moved["msg"].scalars["lr"] == 0.1 and moved["msg"].scalars["mask"].device.type == "meta"
    assert moved["list"][0].device.type == "meta" and moved["list"][1:] == [1, "x"]
    assert moved["tuple"][0].device.type == "meta" and moved["tuple"][1] is None
    assert isinstance(moved["pair"], Pair) and moved["pair"].a.device.type == "meta" and moved["pair"].b == 2.0
    assert moved["n"] == 5
    assert obj["msg"].arrays["model"]["w"].device.type == "cpu"     # the original is untouched
