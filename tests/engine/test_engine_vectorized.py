"""The vectorized engine equals the reference engine to float tolerance.

The vectorized side runs on ``$FEDHET_TEST_DEVICE`` (default ``cpu``; ``cuda`` on a GPU machine:
benchmarks/gpu_check.sh), the reference on the CPU. The engine keeps TF32 off on CUDA
(``vectorized.strict_fp32``), so the same fp32 tolerances apply there.

vmapped convolutions run as grouped convolutions and batched matmuls, whose float summation
order differs from the reference's, so the engines agree to a tolerance, not bitwise. Two
regimes, both measured over this file's cases after 2 rounds:

* Smooth model (the BatchNorm CNN below: tanh, average pooling): pure rounding, every tensor
  within TIGHT (observed <= 1.4e-7; SCAFFOLD controls <= 5.5e-7), but for its convolution biases:
  BatchNorm subtracts them again, so their gradient is zero and their value is the start plus lr
  times rounding noise. They are held to what rounding can move them by (helpers.ZeroGradientBounds,
  which finds them from the model), not to TIGHT, and their derived entries (SCAFFOLD controls,
  momentum) are not compared.
* cnn2 (ReLU, max-pool): mostly ~1e-7 too, but now and then a pre-activation lies within
  rounding of a ReLU kink (or a max-pool tie) and the engines take different sides. What such a
  flip can move is derived, not fitted (``flip_bounds``): in one step, one sample of a batch of b
  contributes lr/b times its own gradient, and the flip cuts or reroutes one position's
  delta_out * input product of that sample, so an entry of tensor T moves by at most lr * g_T / b,
  where g_T = max over the case's samples of max|delta_out| * max|input| of T's layer (max|delta_out|
  for a bias), measured at the initial and at the reference's final model
  (``largest_flip_terms``). b is the smallest batch any client takes (a client smaller than a
  batch, or the last partial batch without drop_last); momentum beta carries one step's difference
  into all later steps (at most 1 / (1 - beta) of it); an aggregation weight or a personal model
  (weight 1) never enlarges it; and an entry may carry FLIPS = 2 such moves (one a round). Each
  tensor must agree within that bound plus rounding (TIGHT), and the whole model within a relative
  L2 distance of MODEL_RTOL (the bulk agrees to rounding). Measured against it: 1.1e-3 on an
  AVX512-BF16 CPU (fedcme-oe, equal sizes, fc1 weights; bound 3.5e-3) and 2.77e-3 on an AMX Xeon
  and 2.8e-3 on an H200 (fedpac, unequal sizes, fc1 weights, 2 of 524,288 entries; bound 6.3e-3:
  its smallest batch is a 4-sample remainder). ``PYTHONPATH=tests python
  tests/engine/test_engine_vectorized.py fedpac unequal`` prints a case's bounds, its differences
  and the whole model's. After a flip the later steps differ a little everywhere, which no derived
  bound covers: the one case known to take the whole model past MODEL_RTOL on a CPU (FedPAC,
  unequal sizes, 1.006e-3 on an AVX512-BF16 Xeon) is held to its per-entry bounds only
  (``FLIP_DOMINATED``).

What the tests catch: ``bash scripts/engine_breaks.sh`` breaks the engine nine ways (a vmapped
term given the first client's constants for every client; frozen parameters trained; momentum not
carried across calls; the last partial batch dropped; a bucket's weights not written back; a wide
step updating the clients outside it; a wide step not restoring their BatchNorm statistics;
augmentation draws taken from another stream; dropout masks from another stream, caught by
tests/training/test_dropout.py) and checks that tests fail under each.

SCAFFOLD's control variates are displacements divided by lr * steps (~0.05 * 7): they get 10x
the parameters' tolerance. Hyper-parameters stay out of the chaotic regime: at lr 0.05 with
momentum 0.9 a 1e-7 difference grows to 1e-3 within two rounds between any two float-different
runs of the same method, which says nothing about the engine. (The FedReMa Table 1 test runs
momentum 0.9 at the paper's lr 0.01 on the smooth model, where it stays within TIGHT over three rounds.)
"""

import copy
import os
import warnings
from dataclasses import replace

import pytest
import torch
from helpers import ZeroGradientBounds, assert_close, bn_model, build_loop, small_config_in
from torch import nn

from fedhet.algorithms.fedavg import FedAvg
from fedhet.core.contract import ClientData
from fedhet.core.errors import NumericalError
from fedhet.data.federated import build_federation
from fedhet.engine import vectorized
from fedhet.engine.vectorized import Vectorized, available
from fedhet.experiment.build import build_models
from fedhet.experiment.config import load_config
from fedhet.models.base import SplitModel
from fedhet.training.objective import CrossEntropy, LossTerm

DEVICE = os.environ.get("FEDHET_TEST_DEVICE", "cpu")
CUDA_GRAPHS = os.environ.get("FEDHET_TEST_CUDA_GRAPHS", "1") != "0"     # on CUDA: 0 compares the eager steps
TIGHT = 1e-6         # atol, smooth model; also the rounding part of the cnn2 bound
FLIPS = 2            # cnn2: flips one entry may carry, one a round (module docstring)
RTOL = 1e-5
MODEL_RTOL = 1e-3    # relative norm of the model difference; measured, not derived (module docstring, FLIP_DOMINATED)
EQUAL = {"kind": "iid"}
# Dir(0.3) sizes over 6 clients: tiny and large clients side by side (checked below).
UNEQUAL = {"kind": "quantity_skew", "alpha": 0.3, "min_size": 5}


def largest_flip_terms(model: SplitModel, states, fed) -> dict[str, float]:
    """Per parameter tensor of each Linear / Conv2d layer: the largest term one sample's kink flip can
    add to or remove from its gradient, max over the clients' training samples and over ``states``:
    max|delta| * max|input| for a weight (a flip cuts or reroutes one position's delta_out * input
    product), max|delta| for a bias, where delta is d loss_s / d (layer output) of that sample alone
    (cross-entropy, the data term through which every flip acts)."""
    layers = {name: m for name, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))}
    inputs: dict[str, torch.Tensor] = {}
    outputs: dict[str, torch.Tensor] = {}

    def keep(name):
        def hook(module, args, out):
            inputs[name], outputs[name] = args[0], out
        return hook

    hooks = [m.register_forward_hook(keep(name)) for name, m in layers.items()]
    largest: dict[str, float] = {}
    live = copy.deepcopy(model.state_dict())
    try:
        for state in states:
            model.load_state_dict(state)
            for cid in range(fed.num_clients):
                data = fed.client_data(cid)
                logits = model(data.inputs(data.train_idx))
                names = list(outputs)
                deltas = torch.autograd.grad(torch.nn.functional.cross_entropy(logits, data.y[data.train_idx],
                                                                               reduction="sum"),
                                             [outputs[n] for n in names])
                for name, delta in zip(names, deltas):
                    d = delta.detach().flatten(1).abs().amax(1)          # per sample
                    a = inputs[name].detach().flatten(1).abs().amax(1)
                    for key, value in ((f"{name}.weight", float((d * a).max())), (f"{name}.bias", float(d.max()))):
                        largest[key] = max(largest.get(key, 0.0), value)
    finally:
        for h in hooks:
            h.remove()
        model.load_state_dict(live)
    return largest


def smallest_batch(cfg, fed) -> int:
    """The fewest samples any client's step averages over (a short client, or a remainder batch)."""
    sizes = [len(idx) for idx in fed.train_idx]
    b = cfg.train.batch_size
    batches = [min(n, b) for n in sizes] + ([n % b for n in sizes if n % b] if not cfg.train.drop_last else [])
    return min(batches)


