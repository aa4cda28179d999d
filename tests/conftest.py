import json
import os
import pickle
import resource
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from helpers import small_config_in  # noqa: E402
from synthetic import write_fashion_mnist  # noqa: E402

# Small models at small batches gain little from intra-op threads, and two multi-threaded torch
# processes on a small machine (tests beside a benchmark) slow each other down by 10x or more.
torch.set_num_threads(1)
# The processes tests start (runs, a sweep's runs, Flower's nodes) too: on 2 cores beside the test
# workers, a two-thread torch process spins at its OpenMP barriers while its other thread waits for
# a core (the tutorial's sweep test took 153 s in the whole suite, 24 s alone).
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True)
def one_intra_op_thread():
    """Put torch back on one thread after each test. A run whose config or CLI names run.threads
    sets the process-wide count, and float sums depend on it: a later test on the same worker
    then compared two evaluations summed in different orders (it failed one CI run)."""
    yield
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def sweep_lanes_plan_for_one_cpu(monkeypatch):
    """A sweep's lanes split the usable CPUs between them and pass each run ``--threads`` (past
    OMP_NUM_THREADS above): a one-lane sweep's runs took both cores and spun at their thread
    barriers against the other test workers (test_sweep's CPU seconds:
    benchmarks/results/test_suite_time.md). In tests a sweep plans for one CPU; tests of the split
    set ``usable_cpus`` themselves, and sweeps started as processes pass ``--set run.threads=1``."""
    import fedhet.experiment.sweep.lanes as lanes

    monkeypatch.setattr(lanes, "usable_cpus", lambda: 1)


@pytest.fixture(autouse=True)
def leaf_cache_in_the_tests_folder(tmp_path_factory, monkeypatch):
    """FEMNIST files parsed by tests are kept in the session's temporary folder, never in the
    user's home (each test's files have their own paths, so their own cache entries)."""
    from fedhet.data.datasets import femnist

    folder = tmp_path_factory.getbasetemp() / "leaf-cache"
    monkeypatch.setattr(femnist, "_leaf_cache_dir", lambda: folder)


@pytest.fixture(autouse=True)
def flower_home_in_the_tests_folder(tmp_path_factory, monkeypatch):
    """Flower nodes without a state directory of their own commit under $FLWR_HOME: the session's
    temporary folder, never the user's ~/.flwr (which kept every test run's commits, 1.3 GB)."""
    monkeypatch.setenv("FLWR_HOME", str(tmp_path_factory.getbasetemp() / "flwr-home"))


@pytest.fixture
def determinism_restored():
    """Torch's deterministic-algorithm settings and CUBLAS_WORKSPACE_CONFIG put back after a test that
    runs with ``run.deterministic`` (process-wide, like the thread count), the variable unset during it."""
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,
              os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None))
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[2], before[3]
    os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    if before[4] is not None:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = before[4]


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
    return small_config_in(synth_root, tmp_path / "runs")


# --- the paper configs' datasets in their real formats (CIFAR pickles, CINIC-10 PNG folders) ---

CINIC_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


def balanced_batch(num_classes: int, per_class: int, label_key: bytes, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    labels = np.repeat(np.arange(num_classes), per_class)
    return {b"batch_label": b"batch", b"data": rng.integers(0, 256, (labels.size, 3072), dtype=np.uint8),
            label_key: labels.tolist(), b"filenames": [b"x.png"] * labels.size}


def dump(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pickle.dumps(obj, protocol=2))


@pytest.fixture(scope="session")
def data_root(tmp_path_factory) -> Path:
    """CIFAR-10 / CIFAR-100 python pickles and CINIC-10 PNG folders, 50-90 images per class
    (NIID-2 cuts every class into 50 shards, CINIC-10's into 90)."""
    from PIL import Image

    root = tmp_path_factory.mktemp("papers_data")
    for i in range(1, 6):
        dump(root / "cifar-10-batches-py" / f"data_batch_{i}", balanced_batch(10, 12, b"labels", i))
    dump(root / "cifar-10-batches-py" / "test_batch", balanced_batch(10, 2, b"labels", 9))
    train = balanced_batch(100, 50, b"fine_labels", 1)
    test = balanced_batch(100, 1, b"fine_labels", 2)
    for name, batch in (("train", train), ("test", test)):
        batch[b"coarse_labels"] = [0] * len(batch[b"fine_labels"])
        dump(root / "cifar100" / "cifar-100-python" / name, batch)
    rng = np.random.default_rng(0)
    for split, per_class in (("train", 90), ("test", 2)):
        for cls in CINIC_CLASSES:
            folder = root / "cinic-10" / split / cls
            folder.mkdir(parents=True)
            for i in range(per_class):
                Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    return root


def pytest_collection_modifyitems(config, items):
    """The real Flower deployments first: they take minutes each, mostly waiting on Flower, so
    under pytest-xdist (scripts/test.sh) they should start at once beside the others rather than
    be the last tests running, alone."""
    items.sort(key=lambda item: item.get_closest_marker("deploy") is None)


# FEDHET_TEST_CPU_LOG=path: one JSON line per test with its wall time and the CPU seconds it used,
# in the test process and in the child processes it waited for (CLI runs, Flower processes);
# under pytest-xdist the CPU figures, unlike the wall times, do not count waiting for a core.
# scripts/test_cpu_table.py sums them per file.
if os.environ.get("FEDHET_TEST_CPU_LOG"):

    def _cpu_seconds() -> tuple[float, float]:
        own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        (own0, kids0), wall0 = _cpu_seconds(), time.monotonic()
        yield
        (own1, kids1), wall1 = _cpu_seconds(), time.monotonic()
        # start (Unix seconds) and worker: the run's timeline, where cores stood idle (--timeline)
        line = json.dumps({"test": item.nodeid, "wall": round(wall1 - wall0, 3), "cpu": round(own1 - own0, 3),
                           "children_cpu": round(kids1 - kids0, 3), "start": round(time.time() - (wall1 - wall0), 3),
                           "worker": os.environ.get("PYTEST_XDIST_WORKER", "main")})
        with open(os.environ["FEDHET_TEST_CPU_LOG"], "a") as f:      # one short appended line: atomic
            f.write(line + "\n")
