"""run.memory_format: the layout local training's convolutions run in, and what it may change."""

import pytest
import torch
from helpers import conv_layouts

import fedhet
from fedhet.core.contract import ClientData, TrainSettings
from fedhet.core.errors import ConfigError
from fedhet.training.local import train_local
from fedhet.training.objective import CrossEntropy


def train(client, memory_format, precision="fp32", rows=None):
    model, data, w0 = client
    if rows is not None:
        data = ClientData(data.x, data.y, data.train_idx[:rows], data.mean, data.std)
    settings = TrainSettings(epochs=1, batch_size=32, lr=0.05, momentum=0.9, precision=precision,
                             memory_format=memory_format)
    return train_local(model, w0, data, [CrossEntropy()], settings, lambda e: torch.Generator().manual_seed(7 + e))


@pytest.mark.parametrize("memory_format, precision, channels_last", [
    ("auto", "fp32", False), ("contiguous", "fp32", False), ("channels_last", "fp32", True),
    ("auto", "bf16", True), ("contiguous", "bf16", False)])
def test_convolutions_train_in_the_layout_asked_for(cnn_client, memory_format, precision, channels_last):
    # every convolution call's input and weights, the first convolution's one-channel ones included
    # (is_contiguous(memory_format=...) holds for both layouts there; the strides tell them apart)
    inputs, weights = conv_layouts(cnn_client[0]), conv_layouts(cnn_client[0], of="weight")
    train(cnn_client, memory_format, precision, rows=40)
    assert len(inputs) == len(weights) == 2 * 2                         # two convolutions, two batches
    assert set(inputs) == set(weights) == {channels_last}


def test_channels_last_trains_the_same_model_up_to_rounding(cnn_client):
    default, last = train(cnn_client, "contiguous"), train(cnn_client, "channels_last")
    assert all(t.is_contiguous() for t in last.weights.values())        # weights leave in the default layout
    assert all(t.is_contiguous() for t in last.optimizer_state.values())
    assert last.steps == default.steps and last.samples == default.samples
    # The layouts sum the convolutions in different orders: rounding, and now and then a ReLU or
    # max-pool decided the other way within rounding, which moves a few entries by a step's share of
    # one sample's gradient (tests/engine/test_engine_vectorized.py derives that bound). The bulk
    # agrees to rounding; a wrong layout (transposed channels, say) moves the model by order one.
    for name, t in default.weights.items():
        distance = (last.weights[name] - t).norm() / t.norm().clamp_min(1e-12)
        assert distance < 1e-3, (name, float(distance))
    assert last.mean_loss == pytest.approx(default.mean_loss, rel=1e-4)


def test_an_unknown_layout_is_refused():
    with pytest.raises(ValueError, match="memory_format: expected one of auto, contiguous, channels_last, got 'nhwc'"):
        TrainSettings(epochs=1, batch_size=8, lr=0.1, memory_format="nhwc")


def test_the_vectorized_engine_refuses_channels_last(small_config, tmp_path):
    with pytest.raises(ConfigError, match="run.memory_format: channels_last is how the reference and parallel engines "
                                          "train; the vectorized engine trains in the default layout"):
        fedhet.run(small_config, {"run.engine": "vectorized", "run.memory_format": "channels_last"},
                   out=tmp_path / "v")
    assert not (tmp_path / "v" / "metrics.jsonl").exists()


@pytest.fixture
def fast_calls(monkeypatch) -> list[int]:
    """Records each tensor the statistics passes put in channels_last: one entry per fast pass's batch."""
    from fedhet.algorithms import prototypes

    calls: list[int] = []
    real = prototypes.channels_last
    monkeypatch.setattr(prototypes, "channels_last", lambda t: calls.append(t.dim()) or real(t))
    return calls