def flip_bounds(cfg, ref) -> dict[str, float]:
    """Per parameter tensor: what one kink flip of one sample in one step can move an entry by
    (module docstring), plus rounding. Several architectures: each measured on its own models,
    a name shared by two taking the larger bound."""
    finals = [ref.server_state["model"]] if "model" in ref.server_state else []
    finals += [s["model"] for s in ref.client_states.values() if isinstance(s, dict) and "model" in s]
    carry = 1.0 / (1.0 - cfg.train.momentum)
    step = cfg.train.lr / smallest_batch(cfg, ref.federation)
    bounds: dict[str, float] = {}
    network_keys = set().union(*(m.state_dict() for m in ref.host.models.values()))
    for arch, model in ref.host.models.items():
        keys = set(model.state_dict())
        # a final model of this architecture, without a method's own entries (FedNH's learned scale)
        states = [ref.host.init_models[arch], *({k: f[k] for k in keys} for f in finals
                                                if set(f) & network_keys == keys)]
        for k, gk in largest_flip_terms(model, states, ref.federation).items():
            bounds[k] = max(bounds.get(k, 0.0), TIGHT + FLIPS * step * carry * gk)
    return bounds


class FrozenKeepMomentum(FedAvg):
    """Test-only: the head is frozen and each client keeps its momentum buffers across rounds."""

    name = "frozen_keep_momentum"

    def train_options(self, msg, state, client):
        opts = {"trainable": lambda name: not name.startswith("head.")}
        if state and "momentum" in state:
            opts["optimizer_state"] = state["momentum"]
        return opts

    def after_training(self, result, msg, state, client):
        return {**(state or {}), "momentum": result.optimizer_state}


def make_config(small_config, algorithm="fedavg", params=None, partition=EQUAL, momentum=0.0, lr=0.05,
                epochs=1, options=None, **train):
    raw = copy.deepcopy(small_config)
    raw["data"]["partition"] = dict(partition)
    raw["model"]["options"] = dict(options or {})
    raw["algorithm"] = {"name": algorithm, "params": dict(params or {})}
    raw["train"].update(momentum=momentum, lr=lr, local_epochs=epochs, **train)
    return load_config(raw=raw)


def build(cfg, engine, bn=False, algorithm=None, fed=None, wide=None, keep_graphs=False):
    """A simulator built like ``Experiment`` builds it (runner helpers), optionally with the BN CNN;
    ``wide``: the vectorized engine's full-width masked steps on (True), off, or as on the device (None);
    ``keep_graphs``: later groups of one signature train in the first one's buffers (and graphs)."""
    fed = fed or build_federation(cfg.data, cfg.seed)
    models, client_arch = build_models(cfg, fed)
    if bn:
        models = {"cnn2": bn_model(cfg.model.options.get("projection_dim"), cfg.model.split or "fc2")}
    # graph_min_repeats 2: the tests' short schedules replay graphs as well (on CUDA)
    transport = Vectorized(device=DEVICE, fallback_on_error=False, cuda_graphs=CUDA_GRAPHS, graph_min_repeats=2,
                           wide_steps=wide, keep_graphs=keep_graphs) if engine == "vectorized" else None
    return build_loop(cfg, transport, fed=fed, models=models, algorithm=algorithm)


def assert_tensors_close(a, b, atol, where="", zero=None):
    """``atol``: one number, or a flip bound per parameter tensor (``flip_bounds``), matched by the
    tensor's name at the end of the entry's path. SCAFFOLD's control variates are differences of
    models divided by lr * steps, and FedFM's anchors are means of unnormalised features (entries of
    several units) computed with the drifted global model: 10x looser (fedfm-equal-nobn measured 9e-3
    on an AMD EPYC without AVX-512). FedProto's prototypes are the same kind of means
    (fedproto-equal-nobn: 1.0e-2, same CPU).
    ``zero`` (``helpers.ZeroGradientBounds``): the tensors whose gradient is zero by construction (the
    BN CNN's convolution biases) are held by ``zero.check`` instead, not here, where an absolute
    tolerance would compare rounding noise; the running means they feed get its 2 D on top."""
    per_tensor = atol if isinstance(atol, dict) else {}
    base = max(per_tensor.values()) if per_tensor else atol

    def atol_for(w):
        if any(k in w for k in (".control", ".anchors", ".prototypes")):
            tol = 10 * base
        else:
            tol = next((v for k, v in per_tensor.items() if w.endswith("." + k)), base)
        return tol + zero.extra_atol(w) if zero else tol

    assert_close(a, b, base, RTOL, where, atol_for=atol_for, leave_out=zero.leave_out if zero else None)


def assert_engines_agree(ref, vec, atol, whole_model=True):
    """Every entry of both loops' states within ``atol`` (``assert_tensors_close``), the tensors with a
    zero gradient by construction within what rounding can move them (``helpers.ZeroGradientBounds``,
    from the steps ``run_both`` / ``run_adam`` recorded), the global model as a whole within
    MODEL_RTOL, and the ledgers equal."""
    zero = ZeroGradientBounds(ref, ref.steps_per_round)
    assert_tensors_close(ref.server_state, vec.server_state, atol, "server_state", zero)
    zero.check(ref.server_state, vec.server_state, "server_state")
    # FedProto has no global model: its models are the clients'
    if "model" in ref.server_state and whole_model:
        assert_model_close(ref.server_state["model"], vec.server_state["model"])
    assert_tensors_close(ref.client_states, vec.client_states, atol, "client_states", zero)
    zero.check(ref.client_states, vec.client_states, "client_states")
    assert ref.ledger.totals() == vec.ledger.totals()


def within_flips(check, cfg, ref) -> None:
    """``check(atol)`` with the cnn2 flip bounds (``flip_bounds``), tried at TIGHT first: every bound is
    TIGHT plus a non-negative term, so a pass at TIGHT is a pass within the bounds, and the bounds (an
    autograd pass over every client's data, about a second a case) are derived only where some check
    fails at TIGHT, and that check then decides."""
    try:
        check(TIGHT)
    except AssertionError:
        check(flip_bounds(cfg, ref))


def assert_engines_agree_within_flips(cfg, ref, vec, whole_model=True):
    within_flips(lambda atol: assert_engines_agree(ref, vec, atol, whole_model), cfg, ref)


def model_relative_difference(a, b) -> float:
    """||a - b|| / ||a|| over the models' floating-point tensors, taken as one vector."""
    keys = [k for k, v in a.items() if v.is_floating_point()]
    return float(torch.cat([(a[k] - b[k]).flatten() for k in keys]).norm() / torch.cat([a[k].flatten() for k in keys]).norm())


def assert_model_close(a, b):
    assert model_relative_difference(a, b) <= MODEL_RTOL


def run_both(cfg, rounds=2, bn=False, algorithm=None, after_round=None, wide=None, keep_graphs=False):
    """Both engines side by side; ``after_round(rnd, loop)`` may edit each loop's state in between.
    Each loop's ``steps_per_round`` records the most local steps any client took in each round."""
    fed = build_federation(cfg.data, cfg.seed)
    ref = build(cfg, "reference", bn, copy.deepcopy(algorithm), fed)
    vec = build(cfg, "vectorized", bn, copy.deepcopy(algorithm), fed, wide, keep_graphs)
    ref.steps_per_round = vec.steps_per_round = []
    for rnd in range(rounds):
        a, b = ref.run_round(rnd), vec.run_round(rnd)
        ref.steps_per_round.append(max(a.steps.values(), default=0))
        assert (a.steps, a.samples, a.phases) == (b.steps, b.samples, b.phases)
        # rel 1e-3: cnn2 kink flips (fedcme-oe-equal-nobn: 1.23161 vs 1.23124, the same at the parent commit)
        assert b.mean_train_loss() == pytest.approx(a.mean_train_loss(), rel=1e-3)
        if after_round:
            after_round(rnd, ref)
            after_round(rnd, vec)
    return ref, vec


