"""Write the FedACD paper's experiment grid as fedhet configs (idempotent).

    python configs/papers/fedacd/generate.py          # writes next to this file
    python configs/papers/fedacd/generate.py --check  # exit 1 if a file differs from what it would write

Protocol of every config (FedACD paper (Zhou et al.) Sec. 4.1; Tables 4, 6 and 7 vary one setting
each): K=20 clients, 40% participation (8 per round), Dirichlet(beta) label skew, T=200 rounds, E=5
local epochs, batch 64, SGD lr 0.01, momentum 0.9 (fresh each round), weight decay 1e-5 (1e-3 on
Tiny-ImageNet). CIFAR: the simple CNN of FedNH (``simple_cnn`` = Conv2Cifar); Tiny-ImageNet:
ResNet-18 as the FedNH code base builds it (``ResNetMod``: the 3x3 stem, GroupNorm with 2 groups,
a classifier without bias; its default init, where fedhet's is torchvision's Kaiming fan-out).
Metrics: ``global_acc`` (Table 1), ``global_labeldist_acc`` (Table 2), ``local_risk`` (Table 3) and
``local_kl`` / ``fedacd_kl_mean`` (Table 9), evaluated every 5 rounds and at the end; the paper does
not say best or final: summary.json has both. Files: ``<dataset>_b<beta>_<method>.yaml`` (the
ablations: ``_<setting>`` after it); the first lines state the table, the cell and the paper's
number; a ``paper`` section carries the accuracy (Table 1's with its std).
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))
from write_configs import paper_section, write_configs  # noqa: E402  (configs/papers/write_configs.py)

# name -> (description, algorithm yaml)
METHODS = {
    "fedavg": ("FedAvg", "{name: fedavg}"),
    "fedprox": ("FedProx (mu=0.01; value not stated)", "{name: fedprox, params: {mu: 0.01}}"),
    "fednova": ("FedNova", "{name: fednova}"),
    "fedrod": ("FedROD (balanced-softmax generic head + personal head)", "{name: fedrod}"),
    "creff": ("CReFF (classifier re-training on federated features)", "{name: creff}"),
    "fedntd": ("FedNTD (tau 1, beta 1: the official config/fedntd.json)", "{name: fedntd}"),
    "fedlc": ("FedLC (tau 1: FL-bench's default)", "{name: fedlc}"),
    "feddecorr": ("FedDecorr", "{name: feddecorr}"),
    "fednh": ("FedNH (smoothing 0.9, scale 30)", "{name: fednh}"),
    "fedacd": ("FedACD (lambda 1, tau 1-1e-5, delta_missing 1e-2, mixup Beta(1,1))", "{name: fedacd}"),
    "fedacd_base": ("FedACD_base: uniform aggregation weights (Table 8)", "{name: fedacd_base}"),
    "fedacd_nomixup": ("FedACD without mixup (Table 5)", "{name: fedacd, params: {mixup: false}}"),
    # Table 5's baselines with Input Mixup (Beta(1,1), as FedACD's)
    "fedavg_mixup": ("FedAvg with Input Mixup (Table 5)", "{name: fedavg, params: {mixup: true}}"),
    "fedrod_mixup": ("FedROD with Input Mixup (Table 5)", "{name: fedrod, params: {mixup: true}}"),
    "fedlc_mixup": ("FedLC with Input Mixup (Table 5)", "{name: fedlc, params: {mixup: true}}"),
    "fednh_mixup": ("FedNH with Input Mixup (Table 5)", "{name: fednh, params: {mixup: true}}"),
}

# dataset -> (fedhet dataset, model yaml, weight decay, note)
DATASETS = {
    "cifar10": ("cifar10", "{arch: simple_cnn}", 1e-5, "FedNH's Conv2Cifar"),
    "cifar100": ("cifar100", "{arch: simple_cnn}", 1e-5, "FedNH's Conv2Cifar"),
    "tiny": ("tiny_imagenet", "{arch: resnet18, norm: gn, options: {fc_bias: false}}", 1e-3,
             "ResNet-18 as FedNH's ResNetMod (GroupNorm(2), bias-free classifier)"),
    "fmnist": ("fashion_mnist", "{arch: simple_cnn}", 1e-5,
               "proxy: no paper number (the paper has no Fashion-MNIST results); Conv2Cifar on 1x28x28"),
}

BETAS = {"0.3": 0.3, "0.1": 0.1, "0.05": 0.05}

# Each client's local test set (Table 2's metric) draws round(fraction x its training size) images from
# the test set with its label proportions, a class's quota rounded by largest remainder: at most
# fraction x (its training images of the class) + 1.5. At beta <= 0.3 one client can hold nearly all of a
# class's training images, so that must not exceed the test images per class: Fashion-MNIST 6,000:1,000
# (0.2 failed to build at beta 0.1 and 0.05 at every seed: 0.1), CIFAR-10 5,000:1,000 and CIFAR-100
# 500:100 (0.2 could ask 1,001 of 1,000: 0.19), Tiny-ImageNet 500:50 against its validation set (0.08).
LOCAL_TEST_FRACTION = {"cifar10": 0.19, "cifar100": 0.19, "tiny": 0.08, "fmnist": 0.1}

# Table 1, mean±std as printed (the paper does not say over how many runs): dataset -> method ->
# "beta 0.3, 0.1, 0.05".
TABLE1 = {
    "cifar10": dict(
        fedavg="75.63±0.75 68.35±2.43 60.47±3.74", fedprox="75.54±0.91 68.80±2.60 62.18±0.20",
        fednova="75.19±1.15 67.02±2.90 56.63±1.88", creff="76.07±0.85 69.40±2.17 61.71±3.57",
        fedrod="77.53±0.86 71.12±1.33 62.46±3.29", fedntd="76.01±0.47 70.41±0.76 60.48±1.41",
        feddecorr="74.51±0.37 71.80±1.81 61.19±1.79", fedlc="76.76±0.56 69.40±1.40 52.71±4.09",
        fednh="75.30±0.84 68.11±2.15 60.54±2.61", fedacd="79.57±0.02 73.13±0.52 63.57±0.46"),
    "cifar100": dict(
        fedavg="41.97±0.24 39.57±0.60 38.12±0.11", fedprox="41.70±0.16 39.33±0.05 38.15±0.07",
        fednova="41.63±0.12 39.38±0.46 37.88±0.39", creff="37.60±0.27 37.71±0.59 38.03±0.17",
        fedrod="42.02±0.15 40.15±0.44 38.37±0.18", fedntd="43.05±0.22 39.90±0.31 37.70±0.29",
        feddecorr="38.85±0.34 38.89±0.19 37.50±0.18", fedlc="41.92±0.39 39.85±0.52 35.27±0.16",
        fednh="44.74±0.14 41.74±0.24 39.61±0.43", fedacd="49.08±0.08 46.24±0.17 43.22±0.46"),
    "tiny": dict(
        fedavg="45.76±0.21 40.24±0.31 36.09±0.33", fedprox="45.47±0.09 40.35±0.35 35.64±0.19",
        fednova="45.72±0.12 40.36±0.24 35.47±0.43", creff="44.75±0.23 39.74±0.49 35.26±0.55",
        fedrod="46.18±0.26 42.02±0.14 37.81±0.39", fedntd="46.86±0.18 41.89±0.30 36.86±0.28",
        feddecorr="45.89±0.12 40.69±0.38 35.64±0.25", fedlc="46.66±0.12 41.37±0.14 36.63±0.38",
        fednh="45.09±1.95 42.31±0.85 38.87±0.21", fedacd="49.62±0.32 45.29±0.14 41.44±0.85"),
}
TABLE5 = {"cifar10": (77.97, 72.59, 62.64), "cifar100": (45.53, 42.61, 40.76), "tiny": (46.94, 43.40, 39.67)}
TABLE5_MIXUP = {  # method with Input Mixup -> dataset -> (beta 0.3, 0.1, 0.05)
    "fedavg_mixup": dict(cifar10=(73.44, 66.13, 59.25), cifar100=(46.43, 41.41, 37.17), tiny=(47.36, 41.61, 34.99)),
    "fedrod_mixup": dict(cifar10=(76.71, 71.70, 61.76), cifar100=(42.38, 40.06, 38.13), tiny=(46.19, 41.83, 37.08)),
    "fedlc_mixup": dict(cifar10=(76.22, 69.82, 55.39), cifar100=(45.37, 42.38, 38.01), tiny=(47.33, 43.22, 37.51)),
    "fednh_mixup": dict(cifar10=(74.16, 66.87, 58.16), cifar100=(46.80, 43.11, 40.58), tiny=(47.47, 42.62, 39.85)),
}
TABLE8 = {"cifar100": (48.63, 45.51, 42.76)}
# Tables 4 and 6: CIFAR-100, beta 0.1, one setting varied from Table 1's (K=20, 40% participation, E=5,
# whose column is Table 1's cell). Table 4: (K, clients a round) -> method -> %; Table 6: E -> method -> %.
TABLE4_COLUMNS = {"k20_p0.2": (20, 4), "k20_p0.6": (20, 12), "k40": (40, 16), "k60": (60, 24), "k80": (80, 32),
                  "k100": (100, 40)}
TABLE4 = {  # the columns above, in order
    "fedavg": (36.87, 40.05, 39.64, 38.47, 37.77, 35.76), "creff": (38.60, 36.40, 31.28, 26.50, 23.26, 20.86),
    "fedrod": (39.85, 40.56, 38.50, 36.97, 34.78, 33.01), "fedntd": (39.11, 40.55, 39.34, 37.69, 37.48, 36.35),
    "feddecorr": (37.80, 39.87, 39.09, 38.34, 37.82, 35.62), "fednh": (39.99, 42.10, 40.76, 39.48, 38.21, 37.43),
    "fedacd": (44.42, 46.70, 44.27, 42.49, 41.30, 40.33),
}
TABLE6_EPOCHS = (3, 7, 9, 11, 13, 15)
TABLE6 = {  # E in TABLE6_EPOCHS, in order
    "fedavg": (40.76, 38.89, 38.51, 37.81, 37.41, 37.32), "creff": (36.93, 38.38, 38.48, 38.23, 38.78, 38.24),
    "fedrod": (41.72, 39.23, 38.84, 37.28, 37.47, 38.00), "fedntd": (41.61, 39.25, 39.42, 39.30, 39.03, 38.51),
    "feddecorr": (40.22, 38.33, 38.18, 37.84, 36.87, 36.92), "fedlc": (41.40, 39.53, 38.68, 37.20, 37.63, 36.74),
    "fednh": (42.17, 41.34, 39.62, 39.55, 39.93, 39.36), "fedacd": (46.12, 45.46, 45.36, 44.73, 44.68, 44.85),
}
# Table 7: CIFAR-100, beta 0.1, FedACD's lambda (``margin_weight``) varied; lambda=1 is Table 1's cell.
TABLE7 = {"0.5": "46.05±0.21", "1.5": "45.79±0.18", "2": "45.35±0.28"}
TABLE3 = {"cifar10": dict(fedacd=(0.25, 0.31, 0.39), fedavg=(0.41, 0.57, 0.70)),
          "cifar100": dict(fedacd=(0.60, 0.67, 0.74), fedavg=(0.69, 0.77, 0.82)),
          "tiny": dict(fedacd=(0.64, 0.73, 0.80), fedavg=(0.68, 0.79, 0.86))}


def accuracy(dataset: str, beta: str, method: str) -> tuple[str, str, str] | None:
    """The table, what its number is, and the global test accuracy (%, "mean" or "mean±std") the paper
    reports for this cell, if any (one at most)."""
    i = list(BETAS).index(beta)
    if method in TABLE1.get(dataset, {}):
        return "Table 1", "global model, balanced test", TABLE1[dataset][method].split()[i]
    if method == "fedacd_nomixup" and dataset in TABLE5:
        return "Table 5", "no mixup", f"{TABLE5[dataset][i]:.2f}"
    if dataset in TABLE5_MIXUP.get(method, {}):
        return "Table 5", "with Input Mixup", f"{TABLE5_MIXUP[method][dataset][i]:.2f}"
    if method == "fedacd_base" and dataset in TABLE8:
        return "Table 8", "FedACD_base", f"{TABLE8[dataset][i]:.2f}"
    return None


def stated(found: tuple[str, str, str]) -> str:
    """The number as the first comment line states it: the mean (the std is in the ``paper`` section)."""
    table, what, number = found
    return f"{table} ({what}) {number.partition('±')[0]}%"


def paper(dataset: str, beta: str, method: str) -> str | None:
    parts = []
    if found := accuracy(dataset, beta, method):
        parts.append(stated(found))
    if method in TABLE3.get(dataset, {}):
        parts.append(f"Table 3 local risk {TABLE3[dataset][method][list(BETAS).index(beta)]:.2f}")
    return "; ".join(parts) or None


def cells() -> list[tuple[str, str, str]]:
    out = [(d, b, m) for d in ("cifar10", "cifar100", "tiny") for b in BETAS for m in METHODS]
    out += [("fmnist", b, m) for b in BETAS for m in METHODS]
    return out


def describe(dataset: str, method: str) -> tuple[str, str]:
    desc, algo = METHODS[method]
    if dataset == "cifar100" and method == "feddecorr":   # the FedDecorr repository's CIFAR-100 script
        desc, algo = "FedDecorr (coefficient 0.05: its CIFAR-100 script)", "{name: feddecorr, params: {decorr_beta: 0.05}}"
    return desc, algo


def render(dataset: str, beta: str, method: str, clients: int = 20, per_round: int = 8, epochs: int = 5,
           setting: str = "", tag: str = "", found: tuple[str, str, str] | None = None,
           described: tuple[str, str] | None = None) -> str:
    """One config; ``setting`` (Tables 4, 6 and 7) names what differs from Table 1's protocol, ``found``
    the table, what its number is and the number, ``described`` the description and algorithm yaml
    where they differ from the method's."""
    name, model, wd, note = DATASETS[dataset]
    desc, algo = described or describe(dataset, method)
    number = stated(found) if setting and found else paper(dataset, beta, method)
    head = (f"# FedACD paper (Zhou et al.): {desc}; paper: {number}." if number
            else f"# FedACD paper (Zhou et al.) protocol, no paper number for this cell: {desc}.")
    where = f", {setting}" if setting else ""
    return "\n".join([
        head,
        f"# {dataset} Dirichlet beta={beta}{where}, {note}.",
        f"name: fedacd-{dataset}_b{beta}_{method}" + (f"_{tag}" if tag else ""),
        "seed: 0",
        "data:",
        f"  dataset: {name}",
        f"  num_clients: {clients}",
        f"  partition: {{kind: dirichlet, alpha: {BETAS[beta]}}}",
        f"  local_test: {{source: test_set, fraction: {LOCAL_TEST_FRACTION[dataset]}}}",
        f"model: {model}",
        f"algorithm: {algo}",
        f"train: {{rounds: 200, clients_per_round: {per_round}, local_epochs: {epochs}, batch_size: 64, lr: 0.01, "
        "momentum: 0.9,",
        f"        weight_decay: {wd:.1e}}}",
        "eval: {every: 5, final_window: 5, local_risk: true}",
        "run: {checkpoint_every: 5}",
        "",
    ]) + paper_entry(dataset, beta, desc, found if setting else accuracy(dataset, beta, method), where)


