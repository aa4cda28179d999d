"""helpers.zero_gradient_parameters and helpers.ZeroGradientBounds: which tensors of a model have a
zero gradient by construction, and what the engine-equivalence tests hold them to instead of an
absolute tolerance."""

import copy

import pytest
import torch
from helpers import (
    UNIT_ROUNDOFF,
    ZeroGradientBounds,
    bn_model,
    build_loop,
    config,
    largest_term_sum,
    measured_largest_term_sum,
    zero_gradient_parameters,
)
from torch import nn

from fedhet.models import build_model

BIASES = {"body.conv1.0.bias": {"body.conv1.1.running_mean"}, "body.conv2.0.bias": {"body.conv2.1.running_mean"}}


def test_the_convolution_biases_in_front_of_batchnorm_are_found_with_the_running_means_they_feed():
    assert zero_gradient_parameters(bn_model()) == BIASES
    assert zero_gradient_parameters(bn_model(projection_dim=16)) == BIASES       # MOON's projection: real gradients


def test_models_without_such_tensors_have_none():
    assert zero_gradient_parameters(bn_model(batch_norm=False)) == {}
    assert zero_gradient_parameters(build_model("cnn2", 1, 10, 28)) == {}
    # fedhet's own BatchNorm model: bias-free convolutions in front of its BatchNorm layers
    assert zero_gradient_parameters(build_model("fca_tiny_c", 1, 10, 28)) == {}


def test_a_bias_before_a_one_channel_per_group_norm_is_found_too():
    """Found from what the model computes, not from BatchNorm by name: GroupNorm with one channel per
    group subtracts each channel's mean as well; with two channels a group only one direction of the
    bias is free, so it is not a zero-gradient tensor."""
    def model(groups):
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(1, 4, 3), nn.GroupNorm(groups, 4), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))

    assert zero_gradient_parameters(model(4), input_shape=(1, 8, 8)) == {"0.bias": frozenset()}
    assert zero_gradient_parameters(model(2), input_shape=(1, 8, 8)) == {}


def test_the_found_gradient_is_rounding_within_the_bound_and_the_others_are_not():
    """What autograd returns for such a bias in float32 is rounding: within G = 3 lambda u S of zero
    (ZeroGradientBounds), while the convolution weight's gradient beside it is thousands of times G."""
    model = bn_model().train()
    torch.manual_seed(4)
    x, y = torch.randn(32, 1, 28, 28), torch.randint(0, 10, (32,))
    grads = dict(zip([n for n, _ in model.named_parameters()],
                     torch.autograd.grad(nn.functional.cross_entropy(model(x), y), list(model.parameters()))))

    class Data:                 # one client holding the batch, as largest_term_sum reads a federation
        num_clients = 1

        def client_data(self, cid):
            return type("D", (), {"train_idx": torch.arange(32), "y": y, "inputs": lambda self, idx: x[idx]})()

    for name in BIASES:
        g = ZeroGradientBounds.SUMS * ZeroGradientBounds.LAMBDA * UNIT_ROUNDOFF * \
            largest_term_sum(model, name, Data(), [model.state_dict()])
        assert float(grads[name].abs().max()) <= g
        weight = name.replace(".bias", ".weight")
        assert float(grads[weight].abs().max()) > 1000 * g


def test_the_term_sum_is_reused_only_for_the_same_model_states_and_data():
    """largest_term_sum keeps what it measured: asked again with the same model, states and
    data it answers as a fresh measurement would; with another state, other data or another model
    it measures again."""
    torch.manual_seed(5)
    x, y = torch.randn(24, 1, 28, 28), torch.randint(0, 10, (24,))

    def data(images):
        class Data:
            num_clients = 1

            def client_data(self, cid):
                return type("D", (), {"train_idx": torch.arange(24), "y": y, "inputs": lambda self, idx: images[idx]})()
        return Data()

    model, name = bn_model(), "body.conv2.0.bias"
    state = model.state_dict()
    moved = {k: (v * 1.5 if k == "body.conv2.0.weight" else v) for k, v in state.items()}
    other = copy.deepcopy(model)                          # the same weights, another function
    other.body.fc1[1] = nn.ReLU()
    cases = [(model, data(x), [state]), (model, data(x), [moved]), (model, data(2 * x), [state]),
             (other, data(x), [state])]
    measured = [measured_largest_term_sum(m, name, fed, states) for m, fed, states in cases]
    assert len(set(measured)) == len(measured)            # each case is a different value to get right
    for _ in range(2):                                    # the second pass answers from what was kept
        assert [largest_term_sum(m, name, fed, states) for m, fed, states in cases] == measured


@pytest.fixture
def trained(small_config):
    """A BN-CNN loop after two FedAvg rounds (momentum 0.5), with the bounds for its states."""
    loop = build_loop(config(small_config, momentum=0.5), models={"cnn2": bn_model()})
    steps = [max(loop.run_round(rnd).steps.values()) for rnd in range(2)]
    return loop, ZeroGradientBounds(loop, steps)


def test_the_bound_covers_the_rounding_and_is_far_below_a_real_step(trained):
    loop, bounds = trained
    assert set(bounds.names) == set(BIASES)
    state = loop.server_state["model"]
    for name in BIASES:
        start = loop.host.init_models["cnn2"][name]
        drift = bounds.drift(name, float(start.abs().max()))
        assert float((state[name] - start).abs().max()) <= drift          # moved by rounding only
        # one SGD step with a gradient the size of its layer's weights' leaves the bound behind
        assert loop.host.settings.lr * 1e-2 > 10 * drift
    bounds.check(loop.server_state, loop.server_state, "server_state")


@pytest.mark.parametrize("edit", ["one real step", "reset to zero", "nan"])
def test_check_fails_on_a_value_that_rounding_cannot_explain(trained, edit):
    loop, bounds = trained
    other = copy.deepcopy(loop.server_state)
    bias = other["model"]["body.conv2.0.bias"]
    bias[3] = {"one real step": bias[3] + loop.host.settings.lr * 1e-2, "reset to zero": 0.0,
               "nan": float("nan")}[edit]
    with pytest.raises(AssertionError, match=r"body\.conv2\.0\.bias: the second state's value moved"):
        bounds.check(loop.server_state, other, "server_state")


def test_only_the_found_tensors_and_their_derived_entries_are_left_to_the_check(trained):
    _, bounds = trained
    assert bounds.leave_out("server_state.model.body.conv1.0.bias")
    assert bounds.leave_out("client_states.2.control.body.conv2.0.bias")              # SCAFFOLD's
    assert not bounds.leave_out("server_state.model.body.conv1.0.weight")
    assert not bounds.leave_out("server_state.model.body.conv1.1.running_mean")
    assert bounds.extra_atol("server_state.model.body.conv1.1.running_mean") > 0
    assert bounds.extra_atol("server_state.model.body.conv1.1.running_var") == 0


def test_adam_gets_no_bound_where_such_tensors_exist(small_config):
    loop = build_loop(config(small_config, optimizer="adam", lr=1e-3), models={"cnn2": bn_model()})
    with pytest.raises(ValueError, match="no bound derived"):
        ZeroGradientBounds(loop, [1])