CASES = [
    # (id, algorithm, params, model options, momentum, lr, epochs)
    ("fedavg", "fedavg", {}, {}, 0.0, 0.05, 1),
    ("fedprox", "fedprox", {"mu": 0.1}, {}, 0.5, 0.05, 1),
    ("scaffold", "scaffold", {}, {}, 0.0, 0.05, 1),
    ("moon", "moon", {"mu": 1.0}, {"projection_dim": 16}, 0.5, 0.05, 1),
    # FedCME-OE: two phases (classifier swap between them), one epoch each.
    ("fedcme-oe", "fedcme", {"mu": 0, "exchange": "classifier"}, {}, 0.0, 0.05, 2),
    # FedFM's matching term from round 0: vmapped with the anchors as constants
    ("fedfm", "fedfm", {"start_round": 0, "lam": 1.0}, {}, 0.0, 0.05, 1),
    # FedACD without mixup (mixup is a per-client augmentation: reference path): two epochs, each
    # with the P of the one before, momentum carried across the per-epoch calls
    ("fedacd", "fedacd", {"mixup": False}, {}, 0.5, 0.05, 2),
    ("fedlc", "fedlc", {}, {}, 0.0, 0.05, 1),
    # FedROD: balanced-softmax term vmapped; the personal head is trained after, on the CPU
    ("fedrod", "fedrod", {}, {}, 0.0, 0.05, 1),
    # The prototype alignment term (round 2 receives round 1's prototypes): FedProto, and FedPAC's
    # body phase after its head phase
    ("fedproto", "fedproto", {}, {}, 0.0, 0.05, 1),
    ("fedpac", "fedpac", {}, {}, 0.0, 0.05, 2),
    # FedRS: each client's restricted-softmax weights (its own label counts) inside the vmapped term
    ("fedrs", "fedrs", {"alpha": 0.5}, {}, 0.0, 0.05, 1),
    # FedBABU: the body trained with the head frozen at its initialisation (training rounds only:
    # run_both does not evaluate, so its evaluation-only fine-tuning is not compared here)
    ("fedbabu", "fedbabu", {}, {}, 0.5, 0.05, 1),
]


# Every case with equal and very unequal sizes on cnn2 (no BatchNorm); with BatchNorm (smooth CNN)
# all cases with unequal sizes, and fedavg and moon with equal sizes (time budget).
# FedACD only on the smooth model: its log(P_yi / P_iy) offsets amplify cnn2's kink flips (after two
# rounds on cnn2 the model differed by 1.6e-3 in relative norm, above MODEL_RTOL; on the smooth CNN
# it agrees to TIGHT).
MATRIX = [(case, part, bn) for case in CASES for part in (EQUAL, UNEQUAL) for bn in (False, True)
          if not (bn and part is EQUAL and case[1] not in ("fedavg", "moon"))
          and not (case[1] == "fedacd" and not bn)]


# Two cnn2 cases exceed their derived bound on an H200 by one entry each, with CUDA graphs on or off
# (benchmarks/results/gpu_device_resident_h200.md): FedPAC's prototypes (means of features, whose
# flips the per-weight bound does not cover) and one FedProto conv1 bias (8% over). Expected to
# fail there until the bound covers statistics; any other CUDA failure still shows.
CUDA_KNOWN = {"fedpac-unequal-nobn", "fedproto-equal-nobn"}

# The whole-model check (MODEL_RTOL, a measured figure, not a derived one) is left out for a case
# known to flip a kink on some CPU: after a flip the engines' later steps differ a little
# everywhere, which no derived bound covers. FedPAC with unequal sizes on cnn2 flips on an
# AVX512-BF16 Xeon: each entry stays within its flip bound (fc1 weights 2.77e-3 against 6.3e-3),
# while the whole model differs by 1.006e-3 in relative norm, 0.6% over MODEL_RTOL (FedAvg and
# FedCME-OE with the same unequal sizes, without a flip there: 1.2e-6 and 3.6e-8). Its entries stay held to
# the flip bounds, and the same case on the smooth model to TIGHT, where a wrong engine shows
# (benchmarks/results/vectorized_flips_xeon.md).
FLIP_DOMINATED = {"fedpac-unequal-nobn"}


def matrix_id(case, partition, bn) -> str:
    return f"{case[0]}-{'equal' if partition is EQUAL else 'unequal'}-{'bn' if bn else 'nobn'}"


@pytest.mark.parametrize("case,partition,bn", [
    pytest.param(c, p, bn, id=matrix_id(c, p, bn),
                 marks=[pytest.mark.xfail(DEVICE == "cuda", reason="kink flips beyond the derived bound on an H200",
                                          raises=AssertionError, strict=False)] if matrix_id(c, p, bn) in CUDA_KNOWN else [])
    for c, p, bn in MATRIX])
def test_parameters_after_two_rounds_equal_reference(small_config, case, partition, bn):
    _, algorithm, params, options, momentum, lr, epochs = case
    cfg = make_config(small_config, algorithm, params, partition, momentum, lr, epochs, options)
    ref, vec = run_both(cfg, bn=bn)
    assert vec.transport.counters["fallback_requests"] == 0 and vec.transport.counters["vectorized_requests"] > 0
    whole_model = matrix_id(case, partition, bn) not in FLIP_DOMINATED
    if bn:   # the smooth model agrees to rounding
        assert_engines_agree(ref, vec, TIGHT, whole_model)
    else:
        assert_engines_agree_within_flips(cfg, ref, vec, whole_model)
    if bn:   # BatchNorm statistics moved (and agreed, above)
        key = "body.conv1.1.running_mean"
        model = vec.server_state["model"] if "model" in vec.server_state else \
            next(iter(vec.client_states.values()))["model"]
        assert not torch.equal(model[key], vec.host.init_models["cnn2"][key])


def test_fednh_learned_scale_trains_in_the_vmapped_step_as_in_the_reference(small_config):
    # A method's own trained entry (fedhet.training.local.trained_names) stacked and stepped with the model
    raw = {**small_config, "model": {"arch": "simple_cnn"}}     # a bias-free linear head
    cfg = make_config(raw, "fednh", {"learn_scale": True, "cosine_scale": 1.0}, UNEQUAL, 0.5)
    ref, vec = run_both(cfg)
    assert vec.transport.counters["fallback_requests"] == 0 and vec.transport.counters["vectorized_requests"] > 0
    assert_engines_agree_within_flips(cfg, ref, vec)
    scale = vec.server_state["model"]["fednh.logit_scale"]
    assert float(scale) > 1.0
    torch.testing.assert_close(scale, ref.server_state["model"]["fednh.logit_scale"], rtol=1e-4, atol=0)


# run.keep_graphs: three rounds, so that later groups train in the buffers (and on CUDA replay the
# graphs) of earlier ones: momentum carried within a round (fedprox), a projection head (moon), two
# phases whose second continues the first's statistics (fedcme), prototypes as term constants
# (fedproto), frozen parameters (fedbabu); wide steps as on the device.
KEPT_CASES = [c for c in CASES if c[0] in ("fedavg", "fedprox", "moon", "fedproto", "fedbabu")] + [
    ("fedcme", "fedcme", {"mu": 0.01}, {}, 0.0, 0.05, 2)]


@pytest.mark.parametrize("case", KEPT_CASES, ids=[c[0] for c in KEPT_CASES])
def test_kept_groups_equal_reference(small_config, case):
    _, algorithm, params, options, momentum, lr, epochs = case
    cfg = make_config(small_config, algorithm, params, UNEQUAL, momentum, lr, epochs, options)
    ref, vec = run_both(cfg, rounds=3, bn=True, wide=True, keep_graphs=True)
    engine = vec.transport
    assert engine.counters["fallback_requests"] == 0 and engine.counters["groups"] > len(engine._kept) >= 1
    assert_engines_agree(ref, vec, TIGHT)


def kept_addresses(g) -> dict:
    """Where every tensor a kept group's CUDA graphs may read lives."""
    out = {}
    for part in ("weights", "momentum", "has_momentum", "adam_m", "adam_v", "adam_vmax", "stat_totals", "stat_seen"):
        out.update({(part, k): t.data_ptr() for k, t in getattr(g, part).items()})
    out.update({("shared", k): t.data_ptr() for k, t in g.shared_consts.items()})
    out.update({("batched", i): t.data_ptr() for i, t in enumerate(g.batched_consts)})
    if g.adam_now is not None:
        out["adam_now"] = g.adam_now.data_ptr()
    return out