@pytest.mark.parametrize("algorithm, params", [
    ("fedacd", {}), ("fedproto", {}), ("fedrema", {"algorithm.params.feature_alignment": True}),
    ("fedfm", {"algorithm.params.start_round": 0, "algorithm.params.lam": 1.0}),    # anchors from round 1
    ("fednh", {"model.arch": "simple_cnn"}), ("fedpac", {})])                          # FedNH: a bias-free head
def test_statistics_passes_that_feed_training_are_fast_exactly_when_training_is_in_channels_last(
        small_config, tmp_path, fast_calls, algorithm, params):
    """FedACD's probability matrix and the prototypes of FedProto, FedReMa+F, FedFM, FedNH and FedPAC:
    evaluation's faster passes (rows per thread, channels_last: other last bits) in a channels_last
    run, training's own passes otherwise."""
    for memory_format, fast in (("auto", False), ("channels_last", True)):
        fast_calls.clear()
        res = fedhet.run(small_config, {"algorithm.name": algorithm, "train.rounds": 1, "run.engine": "reference",
                                        "run.memory_format": memory_format, **params},
                         out=tmp_path / memory_format / algorithm)
        assert bool(fast_calls) is fast, (memory_format, len(fast_calls))
        assert res.summary["memory_format"] == ("channels_last" if fast else "contiguous")   # the layout it ran in


def test_the_summary_counts_the_vectorized_requests_that_trained_in_channels_last(small_config, tmp_path):
    """bf16 with memory_format auto: the vmapped groups train in the default layout, the requests the
    vectorized engine sends to the reference path (Adam with carried state, from round 2) in
    channels_last, as the reference engine would."""
    res = fedhet.run(small_config, {"train.rounds": 2, "run.engine": "vectorized", "run.precision": "bf16",
                                    "train.optimizer": "adam", "train.lr": 1e-3, "train.optimizer_state": "keep",
                                    "algorithm.name": "local"}, out=tmp_path / "run")
    engine = res.summary["engine"]
    assert engine["vectorized_requests"] > 0 and engine["fallback_requests"] > 0
    assert res.summary["memory_format"] == "contiguous"                  # the vmapped groups' layout
    assert res.summary["channels_last_requests"] == engine["fallback_requests"]


def test_fedacds_clean_score_pass_is_fast_exactly_when_training_is_in_channels_last(small_config, tmp_path,
                                                                                  monkeypatch):
    """score_from: clean adds a P pass of the trained model: it takes the layout's passes like the
    pass before training."""
    from fedhet.algorithms import fedacd

    asked = []
    real = fedacd.local_probability_matrix
    monkeypatch.setattr(fedacd, "local_probability_matrix",
                        lambda *a, fast_passes=False, **k: asked.append(fast_passes) or real(*a, fast_passes=fast_passes, **k))
    for memory_format, fast in (("auto", False), ("channels_last", True)):
        asked.clear()
        fedhet.run(small_config, {"algorithm.name": "fedacd", "algorithm.params.score_from": "clean",
                                  "train.rounds": 1, "train.clients_per_round": 2, "run.engine": "reference",
                                  "run.memory_format": memory_format}, out=tmp_path / memory_format)
        assert asked == [fast] * 4, (memory_format, asked)      # 2 clients: before training and after


def test_class_means_takes_trainings_own_passes_unless_asked(small_config, fast_calls):
    """A caller of class_means (a method of one's own) gets training's passes by default, and
    evaluation's faster ones only when it asks (fast_passes=True)."""
    from helpers import build_loop, config, runtime

    from fedhet.algorithms import prototypes

    loop = build_loop(config(small_config, "fedproto"))
    client = runtime(loop, 0)
    weights = next(iter(loop.host.init_models.values()))
    plain = prototypes.class_means(client.model, weights, client.data, client.num_classes)
    assert not fast_calls
    fast = prototypes.class_means(client.model, weights, client.data, client.num_classes, fast_passes=True)
    assert fast_calls
    torch.testing.assert_close(fast[0], plain[0], rtol=1e-4, atol=1e-5)
    assert torch.equal(fast[1], plain[1])
