"""KT-pFL (fedhet.algorithms.ktpfl): the server's knowledge transfer against hand computations,
the client's distillation loss, and short runs with heterogeneous architectures."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers import build_loop, config, runtime

import fedhet
from fedhet.algorithms.ktpfl import (
    Distillation,
    KTpFL,
    adaptive_step,
    personalized_targets,
    public_positions,
    soft_predictions,
    update_coefficients,
)
from fedhet.core.contract import Batch, Forward, Message
from fedhet.core.errors import ConfigError, NumericalError
from fedhet.engine.vectorized import Vectorized

# three clients, two public samples, two classes
SOFT = torch.tensor([[[0.9, 0.1], [0.2, 0.8]],
                     [[0.6, 0.4], [0.5, 0.5]],
                     [[0.3, 0.7], [0.1, 0.9]]], dtype=torch.float64)


def test_personalized_target_is_the_coefficient_mixture():
    coef = torch.tensor([[0.5, 0.25, 0.25], [0.0, 1.0, 0.0], [0.2, 0.3, 0.5]], dtype=torch.float64)
    t = personalized_targets(coef, SOFT)
    # client 0, sample 0: 0.5*0.9 + 0.25*0.6 + 0.25*0.3 = 0.675
    assert t[0, 0, 0].item() == pytest.approx(0.675)
    assert t[0, 1, 1].item() == pytest.approx(0.5 * 0.8 + 0.25 * 0.5 + 0.25 * 0.9)
    torch.testing.assert_close(t[1], SOFT[1])
    assert t[2, 1, 0].item() == pytest.approx(0.2 * 0.2 + 0.3 * 0.5 + 0.5 * 0.1)


def hand_gradient(row, k, soft, rho):
    """d/dc_j [ mean_{p,c} (s_k - sum_m c_m s_m)^2 + rho * mean_m (c_m - 1/n)^2 ], written out."""
    n, p, c = soft.shape
    t = sum(row[m] * soft[m] for m in range(n))
    resid = soft[k] - t
    return torch.stack([(-2.0 / (p * c)) * (resid * soft[j]).sum() + (2.0 * rho / n) * (row[j] - 1.0 / n)
                        for j in range(n)])


def test_one_coefficient_step_matches_the_hand_gradient():
    coef = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3], [0.2, 0.2, 0.6]], dtype=torch.float64)
    rho, lr = 0.7, 0.5
    new = update_coefficients(coef, SOFT, rho=rho, step="fixed", lr=lr, projection="none")
    for k in range(3):
        expected = coef[k] - lr * hand_gradient(coef[k], k, SOFT, rho)
        torch.testing.assert_close(new[k], expected)
    # the authors' projection: softmax(5 * (row - step * grad)), rows on the simplex
    proj = update_coefficients(coef, SOFT, rho=rho, step="fixed", lr=lr, projection="softmax")
    for k in range(3):
        torch.testing.assert_close(proj[k], torch.softmax(5.0 * (coef[k] - lr * hand_gradient(coef[k], k, SOFT, rho)), 0))


def test_one_coefficient_step_with_the_papers_kl_matches_the_hand_gradient():
    """c_loss="kl" (the paper's objective): d/dc_j mean_{p,c} [t log t - t log s_k] = mean((log t + 1 - log s_k) s_j)."""
    coef = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3], [0.2, 0.2, 0.6]], dtype=torch.float64)
    rho, lr = 0.7, 0.5
    new = update_coefficients(coef, SOFT, rho=rho, c_loss="kl", step="fixed", lr=lr, projection="none")
    n, p, c = SOFT.shape
    for k in range(3):
        t = sum(coef[k, m] * SOFT[m] for m in range(n))
        grad = torch.stack([((t.log() + 1 - SOFT[k].log()) * SOFT[j]).sum() / (p * c)
                            + (2.0 * rho / n) * (coef[k, j] - 1.0 / n) for j in range(n)])
        torch.testing.assert_close(new[k], coef[k] - lr * grad)
    assert not torch.allclose(new, update_coefficients(coef, SOFT, rho=rho, step="fixed", lr=lr, projection="none"))


