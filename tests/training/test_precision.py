"""Precision: bf16 autocast trains with fp32 master weights; fp32 is bit-reproducible; `auto`."""

import copy
import json
import warnings

import pytest
import torch

from fedhet.core.contract import ClientData, TrainSettings
from fedhet.data.federated import build_federation
from fedhet.experiment.build import build_models, resolve_precision
from fedhet.experiment.config import load_config
from fedhet.experiment.runner import Experiment
from fedhet.training import precision as local
from fedhet.training.local import train_local
from fedhet.training.objective import CrossEntropy
from fedhet.training.precision import bf16_native


@pytest.fixture
def client(small_config):
    cfg = load_config(raw=copy.deepcopy(small_config))
    fed = build_federation(cfg.data, cfg.seed)
    models, arch = build_models(cfg, fed)
    model = models[arch[0]]
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    idx = fed.train_idx[0]        # one client (301 images): bf16 is emulated, so slow, on CPUs without AVX512-BF16
    return model, weights, ClientData(fed.pool.x, fed.pool.y, idx, fed.mean, fed.std)


def train(client, precision, epochs=1, momentum=0.0, weights=None):
    model, w0, data = client
    settings = TrainSettings(epochs=epochs, batch_size=32, lr=0.05, momentum=momentum, precision=precision)
    return train_local(model, weights or w0, data, [CrossEntropy()], settings,
                       lambda e: torch.Generator().manual_seed(100 + e))


def mean_loss(client, weights):
    model, _, data = client
    model.eval()
    with torch.no_grad():
        logits = torch.func.functional_call(model, weights, (data.inputs(data.train_idx),))
    model.train()
    return float(torch.nn.functional.cross_entropy(logits, data.y[data.train_idx]))


def test_bf16_trains_with_fp32_master_weights(client):
    _, w0, _ = client
    res = train(client, "bf16", epochs=2, momentum=0.9)
    for k, v in res.weights.items():
        assert v.dtype == w0[k].dtype == torch.float32 and v.is_contiguous(), k   # fp32 masters, default layout
    assert all(b.dtype == torch.float32 and b.is_contiguous() for b in res.optimizer_state.values())
    assert mean_loss(client, res.weights) < 0.7 * mean_loss(client, w0)
    fp32 = train(client, "fp32", epochs=2, momentum=0.9)
    assert abs(mean_loss(client, res.weights) - mean_loss(client, fp32.weights)) < 0.1
    assert any(not torch.equal(res.weights[k], fp32.weights[k]) for k in w0)        # bf16 really ran
    again = train(client, "bf16", epochs=1, momentum=0.9, weights=res.weights)      # momentum state reusable
    assert all(torch.isfinite(v).all() for v in again.weights.values())


def test_fp32_is_bit_reproducible_and_leaves_inputs_alone(client):
    _, w0, _ = client
    before = {k: v.clone() for k, v in w0.items()}
    a, b = train(client, "fp32", epochs=2, momentum=0.5), train(client, "fp32", epochs=2, momentum=0.5)
    for k in w0:
        assert torch.equal(a.weights[k], b.weights[k]) and torch.equal(w0[k], before[k]), k
    assert a.mean_loss == b.mean_loss


def test_auto_is_fp32_when_switched_off_else_follows_the_hardware(monkeypatch):
    assert resolve_precision("fp32") == "fp32" and resolve_precision("bf16") == "bf16"
    monkeypatch.setattr(local, "AUTO_BF16", False)
    assert resolve_precision("auto") == "fp32"
    monkeypatch.setattr(local, "AUTO_BF16", True)
    monkeypatch.setattr(local, "bf16_native", lambda device="cpu": device == "cpu")
    assert resolve_precision("auto", "cpu") == "bf16"
    assert resolve_precision("auto", "cuda") == "fp32"
    assert isinstance(bf16_native("cpu"), bool) and bf16_native("no-such-device") is False


def test_precision_and_capability_are_recorded(small_config, tmp_path, monkeypatch):
    import fedhet.experiment.runner as runner

    raw = copy.deepcopy(small_config)
    raw["train"]["rounds"] = 1
    raw["run"]["precision"] = "bf16"
    # the summary records what the capability check says for the run's device (the opposite of
    # this machine's answer here, so that a value recorded some other way shows)
    claimed = not bf16_native("cpu")
    asked = []
    monkeypatch.setattr(runner, "bf16_native", lambda device: asked.append(device) or claimed)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exp = Experiment.create(load_config(raw=raw), tmp_path / "bf16")
    emulated = [str(w.message) for w in caught if "has no native bf16" in str(w.message)]
    # bf16 asked for where it is emulated is said (auto never takes it there)
    assert emulated == ([] if claimed else ["run.precision: bf16 trains on cpu, which has no native bf16 (emulated: "
                                            "often slower than fp32, bf16_native: false in summary.json); "
                                            "run.precision: auto takes bf16 only where it is native"])
    exp.run(progress=False)
    summary = json.loads((exp.run_dir / "summary.json").read_text())
    assert summary["precision"] == "bf16" and summary["bf16_native"] is claimed and "cpu" in asked
    assert summary["engine"]["engine"] == "reference"