def test_a_kept_group_trains_later_groups_in_its_own_buffers(small_config):
    """Later rounds' groups are the first's: every buffer its CUDA graphs read (weights, momentum,
    term constants shared and per client, statistics) stays at its address, refilled with the
    round's values; and the caller's own tensors (the global model, a shared constant of MOON's
    terms) are never written into."""
    cfg = make_config(small_config, "moon", {"mu": 1.0}, UNEQUAL, momentum=0.5, options={"projection_dim": 16})
    vec = build(cfg, "vectorized", keep_graphs=True)
    vec.run_round(0)                       # no previous local models yet: a signature of its own
    sent = vec.server_state["model"]       # the global model round 1's group holds as a shared constant
    values_sent = {k: v.clone() for k, v in sent.items()}
    vec.run_round(1)
    kept = next(g for g in vec.transport._kept.values() if g.batched_consts)   # previous models, per client
    addresses = kept_addresses(kept)
    assert any(part == "shared" for part, *_ in addresses)
    for rnd in (2, 3):
        vec.run_round(rnd)
        assert kept in vec.transport._kept.values() and kept_addresses(kept) == addresses
    for k, v in sent.items():
        assert torch.equal(v, values_sent[k]), k
    assert vec.transport.counters["groups"] == 4 and len(vec.transport._kept) == 2


def test_kept_groups_with_adam_equal_reference(small_config):
    cfg = make_config(small_config, "fedavg", partition=UNEQUAL, lr=1e-3, optimizer="adam", weight_decay=1e-4,
                      optimizer_state="reset")
    ref, vec = run_adam(cfg, rounds=3, wide=True, keep_graphs=True)
    assert vec.transport.counters["fallback_requests"] == 0 and len(vec.transport._kept) == 1
    assert_engines_agree(ref, vec, TIGHT)


# Full-width steps with an active mask (the steps CUDA graphs replay for at least half a group):
# momentum (fedprox), per-client statistics (fedcme's feature sums, fedproto's and fedpac's
# prototypes), two phases (fedcme, fedpac), frozen parameters (fedbabu).
WIDE_CASES = [c for c in CASES if c[0] in ("fedavg", "fedprox", "fedproto", "fedpac", "fedbabu")] + [
    ("fedcme", "fedcme", {"mu": 0.01}, {}, 0.0, 0.05, 2)]


@pytest.mark.parametrize("case", WIDE_CASES, ids=[c[0] for c in WIDE_CASES])
def test_wide_steps_equal_reference(small_config, case):
    """With wide steps on, the steps of at least half a group run at its full width and the clients
    outside a step compute on a stand-in batch: their weights, momentum, BatchNorm statistics and
    the terms' statistics must stay as they were. Unequal sizes over 6 clients make such steps
    (idle rows > 0); on the BN CNN every tensor agrees with the reference to rounding."""
    _, algorithm, params, options, momentum, lr, epochs = case
    cfg = make_config(small_config, algorithm, params, UNEQUAL, momentum, lr, epochs, options, clients_per_round=6)
    ref, vec = run_both(cfg, bn=True, wide=True)
    counters = vec.transport.counters
    assert counters["fallback_requests"] == 0 and counters["idle_rows"] > 0
    assert_engines_agree(ref, vec, TIGHT)


@pytest.mark.parametrize("extras", [{}, {"amsgrad": True, "clip_grad_norm": 0.5}], ids=["plain", "amsgrad-clip"])
def test_wide_steps_with_adam_equal_reference(small_config, extras):
    """Adam's moments of the clients outside a wide step stay as they were (moments() updates in place)."""
    cfg = make_config(small_config, "fedavg", partition=UNEQUAL, lr=1e-3, optimizer="adam", weight_decay=1e-4,
                      optimizer_state="reset", clients_per_round=6)
    ref, vec = run_adam(cfg, wide=True, **extras)
    assert vec.transport.counters["idle_rows"] > 0
    assert_engines_agree(ref, vec, TIGHT)


@pytest.mark.parametrize("algorithm", ["fedrema", "fedpac"])
def test_fedrema_table_1_settings_equal_reference(small_config, algorithm):
    """The FedReMa Table 1 settings its GPU runs used (configs/papers/fedrema/t1_fmnist_*.yaml):
    every FC layer as the classifier (split at fc1), lr 0.01 with momentum 0.9 kept per client across
    rounds, drop_last, gradient clipping; three rounds, so rounds 2 and 3 start from carried momentum.
    FedReMa's critical co-learning period is ended by hand after round 1 (its mean gap keeps rising
    over three rounds of this tiny federation, so Eq. 9 would not end it): round 1 aggregates heads
    by relevance (Eq. 7), rounds 2 and 3 by the dependency counts G (Eq. 10).
    On the smooth BN CNN: on cnn2, momentum 0.9 carries kink flips into the kept buffers, where they
    grow over the rounds (FedAvg as much), beyond any tolerance that would still test the engine."""
    raw = copy.deepcopy(small_config)
    raw["data"]["partition"] = dict(UNEQUAL)
    raw["model"] = {"arch": "cnn2", "split": "fc1"}
    raw["algorithm"] = {"name": algorithm}
    raw["train"].update(clients_per_round=6, lr=0.01, momentum=0.9, drop_last=True, clip_grad_norm=10,
                        optimizer_state="keep")

    def end_co_learning_period(rnd, loop):
        if algorithm == "fedrema" and rnd == 0:
            assert loop.server_state["ccp"] and loop.server_state["G"]
            loop.server_state = {**loop.server_state, "ccp": False, "ccp_end_round": 1}

    ref, vec = run_both(load_config(raw=raw), rounds=3, bn=True, after_round=end_co_learning_period)
    assert vec.transport.counters["vectorized_requests"] > 0
    kept = [state["optimizer_state"] for state in vec.client_states.values() if state.get("optimizer_state")]
    assert kept and any(k.startswith("head.fc1.") for k in kept[0]), "no momentum kept for the fc1 head"
    if algorithm == "fedrema":      # the last round aggregated heads by Eq. 10, not by MDS
        assert vec.server_state["mean_gap"] is None and vec.server_state["relevant"] == {}
    assert_engines_agree(ref, vec, TIGHT)


@pytest.fixture(scope="module")
def agreeing_bn_runs(synth_root, tmp_path_factory):
    """Both engines' loops after two rounds of the BN CNN on the unequal partition, trained once for the
    module; a test that edits one copies it first."""
    cfg = make_config(small_config_in(synth_root, tmp_path_factory.mktemp("runs")), partition=UNEQUAL, momentum=0.5)
    return run_both(cfg, bn=True)


@pytest.mark.parametrize("tensor,by", [("body.conv1.0.weight", 10 * TIGHT), ("body.conv2.1.running_mean", 1e-4),
                                       ("body.conv1.0.bias", 1e-4)])
def test_the_agreement_check_still_fails_on_a_genuine_difference(agreeing_bn_runs, tensor, by):
    """The BN CNN's zero-gradient biases are held to a rounding bound, not left unchecked: one entry of a
    real parameter moved by 10x TIGHT, a running mean (which such a bias feeds, so it has 2 D more than
    TIGHT) by 1e-4, or the bias itself by 1e-4 (a tenth of one step of lr times a gradient of 1e-2) in
    the vectorized side's global model fails the comparison."""
    ref, vec = agreeing_bn_runs
    assert_engines_agree(ref, vec, TIGHT)
    vec = copy.copy(vec)                 # the module's loops stay as trained for the next case
    vec.server_state = copy.deepcopy(vec.server_state)
    vec.server_state["model"][tensor].view(-1)[0] += by
    with pytest.raises(AssertionError, match=tensor.replace(".", r"\.")):
        assert_engines_agree(ref, vec, TIGHT)