def test_adaptive_step_follows_the_authors_heuristic():
    # g = 0.3/3 = 0.1 > 0.01: /5 -> 0.02 (lr 0.2), again /5 -> 0.004 < 0.01: *5 -> 0.02 (lr 1.0); and so on
    g = 0.1
    lr = 1.0
    for _ in range(5):
        if g > 0.01:
            g, lr = g / 5, lr / 5
        if g < 0.01:
            g, lr = g * 5, lr * 5
    assert adaptive_step(torch.tensor([0.1, -0.1, 0.1]), 3) == pytest.approx(lr)
    assert adaptive_step(torch.tensor([0.1, -0.1, 0.1]), 3) == pytest.approx(0.2)
    assert adaptive_step(torch.zeros(3), 3) == pytest.approx(5.0 ** 5)


def test_rows_stay_on_the_simplex_under_partial_participation():
    algo = KTpFL()
    k = 5
    coef = torch.full((k, k), 1.0 / k, dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    for clients in ([0, 1, 2, 3, 4], [1, 3, 4], [0, 2], [0, 1, 2, 3, 4]):
        soft = torch.softmax(torch.randn(len(clients), 7, 4, generator=gen, dtype=torch.float64) * 3, -1)
        before = coef.clone()
        targets, coef = algo.transfer(coef, clients, soft.float())
        assert (coef >= 0).all()
        torch.testing.assert_close(coef.sum(1), torch.ones(k, dtype=torch.float64))
        # rows and columns of absent clients are untouched
        absent = [c for c in range(k) if c not in clients]
        for c in absent:
            torch.testing.assert_close(coef[c], before[c])
        # targets are mixtures of the repliers' predictions with the block's renormalised rows
        idx = torch.tensor(clients)
        block = coef[idx][:, idx]
        block = block / block.sum(1, keepdim=True)
        torch.testing.assert_close(targets, personalized_targets(block, soft).float(), atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(targets.sum(-1), torch.ones(targets.shape[:2]), atol=1e-5, rtol=0)


def test_distillation_loss_against_hand_kl():
    z = torch.tensor([[2.0, 0.0, -1.0], [0.5, 0.5, 1.0]])
    target = torch.tensor([[0.7, 0.2, 0.1], [0.3, 0.3, 0.4], [0.1, 0.1, 0.8]])
    batch = Batch(torch.zeros(2, 1), torch.zeros(2, dtype=torch.long), torch.tensor([2, 0]))
    term = Distillation(target, temperature=10.0, kind="kl", weight=2.0)
    value = term(Forward(torch.zeros(2, 1), z), batch, {})
    hand = 0.0
    for row, pos in ((0, 2), (1, 0)):
        logp = [zi / 10.0 for zi in z[row].tolist()]
        lse = math.log(sum(math.exp(v) for v in logp))
        for c in range(3):
            t = target[pos, c].item()
            hand += t * (math.log(t) - (logp[c] - lse))
    assert value.item() == pytest.approx(2.0 * hand / 6)           # 'mean' over the B x C entries
    mse = Distillation(target, temperature=10.0, kind="mse")(Forward(torch.zeros(2, 1), z), batch, {})
    assert mse.item() == pytest.approx(F.mse_loss(torch.softmax(z, 1), target[[2, 0]]).item())


def test_public_batch_is_shared_and_seeded():
    a = public_positions(1000, 50, 7)
    assert torch.equal(a, public_positions(1000, 50, 7))
    assert len(set(a.tolist())) == 50 and not torch.equal(a, public_positions(1000, 50, 8))


def mixed(small_config, public=True, **params):
    raw = copy.deepcopy(small_config)
    raw["model"] = {"arch": ["fca_cnn_a", "fca_cnn_b"]}
    if public:
        raw["data"]["public"] = {"source": "holdout", "size": 100}
    base = {"public_size": 64, "distill_batch_size": 32}
    return config(raw, "ktpfl", {**base, **params}, rounds=2, clients_per_round=6, lr=0.05)


def test_only_soft_predictions_travel_and_models_stay_private(small_config):
    loop = build_loop(mixed(small_config))
    assert loop.host.client_arch[:2] == ["fca_cnn_a", "fca_cnn_b"]
    for rnd in range(2):
        loop.run_round(rnd)
    totals = loop.ledger.totals()
    assert {k for k in totals if "/" in k} == {"up/soft", "down/target"}
    assert totals["up"]["floats"] == 64 * 10 * 6 * 2 == totals["down"]["floats"]
    coef = loop.server_state["coef"]
    assert coef.shape == (6, 6)
    torch.testing.assert_close(coef.sum(1), torch.ones(6, dtype=torch.float64))
    assert not torch.allclose(coef, torch.full_like(coef, 1 / 6))            # C was learned
    a, b = loop.client_states[0]["model"], loop.client_states[2]["model"]     # same architecture
    init = loop.host.init_models["fca_cnn_a"]
    for name in ("head.classifier.1.weight", "body.fcin.weight"):
        assert not torch.equal(a[name], b[name]) and not torch.equal(a[name], init[name])
    assert loop.algorithm.client_model(0, loop.server_state, loop.client_states[0]) is loop.client_states[0]["model"]


def test_the_client_distils_towards_its_target(small_config):
    loop = build_loop(mixed(small_config, distill_epochs=5, public_size=32))
    client = runtime(loop, 1)
    reply, state = loop.algorithm.client_update(Message("train", scalars={"public_seed": 11}), None, client)
    probs = reply.arrays["soft"]["probs"]
    assert probs.shape == (32, 10)
    torch.testing.assert_close(probs.sum(1), torch.ones(32))
    target = torch.zeros(32, 10)
    target[:, 3] = 1.0                                                       # all mass on class 3
    msg = Message("distill", {"target": {"probs": target}}, {"public_seed": 11})
    _, state2 = loop.algorithm.client_update(msg, state, client)
    data = loop.algorithm.public_data(msg, client)
    after = soft_predictions(client.model, state2["model"], data, 10.0)
    assert after[:, 3].mean() > probs[:, 3].mean()


@pytest.mark.parametrize("training", ["plain_sgd", "run"])
def test_distillation_trains_with_plain_sgd_as_both_codes_or_with_the_runs_settings(small_config, training):
    """Both codes distil with a fresh plain SGD (cugzj: SGD(lr=0.02), no momentum, no weight decay)
    over every public image, whatever the private training uses; "run" keeps the run's Adam."""
    cfg = mixed(small_config, distill_training=training, distill_lr=0.02)
    cfg.train.optimizer, cfg.train.momentum, cfg.train.weight_decay, cfg.train.drop_last = "adam", 0.0, 1e-4, True
    loop = build_loop(cfg)
    client = runtime(loop, 1)
    _, state = loop.algorithm.client_update(Message("train", scalars={"public_seed": 11}), None, client)
    seen, real_train = [], client.train
    client.train = lambda weights, terms=None, **kw: (seen.append(kw["settings"]), real_train(weights, terms, **kw))[1]
    msg = Message("distill", {"target": {"probs": torch.full((64, 10), 0.1)}}, {"public_seed": 11})
    loop.algorithm.client_update(msg, state, client)
    (s,) = seen
    assert (s.lr, s.batch_size, s.epochs) == (0.02, 32, 1)
    if training == "plain_sgd":
        assert (s.optimizer, s.momentum, s.weight_decay, s.clip_grad_norm, s.drop_last) == ("sgd", 0.0, 0.0, None, False)
    else:
        assert (s.optimizer, s.weight_decay, s.drop_last) == ("adam", 1e-4, True)


def test_the_public_batch_comes_from_the_public_set(small_config):
    loop = build_loop(mixed(small_config, public_size=40))
    public = loop.host.federation.public
    assert public is not None and public.shape[0] == 100
    data = loop.algorithm.public_data(Message("train", scalars={"public_seed": 5}), runtime(loop, 0))
    assert data.x is public and len(data.train_idx) == 40
    torch.testing.assert_close(data.batch(torch.arange(40)).x,
                               loop.host.federation.normalize(public[public_positions(100, 40, 5)]))


def test_a_public_set_smaller_than_public_size_is_a_clear_error_before_any_training(small_config):
    from fedhet.experiment.build import build

    assert build(mixed(small_config, public_size=100)).federation.public.shape[0] == 100    # exactly enough
    with pytest.raises(ConfigError, match="public_size is 101 but the public set .* has 100 images"):
        build(mixed(small_config, public_size=101))
    pool = build(mixed(small_config, public=False, public_size=40)).federation.pool.x.shape[0]
    with pytest.raises(ConfigError, match=f"the training pool, which has {pool} images"):
        build(mixed(small_config, public=False, public_size=pool + 1))


def run_config(small_config, public_size, rounds):
    """A raw KT-pFL config for fedhet.run: two architectures, a held-out public set of 100 images."""
    raw = copy.deepcopy(small_config)
    raw["model"] = {"arch": ["fca_cnn_a", "fca_cnn_b"]}
    raw["algorithm"] = {"name": "ktpfl", "params": {"public_size": public_size, "distill_batch_size": 32}}
    raw["data"]["public"] = {"source": "holdout", "size": 100}
    raw["train"].update(rounds=rounds, clients_per_round=3)
    return raw


def test_a_public_batch_larger_than_its_pool_is_refused_not_shrunk():
    assert len(public_positions(100, 100, 3)) == 100
    with pytest.raises(ValueError, match="101 images cannot be drawn without replacement from 100"):
        public_positions(100, 101, 3)


def test_a_run_with_too_small_a_public_set_stops_with_that_message(small_config, tmp_path):
    raw = run_config(small_config, public_size=101, rounds=1)
    with pytest.raises(ConfigError, match="public_size is 101"):
        fedhet.run(raw, out=tmp_path / "a")
    assert not (tmp_path / "a" / "summary.json").exists()     # refused while building: no run started, none failed


def test_without_a_public_set_it_warns_and_draws_from_the_pool(small_config):
    loop = build_loop(mixed(small_config, public=False, public_size=40))
    with pytest.warns(UserWarning, match="no data.public"):          # once, as the run is built (build calls it)
        loop.algorithm.check_data(loop.host.federation.client_data(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # not again from inside a client update
        data = loop.algorithm.public_data(Message("train", scalars={"public_seed": 5}), runtime(loop, 0))
    assert data.x is loop.host.federation.pool.x
    assert torch.equal(data.train_idx, public_positions(data.x.shape[0], 40, 5))


def test_end_to_end_run_is_deterministic(small_config, tmp_path):
    raw = run_config(small_config, public_size=64, rounds=2)
    first = fedhet.run(raw, out=tmp_path / "a")
    second = fedhet.run(raw, out=tmp_path / "b")
    assert first.summary["status"] == "completed", first.summary.get("error")
    comm = first.summary["communication"]
    assert {k for k in comm if "/" in k} == {"up/soft", "down/target"}
    acc = first.metric("personal_acc")
    assert len(acc) == 2 and acc == second.metric("personal_acc")


def test_the_distillation_goes_through_the_engine_which_counts_it(small_config, tmp_path):
    """The distillation trains through client.train: the vectorized engine vmaps the private
    training and trains each distillation per client, counted under the term's name, and the
    run keeps the reference engine's result within vmap's float tolerance."""
    raw = run_config(small_config, public_size=64, rounds=2)
    reference = fedhet.run(raw, out=tmp_path / "reference")
    raw["run"]["engine"] = "vectorized"
    vectorized = fedhet.run(raw, out=tmp_path / "vectorized")
    assert vectorized.summary["status"] == "completed", vectorized.summary.get("error")
    counters = vectorized.summary["engine"]
    updates = 2 * raw["train"]["clients_per_round"]                         # rounds x clients
    assert counters["fallback_reasons"] == {"loss term distill (not declared vectorizable)": updates}
    assert counters["vectorized_requests"] == updates
    assert reference.summary["status"] == "completed", reference.summary.get("error")
    # rel 1e-3: run_both's bound for a kink flip in vmapped training (tests/engine/test_engine_vectorized.py);
    # measured here: 3e-8 (Intel Xeon, AVX512)
    losses = {name: [v for _, v in r.metric("train_loss")] for name, r in (("ref", reference), ("vec", vectorized))}
    assert losses["vec"] == pytest.approx(losses["ref"], rel=1e-3)


def test_the_vectorized_engine_names_the_distillation_it_trains_apart_once(small_config):
    loop = build_loop(mixed(small_config), transport=Vectorized(device="cpu"))
    with pytest.warns(RuntimeWarning, match="loss term distill \\(not declared vectorizable\\)") as record:
        loop.run_round(0)
        loop.run_round(1)
    assert sum("loss term distill" in str(w.message) for w in record) == 1


def test_a_non_finite_distillation_loss_names_the_distillation(small_config):
    loop = build_loop(mixed(small_config, public_size=32))
    msg = Message("distill", {"target": {"probs": torch.full((32, 10), float("nan"))}}, {"public_seed": 11})
    with pytest.raises(NumericalError, match="client 1, algorithm ktpfl \\(its 'distill' training\\)"):
        loop.algorithm.client_update(msg, None, runtime(loop, 1))
