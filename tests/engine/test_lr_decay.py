"""train.lr_decay: round t (1-based) trains at lr * lr_decay ** (t - 1), for every client and method
(the "diminishing" schedule of the FedNH code base), carried by the client host (fedhet.engine.host)."""

from __future__ import annotations

import pytest
import torch
from helpers import build_loop, config

from fedhet.core.errors import ConfigError
from fedhet.engine.host import Job, Tally
from fedhet.experiment.build import build


def _update(loop, cid: int, rnd: int) -> dict[str, torch.Tensor]:
    """What client ``cid`` adds to the global model when it trains in round ``rnd`` (the same weights
    and message in every round, so only the round's learning rate differs)."""
    msg = loop.algorithm.train_message(loop.server_state, cid, loop.round_context(0))
    result = loop.host.run(rnd, Job(cid, msg, None, Tally()))
    start = loop.server_state["model"]
    return {k: result.reply.arrays["model"][k] - start[k] for k in start if start[k].is_floating_point()}


def test_each_round_trains_at_the_decayed_rate(small_config):
    loop = build_loop(config(small_config, lr=0.05, lr_decay=0.5))
    for rnd, lr in [(0, 0.05), (1, 0.025), (3, 0.00625)]:
        settings = loop.host.runtime(0, rnd, Tally()).settings
        assert settings.lr == pytest.approx(lr, rel=1e-12)
        assert settings.batch_size == loop.host.settings.batch_size and settings.epochs == 1


def test_one_plain_sgd_step_moves_the_weights_by_the_rounds_rate(small_config):
    # One step (a batch larger than any client), no momentum or weight decay: the update is
    # -lr_t * gradient, and the gradient at the same weights on the same data is the same in
    # every round, so round 3 under a decay of 0.5 (t = 3: 0.5 ** 2) moves a quarter as far as
    # a run without decay moves in any round.
    one_step = dict(lr=0.05, batch_size=4096, local_epochs=1)
    plain = build_loop(config(small_config, **one_step))
    decayed = build_loop(config(small_config, lr_decay=0.5, **one_step))
    reference, third = _update(plain, 1, 2), _update(decayed, 1, 2)
    first = _update(decayed, 1, 0)
    moved = [k for k in reference if reference[k].abs().max() > 0]
    assert moved
    for k in moved:   # summation order may differ between rounds (the batch is shuffled): rounding only
        torch.testing.assert_close(third[k], 0.25 * reference[k], rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(first[k], reference[k], rtol=1e-4, atol=1e-7)


def test_a_built_run_carries_the_configs_decay(small_config):
    # build() is what the runner and a Flower node use
    host = build(config(small_config, lr=0.05, lr_decay=0.9)).host
    assert host.round_settings(2).lr == pytest.approx(0.05 * 0.81, rel=1e-12)


def test_no_decay_is_the_settings_themselves(small_config):
    loop = build_loop(config(small_config))
    assert loop.host.lr_decay == 1.0
    assert loop.host.round_settings(7) is loop.host.settings


@pytest.mark.parametrize("bad", [0.0, -0.5, 1.5])
def test_a_decay_outside_0_1_is_refused(small_config, bad):
    with pytest.raises(ConfigError, match="lr_decay"):
        config(small_config, lr_decay=bad)
