"""train.optimizer_state: one optimizer-state policy that every method honours, carried by the
client host (fedhet.engine.host): reset, keep, or each method's own default (auto)."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from helpers import build_loop, config

from fedhet.core.contract import ClientData
from fedhet.engine.host import OPTIMIZER_STATE, Job, Tally
from fedhet.training.local import train_local
from fedhet.training.objective import CrossEntropy


def _loop(small_config, algorithm, policy, params=None, **train):
    raw = copy.deepcopy(small_config)
    raw["train"]["optimizer_state"] = policy
    return build_loop(config(raw, algorithm, params, momentum=0.9, clients_per_round=6, **train))


def _spy(loop, cid, rnd=0):
    """A runtime of ``cid`` whose fit records the optimizer state each training call starts from."""
    client = loop.host.runtime(cid, rnd, Tally())
    seen, real = [], client.fit

    def fit(weights, terms, settings, **kw):
        seen.append({k: v.clone() for k, v in (kw["optimizer_state"] or {}).items()})
        return real(weights, terms, settings, **kw)

    client.fit = fit
    return client, seen


@pytest.mark.parametrize("algorithm,policy,keeps", [
    ("fedavg", "auto", False), ("fedavg", "keep", True), ("fedrema", "auto", True), ("fedrema", "reset", False),
    ("fedprox", "keep", True),
])
def test_the_policy_decides_for_every_method(small_config, algorithm, policy, keeps):
    loop = _loop(small_config, algorithm, policy)
    assert loop.host.keeps_optimizer_state is keeps
    loop.run_round(0)
    stored = [s for s in loop.client_states.values() if s and OPTIMIZER_STATE in s]
    assert bool(stored) is keeps
    if keeps:   # one momentum buffer per trained parameter
        names = {n for n, _ in loop.host.models["cnn2"].named_parameters()}
        assert all(set(s[OPTIMIZER_STATE]) == names for s in stored)


def test_kept_state_is_where_the_next_round_starts(small_config):
    loop = _loop(small_config, "fedavg", "keep")
    loop.run_round(0)
    cid = next(c for c, s in loop.client_states.items() if s and OPTIMIZER_STATE in s)
    stored = loop.client_states[cid][OPTIMIZER_STATE]
    msg = loop.algorithm.train_message(loop.server_state, cid, loop.round_context(1))
    client, seen = _spy(loop, cid, 1)
    result = loop.host.run(1, Job(cid, msg, loop.client_states[cid], Tally()), client)
    assert len(seen) == 1 and set(seen[0]) == set(stored)
    assert all(torch.equal(seen[0][k], stored[k]) for k in stored)
    assert not torch.equal(result.state[OPTIMIZER_STATE]["body.conv1.0.weight"], stored["body.conv1.0.weight"])
    # reset: the same client starts from a fresh optimizer whatever its state holds
    fresh = _loop(small_config, "fedavg", "reset")
    client, seen = _spy(fresh, cid, 1)
    out = fresh.host.run(1, Job(cid, msg, None, Tally()), client)
    assert seen == [{}] and out.state is None


def test_a_two_phase_method_keeps_the_union_of_its_phases(small_config):
    """FedRep trains the head, then the body: under keep each phase resumes its own parameters'
    buffers from the last round and the stored state holds both parts."""
    loop = _loop(small_config, "fedrep", "keep", {"rep_head_epochs": 1})
    loop.run_round(0)
    cid = next(c for c, s in loop.client_states.items() if s and OPTIMIZER_STATE in s)
    stored = loop.client_states[cid][OPTIMIZER_STATE]
    assert any(k.startswith("head.") for k in stored) and any(k.startswith("body.") for k in stored)
    msg = loop.algorithm.train_message(loop.server_state, cid, loop.round_context(1))
    client, seen = _spy(loop, cid, 1)
    result = loop.host.run(1, Job(cid, msg, loop.client_states[cid], Tally()), client)
    assert len(seen) == 2                                        # head phase, body phase
    assert all(torch.equal(seen[0][k], stored[k]) for k in stored)
    head = [k for k in stored if k.startswith("head.")]
    # the body phase starts from last round's body buffers and this round's head buffers
    assert all(torch.equal(seen[1][k], stored[k]) for k in stored if k.startswith("body."))
    assert all(not torch.equal(seen[1][k], stored[k]) for k in head)
    assert set(result.state[OPTIMIZER_STATE]) == set(stored)


def test_keep_changes_the_run_and_reset_matches_the_default(small_config, tmp_path):
    import fedhet

    def loss(policy):
        raw = copy.deepcopy(small_config)
        raw["train"].update(momentum=0.9, rounds=2, clients_per_round=6, optimizer_state=policy)
        return fedhet.run(raw, out=tmp_path / policy).metric("train_loss")

    reset = loss("reset")
    assert reset == loss("auto")                    # FedAvg's default is a fresh optimizer each round
    kept = loss("keep")
    assert kept[0] == reset[0] and kept[1] != reset[1]      # round 1 starts fresh either way


def test_evaluation_fine_tuning_leaves_the_kept_state_alone(small_config):
    """FedBABU fine-tunes every client for evaluation; under keep, that must neither start from
    nor change the momentum its training carries: the kept state after round 1 is the same
    whether round 1 evaluated (fine-tuned) or not."""
    kept = {}
    for evaluating in (False, True):
        loop = _loop(small_config, "fedbabu", "keep", {"finetune_epochs": 1})
        loop.run_round(0, evaluating=evaluating)
        kept[evaluating] = {c: s.get(OPTIMIZER_STATE) for c, s in loop.client_states.items() if s}
    assert set(kept[True]) >= set(kept[False]) and kept[False]
    for cid, state in kept[True].items():
        if cid not in kept[False]:                      # only fine-tuned, never trained: nothing kept
            assert state is None, cid
            continue
        assert set(state) == set(kept[False][cid])
        assert all(torch.equal(state[k], kept[False][cid][k]) for k in state), cid


def test_a_training_on_other_data_uses_its_own_settings_stream_and_optimizer(small_config):
    """``client.train(data=, settings=, stream=, carry_optimizer_state=False)`` (KT-pFL's distillation):
    the same arithmetic as train_local on that view with those settings and that stream, from a
    fresh optimizer, leaving the kept momentum as it was; the round's tally counts it."""
    loop = _loop(small_config, "fedavg", "keep")
    loop.run_round(0)
    cid = next(c for c, s in loop.client_states.items() if s and OPTIMIZER_STATE in s)
    client, seen = _spy(loop, cid, 1)
    client.kept_optimizer_state = {k: v.clone() for k, v in loop.client_states[cid][OPTIMIZER_STATE].items()}
    before = {k: v.clone() for k, v in client.kept_optimizer_state.items()}
    own = client.data
    other = ClientData(own.x, own.y, own.train_idx[: len(own.train_idx) // 2].flip(0), own.mean, own.std)
    settings = replace(client.settings, epochs=2, batch_size=5, lr=client.settings.lr / 2)
    weights = client.init_weights()
    got = client.train(weights, data=other, settings=settings, stream="side", carry_optimizer_state=False)
    want = train_local(client.model, weights, other, [CrossEntropy()], settings,
                       lambda e: client.generator("side", e))
    assert seen == [{}]                                                   # a fresh optimizer
    assert got.steps == want.steps == 2 * -(-len(other.train_idx) // 5)
    assert all(torch.equal(got.weights[k], want.weights[k]) for k in want.weights)
    assert all(torch.equal(client.kept_optimizer_state[k], before[k]) for k in before)
    assert client.tally.steps == got.steps
