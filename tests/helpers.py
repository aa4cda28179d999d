"""Helpers shared by the tests (one place for each): configs, loops built like the runner builds
them, round contexts, and exact / tolerant comparison of nested states."""

from __future__ import annotations

import copy

import numpy as np
import torch
from torch import nn

from fedhet.core.contract import RoundContext
from fedhet.data.federated import build_federation
from fedhet.engine import ClientHost, RoundLoop
from fedhet.engine.host import Tally
from fedhet.experiment.build import build_models, make_algorithm, train_settings
from fedhet.experiment.config import load_config
from fedhet.models.base import SplitModel


def config(small_config: dict, algorithm: str = "fedavg", params: dict | None = None, **train):
    """``small_config`` with another algorithm and train settings, validated."""
    raw = copy.deepcopy(small_config)
    raw["algorithm"] = {"name": algorithm, "params": dict(params or {})}
    raw["train"].update(train)
    return load_config(raw=raw)


def build_host(cfg, fed=None, models=None, algorithm=None, precision: str = "fp32") -> ClientHost:
    fed = fed or build_federation(cfg.data, cfg.seed)
    built_models, client_arch = build_models(cfg, fed)
    return ClientHost(algorithm or make_algorithm(cfg), fed, models or built_models, client_arch,
                      train_settings(cfg, precision), cfg.seed)


def build_loop(cfg, transport=None, **host_options) -> RoundLoop:
    """A round loop built as the runner builds it, on ``transport`` (default: in-process)."""
    return RoundLoop(build_host(cfg, **host_options), cfg.train.clients_per_round, transport)


def ctx(clients, num_classes: int = 10, rnd: int = 0, num_clients: int | None = None, sizes=None,
        evaluating: bool = False) -> RoundContext:
    """A round context by hand (sizes: one int for all clients, a dict, or None for 100 each)."""
    n = num_clients or (max(clients) + 1)
    if sizes is None or isinstance(sizes, int):
        sizes = {c: sizes or 100 for c in range(n)}
    return RoundContext(round=rnd, clients=list(clients), num_clients=n, num_classes=num_classes,
                        client_sizes=sizes, rng=np.random.default_rng(0), evaluating=evaluating)


def runtime(loop: RoundLoop, cid: int, rnd: int = 0):
    """The in-process client runtime of ``cid`` in round ``rnd`` (a fresh round tally)."""
    return loop.host.runtime(cid, rnd, Tally())


def assert_identical(a, b, where: str = "state") -> None:
    """Exact equality of nested states: tensors bit for bit (dtype and shape too)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            assert_identical(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, f"{where}[{i}]")
    else:
        assert a == b or (a != a and b != b), f"{where}: {a!r} != {b!r}"     # NaN equals NaN here


def assert_close(a, b, atol: float, rtol: float = 1e-5, where: str = "state", atol_for=None) -> None:
    """Nested states equal to float tolerance (integer tensors and plain non-float values exactly;
    Python floats to rel 1e-3).
    ``atol_for(where)``, if given, picks the tolerance per entry (e.g. looser for control variates)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype, where
        if a.is_floating_point():
            tol = atol_for(where) if atol_for else atol
            torch.testing.assert_close(b, a, atol=tol, rtol=rtol, msg=lambda m: f"{where}: {m}")
        else:
            assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert set(a) == set(b), where
        for k in a:
            assert_close(a[k], b[k], atol, rtol, f"{where}.{k}", atol_for)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_close(x, y, atol, rtol, f"{where}[{i}]", atol_for)
    elif isinstance(a, float):          # statistics computed from the weights (FedACD's KL per client)
        import pytest

        assert b == pytest.approx(a, rel=1e-3, abs=atol_for(where) if atol_for else atol), where
    else:
        assert a == b, where


def deliver(loop: RoundLoop, cid: int, msg, rnd: int, stats):
    """One client's message through the loop, as a one-client phase; its reply."""
    return loop.deliver_phase({cid: msg}, rnd, stats)[cid]


def run_killed_in_round(exp, monkeypatch, rnd: int) -> None:
    """Run ``exp`` until a KeyboardInterrupt hits it at the start of 0-based round ``rnd`` (as a
    kill would); the rounds before are recorded and checkpointed as in a real run."""
    import pytest

    real = exp.loop.run_round

    def interrupted(r, *args):
        if r == rnd:
            raise KeyboardInterrupt
        return real(r, *args)

    monkeypatch.setattr(exp.loop, "run_round", interrupted)
    with pytest.raises(KeyboardInterrupt):
        exp.run(progress=False)


def bn_model(projection_dim=None, split="fc2", batch_norm: bool = True, channels: int = 1,
             size: int = 28) -> SplitModel:
    """A small CNN with BatchNorm for ``channels`` x ``size`` x ``size`` inputs (default 1x28x28; the
    library's BN models are the ResNets, too slow for most tests).

    Smooth (tanh, average pooling): no ReLU kink or max-pool tie for rounding to flip, so the
    engine-equivalence tests hold it to rounding (their TIGHT). ``batch_norm=False`` leaves the
    BatchNorm layers out (Identity): a convolution's bias before BatchNorm has an exactly zero
    gradient, i.e. rounding noise, which Adam's normalisation blows up to steps of lr.
    """
    torch.manual_seed(11)
    side = ((size - 2) // 2 - 2) // 2      # after two 3x3 convolutions, each followed by 2x2 pooling

    def norm(width: int) -> nn.Module:
        return nn.BatchNorm2d(width) if batch_norm else nn.Identity()

    stages = [
        ("conv1", nn.Sequential(nn.Conv2d(channels, 8, 3), norm(8), nn.Tanh(), nn.AvgPool2d(2))),
        ("conv2", nn.Sequential(nn.Conv2d(8, 16, 3), norm(16), nn.Tanh(), nn.AvgPool2d(2), nn.Flatten())),
        ("fc1", nn.Sequential(nn.Linear(16 * side * side, 64), nn.Tanh())),
        ("fc2", nn.Linear(64, 10)),
    ]
    model = SplitModel(stages, split, (channels, size, size))
    if projection_dim:
        model.add_projection(projection_dim)
    return model
