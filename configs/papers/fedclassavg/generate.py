"""Write the FedClassAvg paper's experiment grid as fedhet configs (idempotent).

    python configs/papers/fedclassavg/generate.py          # writes next to this file
    python configs/papers/fedclassavg/generate.py --check  # exit 1 if a file differs from what it would write

Protocol (FedClassAvg paper (Jang et al., ICPP 2022) Sec. 5 and Table 1, and the authors' code
hukla/FedClassAvg): 20 clients, all
sampled every round (Table 3's 100-client column: 10%), one local epoch, batch 64 (drop_last as the
code), Adam with betas (0.5, 0.999) fresh each round - lr 6e-4 and rho 0.4662 on Fashion-MNIST,
1e-4 / 0.1 on CIFAR-10, 5e-4 / 0.1 on EMNIST (Table 1) - for every method of a table (like for like).
Heterogeneous federations (Tables 2 and 4): client i has architecture i mod 4 (ResNet-18,
ShuffleNetV2, GoogLeNet, AlexNet, each with a 512-d feature layer); Table 3: ResNet-18 for
FedClassAvg, and for FedAvg, FedProx and KT-pFL "the same convolutional architecture as FedAvg
paper" (its caption): McMahan et al.'s CNNs, fedhet's ``cnn2`` for (E)MNIST-shaped images and, for
CIFAR-10, ``simple_cnn`` (the TensorFlow tutorial's CNN that paper trains on CIFAR-10).
Local test sets: 30% of the client's training size drawn from the test set with its label
proportions (fixed and without replacement; the code draws with replacement and re-samples them
each round). A seed whose client needs more images of a class than the test set holds (Dir(0.5)
with seed 3) stops with an error that names ``data.local_test.replace: true``, the code's
draw. Rounds: the code runs up to 1,000 with
early stopping (patience 100 on the mean local test loss); fedhet has no early stopping, these
configs run 200 and report best and final. The number reported is the mean of the clients'
accuracies (``personal_acc``; its std over clients is ``personal_acc_std``, the paper's +-).
Files: ``<dataset>_<partition>_<method>.yaml``; the first lines state the table, cell and number.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))
from write_configs import paper_section, write_configs  # noqa: E402  (configs/papers/write_configs.py)

HETERO = "[fca_resnet18, fca_shufflenetv2, fca_googlenet, fca_alexnet]"

METHODS = {
    "local": ("Local-only", "{name: local}"),
    "fedproto": ("FedProto across architectures (512-d features)", "{name: fedproto}"),
    # distillation by the authors' plain SGD at their lr 0.02 (cugzj/KT-pFL, which the paper says it ran);
    # the private training keeps the table's common Adam
    "ktpfl": ("KT-pFL (knowledge transfer through soft predictions on a public set)",
              "{name: ktpfl, params: {distill_lr: 0.02}}"),
    # Table 3's "+weight" row: the transfer in weight space (the authors' KTpFL_homo.py: one distillation
    # step at its private lr 0.01; C's step and penalty per dataset, KTPFL_WEIGHT below)
    "ktpfl_weight": ("KT-pFL +weight (knowledge transfer in weight space)",
                     "{name: ktpfl_weight, params: {distill_lr: 0.01, KTPFL_WEIGHT}}"),
    "fedclassavg": ("FedClassAvg (classifier averaging + SupCon + proximal term)", "{name: fedclassavg, params: {RHO}}"),
    "fedclassavg_ca": ("FedClassAvg ablation CA: classifier averaging only (Table 4)",
                       "{name: fedclassavg, params: {contrastive: false, proximal: false}}"),
    "fedclassavg_pr": ("FedClassAvg ablation CA+PR (Table 4)", "{name: fedclassavg, params: {contrastive: false, RHO}}"),
    "fedclassavg_cl": ("FedClassAvg ablation CA+CL (Table 4)", "{name: fedclassavg, params: {proximal: false}}"),
    "fedclassavg_weight": ("FedClassAvg+weight: bodies averaged too (Table 3)",
                           "{name: fedclassavg, params: {average_body: true, RHO}}"),
    "fedavg": ("FedAvg", "{name: fedavg}"),
    "fedprox": ("FedProx (mu=0.01; value not stated)", "{name: fedprox, params: {mu: 0.01}}"),
}

# KT-pFL's public data (both codes): MNIST for the MNIST family (3000 of its training images drawn
# every round: the whole MNIST train split is the public set), CIFAR-100 classes 0, 2, 20, 63, 71,
# 82 (3000 images) for CIFAR-10.
PUBLIC = {
    "fmnist": "{source: dataset, dataset: mnist, size: 60000}",
    "emnist": "{source: dataset, dataset: mnist, size: 60000}",
    "cifar10": "{source: dataset, dataset: cifar100, size: 3000, classes: [0, 2, 20, 63, 71, 82]}",
}

# KTpFL_homo.py's penalty_ratio and C's step (its distill_lr): 0.6 and 0.005 for the MNIST family,
# 0.7 and 0.01 for CIFAR-10
KTPFL_WEIGHT = {"fmnist": "rho: 0.6, c_lr: 0.005", "emnist": "rho: 0.6, c_lr: 0.005", "cifar10": "rho: 0.7, c_lr: 0.01"}

# dataset -> (fedhet dataset, lr, rho, note)
DATASETS = {
    "fmnist": ("fashion_mnist", 6e-4, 0.4662, ""),
    "cifar10": ("cifar10", 1e-4, 0.1, ""),
    "emnist": ("emnist_letters", 5e-4, 0.1, " EMNIST Letters, as the paper says (Sec. 4.1: 124,800 training images, 26 classes)."),
}
PARTITIONS = {
    "dir0.5": ("Dirichlet(0.5) (NIID-Bench)", "{kind: dirichlet, alpha: 0.5}"),
    "skewed": ("skewed: 2 random classes per client, equal sizes, sampled with replacement",
               "{kind: classes_per_client, k: 2}"),
}

# (table, dataset, partition, method, clients) -> (number, its ±: std over clients), fractions
RESULTS = {
    **{("2", d, "dir0.5", m, 20): v for d, row in {
        "cifar10": dict(local=(0.6894, 0.0665), fedproto=(0.4742, 0.0323), ktpfl=(0.6228, 0.0783),
                        fedclassavg=(0.7670, 0.0532)),
        "fmnist": dict(local=(0.8840, 0.0698), fedproto=(0.6042, 0.0500), ktpfl=(0.9039, 0.0435),
                       fedclassavg=(0.9303, 0.0308)),
        "emnist": dict(local=(0.9149, 0.0378), fedproto=(0.2249, 0.0210), ktpfl=(0.9055, 0.0500),
                       fedclassavg=(0.9305, 0.0178))}.items() for m, v in row.items()},
    **{("2", d, "skewed", m, 20): v for d, row in {
        "cifar10": dict(local=(0.8871, 0.0417), fedproto=(0.8359, 0.0181), ktpfl=(0.8721, 0.0717),
                        fedclassavg=(0.9202, 0.0562)),
        "fmnist": dict(local=(0.9430, 0.0288), fedproto=(0.6364, 0.0423), ktpfl=(0.9737, 0.0434),
                       fedclassavg=(0.9800, 0.0281)),
        "emnist": dict(local=(0.9671, 0.1073), fedproto=(0.2183, 0.0661), ktpfl=(0.9921, 0.0076),
                       fedclassavg=(0.9957, 0.0040))}.items() for m, v in row.items()},
    # Table 4 gives no ±; its last column is Table 2's FedClassAvg
    **{("4", d, "dir0.5", m, 20): (v, None) for d, row in {
        "cifar10": dict(fedclassavg_ca=0.615, fedclassavg_pr=0.6311, fedclassavg_cl=0.7509),
        "fmnist": dict(fedclassavg_ca=0.8578, fedclassavg_pr=0.8971, fedclassavg_cl=0.924),
        "emnist": dict(fedclassavg_ca=0.915, fedclassavg_pr=0.8993, fedclassavg_cl=0.9186)}.items()
       for m, v in row.items()},
    # Table 3 (20 clients all sampled; 100 clients at 10%)
    **{("3", d, "dir0.5", m, k): v for d, row in {
        "cifar10": {("fedavg", 20): (0.7729, 0.0501), ("fedavg", 100): (0.6336, 0.1788),
                    ("fedprox", 20): (0.8123, 0.0363), ("fedprox", 100): (0.6505, 0.1809),
                    ("ktpfl", 20): (0.5433, 0.0988), ("ktpfl", 100): (0.4777, 0.1978),
                    ("ktpfl_weight", 20): (0.6809, 0.0626), ("ktpfl_weight", 100): (0.5624, 0.1909),
                    ("fedclassavg", 20): (0.7653, 0.0454), ("fedclassavg", 100): (0.5096, 0.1661),
                    ("fedclassavg_weight", 20): (0.8546, 0.0406), ("fedclassavg_weight", 100): (0.7817, 0.0649)},
        "fmnist": {("fedavg", 20): (0.8988, 0.0359), ("fedavg", 100): (0.7471, 0.1554),
                   ("fedprox", 20): (0.9025, 0.0218), ("fedprox", 100): (0.7477, 0.1566),
                   ("ktpfl", 20): (0.8954, 0.045), ("ktpfl", 100): (0.6114, 0.2721),
                   ("ktpfl_weight", 20): (0.9113, 0.041), ("ktpfl_weight", 100): (0.8647, 0.066),
                   ("fedclassavg", 20): (0.9294, 0.0304), ("fedclassavg", 100): (0.6712, 0.1605),
                   ("fedclassavg_weight", 20): (0.9361, 0.0158), ("fedclassavg_weight", 100): (0.9057, 0.0472)},
        "emnist": {("fedavg", 20): (0.9343, 0.0247), ("fedavg", 100): (0.8662, 0.0445),
                   ("fedprox", 20): (0.9462, 0.1566), ("fedprox", 100): (0.8677, 0.0923),
                   ("ktpfl", 20): (0.8505, 0.0443), ("ktpfl", 100): (0.6589, 0.3258),
                   ("ktpfl_weight", 20): (0.6774, 0.2311), ("ktpfl_weight", 100): (0.8441, 0.0316),
                   ("fedclassavg", 20): (0.9361, 0.0168), ("fedclassavg", 100): (0.7097, 0.1022),
                   ("fedclassavg_weight", 20): (0.9464, 0.0136), ("fedclassavg_weight", 100): (0.9166, 0.0275)},
    }.items() for (m, k), v in row.items()},
}
PAPER = {cell: number for cell, (number, _) in RESULTS.items()}
STD = {cell: std for cell, (_, std) in RESULTS.items() if std is not None}


def cells() -> list[tuple[str, str, str, str, int]]:
    return sorted({(t, d, p, m, k) for t, d, p, m, k in PAPER}
                  | {("2", "fmnist", p, m, 20) for p in PARTITIONS for m in ("local", "fedproto", "ktpfl", "fedclassavg")}
                  | {("4", "fmnist", "dir0.5", m, 20) for m in ("fedclassavg_ca", "fedclassavg_pr", "fedclassavg_cl")})


def render(table: str, dataset: str, partition: str, method: str, clients: int) -> str:
    name, lr, rho, note = DATASETS[dataset]
    desc, algo = METHODS[method]
    algo = algo.replace("RHO", f"rho: {rho}").replace("KTPFL_WEIGHT", KTPFL_WEIGHT[dataset])
    number = PAPER.get((table, dataset, partition, method, clients))
    head = (f"# FedClassAvg paper (Jang et al., ICPP 2022), Table {table}: {desc}, paper {number:.4f}."
            if number is not None else f"# FedClassAvg paper (Jang et al., ICPP 2022), Table {table} protocol, no paper number: {desc}.")
    homogeneous = table == "3"
    fedavg_cnn = homogeneous and not method.startswith("fedclassavg")     # Table 3's caption
    fedavg_arch = "simple_cnn" if dataset == "cifar10" else "cnn2"
    arch = fedavg_arch if fedavg_cnn else "fca_resnet18" if homogeneous else HETERO
    # FedProto's prototypes are the classifier's inputs (both references): the ReLU of the head
    # moves into the body, leaving a one-Linear head for the nearest-prototype evaluation.
    model = f"{{arch: {arch}, options: {{relu_features: true}}}}" if method == "fedproto" else f"{{arch: {arch}}}"
    public = [f"  public: {PUBLIC[dataset]}"] if method == "ktpfl" else []
    return "\n".join([
        head,
        f"# {dataset} {PARTITIONS[partition][0]}, {clients} clients, "
        f"{f'the FedAvg paper CNN ({fedavg_arch}) for every client, as Table 3 says of FedAvg and KT-pFL' if fedavg_cnn else 'ResNet-18 for every client' if homogeneous else 'client i: architecture i mod 4'}.{note}",
        *(["# One distillation step at lr 0.01 moves a parameter tensor of |T| entries 2 * 0.01 / |T| of the way to its",
            "# target: 0.2% for the 10-entry output bias and far less for every other tensor, so the transfer barely moves the models."]
          if method == "ktpfl_weight" else []),
        f"name: fedclassavg-t{table}-{dataset}_{partition}_{method}" + (f"_k{clients}" if clients != 20 else ""),
        "seed: 0",
        "data:",
        f"  dataset: {name}",
        f"  num_clients: {clients}",
        f"  partition: {PARTITIONS[partition][1]}",
        "  local_test: {source: test_set, fraction: 0.3}",
        *public,
        f"model: {model}",
        f"algorithm: {algo}",
        f"train: {{rounds: 200, clients_per_round: {clients if clients == 20 else clients // 10}, local_epochs: 1, "
        f"batch_size: 64, drop_last: true,",
        f"        optimizer: adam, betas: [0.5, 0.999], lr: {lr}}}",
        "eval: {every: 1, final_window: 5}",
        "run: {checkpoint_every: 10}",
        "",
    ]) + (paper_section(f"FedClassAvg (Jang et al., ICPP 2022) Table {table}",
                        f"{dataset} {partition}, {clients} clients, {desc}", f"{number}" + (
                            f"±{STD[(table, dataset, partition, method, clients)]}"
                            if (table, dataset, partition, method, clients) in STD else ""),
                        "the authors' code: the round of minimum mean local test loss (its best_val_loss, "
                        "up to 1000 rounds, patience 100); mean over clients, ± = std over clients",
                        metric="personal_acc", percent=False, measured_as="lowest:personal_loss")
          if number is not None else "")


def main() -> int:
    files = {}
    for t, d, p, m, k in cells():
        files[f"t{t}_{d}_{p}_{m}" + (f"_k{k}" if k != 20 else "") + ".yaml"] = render(t, d, p, m, k)
    return write_configs(HERE, files, check="--check" in sys.argv)


if __name__ == "__main__":
    raise SystemExit(main())
