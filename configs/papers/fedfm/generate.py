"""Write the FedFM paper's experiment grid as fedhet configs (idempotent).

    python configs/papers/fedfm/generate.py          # writes next to this file
    python configs/papers/fedfm/generate.py --check  # exit 1 if a file differs from what it would write

Protocol of every config (FedFM paper (Ye et al.) Sec. VII-A and the authors' code): K=10 clients
(Table VI: 20, 30, 50, 100), full participation (Table VII: 3,150 FEMNIST writers, 7 a round), T=100
rounds, E=10 local epochs, batch 64 (drop_last as the code; not on FEMNIST, whose writers are
small), SGD lr 0.01, momentum 0.9 (fresh each round), weight decay 1e-5; 20% of
every client's data held out for validation; the reported number is the test accuracy at the
best-validation round (``summary.json`` ``model_selection``). FedFM: lambda 50, temperature 0.1,
T_s = 20, weighted anchors. Files: ``<dataset>_<partition>_<method>.yaml`` (Table VI's K in the
partition: ``niid1-k20``); the first lines state the table, the cell and the paper's number (mean
± std over 3 trials where the table prints one), which a ``paper`` section carries too.
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))
from write_configs import paper_section, write_configs  # noqa: E402  (configs/papers/write_configs.py)

# name -> (description, algorithm yaml)
METHODS = {
    "fedavg": ("FedAvg", "{name: fedavg}"),
    # the MOON code's --server_momentum (FedFM's code is its fork): v = 0.9 v + 0.1 d, w -= v
    "fedavgm": ("FedAvgM (server momentum 0.9 dampened as the MOON code's, i.e. server_lr 0.1; values not stated)",
                "{name: fedavgm, params: {server_momentum: 0.9, server_lr: 0.1}}"),
    "fedprox": ("FedProx (mu=0.01; the paper tunes it, value not stated)", "{name: fedprox, params: {mu: 0.01}}"),
    "scaffold": ("SCAFFOLD", "{name: scaffold}"),
    "feddyn": ("FedDyn (alpha=0.01; value not stated)", "{name: feddyn, params: {alpha: 0.01}}"),
    "fednova": ("FedNova", "{name: fednova}"),
    "moon": ("MOON (mu=5, tau=0.5: the MOON paper's CIFAR-10 values; FedFM's fork has no projection head)",
             "{name: moon, params: {mu: 5.0, tau: 0.5}}"),
    "fedfm": ("FedFM with contrastive guiding (lambda 50, temperature 0.1, T_s 20)", "{name: fedfm}"),
    "fedfm_l2": ("FedFM with the l2 matching loss", "{name: fedfm, params: {matching: l2}}"),
    "fedfm_uniform": ("FedFM with uniform anchor averaging (Table VIII)",
                      "{name: fedfm, params: {anchor_weighting: uniform}}"),
    "fedfm_lite_a2": ("FedFM-Lite, models every 2 rounds (Fig. 7)", "{name: fedfm_lite, params: {model_every: 2}}"),
    "fedfm_lite_a5": ("FedFM-Lite, models every 5 rounds (Fig. 7)", "{name: fedfm_lite, params: {model_every: 5}}"),
    **{f"fedfm_temp{t:g}": (f"FedFM with CG temperature alpha={t:g} (lambda 50, T_s 20)",
                            f"{{name: fedfm, params: {{temperature: {t}}}}}") for t in (0.01, 0.1, 1.0, 10.0)},
}

# dataset -> (fedhet dataset, model yaml, extra note)
DATASETS = {
    "cifar10": ("cifar10", "{arch: resnet18, options: {stem: imagenet}}", "ResNet-18 with the 7x7 stem (resnet18_7)"),
    "cinic10": ("cinic10", "{arch: resnet18, options: {stem: imagenet}}", "ResNet-18 with the 7x7 stem (resnet18_7)"),
    "cifar100": ("cifar100", "{arch: resnet50, options: {stem: imagenet}}",
                 "ResNet-50 with the 7x7 stem (the paper does not say which; the authors' code has resnet50_7 and "
                 "resnet50, the 3x3 stem without max-pool: --set model.options.stem=cifar); every method trains on "
                 "CIFAR-100 augmented as the code's pipeline (crop of the 4-padded image, flip, rotation by up to "
                 "15 degrees: algorithm.params.augment crop_flip_rotate)"),
    "fmnist": ("fashion_mnist", "{arch: cnn2}", "proxy: no paper number (the paper has no Fashion-MNIST results); "
               "cnn2 features = the 512-d fc1 output (fedhet's choice)"),
    # Table VII: "ResNet18-v1 is the vanilla backbone in PyTorch and ResNet18-v2 replaces the first
    # convolution layer with smaller kernel size (from 7 to 3)": the authors' code's resnet18_7 and resnet18
    "femnist-v1": ("femnist", "{arch: resnet18, options: {stem: imagenet}}",
                   "ResNet18-v1: ResNet-18 with the 7x7/stride-2 stem and max-pool (torchvision's)"),
    "femnist-v2": ("femnist", "{arch: resnet18}", "ResNet18-v2: ResNet-18 with a 3x3 stem (stride 1, no max-pool: "
                   "the authors' code's resnet18)"),
}

PARTITIONS = {
    "niid1": ("NIID-1, Dirichlet beta=0.5", "{kind: dirichlet, alpha: 0.5}"),
    "niid2": ("NIID-2, dominant classes per client (C/10 each, 46% of its data)", "{kind: niid2}"),
    **{f"niid3-m{m}": (f"NIID-3, {m} missing classes per client", f"{{kind: niid3, missing: {m}}}")
       for m in (1, 2, 3, 5, 7)},
    # Table VI names no partition: NIID-1, the paper's (and the code's) default
    **{f"niid1-k{k}": (f"NIID-1 (Table VI names none: the default), Dirichlet beta=0.5, K={k} clients",
                       "{kind: dirichlet, alpha: 0.5}")
       for k in (20, 30, 50, 100)},
    # Table VII: "3500 clients. We hold out 10% of the clients for testing. For each round of FL, we
    # sample 0.2% clients": every LEAF image pooled (train+test, whichever way LEAF split them), the
    # images of 10% of the writers the global test set, 3,150 of the others the clients
    "writers": ("LEAF writers, one client each, 10% of the writers held out as the test set",
                "{kind: natural, test_writers: 0.1}"),
}

# Table VI's clients, all taking part every round: its FedAvg cost, 474 x 10^8 floats at K=20, is
# K x T = 2,000 transfers of ResNet-50's 23.705 x 10^6.
CLIENTS = {**{f"niid1-k{k}": k for k in (20, 30, 50, 100)}, "writers": 3150}
# Clients a round where not all: Table VII's 0.2% of its 3,500 clients
PER_ROUND = {"writers": 7}

# The authors' code cuts CINIC-10's classes (9,000 training images each) into shards of 100 and
# hands each client 5 shards of every class, not 3 (``noniid-2``, ``cinic10`` branch of
# pytorch/utils.py): 40 + 5 of its 90 shards are its own class, 50% of its data.
NIID2_OF = {"cinic10": ("NIID-2, one dominant class per client (50% of its data)",
                        "{kind: niid2, shards_per_class: 90, dominant_shards: 40, minor_shards: 5}")}

# The tables as printed (%, mean ± std over 3 trials where shown).
TABLE_III_COLUMNS = [(d, p) for d in ("cifar10", "cinic10", "cifar100") for p in ("niid1", "niid2")]
TABLE_III = {
    "fedavg": "66.69±0.69 69.47±0.48 55.96±0.16 58.56±0.22 62.16±0.04 62.33±0.27",
    "fedavgm": "66.85±0.42 67.87±0.17 56.15±0.45 58.79±0.30 61.23±0.12 61.30±0.27",
    "fedprox": "66.99±0.26 69.42±0.38 55.58±0.13 58.32±0.11 61.96±0.05 62.20±0.28",
    "scaffold": "69.91±0.54 71.48±0.23 58.60±0.27 60.78±0.32 67.32±0.29 67.24±0.03",
    "feddyn": "68.32±0.34 67.63±0.16 56.71±0.50 59.92±0.15 43.41±0.54 46.44±0.87",
    "fednova": "66.80±0.81 69.45±0.49 55.67±0.24 58.63±0.22 62.35±0.20 62.31±0.26",
    "moon": "67.74±0.30 71.09±0.22 57.25±0.07 59.28±0.03 62.56±0.22 62.99±0.13",
    "fedfm": "72.89±0.22 74.52±0.21 62.56±0.40 65.75±0.46 71.48±0.25 72.13±0.45",
}
# CIFAR-10 NIID-3, missing 1, 2, 3, 5, 7 classes (FedProx's Missing 5 repeats FedAvg's, as printed)
TABLE_IV = {
    "fedavg": "70.54±0.22 70.50±0.24 69.87±0.30 67.25±0.54 59.52±0.59",
    "fedavgm": "70.02±0.40 69.93±0.57 69.34±0.37 67.04±0.47 57.08±0.66",
    "fedprox": "71.16±0.42 70.72±0.35 69.82±0.23 67.25±0.54 58.58±0.23",
    "scaffold": "72.67±0.39 72.94±0.30 72.60±0.22 71.43±0.05 64.28±0.60",
    "feddyn": "67.43±0.51 67.76±0.64 67.78±0.28 69.53±0.59 64.75±0.30",
    "fednova": "70.56±0.25 70.48±0.23 70.05±0.15 67.56±0.52 59.66±0.42",
    "moon": "72.64±0.25 72.21±0.22 71.57±0.23 68.86±0.27 57.80±1.02",
    "fedfm": "75.97±0.44 75.84±0.23 75.04±0.29 73.23±0.35 65.24±0.52",
}
# CIFAR-100, K = 20, 30, 50, 100 (no std printed)
TABLE_VI = {
    "fedavg": "58.48 54.46 50.20 41.41",
    "fedavgm": "58.36 54.48 52.86 46.72",
    "fedprox": "58.27 54.50 50.55 40.62",
    "scaffold": "64.65 61.82 56.71 47.70",
    "feddyn": "41.90 41.13 39.30 31.21",
    "fednova": "58.01 53.83 50.34 42.61",
    "moon": "57.63 52.71 47.84 38.45",
    "fedfm": "69.49 67.70 64.22 55.38",
}
# NIID-1, temperature alpha = 0.01, 0.1, 1.0, 10.0; its alpha=0.1 cells are other runs than Table III's FedFM
TABLE_IX = {"cifar10": "70.44 72.41 71.46 69.17", "cifar100": "68.10 71.41 68.24 65.05"}

# FEMNIST (no std printed; the paper states no rounds, epochs or batch size for it)
TABLE_VII = {"femnist-v1": {"fedavg": "79.93", "scaffold": "67.61", "fedfm": "81.62"},
             "femnist-v2": {"fedavg": "81.85", "scaffold": "74.63", "fedfm": "83.05"}}
# Feature-space quality of the CIFAR-10 NIID-1 runs' final global models: (NMI, silhouette)
TABLE_V = {"fedavg": ("0.413", "0.036"), "fedavgm": ("0.411", "0.038"), "fedprox": ("0.397", "0.006"),
           "scaffold": ("0.432", "0.056"), "feddyn": ("0.485", "0.136"), "fednova": ("0.416", "0.049"),
           "moon": ("0.481", "0.068"), "fedfm": ("0.557", "0.173")}

# (dataset, partition, method) -> (table, paper number % as printed)
PAPER = {
    **{(d, p, m): ("Table III", v) for m, row in TABLE_III.items()
       for (d, p), v in zip(TABLE_III_COLUMNS, row.split())},
    **{("cifar10", f"niid3-m{x}", m): ("Table IV", v) for m, row in TABLE_IV.items()
       for x, v in zip((1, 2, 3, 5, 7), row.split())},
    **{("cifar100", f"niid1-k{k}", m): ("Table VI", v) for m, row in TABLE_VI.items()
       for k, v in zip((20, 30, 50, 100), row.split())},
    **{(d, "niid1", f"fedfm_temp{t:g}"): ("Table IX", v) for d, row in TABLE_IX.items()
       for t, v in zip((0.01, 0.1, 1.0, 10.0), row.split())},
    ("cifar10", "niid1", "fedfm_uniform"): ("Table VIII", "72.87±0.26"),
    ("cifar10", "niid1", "fedfm_l2"): ("Sec. VII-D.6 (text, beside Table IX)", "67.98"),
    **{(d, "writers", m): ("Table VII", v) for d, row in TABLE_VII.items() for m, v in row.items()},
}

FMNIST_METHODS = ["fedavg", "scaffold", "fedprox", "moon", "fednova", "fedfm", "fedfm_l2", "fedfm_uniform",
                  "fedfm_lite_a2", "fedfm_lite_a5"]


def cells() -> list[tuple[str, str, str]]:
    out = sorted(PAPER)
    out += [("fmnist", p, m) for p in ("niid1", "niid2") for m in FMNIST_METHODS]
    return out


def render(dataset: str, partition: str, method: str) -> str:
    name, model, note = DATASETS[dataset]
    part_desc, part_yaml = NIID2_OF[dataset] if partition == "niid2" and dataset in NIID2_OF else PARTITIONS[partition]
    desc, algo = METHODS[method]
    if dataset == "cifar100":          # the code's CIFAR-100 transform, every method's local training
        spec = yaml.safe_load(algo)
        spec["params"] = {**spec.get("params", {}), "augment": "crop_flip_rotate"}
        algo = yaml.safe_dump(spec, default_flow_style=True, sort_keys=False, width=1000).strip()
    table, number = PAPER.get((dataset, partition, method), (None, None))
    k = CLIENTS.get(partition, 10)
    femnist = dataset.startswith("femnist")
    head = (f"# FedFM paper (Ye et al.), {table}: {desc}, paper {number}%."
            if table else f"# FedFM paper (Ye et al.) protocol, no paper number for this cell: {desc}.")
    notes = []
    if femnist:
        notes.append("# The paper states no rounds, epochs or batch size for FEMNIST: the protocol of its other tables. "
                     "drop_last is off (a writer with fewer than 64 training images would take no step).")
    if (dataset, partition) == ("cifar10", "niid1") and method in TABLE_V:
        nmi, ss = TABLE_V[method]
        notes.append(f"# Table V: the final global model's features, NMI {nmi}, silhouette {ss} "
                     "(fedhet features RUN_DIR computes both from the run's last checkpoint).")
    return "\n".join([
        head,
        f"# {dataset} {part_desc}; {DATASETS[dataset][2]}. Reported: test accuracy at the best-validation round.",
        *notes,
        f"name: fedfm-{dataset}_{partition}_{method}",
        "seed: 0",
        "data:",
        f"  dataset: {name}",
        *(["  pool: train+test"] if femnist else []),
        f"  num_clients: {k}",
        f"  partition: {part_yaml}",
        "  local_test: {source: holdout, fraction: 0.2}",
        f"model: {model}",
        f"algorithm: {algo}",
        f"train: {{rounds: 100, clients_per_round: {PER_ROUND.get(partition, k)}, local_epochs: 10, batch_size: 64, "
        "lr: 0.01, momentum: 0.9,",
        f"        weight_decay: 1.0e-5, drop_last: {'false' if femnist else 'true'}}}",
        "eval: {every: 1, final_window: 5}",
        "run: {checkpoint_every: 5}",
        "",
    ]) + (paper_section(f"FedFM (Ye et al.) {table}", f"{dataset} {part_desc}: {desc}", number,
                        "test accuracy of the global model at the round of best validation accuracy"
                        + (" (the paper's protocol; it states no rounds for FEMNIST)" if femnist else ", T=100"),
                        metric="global_acc", measured_as="highest:global_val_acc",
                        rounds=None if femnist else 100) if table else "")


def main() -> int:
    files = {f"{d}_{p}_{m}.yaml": render(d, p, m) for d, p, m in cells()}
    return write_configs(HERE, files, check="--check" in sys.argv)

if __name__ == "__main__":
    raise SystemExit(main())
