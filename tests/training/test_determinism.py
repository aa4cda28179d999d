"""fedhet.training.determinism: what run.deterministic asks of torch, and the one case it refuses."""

from __future__ import annotations

import os

import pytest
import torch

from fedhet.core.errors import ConfigError
from fedhet.training.determinism import use_deterministic_algorithms


def test_it_asks_for_deterministic_kernels_and_the_cublas_setting(determinism_restored):
    torch.backends.cudnn.benchmark = True
    use_deterministic_algorithms()
    assert torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"


def test_a_deterministic_cublas_setting_of_the_environment_is_kept(determinism_restored, monkeypatch):
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":16:8"
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)     # set before CUDA started: fine
    use_deterministic_algorithms()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8" and torch.are_deterministic_algorithms_enabled()


@pytest.mark.parametrize("value", [None, ":0:0"])
def test_cuda_used_before_the_cublas_setting_is_refused_with_what_to_do(determinism_restored, monkeypatch, value):
    """torch reads CUBLAS_WORKSPACE_CONFIG once, at the process's first CUDA matrix product: set
    after CUDA has run, it would not count and the run would fail at its first product."""
    if value is not None:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = value
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(ConfigError, match="new process.*CUBLAS_WORKSPACE_CONFIG=:4096:8"):
        use_deterministic_algorithms()
    assert not torch.are_deterministic_algorithms_enabled() and os.environ.get("CUBLAS_WORKSPACE_CONFIG") == value
