"""KT-pFL +weight (fedhet.algorithms.ktpfl_weight): the weight-space transfer of FedClassAvg's
Table 3 against hand computations, the server's round on hand-made replies, and short runs."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import build_loop, config, ctx, runtime

import fedhet
from fedhet.algorithms.ktpfl_weight import (
    KTpFLWeight,
    coefficient_gradient,
    coefficient_losses,
    pull_towards,
    stacked,
    weight_targets,
)
from fedhet.core.contract import Message
from fedhet.core.errors import ConfigError


def test_targets_are_the_coefficient_mixture_of_every_clients_copy():
    copies = [{"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([[4.0]])},
              {"a": torch.tensor([3.0, 0.0]), "b": torch.tensor([[8.0]])},
              {"a": torch.tensor([5.0, 6.0]), "b": torch.tensor([[0.0]])}]
    coef = torch.tensor([[0.5, 0.25, 0.25], [0.0, 1.0, 0.0]], dtype=torch.float64)
    t = weight_targets(coef, stacked(copies, ["a", "b"]), {"a": torch.Size([2]), "b": torch.Size([1, 1])})
    # row 0: a = 0.5*[1, 2] + 0.25*[3, 0] + 0.25*[5, 6] = [2.5, 2.5]; b = 0.5*4 + 0.25*8 = 4
    torch.testing.assert_close(t[0]["a"], torch.tensor([2.5, 2.5]))
    torch.testing.assert_close(t[0]["b"], torch.tensor([[4.0]]))
    torch.testing.assert_close(t[1]["a"], copies[1]["a"])
    assert t[0]["a"].dtype == torch.float32 and t[0]["b"].shape == (1, 1)


def test_the_pull_is_plain_gradient_descent_on_the_codes_summed_parameter_mse():
    """KTpFL_homo.py distils by SGD steps on sum over parameters of MSELoss(param, target): the
    closed form must equal those steps; buffers (not parameters) stay as they are."""
    g = torch.Generator().manual_seed(0)
    weights = {"w": torch.randn(3, 4, generator=g), "b": torch.randn(5, generator=g), "buf": torch.randn(2, generator=g)}
    target = {k: torch.randn(v.shape, generator=g) for k, v in weights.items()}
    lr, steps = 0.3, 4
    params = {k: weights[k].clone().requires_grad_(True) for k in ("w", "b")}
    opt = torch.optim.SGD(params.values(), lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        sum(F.mse_loss(p, target[k]) for k, p in params.items()).backward()
        opt.step()
    pulled = pull_towards(weights, target, ["w", "b"], lr, steps)
    for k in ("w", "b"):
        torch.testing.assert_close(pulled[k], params[k].detach())
    assert torch.equal(pulled["buf"], weights["buf"])
    # one step moves a 5-entry tensor by 2 * 0.3 / 5 = 12% of its distance to the target
    one = pull_towards(weights, target, ["b"], lr, 1)
    torch.testing.assert_close(one["b"] - weights["b"], 0.12 * (target["b"] - weights["b"]))


def test_the_coefficient_gradient_by_hand_and_as_the_losses_gradient():
    # two clients, one scalar parameter: start copies 1 and 3, weights after the round 2 and 3
    start = [{"x": torch.tensor([1.0])}, {"x": torch.tensor([3.0])}]
    after = [{"x": torch.tensor([2.0])}, {"x": torch.tensor([3.0])}]
    coef = torch.tensor([[1.0, 0.0], [0.5, 0.5]], dtype=torch.float64)
    grad = coefficient_gradient(coef, stacked(after, ["x"]), stacked(start, ["x"]), rho=0.6)
    # row 0: t = 1, r = 1, fit gradient -2 r s_j = [-2, -6]; penalty 2 rho (c - 1/2) / 2 = [0.3, -0.3]
    # row 1: t = 2, r = 1, fit gradient [-2, -6]; penalty 0
    torch.testing.assert_close(grad, torch.tensor([[-1.7, -6.3], [-2.0, -6.0]], dtype=torch.float64))

    g = torch.Generator().manual_seed(1)
    start = [{"w": torch.randn(2, 3, generator=g), "b": torch.randn(4, generator=g)} for _ in range(3)]
    after = [{k: v + 0.1 * torch.randn(v.shape, generator=g) for k, v in w.items()} for w in start]
    coef = torch.rand(3, 3, generator=g, dtype=torch.float64).requires_grad_(True)
    coefficient_losses(coef, after, start, ["w", "b"], rho=0.7).sum().backward()
    torch.testing.assert_close(coefficient_gradient(coef.detach(), stacked(after, ["w", "b"]), stacked(start, ["w", "b"]),
                                                    rho=0.7), coef.grad,
                               rtol=1e-5, atol=1e-6)       # float32 products in the written-out form


def test_a_round_sends_each_sampled_client_its_mixture_and_steps_every_row_with_the_round_start_copies():
    alg = KTpFLWeight(KTpFLWeight.Params(rho=0.6, c_lr=0.5))
    init = {"w": torch.tensor([1.0, 2.0]), "bn.running_mean": torch.tensor([0.0])}
    state = alg.init_server_state({"cnn2": init})
    gen = alg.round(state, ctx([0, 2], num_clients=3))
    msgs = next(gen)
    assert sorted(msgs) == [0, 2]
    for m in msgs.values():                    # uniform rows over three initialisations: the initialisation
        torch.testing.assert_close(m.arrays["target"]["w"], init["w"])
    uploads = {0: {"w": torch.tensor([3.0, 2.0])}, 2: {"w": torch.tensor([1.0, 5.0])}}
    with pytest.raises(StopIteration) as stop:
        gen.send({c: Message("update", {"model": w}, {"num_samples": 10}) for c, w in uploads.items()})
    new = stop.value.value
    start = [{"w": init["w"]}] * 3
    after = [uploads[0], {"w": init["w"]}, uploads[2]]            # client 1 was not sampled
    uniform = torch.full((3, 3), 1 / 3, dtype=torch.float64)
    torch.testing.assert_close(new["coef"], uniform - 0.5 * coefficient_gradient(uniform, stacked(after, ["w"]),
                                                                                 stacked(start, ["w"]), 0.6))
    assert new["keys"] == ["w"] and sorted(new["copies"]) == [0, 2]
    assert state["copies"] == {} and state["coef"] is None          # the round's input state is left as it was

    # the next round mixes the copies the replies left: client 1's is still the initialisation
    msgs = next(alg.round(new, ctx([1], num_clients=3, rnd=1)))
    c = new["coef"][1]
    expected = c[0] * uploads[0]["w"] + c[1] * init["w"] + c[2] * uploads[2]["w"]
    torch.testing.assert_close(msgs[1].arrays["target"]["w"], expected.float())
    assert list(msgs[1].arrays["target"]) == ["w"]              # parameters only, once known


def test_clients_of_several_architectures_are_refused():
    with pytest.raises(ConfigError, match="same architecture.*ktpfl, which transfers soft predictions"):
        KTpFLWeight().init_server_state({"cnn2": {}, "simple_cnn": {}})


def test_the_client_trains_then_pulls_its_parameters_towards_the_target(small_config):
    cfg = config(small_config, "ktpfl_weight", {"distill_lr": 2.5}, rounds=2, clients_per_round=3, lr=0.05)
    loop = build_loop(cfg)
    alg = loop.algorithm
    target = {k: torch.zeros_like(v) for k, v in loop.host.init_models["cnn2"].items()}
    pulled_reply, pulled = alg.client_update(Message("train", {"target": target}), None, runtime(loop, 1))
    alg.params = alg.Params(distill_steps=0)
    _, trained = alg.client_update(Message("train", {"target": target}), None, runtime(loop, 1))
    for name, w in trained["model"].items():
        keep = 1 - 2 * 2.5 / w.numel()
        torch.testing.assert_close(pulled["model"][name], keep * w)
    assert (1 - 2 * 2.5 / 10) == 0.5          # the head's 10-entry bias halved: the pull is visible
    assert set(pulled_reply.arrays["model"]) == {n for n, _ in loop.host.models["cnn2"].named_parameters()}


def test_a_run_communicates_models_and_resumes_as_an_uninterrupted_one(small_config, tmp_path):
    raw = copy.deepcopy(small_config)
    raw["algorithm"] = {"name": "ktpfl_weight", "params": {"distill_lr": 2.5, "c_lr": 0.5}}
    raw["train"].update(rounds=2, clients_per_round=3)
    raw["run"]["checkpoint_every"] = 1
    whole = fedhet.run(raw, out=tmp_path / "whole")
    assert whole.summary["status"] == "completed", whole.summary.get("error")
    assert {k for k in whole.summary["communication"] if "/" in k} == {"up/model", "down/target"}
    first = fedhet.run({**raw, "train": {**raw["train"], "rounds": 1}}, out=tmp_path / "half")
    resumed = fedhet.resume(first.run_dir, {"train.rounds": 2})
    assert resumed.metric("personal_acc") == whole.metric("personal_acc")
    assert resumed.metric("ktpfl_c_max_dev") == whole.metric("ktpfl_c_max_dev") != [(0, 0.0), (1, 0.0)]