def paper_entry(dataset: str, beta: str, desc: str, found: tuple[str, str, str] | None, where: str = "") -> str:
    """The accuracy as a ``paper`` section, which ``fedhet compare`` prints beside the measured one
    (Table 3's local risk stays in the first comment line: the section holds one number)."""
    if not found:
        return ""
    table, _, number = found
    return paper_section(f"FedACD (Zhou et al.) {table}", f"{dataset} beta={beta}{where}: {desc}",
                         number, "global test accuracy after T=200 rounds (the paper says neither best "
                         "nor final)", metric="global_acc", rounds=200)


def ablations() -> dict[str, str]:
    """Tables 4, 6 and 7 (CIFAR-100, beta 0.1): the clients and participation, the local epochs, and
    FedACD's lambda, each varied alone; the methods of each table (Tables 4 and 6 compare the best
    baselines of Table 1, Table 7 FedACD alone)."""
    files = {}
    for i, (column, (clients, per_round)) in enumerate(TABLE4_COLUMNS.items()):
        setting = f"K={clients}, {per_round} clients a round"
        for method, numbers in TABLE4.items():
            found = ("Table 4", setting, f"{numbers[i]:.2f}")
            files[f"cifar100_b0.1_{method}_{column}.yaml"] = render("cifar100", "0.1", method, clients, per_round,
                                                                     setting=setting, tag=column, found=found)
    for i, epochs in enumerate(TABLE6_EPOCHS):
        setting = f"E={epochs}"
        for method, numbers in TABLE6.items():
            found = ("Table 6", setting, f"{numbers[i]:.2f}")
            files[f"cifar100_b0.1_{method}_e{epochs}.yaml"] = render("cifar100", "0.1", method, epochs=epochs,
                                                                      setting=setting, tag=f"e{epochs}", found=found)
    for lam, number in TABLE7.items():
        setting = f"lambda={lam}"
        described = (f"FedACD (lambda {lam}, tau 1-1e-5, delta_missing 1e-2, mixup Beta(1,1))",
                     f"{{name: fedacd, params: {{margin_weight: {float(lam)}}}}}")
        files[f"cifar100_b0.1_fedacd_lambda{lam}.yaml"] = render("cifar100", "0.1", "fedacd", setting=setting,
                                                                  tag=f"lambda{lam}", found=("Table 7", setting, number),
                                                                  described=described)
    return files


def main() -> int:
    files = {f"{d}_b{b}_{m}.yaml": render(d, b, m) for d, b, m in cells()}
    return write_configs(HERE, {**files, **ablations()}, check="--check" in sys.argv)


if __name__ == "__main__":
    raise SystemExit(main())
