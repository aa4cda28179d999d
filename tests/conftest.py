import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from synthetic import write_fashion_mnist  # noqa: E402

# Small models at small batches gain little from intra-op threads, and two multi-threaded torch
# processes on a small machine (tests beside a benchmark) slow each other down by 10x or more.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def synth_root(tmp_path_factory) -> Path:
    """A small learnable dataset in the real Fashion-MNIST IDX format."""
    return write_fashion_mnist(tmp_path_factory.mktemp("data"))


@pytest.fixture
def cnn_client():
    """(model, ClientData of 60 random images, a copy of the model's weights) for local-training tests."""
    from fedhet.core.contract import ClientData
    from fedhet.models import build_model

    torch.manual_seed(0)
    model = build_model("cnn2", in_channels=1, num_classes=10, image_size=28)
    x = torch.randint(0, 256, (70, 1, 28, 28), dtype=torch.uint8)
    y = torch.randint(0, 10, (70,))
    data = ClientData(x, y, torch.arange(5, 65), torch.full((1, 1, 1, 1), 0.3), torch.full((1, 1, 1, 1), 0.3))
    return model, data, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.fixture
def small_config(synth_root, tmp_path):
    """A raw config dict for a fast end-to-end FedAvg run on the synthetic data."""
    return {
        "name": "tiny",
        "seed": 3,
        "data": {"root": str(synth_root), "verify": False, "num_clients": 6,
                 "partition": {"kind": "dirichlet", "alpha": 0.5, "min_size": 20},
                 "local_test": {"source": "test_set", "fraction": 0.2}},
        "model": {"arch": "cnn2"},
        "algorithm": {"name": "fedavg"},
        "train": {"rounds": 3, "clients_per_round": 3, "local_epochs": 1, "batch_size": 32, "lr": 0.05},
        "eval": {"every": 1, "final_window": 2},
        "run": {"out_dir": str(tmp_path / "runs"), "checkpoint_every": 2, "progress": False},
    }
