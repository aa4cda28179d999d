"""Write the FedReMa paper's experiments (Tables 1-5) as fedhet configs (run once; idempotent).

    python configs/papers/fedrema/generate.py          # writes next to this file
    python configs/papers/fedrema/generate.py --check  # exit 1 if a file differs from what it would write

Setting (FedReMa paper (Liang et al.) Sec. 5 and the official code): K=20
clients, full participation, 5 overlapping groups of 3 dominant labels with an s IID share
(``grouped_dominant``), train+test images pooled, per client ``npc`` samples split 80/20 into
local train/test; CNN2 (MNIST/FMNIST) or the simplified AlexNet (CIFAR-10); the classifier of
every head-based method is every FC layer (``split: fc1``, see ``config``); E=5 (Per-FedAvg: 10,
see LOCAL_EPOCHS), batch 100, lr 0.01, SGD momentum 0.9 kept per client across rounds, gradient
clipping at 10, drop_last; T=500; personalized accuracy (every client's own model on its local
test split), "best" = max over rounds, "final" = mean of the last 5.
Baselines at the paper's values: FedProx mu=1, MOON mu=1 (5 on CIFAR-10), FedProto and FedPAC
lambda=1; the others at their defaults.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))
from write_configs import paper_section, write_configs  # noqa: E402  (configs/papers/write_configs.py)

DATASETS = {  # key -> (fedhet dataset, title, arch)
    "mnist": ("mnist", "MNIST", "cnn2"),
    "fmnist": ("fashion_mnist", "Fashion-MNIST", "cnn2"),
    "cifar10": ("cifar10", "CIFAR-10", "alexnet_fedrema"),
}

# method -> (description, algorithm yaml, model options yaml or None); CIFAR-10 overrides below.
METHODS = {
    "local": ("Local (no communication)", "{name: local}", None),
    "fedavg": ("FedAvg", "{name: fedavg}", None),
    "fedprox": ("FedProx (mu=1)", "{name: fedprox, params: {mu: 1.0}}", None),
    # PFLlib's MOON (the framework FedReMa's code is trimmed from) contrasts the body's output
    # (clientmoon.py: model.base(x)), with no projection head
    "moon": ("MOON (mu=1, tau=0.5, no projection head, as PFLlib)", "{name: moon, params: {mu: 1.0, tau: 0.5}}", None),
    "fedproto": ("FedProto (lambda=1)", "{name: fedproto}", None),
    "fedper": ("FedPer (classifier = every FC layer, kept local)", "{name: fedper}", None),
    "perfedavg": ("Per-FedAvg (first-order)", "{name: perfedavg}", None),
    "fedbabu": ("FedBABU (head frozen, fine-tuned before evaluation)", "{name: fedbabu}", None),
    "fedpac": ("FedPAC (lambda=1)", "{name: fedpac}", None),
    "feddistill": ("FedDistill", "{name: feddistill}", None),
    "fedrema": ("FedReMa (delta=0.5, M=0.5)", "{name: fedrema}", None),
}
CIFAR_OVERRIDES = {"moon": ("MOON (mu=5, tau=0.5, no projection head, as PFLlib)",
                            "{name: moon, params: {mu: 5.0, tau: 0.5}}", None)}

# Table 1 (npc=600, s=0.2, best accuracy %, 5 seeds): MNIST / FMNIST / CIFAR-10.
TABLE_1 = {
    "local": "94.3 86.0 58.9", "fedavg": "98.4 86.1 61.9", "fedprox": "97.8 84.8 61.6",
    "moon": "98.4 86.0 61.9", "fedproto": "95.6 80.8 56.1", "fedper": "94.8 86.1 59.5",
    "perfedavg": "97.6 88.1 62.3", "feddistill": "96.3 87.0 61.2", "fedbabu": "97.1 83.1 53.6",
    "fedpac": "98.4 86.9 64.9", "fedrema": "98.5 88.2±0.3 65.4±0.3",
}
# Table 2 (CIFAR-10, npc=100), every row: method -> best accuracy %, mean±std as printed, at each s of
# TABLE_2_S.
TABLE_2_S = (0.2, 0.4, 0.6, 0.8)
TABLE_2 = {
    "local": "48.1±0.8 38.1±0.6 30.2±0.4 24.2±0.5", "fedavg": "46.4±0.9 47.1±1.2 47.4±1.2 45.4±1.3",
    "fedprox": "40.7±0.6 41.9±0.5 41.6±0.8 41.3±0.4", "moon": "46.4±0.8 47.1±1.2 47.4±1.1 45.5±1.2",
    "fedproto": "36.7±3.0 29.2±0.8 30.9±2.7 30.6±0.9", "fedper": "47.6±0.8 37.8±0.9 30.9±0.9 25.1±0.6",
    "fedbabu": "41.3±0.5 41.1±0.5 40.9±0.6 40.1±0.7", "fedpac": "48.0±2.1 45.7±1.2 41.6±0.8 38.3±0.3",
    "fedrema": "52.9±1.2 50.2±0.7 47.6±1.4 46.5±1.8",
}
# Table 3 (CIFAR-10, npc=600, s=0.2): delta -> (best, final, CCP length in rounds).
TABLE_3 = {0.1: ("63.36", "61.64", 500), 0.3: ("64.13", "60.73", 132), 0.5: ("65.40", "63.77", 36),
           0.7: ("65.26", "62.30", 16), 0.9: ("65.06", "63.03", 7)}
# Tables 4 and 5 (CIFAR-10, npc=600, s=0.2): key -> (description, table, best ± std, note, algorithm).
VARIANTS = {
    "fedrema_f": ("FedReMa+F (FedPAC feature alignment)", "Table 4", "66.31±0.55", "",
                  "{name: fedrema, params: {feature_alignment: true}}"),
    "fedrema_af": ("FedReMa+A&F (alternating training + feature alignment)", "Table 4", "69.73±0.98", "",
                   "{name: fedrema, params: {feature_alignment: true, alternating: true}}"),
    "fedrema_mds_only": ("FedAvg+MDS with the CCP never ending", "Table 5", "63.36±0.79", " (final 61.64)",
                         "{name: fedrema, params: {ccp: forever}}"),
}


# Local epochs per round where PFLlib (the paper's framework) differs from E=5: its Per-FedAvg
# server calls client.train() twice a round (serverperavg.train), so 2E epochs; fedhet's Per-FedAvg
# runs train.local_epochs once, so its configs set the epochs PFLlib gives it.
# method -> (local epochs, the reason, written into the config)
LOCAL_EPOCHS = {"perfedavg": (10, "2E: PFLlib's Per-FedAvg server trains each client twice a round")}

HEAD_BASED = ("fedper", "fedrep", "fedbabu", "fedpac", "fedrema")
BEST_RULE = "best personalized accuracy over 500 rounds (mean of the clients' accuracies), 5 seeds"


def config(name: str, comment: str, ds: str, algorithm: str, options: str | None, npc: int = 600,
           s: float = 0.2, paper: str = "", epochs: tuple[int, str] = (5, "")) -> str:
    dataset, title, arch = DATASETS[ds]
    # Like for like: "we consider the fully connected layers of each network as
    # classifiers" (Liang et al., Sec. 5.1) - every FC layer is the head of every head-based method
    # (FedReMa's main.py too). FedProto and MOON keep PFLlib's split (FedProto's prototypes and
    # MOON's contrasted representation are the last Linear's input); for the other methods the
    # split is moot.
    head_based = any(f"name: {m}" in algorithm for m in HEAD_BASED)
    split = ", split: fc1" if head_based else (", split: fc3" if ds == "cifar10" else "")
    model = f"{{arch: {arch}{split}" + (f", options: {options}" if options else "") + "}"
    return (
        f"# FedReMa paper (Liang et al.), {comment}. {title}, K=20, npc={npc}, s={s}.\n"
        f"# Paper protocol: T=500, personalized accuracy, best over rounds.\n"
        f"# Like for like: every FC layer is the classifier of the head-based methods; every method keeps one\n"
        f"# optimizer per client across rounds (train.optimizer_state: keep, FedReMa's reference).\n"
        f"name: {name}\n"
        "seed: 0\n"
        "data:\n"
        f"  dataset: {dataset}\n"
        "  pool: train+test\n"
        "  num_clients: 20\n"
        f"  partition: {{kind: grouped_dominant, samples_per_client: {npc}, s: {s}}}\n"
        "  local_test: {source: holdout, fraction: 0.2}\n"
        f"model: {model}\n"
        f"algorithm: {algorithm}\n"
        + (f"# local_epochs {epochs[0]} = {epochs[1]}.\n" if epochs[1] else "")
        + f"train: {{rounds: 500, clients_per_round: 20, local_epochs: {epochs[0]}, batch_size: 100, lr: 0.01, momentum: 0.9,\n"
        "        drop_last: true, clip_grad_norm: 10, optimizer_state: keep}\n"
        "eval: {every: 1, final_window: 5}\n"
        "run: {checkpoint_every: 10}\n"
        + paper
    )


def title_of(ds: str) -> str:
    return DATASETS[ds][1]


def files() -> dict[str, str]:
    out = {}
    for ds in DATASETS:                                                      # Table 1
        col = list(DATASETS).index(ds)
        for method, (desc, algo, opts) in METHODS.items():
            if ds == "cifar10" and method in CIFAR_OVERRIDES:
                desc, algo, opts = CIFAR_OVERRIDES[method]
            paper = TABLE_1[method].split()[col]
            name = f"t1_{ds}_{method}"
            out[name] = config(f"fedrema-{name}", f"Table 1: {desc}, paper {paper}", ds, algo, opts,
                               paper=paper_section("FedReMa (Liang et al.) Table 1", f"{title_of(ds)}, {desc}",
                                                   paper, BEST_RULE, metric="personal_acc", measured_as="best",
                                                   rounds=500),
                               epochs=LOCAL_EPOCHS.get(method, (5, "")))
    for col, s in enumerate(TABLE_2_S):                                      # Table 2
        for method, row in TABLE_2.items():
            paper = row.split()[col]
            desc, algo, opts = CIFAR_OVERRIDES.get(method, METHODS[method])    # CIFAR-10, as Table 1's column
            name = f"t2_cifar10_s{s}_{method}"
            out[name] = config(f"fedrema-{name}", f"Table 2: {desc}, paper {paper}", "cifar10", algo, opts, npc=100, s=s,
                               paper=paper_section("FedReMa (Liang et al.) Table 2", f"CIFAR-10 npc=100 s={s}, {desc}",
                                                   paper, BEST_RULE, metric="personal_acc", measured_as="best",
                                                   rounds=500),
                               epochs=LOCAL_EPOCHS.get(method, (5, "")))
    for delta, (best, final, ccp) in TABLE_3.items():                        # Table 3
        name = f"t3_cifar10_delta{delta}"
        out[name] = config(f"fedrema-{name}", f"Table 3: FedReMa delta={delta}, paper best {best}, final {final}, "
                           f"CCP {ccp} rounds", "cifar10", f"{{name: fedrema, params: {{delta: {delta}}}}}", None,
                           paper=paper_section("FedReMa (Liang et al.) Table 3", f"CIFAR-10, FedReMa delta={delta}",
                                               best, BEST_RULE + f" (final: {final}; CCP {ccp} rounds)",
                                               metric="personal_acc", measured_as="best", rounds=500))
    for key, (desc, table, paper, note, algo) in VARIANTS.items():           # Tables 4-5
        name = f"t45_cifar10_{key}"
        out[name] = config(f"fedrema-{name}", f"{table}: {desc}, paper {paper}{note}", "cifar10", algo, None,
                           paper=paper_section(f"FedReMa (Liang et al.) {table}", f"CIFAR-10, {desc}", paper,
                                               BEST_RULE + note, metric="personal_acc", measured_as="best", rounds=500))
    return {f"{k}.yaml": v for k, v in out.items()}


def main() -> int:
    return write_configs(HERE, files(), check="--check" in sys.argv[1:])

if __name__ == "__main__":
    sys.exit(main())
