"""Functional local training equals ordinary PyTorch training, phases compose, guards fire."""

import pytest
import torch

from fedhet.core.contract import TrainSettings
from fedhet.core.errors import NumericalError
from fedhet.core.seeding import torch_generator
from fedhet.models import build_model
from fedhet.training.local import epoch_batches, train_local, trained_names
from fedhet.training.objective import CrossEntropy, LossTerm


def gen(e):
    return torch_generator(1, "batches", e)


def test_matches_plain_torch_sgd_with_momentum_and_weight_decay(cnn_client):
    model, data, weights = cnn_client
    s = TrainSettings(epochs=2, batch_size=16, lr=0.05, momentum=0.9, weight_decay=1e-3)
    result = train_local(model, weights, data, [CrossEntropy()], s, gen)

    ref = build_model("cnn2", in_channels=1, num_classes=10, image_size=28)
    ref.load_state_dict(weights)
    opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    for e in range(2):
        for pos in epoch_batches(60, 16, False, gen(e)):
            b = data.batch(pos)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(ref(b.x), b.y).backward()
            opt.step()
    for name, p in ref.state_dict().items():
        torch.testing.assert_close(result.weights[name], p, rtol=1e-5, atol=1e-6)
    assert result.steps == 2 * 4 and result.samples == 120
    assert set(result.optimizer_state) == {n for n, _ in ref.named_parameters()}


def test_two_phases_equal_one_call(cnn_client):
    """FedCME-style rounds split local epochs into phases; batches depend on the absolute epoch."""
    model, data, weights = cnn_client
    s2 = TrainSettings(epochs=3, batch_size=16, lr=0.05)
    whole = train_local(model, weights, data, [CrossEntropy()], s2, gen)
    a = train_local(model, weights, data, [CrossEntropy()], TrainSettings(epochs=1, batch_size=16, lr=0.05), gen)
    b = train_local(model, a.weights, data, [CrossEntropy()], TrainSettings(epochs=2, batch_size=16, lr=0.05), gen,
                    start_epoch=1)
    for k in whole.weights:
        assert torch.equal(whole.weights[k], b.weights[k])


def test_persisted_momentum_continues_like_one_optimizer(cnn_client):
    model, data, weights = cnn_client
    s = TrainSettings(epochs=1, batch_size=16, lr=0.05, momentum=0.9)
    whole = train_local(model, weights, data, [CrossEntropy()], TrainSettings(epochs=2, batch_size=16, lr=0.05, momentum=0.9), gen)
    a = train_local(model, weights, data, [CrossEntropy()], s, gen)
    b = train_local(model, a.weights, data, [CrossEntropy()], s, gen, start_epoch=1, optimizer_state=a.optimizer_state)
    fresh = train_local(model, a.weights, data, [CrossEntropy()], s, gen, start_epoch=1)
    for k in whole.weights:
        torch.testing.assert_close(whole.weights[k], b.weights[k], rtol=1e-6, atol=1e-7)
    assert any(not torch.allclose(whole.weights[k], fresh.weights[k]) for k in whole.weights)


def test_frozen_parameters_stay_bitwise_unchanged(cnn_client):
    model, data, weights = cnn_client
    s = TrainSettings(epochs=1, batch_size=16, lr=0.1)
    result = train_local(model, weights, data, [CrossEntropy()], s, gen, trainable=lambda n: not n.startswith("head."))
    for k, v in weights.items():
        if k.startswith("head."):
            assert torch.equal(result.weights[k], v)
        else:
            assert not torch.equal(result.weights[k], v)


class TemperedCrossEntropy(LossTerm):
    """CE of the logits times a method's own parameter, read from the weights (like FedNH's learned scale)."""

    name = "tempered_ce"

    def __call__(self, out, batch, weights):
        return torch.nn.functional.cross_entropy(weights["method.scale"] * out.logits, batch.y)