def test_strict_fp32_switches_tf32_off_on_cuda_only_and_restores_it():
    if not hasattr(getattr(torch.backends.cudnn, "conv", None), "fp32_precision"):
        pytest.skip("torch < 2.9: no per-backend fp32_precision flags")
    conv, matmul = torch.backends.cudnn.conv, torch.backends.cuda.matmul
    before = conv.fp32_precision, matmul.fp32_precision
    try:
        conv.fp32_precision = matmul.fp32_precision = "tf32"
        with vectorized.strict_fp32(torch.device("cuda")):
            assert (conv.fp32_precision, matmul.fp32_precision) == ("ieee", "ieee")
        assert (conv.fp32_precision, matmul.fp32_precision) == ("tf32", "tf32")
        with pytest.raises(ValueError), vectorized.strict_fp32(torch.device("cuda")):
            raise ValueError("inside")
        assert (conv.fp32_precision, matmul.fp32_precision) == ("tf32", "tf32")    # restored after an error too
        with vectorized.strict_fp32(torch.device("cpu")):
            assert (conv.fp32_precision, matmul.fp32_precision) == ("tf32", "tf32")
        conv.fp32_precision = matmul.fp32_precision = "ieee"
        with vectorized.tf32_allowed(True):        # the benchmark's switch the other way
            assert (conv.fp32_precision, matmul.fp32_precision) == ("tf32", "tf32")
        assert (conv.fp32_precision, matmul.fp32_precision) == ("ieee", "ieee")
    finally:
        conv.fp32_precision, matmul.fp32_precision = before


def test_every_vmapped_group_trains_inside_strict_fp32(small_config, monkeypatch):
    import contextlib

    inside, seen = [False], []
    real = vectorized.strict_fp32

    @contextlib.contextmanager
    def spy(device):
        assert device == vec.transport.device
        with real(device):
            inside[0] = True
            try:
                yield
            finally:
                inside[0] = False

    real_train = Vectorized._train_group

    def train_group(self, reqs):
        seen.append(inside[0])
        return real_train(self, reqs)

    monkeypatch.setattr(vectorized.transport, "strict_fp32", spy)    # where the engine calls it
    monkeypatch.setattr(Vectorized, "_train_group", train_group)
    vec = build(make_config(small_config), "vectorized")
    vec.run_round(0)
    assert seen and all(seen) and len(seen) == vec.transport.counters["groups"]


def test_unequal_partition_is_very_unequal(small_config):
    cfg = make_config(small_config, partition=UNEQUAL)
    sizes = sorted(len(t) for t in build_federation(cfg.data, cfg.seed).train_idx)
    assert sizes[0] < 32 < 5 * 32 < sizes[-1]     # a client below one batch, one above five


def test_bn_local_buffers_moon_and_options(small_config):
    """FedBN-style local statistics (term constants part shared, part per client), clipping,
    weight decay, drop_last and two local epochs with BatchNorm and very unequal clients."""
    cfg = make_config(small_config, "moon", {"bn_buffers": "local"}, UNEQUAL, momentum=0.5, epochs=2,
                      options={"projection_dim": 16}, clip_grad_norm=0.5, weight_decay=1e-3, drop_last=True)
    ref, vec = run_both(cfg, bn=True)
    assert vec.transport.counters["vectorized_requests"] > 0   # a client smaller than a batch takes 0 steps: reference path
    assert_engines_agree(ref, vec, TIGHT)


def test_frozen_parameters_and_carried_momentum(small_config):
    # 4 of 6 clients per round: round 2 mixes clients with and without kept buffers
    cfg = make_config(small_config, partition=UNEQUAL, momentum=0.5, clip_grad_norm=1.0, clients_per_round=4)
    ref, vec = run_both(cfg, bn=True, algorithm=FrozenKeepMomentum())
    assert_engines_agree(ref, vec, TIGHT)
    head = [k for k in ref.server_state["model"] if k.startswith("head.")]
    for k in head:     # frozen: untouched by either engine, so bitwise equal after the same averaging
        assert torch.equal(vec.server_state["model"][k], ref.server_state["model"][k])
    some = next(iter(vec.client_states.values()))["momentum"]
    assert some and not any(k.startswith("head.") for k in some)


class Undeclared(LossTerm):
    """Test-only: a term that does not declare itself vectorizable (LossTerm.vectorizable is False)."""

    name = "undeclared"

    def __call__(self, out, batch, weights):
        return 0.01 * out.logits.pow(2).mean()


class WithUndeclaredTerm(FedAvg):
    name = "with_undeclared_term"

    def local_terms(self, msg, state, client):
        return [*super().local_terms(msg, state, client), Undeclared()]


