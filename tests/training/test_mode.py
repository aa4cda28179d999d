"""A pass that is not local training runs in the mode it asks for and hands the shared model back
in the mode it came in (training.mode.in_mode), also when it raises."""

from __future__ import annotations

import pytest
import torch

from fedhet.metrics.evaluate import predict
from fedhet.training.mode import in_mode


def _net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))


@pytest.mark.parametrize("before", [True, False])
def test_in_mode_sets_the_mode_for_the_block_and_restores_it_after_a_raise(before):
    net = _net().train(before)
    with in_mode(net, training=not before):
        assert net.training is (not before) and net[2].training is (not before)
    assert net.training is before and net[2].training is before
    with pytest.raises(RuntimeError, match="inside"), in_mode(net, training=not before):
        raise RuntimeError("inside")
    assert net.training is before and net[2].training is before


def test_eval_mode_leaves_batchnorm_running_statistics_alone():
    net = _net().train()
    mean = net[2].running_mean.clone()
    with in_mode(net, training=False), torch.no_grad():
        net(torch.randn(8, 4))
    assert torch.equal(net[2].running_mean, mean)
    with in_mode(net, training=True), torch.no_grad():
        net(torch.randn(8, 4))                         # training mode: the running mean moves
    assert not torch.equal(net[2].running_mean, mean)


@pytest.mark.parametrize("before", [True, False])
def test_evaluation_hands_the_model_back_in_the_mode_it_came_in(before):
    net = _net().train(before)
    x = torch.randint(0, 256, (5, 1, 2, 2), dtype=torch.uint8)
    y = torch.tensor([0, 1, 2, 0, 1])
    hits, losses = predict(net, dict(net.state_dict()), x, y, lambda t: t.float() / 255, batch_size=4)
    assert hits.shape == (5,) and losses.shape == (5,)
    assert net.training is before