def test_a_methods_own_weights_are_trained_with_the_model_like_torch_sgd(cnn_client):
    model, data, weights = cnn_client
    own = {**weights, "method.scale": torch.tensor([2.0]), "method.count": torch.tensor([7]),
           "method.frozen": torch.tensor([1.0])}
    keep = lambda n: n != "method.frozen"    # noqa: E731
    assert trained_names(model, own, keep) == [n for n, _ in model.named_parameters()] + ["method.scale"]
    s = TrainSettings(epochs=1, batch_size=16, lr=0.05, momentum=0.9, weight_decay=1e-3)
    result = train_local(model, own, data, [TemperedCrossEntropy()], s, gen, trainable=keep)

    ref = build_model("cnn2", in_channels=1, num_classes=10, image_size=28)
    ref.load_state_dict(weights)
    scale = torch.nn.Parameter(torch.tensor([2.0]))
    opt = torch.optim.SGD([*ref.parameters(), scale], lr=0.05, momentum=0.9, weight_decay=1e-3)
    for pos in epoch_batches(60, 16, False, gen(0)):
        b = data.batch(pos)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(scale * ref(b.x), b.y).backward()
        opt.step()
    torch.testing.assert_close(result.weights["method.scale"], scale.detach(), rtol=1e-5, atol=1e-6)
    assert not torch.equal(result.weights["method.scale"], own["method.scale"])
    for name, p in ref.state_dict().items():
        torch.testing.assert_close(result.weights[name], p, rtol=1e-5, atol=1e-6)
    assert torch.equal(result.weights["method.count"], own["method.count"])      # not floating: carried
    assert torch.equal(result.weights["method.frozen"], own["method.frozen"])    # rejected by trainable


def test_buffers_are_never_trained_and_the_forward_pass_sees_the_networks_entries_only():
    from helpers import bn_model

    from fedhet.training.local import model_entries
    model = bn_model()
    weights = {**model.state_dict(), "method.scale": torch.tensor([1.0])}
    names = trained_names(model, weights)
    assert names == [n for n, _ in model.named_parameters()] + ["method.scale"]
    assert not any("running" in n or "num_batches" in n for n in names)
    assert set(model_entries(model, weights)) == set(model.state_dict())
    plain = model.state_dict()
    assert model_entries(model, plain) is plain


def test_input_weights_are_not_modified(cnn_client):
    model, data, weights = cnn_client
    before = {k: v.clone() for k, v in weights.items()}
    train_local(model, weights, data, [CrossEntropy()], TrainSettings(epochs=1, batch_size=16, lr=0.1), gen)
    assert all(torch.equal(before[k], weights[k]) for k in weights)


def test_non_finite_loss_names_where(cnn_client):
    model, data, weights = cnn_client
    s = TrainSettings(epochs=3, batch_size=16, lr=1e12)
    with pytest.raises(NumericalError, match="round 4, client 7, algorithm fedavg"):
        train_local(model, weights, data, [CrossEntropy()], s, gen, where="in round 4, client 7, algorithm fedavg")


def test_drop_last_batches():
    g = torch_generator(0, "x")
    assert [len(b) for b in epoch_batches(10, 4, True, g)] == [4, 4]
    assert [len(b) for b in epoch_batches(10, 4, False, g)] == [4, 4, 2]


def finite_cases():
    big = torch.full((300, 7), 3e38)                     # finite, though its sum overflows
    cases = {"finite": torch.randn(512, 1024), "huge but finite": big, "0-dim": torch.tensor(2.0),
             "empty": torch.empty(0, 3), "int64": torch.tensor([1, 2, 3]),
             "bf16": torch.randn(40).to(torch.bfloat16), "non-contiguous": torch.randn(64, 32).t(),
             "bool": torch.tensor([True, False]), "fp16": torch.randn(9).half(), "complex": torch.randn(4, dtype=torch.cfloat)}
    for bad in (float("nan"), float("inf"), float("-inf")):
        for where in (0, 777, -1):
            t = torch.randn(512, 1024)
            t.view(-1)[where] = bad
            cases[f"{bad} at {where}"] = t
        t = torch.randn(64, 32).t()
        t[5, 3] = bad
        cases[f"{bad}, non-contiguous"] = t
        cases[f"{bad}, bf16"] = torch.tensor([1.0, bad, 2.0], dtype=torch.bfloat16)
        cases[f"{bad}, 0-dim"] = torch.tensor(bad)
        cases[f"{bad}, fp16"] = torch.tensor([bad, 1.0], dtype=torch.float16)
        cases[f"{bad}, complex imaginary part"] = torch.tensor([1 + 1j, complex(0.5, bad)])
    return cases


@pytest.mark.parametrize("name", list(finite_cases()))
def test_all_finite_answers_as_isfinite_all(name):
    from fedhet.training.local import all_finite

    t = finite_cases()[name]
    assert all_finite(t) is bool(torch.isfinite(t).all())


def test_weights_that_overflow_in_the_last_update_are_a_numerical_error(cnn_client):
    """The loss of the only step is finite (it comes before the update); the update overflows."""
    model, data, weights = cnn_client
    s = TrainSettings(epochs=1, batch_size=len(data.train_idx), lr=float("inf"), momentum=0.0)
    with pytest.raises(NumericalError, match=r"parameter '.*' became non-finite in round 1; lower the learning rate"):
        train_local(model, weights, data, [CrossEntropy()], s, gen, where="in round 1")
