"""Dropout with masks from each client's stream (training/dropout.py): the layer's arithmetic on a
hand-computed case, the draw order in train_local, reproducibility whatever torch's global
generator holds, and the vectorized engine training such a model (no fallback) equal to the
reference."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from helpers import assert_close, build_loop
from torch import nn

from fedhet.data.federated import build_federation
from fedhet.engine.vectorized import Vectorized
from fedhet.experiment.config import load_config
from fedhet.models import build_model
from fedhet.models.base import SplitModel
from fedhet.training.dropout import MASK_PREFIX, StreamDropout, draw_masks, dropout_layers, masks_applied

DEVICE = os.environ.get("FEDHET_TEST_DEVICE", "cpu")


def test_stream_dropout_scales_the_kept_entries_and_zeroes_the_others():
    layer = StreamDropout(0.25)
    layer.mask_key = "d"
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    keep = torch.tensor([[True, False, True, True]])
    with masks_applied({MASK_PREFIX + "d": keep}):
        out = layer(x)
    assert out[0].tolist() == pytest.approx([1 / 0.75, 0.0, 3 / 0.75, 4 / 0.75])
    layer.eval()
    with masks_applied({MASK_PREFIX + "d": keep}):
        assert torch.equal(layer(x), x)                 # evaluation: the identity
    assert isinstance(layer, nn.Dropout) and layer.p == 0.25


def test_masks_are_drawn_per_layer_in_module_order_from_the_stream():
    model = build_model("pfl_cnn", 3, 10, 32)
    layers = dropout_layers(model, (3, 32, 32))
    assert [(name, p, shape) for name, p, shape in layers] == [
        ("body.conv2.3", 0.25, (64, 14, 14)), ("head.fc2.0", 0.5, (128,))]
    masks = draw_masks(model, (3, 32, 32), 5, torch.Generator().manual_seed(7))
    gen = torch.Generator().manual_seed(7)
    first = torch.rand((5, 64, 14, 14), generator=gen) >= 0.25
    second = torch.rand((5, 128), generator=gen) >= 0.5
    assert torch.equal(masks["dropout.body.conv2.3"], first) and torch.equal(masks["dropout.head.fc2.0"], second)
    # a model without StreamDropout draws nothing: its runs' streams are what they were
    assert draw_masks(build_model("cnn2", 1, 10, 28), (1, 28, 28), 5, torch.Generator()) == {}


def dropout_model(channels: int = 1, size: int = 28) -> SplitModel:
    """A smooth CNN (tanh, average pooling: no kink for rounding to flip) with two dropout layers."""
    torch.manual_seed(5)
    side = ((size - 2) // 2 - 2) // 2
    stages = [
        ("conv1", nn.Sequential(nn.Conv2d(channels, 8, 3), nn.Tanh(), nn.AvgPool2d(2), StreamDropout(0.25))),
        ("conv2", nn.Sequential(nn.Conv2d(8, 16, 3), nn.Tanh(), nn.AvgPool2d(2), nn.Flatten())),
        ("fc1", nn.Sequential(nn.Linear(16 * side * side, 64), nn.Tanh())),
        ("fc2", nn.Sequential(StreamDropout(0.5), nn.Linear(64, 10))),
    ]
    return SplitModel(stages, "fc2", (channels, size, size))


def config(small_config, algorithm="fedavg", params=None, **train):
    raw = copy.deepcopy(small_config)
    raw["data"]["partition"] = {"kind": "quantity_skew", "alpha": 0.3, "min_size": 5}
    raw["algorithm"] = {"name": algorithm, "params": params or {}}
    raw["train"].update({"momentum": 0.5, "lr": 0.05, "clients_per_round": 6, **train})
    return load_config(raw=raw)


def _weights(loop) -> dict[str, torch.Tensor]:
    """Every tensor the round left: the server's and each client's state, flattened by name."""
    out = {f"server.{k}": v for k, v in loop.server_state.items() if isinstance(v, torch.Tensor)}
    out.update({f"server.model.{k}": v for k, v in loop.server_state["model"].items()})

    def walk(prefix, obj):
        if isinstance(obj, torch.Tensor):
            out[prefix] = obj
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}.{k}", v)
    for cid, state in loop.client_states.items():
        walk(f"client{cid}", state)
    return out


@pytest.mark.parametrize(("algorithm", "params", "train"), [
    ("fedavg", None, {}),
    # their own passes with the model in training mode or left in it: Per-FedAvg's meta-steps (FO,
    # HF with both Hessian-vector products) and its evaluation-time adaptation; FedRoD's generic
    # features for the personal head; SCAFFOLD's full gradient
    ("perfedavg", None, {"momentum": 0.0}),
    ("perfedavg", {"perfedavg_variant": "hf"}, {"momentum": 0.0}),
    ("perfedavg", {"perfedavg_variant": "hf", "perfedavg_hvp": "finite_difference"}, {"momentum": 0.0}),
    ("fedrod", None, {}),
    ("scaffold", {"option": "I"}, {"momentum": 0.0}),    # its full gradient over the client's data
], ids=["fedavg", "perfedavg-fo", "perfedavg-hf", "perfedavg-hf-fd", "fedrod", "scaffold-I"])
def test_a_run_with_dropout_does_not_depend_on_the_global_generator(small_config, algorithm, params, train):
    cfg = config(small_config, algorithm, params, **train)
    fed = build_federation(cfg.data, cfg.seed)
    finals = []
    for global_seed in (1, 2):
        loop = build_loop(cfg, fed=fed, models={"cnn2": dropout_model()})
        torch.manual_seed(global_seed)
        loop.run_round(0, evaluating=True)
        finals.append(_weights(loop))
    assert finals[0].keys() == finals[1].keys()
    assert all(torch.equal(finals[0][k], finals[1][k]) for k in finals[0]), \
        [k for k in finals[0] if not torch.equal(finals[0][k], finals[1][k])][:5]
    # and the masks act: without them (dropout off) the round ends elsewhere
    off = build_loop(cfg, fed=fed, models={"cnn2": dropout_model().eval()})
    for m in off.host.models["cnn2"].modules():
        if isinstance(m, StreamDropout):
            m.p = 0.0
    off.run_round(0, evaluating=True)
    assert not all(torch.equal(finals[0][k], _weights(off)[k]) for k in finals[0])


def test_fedremas_probe_of_a_classifier_with_dropout_is_a_measurement_without_noise():
    """The soft logits of the probe feature (FedReMa Sec. 4.1) come from the head in eval mode,
    whatever mode local training left the model in, and leave that mode as it was."""
    from fedhet.algorithms.fedrema import probe_feature, soft_logits
    from fedhet.core.split import HEAD, select

    model = dropout_model().train()
    head = select(dict(model.state_dict()), HEAD)
    probe = probe_feature(3, model.feature_dim)
    seen = []
    for global_seed in (1, 2):
        torch.manual_seed(global_seed)
        seen.append(soft_logits(model, head, probe, temperature=0.5))
    assert torch.equal(seen[0], seen[1]) and model.head.training
    with torch.no_grad():
        expected = torch.softmax(model.eval().head(probe.unsqueeze(0)).double() / 0.5, dim=1).squeeze(0)
    torch.testing.assert_close(seen[0], expected)


@pytest.mark.parametrize(("algorithm", "wide", "optimizer"), [("fedavg", None, "sgd"), ("fedavg", True, "sgd"),
                                                              ("fedclassavg", None, "adam")],
                         ids=["sgd", "sgd-wide", "supcon-views-adam"])
def test_dropout_models_train_vectorized_and_equal_reference(small_config, algorithm, wide, optimizer):
    """No fallback (dropout used to send every client to the reference path), and the engines agree
    to rounding: the same masks from the same streams, the same arithmetic. FedClassAvg's two views
    double the rows the masks cover."""
    extra = {"optimizer": "adam", "betas": (0.5, 0.999), "lr": 1e-3, "momentum": 0.0} if optimizer == "adam" else {}
    cfg = config(small_config, algorithm, **extra)
    fed = build_federation(cfg.data, cfg.seed)
    engine = Vectorized(device=DEVICE, fallback_on_error=False, graph_min_repeats=2, wide_steps=wide)
    loops = [build_loop(cfg, transport, fed=fed, models={"cnn2": dropout_model()}) for transport in (None, engine)]
    if optimizer == "adam":
        from dataclasses import replace
        for loop in loops:
            loop.host.settings = replace(loop.host.settings, eps=1e-3)
    for rnd in range(2):
        for loop in loops:
            loop.run_round(rnd)
    ref, vec = loops
    assert engine.counters["fallback_requests"] == 0 and engine.counters["vectorized_requests"] > 0, \
        engine.fallback_reasons
    if wide:
        assert engine.counters["idle_rows"] > 0
    assert_close(ref.server_state, vec.server_state, 1e-6 if DEVICE == "cpu" else 1e-4, 1e-5, "server_state")
    assert_close(ref.client_states, vec.client_states, 1e-6 if DEVICE == "cpu" else 1e-4, 1e-5, "client_states")


def test_a_training_pass_without_masks_says_once_that_it_draws_from_the_global_generator():
    """A method's own loop that draws no masks: torch's dropout, named once a layer, not silently."""
    import warnings

    layer = StreamDropout(0.5)
    layer.mask_key = "head.unmasked_for_this_test"
    x = torch.ones(4, 8)
    with pytest.warns(RuntimeWarning, match="dropout layer head.unmasked_for_this_test ran in training mode "
                                            "without masks .* fedhet.extend.batch_masks"):
        layer(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layer(x)                                          # said once
        with masks_applied({MASK_PREFIX + layer.mask_key: torch.ones(4, 8, dtype=torch.bool)}):
            assert torch.equal(layer(x), x * 2)           # with masks: none said, the masks applied
