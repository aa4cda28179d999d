"""Every FedFM paper config (configs/papers/fedfm) parses, and the CIFAR-10/CINIC-10/CIFAR-100
and FEMNIST ones build their partition and model on small files written in the datasets' real
formats (the real archives cannot be downloaded here)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fedhet.data.federated import build_federation
from fedhet.experiment.build import build_models
from fedhet.experiment.config import load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "papers" / "fedfm"
FILES = sorted(CONFIGS.glob("*.yaml"))
FEMNIST = [f for f in FILES if f.name.startswith("femnist")]
CIFAR_LIKE = [f for f in FILES if not f.name.startswith(("fmnist", "femnist"))]
BASELINES = ["fedavg", "fedavgm", "fedprox", "scaffold", "feddyn", "fednova", "moon", "fedfm"]   # Tables III, IV, VI


def test_the_generator_wrote_every_file():
    r = subprocess.run([sys.executable, str(CONFIGS / "generate.py"), "--check"], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    # Table III 48, Table IV 40, Table VI 32, Table IX 8, Table VIII 1, Sec. VII-D.6 1, Table VII 6, Fashion-MNIST 20
    assert len(CIFAR_LIKE) == 130 and len(FEMNIST) == 6 and len(FILES) == 156


def test_every_reported_cell_has_a_config():
    names = {f.stem for f in FILES}
    table_iii = {f"{d}_{p}_{m}" for d in ("cifar10", "cinic10", "cifar100") for p in ("niid1", "niid2") for m in BASELINES}
    table_iv = {f"cifar10_niid3-m{x}_{m}" for x in (1, 2, 3, 5, 7) for m in BASELINES}
    table_vi = {f"cifar100_niid1-k{k}_{m}" for k in (20, 30, 50, 100) for m in BASELINES}
    table_ix = {f"{d}_niid1_fedfm_temp{t}" for d in ("cifar10", "cifar100") for t in ("0.01", "0.1", "1", "10")}
    assert not (table_iii | table_iv | table_vi | table_ix) - names


# Hand-copied from the paper: file -> (source, value %, std % or None, K, algorithm, its params)
PAPER_CELLS = {
    "cifar10_niid1_fedavgm": ("Table III", 66.85, 0.42, 10, "fedavgm", {"server_momentum": 0.9, "server_lr": 0.1}),
    "cinic10_niid2_scaffold": ("Table III", 60.78, 0.32, 10, "scaffold", {}),
    "cifar100_niid1_feddyn": ("Table III", 43.41, 0.54, 10, "feddyn", {"alpha": 0.01}),
    "cifar100_niid2_moon": ("Table III", 62.99, 0.13, 10, "moon", {"mu": 5.0, "tau": 0.5}),
    "cifar10_niid1_fedfm": ("Table III", 72.89, 0.22, 10, "fedfm", {}),
    "cifar10_niid3-m7_moon": ("Table IV", 57.80, 1.02, 10, "moon", {"mu": 5.0, "tau": 0.5}),
    "cifar10_niid3-m5_fedprox": ("Table IV", 67.25, 0.54, 10, "fedprox", {"mu": 0.01}),   # = FedAvg's, as printed
    "cifar10_niid3-m3_scaffold": ("Table IV", 72.60, 0.22, 10, "scaffold", {}),
    "cifar100_niid1-k20_feddyn": ("Table VI", 41.90, None, 20, "feddyn", {"alpha": 0.01}),
    "cifar100_niid1-k50_fedavgm": ("Table VI", 52.86, None, 50, "fedavgm", {"server_momentum": 0.9, "server_lr": 0.1}),
    "cifar100_niid1-k100_fedfm": ("Table VI", 55.38, None, 100, "fedfm", {}),
    "cifar10_niid1_fedfm_temp0.01": ("Table IX", 70.44, None, 10, "fedfm", {"temperature": 0.01}),
    "cifar10_niid1_fedfm_temp0.1": ("Table IX", 72.41, None, 10, "fedfm", {"temperature": 0.1}),   # not Table III's 72.89
    "cifar100_niid1_fedfm_temp1": ("Table IX", 68.24, None, 10, "fedfm", {"temperature": 1.0}),
    "cifar100_niid1_fedfm_temp10": ("Table IX", 65.05, None, 10, "fedfm", {"temperature": 10.0}),
}


@pytest.mark.parametrize("stem", sorted(PAPER_CELLS))
def test_cell_states_the_papers_number_and_setting(stem):
    source, value, std, k, algo, params = PAPER_CELLS[stem]
    cfg = load_config(CONFIGS / f"{stem}.yaml")
    assert cfg.paper.source == f"FedFM (Ye et al.) {source}"
    assert cfg.paper.value == pytest.approx(value / 100, abs=1e-9)
    assert cfg.paper.std == (None if std is None else pytest.approx(std / 100, abs=1e-9))
    assert cfg.data.num_clients == k and cfg.train.clients_per_round == k       # full participation
    # CIFAR-100: every method trains on the code's augmented images (crop, flip, rotation)
    augmented = {"augment": "crop_flip_rotate"} if stem.startswith("cifar100") else {}
    assert cfg.algorithm.name == algo and cfg.algorithm.params == {**params, **augmented}
    assert cfg.model.arch == ("resnet50" if stem.startswith("cifar100") else "resnet18")
    assert cfg.model.options == {"stem": "imagenet"}
    assert (cfg.train.rounds, cfg.train.local_epochs, cfg.train.batch_size, cfg.train.lr) == (100, 10, 64, 0.01)
    assert (cfg.train.momentum, cfg.train.weight_decay) == (0.9, 1e-5)
    part = cfg.data.partition
    if "niid3" in stem:
        assert part.kind == "niid3" and part.options() == {"missing": int(stem.split("-m")[1][0])}
    elif "niid1" in stem:
        assert part.kind == "dirichlet" and part.options() == {"alpha": 0.5}
    else:
        assert part.kind == "niid2"


@pytest.mark.parametrize("path", FILES, ids=[f.stem for f in FILES])
def test_config_parses_and_states_its_number(path):
    cfg = load_config(path)
    head = path.read_text().splitlines()[0]
    assert head.startswith("# FedFM paper (Ye et al.)")
    if not path.name.startswith("fmnist"):
        assert "paper " in head and "%" in head                     # the number it corresponds to
    # the same number as a paper section (fedhet compare prints it), none for the Fashion-MNIST proxy
    stated = re.search(r"paper (\d+\.\d+)(?:±(\d+\.\d+))?%", head)
    if stated:
        assert cfg.paper is not None and cfg.paper.metric == "global_acc"
        assert cfg.paper.value == pytest.approx(float(stated.group(1)) / 100, abs=1e-9)
        assert cfg.paper.std == (stated.group(2) and pytest.approx(float(stated.group(2)) / 100, abs=1e-9))
        assert cfg.paper.source.startswith(("FedFM (Ye et al.) Table", "FedFM (Ye et al.) Sec. VII-D.6"))
        assert (path.stem == "cifar10_niid1_fedfm_l2") == ("Sec." in cfg.paper.source)   # 67.98: the text's
        # Tables III, IV and VIII print mean ± std over 3 trials; Tables VI and IX and the text do not
        assert (cfg.paper.std is not None) == cfg.paper.source.endswith(("Table III", "Table IV", "Table VIII"))
    else:
        assert cfg.paper is None
    k = int(re.search(r"-k(\d+)_", path.name).group(1)) if "-k" in path.name else 10     # Table VI's K
    if path.name.startswith("femnist"):        # Table VII: 3,150 of 3,500 writers train, 0.2% of 3,500 a round
        k, per_round = 3150, 7
    else:
        per_round = k
    assert cfg.data.num_clients == k and cfg.train.clients_per_round == per_round
    assert cfg.data.local_test.source == "holdout" and cfg.data.local_test.fraction == 0.2


# Hand-copied from the paper's Table VII (FEMNIST; no std printed)
TABLE_VII = {("v1", "fedavg"): 79.93, ("v1", "scaffold"): 67.61, ("v1", "fedfm"): 81.62,
             ("v2", "fedavg"): 81.85, ("v2", "scaffold"): 74.63, ("v2", "fedfm"): 83.05}


@pytest.mark.parametrize("version, method", sorted(TABLE_VII))
def test_table_vii_cells_hold_out_a_tenth_of_the_writers_and_sample_a_fifth_of_a_percent(version, method):
    cfg = load_config(CONFIGS / f"femnist-{version}_writers_{method}.yaml")
    assert cfg.paper.source == "FedFM (Ye et al.) Table VII" and cfg.paper.std is None and cfg.paper.rounds is None
    assert cfg.paper.value == pytest.approx(TABLE_VII[version, method] / 100, abs=1e-9)
    assert cfg.data.dataset == "femnist" and cfg.data.pool == "train+test"
    assert cfg.data.partition.kind == "natural" and cfg.data.partition.options() == {"test_writers": 0.1}
    assert (cfg.data.num_clients, cfg.train.clients_per_round) == (3150, 7)
    # v1: torchvision's 7x7/2 stem and max-pool; v2: the 3x3 stem
    assert cfg.model.arch == "resnet18" and cfg.model.options == ({"stem": "imagenet"} if version == "v1" else {})
    assert cfg.algorithm.name == method and not cfg.train.drop_last


# Hand-copied from the paper's Table V: (NMI, silhouette) of the CIFAR-10 NIID-1 runs' features
TABLE_V = {"fedavg": ("0.413", "0.036"), "feddyn": ("0.485", "0.136"), "fedfm": ("0.557", "0.173")}


@pytest.mark.parametrize("method", sorted(TABLE_V))
def test_table_v_numbers_stand_in_the_runs_configs(method):
    nmi, ss = TABLE_V[method]
    assert f"# Table V: the final global model's features, NMI {nmi}, silhouette {ss} " in (
        CONFIGS / f"cifar10_niid1_{method}.yaml").read_text()


BUILT_FEMNIST = [f for f in FEMNIST if f.stem.endswith("_fedavg")]       # v1 and v2: what the build depends on


@pytest.mark.parametrize("path", BUILT_FEMNIST, ids=[f.stem for f in BUILT_FEMNIST])
def test_femnist_configs_build_partition_and_model(path, tmp_path):
    from helpers import write_leaf_femnist

    write_leaf_femnist(tmp_path, {f"f{i:04d}_00": ([i % 62] * 4, [(i + 7) % 62] * 2) for i in range(20)})
    cfg = load_config(path, overrides=[f"data.root={tmp_path}", "data.num_clients=18", "train.clients_per_round=2"])
    fed = build_federation(cfg.data, cfg.seed)
    assert fed.num_clients == 18 and len(fed.test.y) == 12          # 2 of 20 writers' 6 images each
    models, arch = build_models(cfg, fed)
    with torch.no_grad():
        feats, logits = models[arch[0]].eval()(fed.normalize(fed.pool.x[fed.train_idx[0][:2]]), with_features=True)
    assert logits.shape == (2, 62) and feats.shape[1] == 512


def one_per_federation_and_model(paths: list[Path]) -> list[Path]:
    """The first config of each dataset, partition, client count and model: what building the
    federation and the model depends on (the method is checked by the test above)."""
    seen: dict[tuple, Path] = {}
    for path in paths:
        cfg = load_config(path)
        key = (cfg.data.dataset, repr(cfg.data.partition), cfg.data.num_clients, repr(cfg.model))
        seen.setdefault(key, path)
    return list(seen.values())


BUILT = one_per_federation_and_model(CIFAR_LIKE)


@pytest.mark.parametrize("path", BUILT, ids=[f.stem for f in BUILT])
def test_cifar_configs_build_partition_and_model(path, data_root):
    cfg = load_config(path, overrides=[f"data.root={data_root}", "data.verify=false"])
    fed = build_federation(cfg.data, cfg.seed)
    assert fed.num_clients == cfg.data.num_clients and all(len(t) > 0 for t in fed.train_idx)
    models, arch = build_models(cfg, fed)
    model = models[arch[0]].eval()
    x = fed.normalize(fed.pool.x[fed.train_idx[0][:2]])
    with torch.no_grad():
        feats, logits = model(x, with_features=True)
    assert logits.shape == (2, fed.num_classes)
    assert feats.shape[1] == (2048 if "cifar100" in path.name else 512)   # ResNet-50 / ResNet-18 features


def test_a_femnist_round_reports_accuracy_over_the_clients_whose_classes_the_held_out_writers_have(tmp_path):
    """Two held-out writers' images hold 4 of the 62 classes, so most clients' label mix has no
    test image: global_labeldist_acc averages only the clients it can judge, and says how many."""
    from helpers import write_leaf_femnist

    import fedhet

    write_leaf_femnist(tmp_path, {f"f{i:04d}_00": ([i % 62] * 4, [(i + 7) % 62] * 2) for i in range(20)})
    res = fedhet.run(CONFIGS / "femnist-v2_writers_fedavg.yaml",
                     [f"data.root={tmp_path}", "data.num_clients=18", "train.clients_per_round=2", "train.rounds=1",
                      "train.local_epochs=1", f"run.out_dir={tmp_path / 'runs'}"], progress=False)
    row = res.rows[-1]
    assert 0 < row["global_labeldist_clients"] < 18 and 0 <= row["global_labeldist_acc"] <= 1
    assert res.summary["status"] == "completed" and res.summary["headline_metric"] == "global_acc"