class OnAViewAtHalfRateFromItsOwnStream(FedAvg):
    """Trains on half of each client's data at half the rate, from a random stream of its own:
    what ``client.train(data=, settings=, stream=)`` offers a method (KT-pFL's distillation)."""

    name = "on_a_view"

    def local_training(self, weights, msg, state, client):
        d = client.data
        half = ClientData(d.x, d.y, d.train_idx[: (len(d.train_idx) + 1) // 2], d.mean, d.std)
        terms = [*self.data_terms(msg, state, client), *self.local_terms(msg, state, client)]
        return client.train(weights, terms, data=half, settings=replace(client.settings, lr=client.settings.lr / 2),
                            stream="side")


def test_a_training_on_another_view_from_another_stream_is_vmapped_like_the_reference(small_config):
    """The engine trains the request's view, settings and stream: the same steps (run_both) and,
    on the smooth model, the same weights to rounding as the reference."""
    cfg = make_config(small_config, partition=UNEQUAL)
    ref, vec = run_both(cfg, bn=True, algorithm=OnAViewAtHalfRateFromItsOwnStream())
    assert vec.transport.counters["fallback_requests"] == 0 and vec.transport.counters["vectorized_requests"] > 0
    assert_engines_agree(ref, vec, TIGHT, True)


class OnAViewWithAnUndeclaredTerm(OnAViewAtHalfRateFromItsOwnStream):
    name = "on_a_view_undeclared"

    def local_terms(self, msg, state, client):
        return [*super().local_terms(msg, state, client), Undeclared()]


@pytest.mark.parametrize("algorithm,epochs", [(WithUndeclaredTerm, 2), (OnAViewWithAnUndeclaredTerm, 1)],
                         ids=["own-data", "another-view-and-stream"])
def test_term_not_declared_vectorizable_falls_back_exactly(small_config, algorithm, epochs):
    """The engine knows no method by name: a term without ``vectorizable = True`` trains on the
    reference path, bit for bit (FedCME's alignment term is vectorizable since it became pure:
    tests/test_statistics_channel.py), on the request's view, settings and stream."""
    cfg = make_config(small_config, partition=UNEQUAL, epochs=epochs)
    algo = algorithm()
    ref, vec = build(cfg, "reference", algorithm=algo), build(cfg, "vectorized", algorithm=algo)
    for rnd in range(2):
        ref.run_round(rnd)
        vec.run_round(rnd)
    assert vec.transport.counters["vectorized_requests"] == 0 and vec.transport.counters["fallback_requests"] > 0
    for k, v in ref.server_state["model"].items():
        assert torch.equal(v, vec.server_state["model"][k]), k


def test_non_finite_loss_raises_like_reference(small_config):
    cfg = make_config(small_config, lr=1e4)
    for engine in ("reference", "vectorized"):
        sim = build(cfg, engine)
        with pytest.raises(NumericalError, match="non-finite"):
            for rnd in range(2):
                sim.run_round(rnd)


def test_same_interface_and_checkpoint_round_trip(small_config):
    cfg = make_config(small_config, "scaffold")
    vec = build(cfg, "vectorized", bn=True)
    for name in ("run_round", "client_model", "snapshot", "restore", "server_state", "client_states", "ledger",
                 "host", "federation", "algorithm", "close"):
        assert hasattr(vec, name)
    vec.run_round(0)
    snap = copy.deepcopy(vec.snapshot())
    other = build(cfg, "vectorized", bn=True)
    other.restore(snap)
    vec.run_round(1)
    other.run_round(1)
    # Bitwise on the CPU; cuDNN's backward kernels add in no fixed order (measured 2.5e-10 on an H200)
    assert_tensors_close(vec.server_state, other.server_state, 0.0 if DEVICE == "cpu" else 1e-8, "server_state")
    assert isinstance(available(), bool) and available() == torch.cuda.is_available()
    assert vectorized.Vectorized is Vectorized


class InterruptingFedAvg(FedAvg):
    """Test-only: SIGINT arrives while one client runs (not blocked in train), and that client goes
    on only once the engine is abandoning the phase. The signal is raised in the client's thread, as
    a terminal's Ctrl-C may be: the engine thread's wait is then not interrupted, and the engine must
    find the pending interrupt itself."""

    name = "interrupting"

    def client_update(self, msg, state, client):
        if client.cid == self.victim:
            import signal

            signal.raise_signal(signal.SIGINT)
            self.abandoning.wait(timeout=10)
        return super().client_update(msg, state, client)


def test_an_interrupt_while_a_client_runs_surfaces_as_keyboard_interrupt(small_config, monkeypatch):
    """Ctrl-C / SIGTERM (the runner turns both into KeyboardInterrupt, and records the run as
    interrupted) in the middle of a phase must surface as itself, with every client thread ended;
    it used to become an AttributeError (seen on a GPU sweep), so the run was recorded as failed."""
    import signal
    import threading

    from fedhet.engine.vectorized import _Task

    # Ctrl-C's own handler, whatever runs the test: a pytest-xdist worker ignores SIGINT.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    algo = InterruptingFedAvg()
    algo.abandoning = threading.Event()
    real_abandon = _Task.abandon

    def abandon(task):
        if task.started and not task.done and task.request is None:    # the victim, still running
            algo.abandoning.set()
        return real_abandon(task)

    monkeypatch.setattr(_Task, "abandon", abandon)
    vec = build(make_config(small_config), "vectorized", algorithm=algo)
    algo.victim = vec.sample_clients(0)[1]
    before = threading.active_count()
    try:
        with pytest.raises(KeyboardInterrupt):
            vec.run_round(0)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert algo.abandoning.is_set()
    assert threading.active_count() == before


def test_bucket_scheduler_runs_lockstep_for_equal_clients(small_config):
    """Equal clients share every step; unequal ones add only small remainder buckets."""
    steps = {}
    for name, part in (("equal", EQUAL), ("unequal", UNEQUAL)):
        cfg = make_config(small_config, partition=part)
        vec = build(cfg, "vectorized", bn=True)
        stats = vec.run_round(0)
        steps[name] = (vec.transport.counters["vmapped_steps"], max(stats.steps.values()), sum(stats.steps.values()))
    calls, longest, _ = steps["equal"]
    assert calls <= longest + 1
    calls, longest, total = steps["unequal"]
    assert longest <= calls < total


class Branchy(CrossEntropy):
    """Test-only: claims to be vectorizable but branches on data, which vmap cannot trace."""

    vectorizable = True

    def __call__(self, out, batch, weights):
        loss = super().__call__(out, batch, weights)
        return loss * 2 if bool((batch.y == 0).any()) else loss


class BranchyFedAvg(FedAvg):
    name = "branchy"

    def data_terms(self, msg, state, client):
        return [Branchy()]


def test_group_that_cannot_be_vmapped_falls_back(small_config):
    cfg = make_config(small_config)
    fed = build_federation(cfg.data, cfg.seed)
    strict = build(cfg, "vectorized", True, BranchyFedAvg(), fed)
    with pytest.raises(RuntimeError, match="data-dependent control flow"):   # fallback_on_error=False: vmap's error surfaces
        strict.run_round(0)
    ref = build(cfg, "reference", True, BranchyFedAvg(), fed)
    vec = build(cfg, "vectorized", True, BranchyFedAvg(), fed)
    vec.transport.fallback_on_error = True
    with pytest.warns(RuntimeWarning, match=r"vectorized engine: training failed .*reference path.*fallback_reasons"):
        vec.run_round(0)
    ref.run_round(0)
    assert vec.transport.counters["fallback_requests"] == 3 and vec.transport.counters["vectorized_requests"] == 0
    assert vec.transport.fallback_reasons == {"vmap error (RuntimeError)": 3}       # the error's type, and its
    assert "data-dependent control flow" in vec.transport.fallback_errors["vmap error (RuntimeError)"]   # message
    for k, v in ref.server_state["model"].items():
        assert torch.equal(v, vec.server_state["model"][k])


class FailingFedAvg(FedAvg):
    """Test-only: one client fails after training; the others are blocked in train() then."""

    name = "failing"

    def after_training(self, result, msg, state, client):
        if client.cid == self.victim:
            raise ValueError("client failure")
        return super().after_training(result, msg, state, client)


def test_client_error_propagates_and_ends_every_client_thread(small_config):
    import threading

    cfg = make_config(small_config)
    algo = FailingFedAvg()
    vec = build(cfg, "vectorized", bn=True, algorithm=algo)
    algo.victim = vec.sample_clients(0)[1]
    before = threading.active_count()
    with pytest.raises(ValueError, match="client failure"):
        vec.run_round(0)
    assert threading.active_count() == before
    assert vec.client_states == {}


def test_mixed_architectures_are_trained_in_groups_per_architecture(small_config):
    """FedClassAvg's setting without its augmentation (which is per-client, so its rounds take the
    reference path): clients of three architectures (fca_tiny_*) each keeping its own model
    (Local-only); the vectorized engine trains one group per architecture and agrees with the reference."""
    cfg = make_config(small_config, "local", momentum=0.5, clients_per_round=6)
    cfg.model.arch = ["fca_tiny_a", "fca_tiny_b", "fca_tiny_c"]
    ref, vec = run_both(cfg)
    assert vec.transport.counters["fallback_requests"] == 0
    assert vec.transport.counters["groups"] == 3 * 2                 # one group per architecture and round

    def states_close(atol):
        assert_tensors_close(ref.client_states, vec.client_states, atol, "client_states")
        assert_tensors_close(ref.server_state, vec.server_state, atol, "server_state")

    within_flips(states_close, cfg, ref)


def test_weights_overflowing_in_the_only_step_raise_like_reference(small_config):
    """One step per client (a batch larger than any client), so the loss before it is finite and
    only the finite check of the weights after the update can stop the run."""
    cfg = make_config(small_config, batch_size=100_000)
    cfg.train.lr = float("inf")              # set after loading: a config file's inf is refused there
    for engine in ("reference", "vectorized"):
        sim = build(cfg, engine)
        with pytest.raises(NumericalError, match=r"parameter '.*' became non-finite in round 1, client \d+"):
            sim.run_round(0)


if __name__ == "__main__":     # PYTHONPATH=tests python tests/engine/test_engine_vectorized.py CASE equal|unequal
    import sys
    import tempfile
    from pathlib import Path

    from synthetic import write_fashion_mnist

    torch.set_num_threads(1)
    case = next(c for c in CASES if c[0] == sys.argv[1])
    with tempfile.TemporaryDirectory() as tmp:
        small = {"name": "tiny", "seed": 3, "model": {"arch": "cnn2"}, "algorithm": {"name": "fedavg"},
                 "data": {"root": str(write_fashion_mnist(Path(tmp))), "verify": False, "num_clients": 6,
                          "local_test": {"source": "test_set", "fraction": 0.2}},
                 "train": {"rounds": 3, "clients_per_round": 3, "local_epochs": 1, "batch_size": 32, "lr": 0.05},
                 "run": {"out_dir": tmp, "progress": False}}
        _, algorithm, params, options, momentum, lr, epochs = case
        cfg = make_config(small, algorithm, params, EQUAL if sys.argv[2] == "equal" else UNEQUAL, momentum, lr,
                          epochs, options)
        ref, vec = run_both(cfg)
        bounds = flip_bounds(cfg, ref)
        a, b = ref.server_state.get("model", {}), vec.server_state.get("model", {})
        print(f"{sys.argv[1]}-{sys.argv[2]}-nobn: smallest batch {smallest_batch(cfg, ref.federation)}")
        if a:
            print(f"  whole global model: relative L2 difference {model_relative_difference(a, b):.3e} "
                  f"(MODEL_RTOL {MODEL_RTOL:.0e})")
        for k, bound in bounds.items():
            diff = f"{float((a[k] - b[k]).abs().max()):.2e}" if k in a else "-"
            print(f"  {k:24s} bound {bound:.2e}  global-model difference here {diff}")


def smooth_model(projection_dim=None, split="fc2", channels=1, size=28):
    """The smooth test CNN without BatchNorm (helpers.bn_model explains why, for Adam)."""
    import helpers  # not this module's bn_model, which the Adam tests replace by this function

    return helpers.bn_model(projection_dim, split, batch_norm=False, channels=channels, size=size)


def run_adam(cfg, rounds: int = 2, wide=None, model=None, keep_graphs=False, **settings):
    """Reference and vectorized loops side by side with Adam at eps 1e-3 on the smooth model. Adam
    divides by sqrt(v) + eps, so where a gradient is rounding noise (near zero) the default eps
    1e-8 amplifies the engines' float differences by up to lr / eps; eps 1e-3 keeps the comparison
    at rounding while every part of the rule (moments, bias corrections, weight decay) still acts."""
    fed = build_federation(cfg.data, cfg.seed)
    models = {"cnn2": model or smooth_model()}
    vectorized_engine = Vectorized(device=DEVICE, fallback_on_error=False, cuda_graphs=CUDA_GRAPHS, graph_min_repeats=2,
                                   wide_steps=wide, keep_graphs=keep_graphs)
    loops = [build_loop(cfg, transport, fed=fed, models=copy.deepcopy(models)) for transport in (None, vectorized_engine)]
    for loop in loops:
        loop.host.settings = replace(loop.host.settings, eps=1e-3, **settings)
    loops[0].steps_per_round = loops[1].steps_per_round = []      # as run_both records them
    for rnd in range(rounds):
        stats = [loop.run_round(rnd) for loop in loops]
        loops[0].steps_per_round.append(max(stats[0].steps.values(), default=0))
    return loops


@pytest.mark.parametrize("partition", [EQUAL, UNEQUAL], ids=["equal", "unequal"])
@pytest.mark.parametrize("extras", [{}, {"amsgrad": True, "clip_grad_norm": 0.5}], ids=["plain", "amsgrad-clip"])
def test_adam_trains_vectorized_and_equals_reference(small_config, partition, extras):
    """Adam (L2 weight decay, fresh state each round; and with amsgrad and per-client gradient
    clipping) through the engine's own kernel: every member of a step takes its step number from
    the schedule, so buckets of unequal clients get their bias corrections right. On the smooth
    model the engines agree to rounding."""
    cfg = make_config(small_config, "fedavg", partition=partition, lr=1e-3, optimizer="adam", weight_decay=1e-4,
                      optimizer_state="reset")
    ref, vec = run_adam(cfg, **extras)
    counters = vec.transport.counters
    assert counters["fallback_requests"] == 0 and counters["vectorized_requests"] > 0
    assert_engines_agree(ref, vec, TIGHT)


@pytest.mark.parametrize("partition", [EQUAL, UNEQUAL], ids=["equal", "unequal"])
def test_adam_with_carried_state_falls_back_by_name(small_config, partition):
    """Adam state kept across rounds (per-client step counts differ) is not vmapped: the second
    round's requests run on the reference path under their own reason, and the kept state (the
    first round's, exported by the engine in torch.optim.Adam's slots) equals the reference's."""
    cfg = make_config(small_config, "fedavg", partition=partition, lr=1e-3, optimizer="adam", optimizer_state="keep",
                      clients_per_round=6)
    ref, vec = run_adam(cfg)
    assert vec.transport.fallback_reasons == {"optimizer adam with carried state": 6}
    assert_engines_agree(ref, vec, TIGHT)


@pytest.mark.parametrize(("wide", "flatten_mixed"), [(None, "per_label"), (True, "per_label"), (None, "pair")],
                         ids=["plain", "wide", "pair"])
def test_mixup_trains_vectorized_and_equals_reference(small_config, wide, flatten_mixed):
    """FedACD with its mixup: each batch's permutation and lambda are drawn on the host from the
    client's stream in train_local's order and applied under vmap, so the engines mix the same
    samples with the same weights (two epochs, momentum carried between FedACD's per-epoch calls);
    with wide steps too (stand-in rows get stand-in draws), and with the pair form of Eq. 7."""
    cfg = make_config(small_config, "fedacd", {"mixup": True, "flatten_mixed": flatten_mixed}, UNEQUAL, 0.5, 0.05, 2,
                      clients_per_round=6)
    ref, vec = run_both(cfg, bn=True, wide=wide)
    counters = vec.transport.counters
    assert counters["fallback_requests"] == 0 and counters["vectorized_requests"] > 0, vec.transport.fallback_reasons
    if wide:
        assert counters["idle_rows"] > 0
    assert_engines_agree(ref, vec, TIGHT)


def test_crop_flip_rotate_trains_vectorized_and_equals_reference(small_config):
    """FedProx with FedFM's CIFAR-100 augmentation (crop of the padded image, flip, rotation through
    the written-out affine grid): the draws come from each client's stream on the host, the images
    are resampled under vmap, and the engines train on the same images (smooth model)."""
    cfg = make_config(small_config, "fedprox", {"mu": 0.1, "augment": "crop_flip_rotate"}, UNEQUAL, 0.5, 0.05, 1,
                      clients_per_round=6)
    ref, vec = run_both(cfg, bn=True)
    counters = vec.transport.counters
    assert counters["fallback_requests"] == 0 and counters["vectorized_requests"] > 0, vec.transport.fallback_reasons
    assert_every_graph_captured(vec.transport)
    assert_engines_agree(ref, vec, VIEWS_ON_CUDA if DEVICE == "cuda" else TIGHT)
    # the engines agree on augmented images, not on clean ones both left alone
    clean = build(make_config(small_config, "fedprox", {"mu": 0.1}, UNEQUAL, 0.5, 0.05, 1, clients_per_round=6),
                  "reference", bn=True)
    clean.run_round(0)
    clean.run_round(1)
    assert model_relative_difference(clean.server_state["model"], ref.server_state["model"]) > 1e-3


@pytest.mark.parametrize("algorithm", ["fedavg", "fedlc"])
def test_mixup_of_a_table5_baseline_trains_vectorized_and_equals_reference(small_config, algorithm):
    """FedAvg and FedLC with Input Mixup (the FedACD paper's Table 5 baselines): their cross-entropy
    weighs both labels of each mixed pair under vmap as on the reference path (on the smooth CNN, as
    FedACD's mixup case: cnn2's kink flips would take the engines apart by more than rounding)."""
    cfg = make_config(small_config, algorithm, {"mixup": True}, UNEQUAL, 0.5, 0.05, 2, clients_per_round=6)
    ref, vec = run_both(cfg, bn=True)
    counters = vec.transport.counters
    assert counters["fallback_requests"] == 0 and counters["vectorized_requests"] > 0, vec.transport.fallback_reasons
    assert_engines_agree(ref, vec, TIGHT)


# Augmented views on CUDA against the CPU reference: the views' pixels round differently there
# (grid_sample and the colour arithmetic are other kernels), and two rounds of Adam carry that into
# the weights. Measured on the 1-channel case, one fc1 entry of 25,600 each time: 1.3e-6 on an H100,
# 5.3e-6 (plain) and 4.9e-6 (wide) on an H200, the other entries within TIGHT; those H200 figures
# came from eager steps (every capture was failing then). After the capture fix both cases and the
# 3-channel one passed at 10x TIGHT on the H200, their largest differences not recorded. 10x TIGHT
# stays far below a wrong view or update (errors of order lr = 1e-3).
VIEWS_ON_CUDA = 10 * TIGHT


def assert_every_graph_captured(engine: Vectorized) -> None:
    """On CUDA with graphs on: some steps replayed a graph and no capture failed (on the CPU the
    engine captures nothing and records no reason)."""
    assert engine.eager_reasons == {}, engine.eager_reasons
    if DEVICE == "cuda" and CUDA_GRAPHS:
        assert engine.counters["graph_steps"] > 0, engine.counters


@pytest.mark.parametrize("wide", [None, True], ids=["plain", "wide"])
def test_supcon_views_train_vectorized_and_equal_reference(small_config, wide):
    """FedClassAvg's two augmented views (crop, flip, colour jitter through the written-out affine
    grid) with Adam, vmapped from draws made on the host, against the reference; with wide steps
    too (stand-in rows get stand-in draws). Smooth model, Adam eps 1e-3 (run_adam). On CUDA the
    views can differ from the CPU's by rounding too (grid_sample and the colour arithmetic run as
    other kernels there; this source was not isolated), beyond what the model-only cases have, so
    CUDA gets VIEWS_ON_CUDA; on CUDA graphs replay and every capture succeeds as well."""
    cfg = make_config(small_config, "fedclassavg", {}, UNEQUAL, lr=1e-3, optimizer="adam", betas=(0.5, 0.999),
                      clients_per_round=6)
    ref, vec = run_adam(cfg, wide=wide)
    counters = vec.transport.counters
    assert counters["fallback_requests"] == 0 and counters["vectorized_requests"] > 0, vec.transport.fallback_reasons
    if wide:
        assert counters["idle_rows"] > 0
    assert_every_graph_captured(vec.transport)
    assert_engines_agree(ref, vec, VIEWS_ON_CUDA if DEVICE == "cuda" else TIGHT)


def test_supcon_views_of_colour_images_train_vectorized_and_equal_reference(small_config, data_root):
    """FedClassAvg's views of 3-channel images (CIFAR-10 in its real format): saturation, hue and
    random grayscale act only on colour, so this is the path 1-channel data never reaches. Vmapped
    with no fallback and equal to the reference; on CUDA graphs replay and every capture succeeds as
    well (a copy from the host inside the step, which a capture refuses, once made them all fail)."""
    raw = copy.deepcopy(small_config)
    raw["data"].update(dataset="cifar10", root=str(data_root), local_test={"source": "holdout", "fraction": 0.2})
    cfg = make_config(raw, "fedclassavg", {}, UNEQUAL, lr=1e-3, optimizer="adam", betas=(0.5, 0.999),
                      clients_per_round=6)
    ref, vec = run_adam(cfg, model=smooth_model(channels=3, size=32))
    counters = vec.transport.counters
    assert counters["fallback_requests"] == 0 and counters["vectorized_requests"] > 0, vec.transport.fallback_reasons
    assert_every_graph_captured(vec.transport)
    assert_engines_agree(ref, vec, VIEWS_ON_CUDA if DEVICE == "cuda" else TIGHT)


def test_keep_graphs_from_the_config_takes_effect_only_where_graphs_replay(monkeypatch):
    """run.keep_graphs (on by default) keeps groups' buffers only where CUDA graphs replay: on the
    CPU the copies would buy nothing. Off in the config means off everywhere."""
    from fedhet.engine import EngineChoice, make_transport
    from fedhet.experiment.config import RunConfig

    assert RunConfig().keep_graphs is True
    vectorized = EngineChoice("vectorized", 1, "test")
    on, off = make_transport(vectorized, "cpu", keep_graphs=True), make_transport(vectorized, "cpu", keep_graphs=False)
    assert not on._keep_on() and not off._keep_on()
    assert on.info()["keep_graphs"] is False
    monkeypatch.setattr(Vectorized, "_graphs_on", lambda self: True)
    assert on._keep_on() and not off._keep_on()


def test_a_decaying_rate_equals_reference_with_kept_groups(small_config):
    # train.lr_decay: a round's rate is part of its groups' signature, so a group kept from an
    # earlier round (its rate in its steps, on CUDA in its graphs) never trains a later round
    cfg = make_config(small_config, "fedprox", {"mu": 0.1}, UNEQUAL, 0.5, 0.05, 1, lr_decay=0.5)
    ref, vec = run_both(cfg, rounds=3, bn=True, wide=True, keep_graphs=True)
    assert vec.transport.counters["fallback_requests"] == 0 and vec.transport.counters["vectorized_requests"] > 0
    assert_engines_agree(ref, vec, TIGHT)


def test_the_device_pool_follows_a_data_view_with_other_labels():
    """Two data views over the same images with different labels (a method's own view, passed to
    client.train(data=...)) each get their own labels on the device, and share one copy of the images."""
    engine = Vectorized(device=DEVICE)
    x = torch.zeros(4, 1, 2, 2, dtype=torch.uint8)
    mean, std = torch.zeros(1), torch.ones(1)
    first = ClientData(x, torch.tensor([0, 1, 2, 3]), torch.arange(4), mean, std)
    second = ClientData(x, torch.zeros(4, dtype=torch.long), torch.arange(4), mean, std)
    assert engine._pool(first)[1].cpu().tolist() == [0, 1, 2, 3]
    assert engine._pool(second)[1].cpu().tolist() == [0, 0, 0, 0]
    assert engine._pool(first)[1].cpu().tolist() == [0, 1, 2, 3]
    assert engine._pool(second)[0] is engine._pool(first)[0]                 # one copy of the images


def test_a_term_the_engine_cannot_stack_is_counted_under_why():
    """The fallback's reason says what keeps a term off the vmapped path: not declared, or the
    attribute whose type the engine cannot stack."""
    from fedhet.engine.vectorized.grouping import term_layout, unstackable
    from fedhet.training.objective import LossTerm

    class Listed(LossTerm):
        name = "listed"
        vectorizable = True

        def __init__(self):
            self.anchors = [torch.zeros(2)]

        def __call__(self, out, batch, weights):
            return out.logits.sum() * 0

    class Undeclared(Listed):
        vectorizable = False

    assert term_layout(Listed()) is None and term_layout(Undeclared()) is None
    assert unstackable(Listed()).startswith("its attribute 'anchors' holds a list; a vectorizable term's attributes")
    assert unstackable(Undeclared()) == "not declared vectorizable"
    Listed.__init__ = lambda self: setattr(self, "anchors", {"a": torch.zeros(2)})    # a dict of tensors: stacked
    assert unstackable(Listed()) is None and term_layout(Listed()) is not None


def test_a_method_training_in_its_own_loop_is_counted_and_named(small_config):
    """Per-FedAvg's meta steps never call client.train, so the engine cannot vmap them: each
    client's own-loop training is counted under its reason and named in one warning (not only in
    summary.json), and the round is the reference's all the same."""
    cfg = make_config(small_config, "perfedavg", partition=UNEQUAL, clients_per_round=6)
    with pytest.warns(RuntimeWarning, match=r"perfedavg trains in its own loop.*one at a time.*own training loop"):
        ref, vec = run_both(cfg, rounds=1, bn=True)
    counters = vec.transport.counters
    assert vec.transport.fallback_reasons == {"own training loop": 6}
    assert counters["fallback_requests"] == 6 and counters["vectorized_requests"] == 0
    assert_engines_agree(ref, vec, TIGHT)


def test_a_failed_cuda_graph_capture_is_named_once_and_counted(small_config, monkeypatch):
    """A recurring step whose CUDA graph cannot be captured runs eagerly: slower, so the first
    failure of each kind is named in a warning and every one is counted in eager_reasons."""
    from fedhet.engine.vectorized import transport

    class FailingCapture:
        ok, error = False, "operation not permitted when stream is capturing"

        def __init__(self, *args, **kwargs):
            pass

    monkeypatch.setattr(transport, "GraphedStep", FailingCapture)
    engine = Vectorized(device="cpu")
    with pytest.warns(RuntimeWarning, match=r"cuda graph capture failed \(operation not permitted.*eager_reasons"):
        engine._capture(None, None, 2, 4, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine._capture(None, None, 2, 4, None)
    assert engine.eager_reasons == {"cuda graph capture failed (operation not permitted when stream is capturing)": 2}
