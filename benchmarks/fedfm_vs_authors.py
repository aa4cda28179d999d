"""FedFM against its authors' code, step by step: the anchors of one round, then one client's training.

    python benchmarks/fedfm_vs_authors.py --authors-src PATH/pytorch [--config RUN/config.yaml]
        [--matching cg l2] [--clients 0 5] [--out benchmarks/results]
        [--break-fedhet unnormalised_features --out /tmp/broken]

PATH is a checkout of the authors' repository (rui-ye/FedFM; Ye et al., "FedFM: Anchor-Based
Feature Matching for Data Heterogeneity in Federated Learning", IEEE TSP 2023). Their anchor
functions (``feature_matching/utils.py``: ``get_client_centroids_info``, ``get_global_centroids``),
their matching losses (``feature_matching/loss_f.py``) and their client update (``train_net_fm`` of
``main.py``) are imported from there and run as they are (their ``.cuda()`` calls made no-ops for
the CPU); nothing of them is copied here. ``main.py``'s own imports of ``model`` and ``utils``
(datasets, torchvision) are stood in for by empty modules: the functions used do not need them.

The round compared is the first matching round (``t = start_round``, the paper's T_s) with every
client taking part, from the run seed's initial weights w (the warm-up's FedAvg rounds are FedAvg's
and are not compared here):

1. Anchors (Eq. 8-9): fedhet's round generator sends every client the anchor message, each client
   answers with its class means and counts computed with w, and the server aggregates them. The
   authors' ``get_client_centroids_info`` runs with the same model and weights over each client's
   training split (a loader in the split's order, without drop_last: their training loader drops
   its last partial batch and leaves those rows as zero features of class 0, which fedhet does not
   copy; see fedhet.algorithms.fedfm), then their ``get_global_centroids`` (size-weighted, momentum
   0, as main.py calls it). Compared: each client's class means and counts, and the global anchors.
2. Training (Eq. 10): for each probed client, fedhet's ``FedFM.client_update`` on the round's
   training message; every batch it draws is recorded. The authors' ``train_net_fm`` then trains a
   copy of the same model from w on those batches with their own global anchors (SGD with their
   momentum 0.9, the config's lr and weight decay, lambda, temperature and matching loss; CG, or
   their ``matching_l2`` with ``--matching l2``). Compared: every weight, beside how far the round
   moved them and the authors' own noise floor (their training from w nudged by 1e-7 of its
   value, largest of 4 draws; benchmarks/authors_check.py), and the mean losses.

``--break-fedhet unnormalised_features`` changes fedhet's side on purpose (its CG term on the raw
features instead of the normalised ones), to see the check fail. fp32 in the default layout on one
thread, whatever the config's run section says: the check is of the arithmetic, not of a layout's
rounding. Writes fedfm_vs_authors.{md,json}.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import logging
import sys
import types
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedhet.algorithms.fedfm import AnchorMatching
from fedhet.core.contract import Batch, Forward, RoundContext
from fedhet.data.federated import build_federation
from fedhet.engine.host import ClientHost, Tally
from fedhet.experiment.build import build_models, make_algorithm, train_settings
from fedhet.experiment.config import load_config
from fedhet.experiment.summary import cpu_name, git_commit, machine_info

sys.path.insert(0, str(Path(__file__).resolve().parent))
from authors_check import (  # noqa: E402
    NUDGE,
    NUDGES,
    checkout_commit,
    compare,
    noise_floors,
    parse_arguments,
    recording,
    weights_only,
)

DEFAULT_CONFIG = Path("benchmarks/runs/fedfm_fmnist_t100_e1/fedfm_lam5_s0/config.yaml")
FEATURE_DIM = 512            # the authors' functions size the anchors for ResNet-18's 512-d features; cnn2's are 512-d too
AUTHORS_MODEL_NAME = "resnet18_7"   # their name for a 512-d feature model
AUTHORS_DATASET_NAME = "cifar10"    # their name for a 10-class dataset


class AuthorsNet(nn.Module):
    """The authors' model interface, ``net(x) -> (representation, _, logits)``, on a fedhet model."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        features, logits = self.model(x, with_features=True)
        return features, features, logits


class CpuLoader(list):
    """A list of batches with the two attributes the authors' anchor pass reads from a DataLoader."""

    def __init__(self, batches: list, dataset_size: int, batch_size: int):
        super().__init__(batches)
        self.dataset = range(dataset_size)
        self.batch_size = batch_size


@contextlib.contextmanager
def cuda_calls_stay_on_cpu() -> Iterator[None]:
    """The authors' code calls ``.cuda()`` on tensors, models and the loss: no-ops here."""
    saved = torch.Tensor.cuda, nn.Module.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self          # type: ignore[method-assign]
    nn.Module.cuda = lambda self, *args, **kwargs: self             # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.cuda, nn.Module.cuda = saved                   # type: ignore[method-assign]


class EpochLosses(logging.Handler):
    """Collects the mean epoch losses ``train_net_fm`` logs ("Epoch: %d Loss: %f")."""

    def __init__(self) -> None:
        super().__init__()
        self.losses: list[float] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("Epoch: ") and " Loss: " in message:
            self.losses.append(float(message.rsplit(" ", 1)[1]))


def import_authors(src: Path) -> types.ModuleType:
    """The authors' ``main.py`` as a module (its ``__main__`` block does not run), with its
    ``feature_matching`` package importable; ``model`` and ``utils`` stood in for while it loads."""
    sys.path.insert(0, str(src.resolve()))
    stand_ins = {name: types.ModuleType(name) for name in ("model", "utils")}
    saved = {name: sys.modules.get(name) for name in stand_ins}
    sys.modules.update(stand_ins)
    try:
        spec = importlib.util.spec_from_file_location("fedfm_authors_main", src / "main.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        for name, before in saved.items():
            if before is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = before
    module.logger = logging.getLogger("fedfm_authors")                 # set in their __main__ block
    module.logger.setLevel(logging.INFO)
    module.logger.propagate = False
    return module


def unnormalised_cg(self: AnchorMatching, out: Forward, batch: Batch, weights: dict) -> torch.Tensor:
    """fedhet's CG term broken on purpose: the raw features against the normalised anchors."""
    a = F.normalize(self.anchors.float(), dim=1)
    return self.lam * F.cross_entropy(out.features.float() @ a.T / self.temperature, batch.y)


def weights_of(model: nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def authors_anchors(authors: types.ModuleType, model: nn.Module, init: dict, loaders: dict[int, CpuLoader],
                    num_classes: int) -> tuple[list, list, torch.Tensor]:
    m = copy.deepcopy(model)
    m.load_state_dict(init)
    with cuda_calls_stay_on_cpu():
        local, counts = authors.get_client_centroids_info(AuthorsNet(m), loaders, AUTHORS_MODEL_NAME,
                                                          AUTHORS_DATASET_NAME, sorted(loaders))
        anchors = authors.get_global_centroids(copy.deepcopy(local), counts, torch.zeros(num_classes, FEATURE_DIM),
                                               momentum=0.0, equally_average=0)
    return local, counts, anchors


def authors_training(authors: types.ModuleType, model: nn.Module, batches: list, anchors: torch.Tensor, lr: float,
                     args: types.SimpleNamespace, init: dict) -> tuple[dict, list[float]]:
    m = copy.deepcopy(model)
    m.load_state_dict(init)
    losses = EpochLosses()
    authors.logger.addHandler(losses)
    try:
        with cuda_calls_stay_on_cpu():
            # all the round's batches as one epoch: one optimizer throughout, as their E epochs have
            authors.train_net_fm(0, AuthorsNet(m), batches, [], 1, lr, "sgd", args, anchors, True, device="cpu")
    finally:
        authors.logger.removeHandler(losses)
    return weights_of(m), losses.losses


def main() -> int:
    p, a = parse_arguments(__doc__.split("\n")[0], "the pytorch/ folder of a checkout of rui-ye/FedFM", DEFAULT_CONFIG,
                           [0, 5], ["unnormalised_features"],
                           lambda p: p.add_argument("--matching", nargs="+", choices=["cg", "l2"], default=["cg", "l2"]))
    if a.break_fedhet:
        if a.matching != ["cg"]:
            p.error("--break-fedhet unnormalised_features breaks the CG term: add --matching cg")
        AnchorMatching.__call__ = unnormalised_cg          # type: ignore[method-assign]
    if not (a.authors_src / "feature_matching" / "loss_f.py").is_file():
        p.error(f"{a.authors_src} has no feature_matching/loss_f.py: pass the pytorch/ folder of a rui-ye/FedFM checkout")
    torch.set_num_threads(1)
    authors = import_authors(a.authors_src)

    # The anchor phase does not depend on the matching loss: one federation, one anchor phase, then
    # each matching loss's training from the same round's messages.
    cfg = load_config(a.config, ["run.memory_format=contiguous", "run.precision=fp32"])
    if cfg.algorithm.name != "fedfm":
        p.error(f"{a.config} runs {cfg.algorithm.name}, not fedfm")
    if cfg.train.momentum != 0.9:
        p.error(f"the authors' train_net_fm uses SGD momentum 0.9; {a.config} has {cfg.train.momentum}")
    algorithm = make_algorithm(cfg)
    fed = build_federation(cfg.data, cfg.seed)
    models, client_arch = build_models(cfg, fed)
    (arch, model), = models.items()
    host = ClientHost(algorithm, fed, models, client_arch, train_settings(cfg, "fp32"), cfg.seed)
    init = weights_of(model)
    rnd = algorithm.params.start_round
    clients = list(range(fed.num_clients))
    sizes = {c: len(host.client_data(c).train_idx) for c in clients}
    ctx = RoundContext(round=rnd, clients=clients, num_clients=fed.num_clients, num_classes=fed.num_classes,
                       client_sizes=sizes, rng=np.random.default_rng(0), num_rounds=cfg.train.rounds)

    # 1. anchors: fedhet's round generator and clients, then the authors' functions
    round_gen = algorithm.round(algorithm.init_server_state({arch: init}), ctx)
    anchor_msgs = round_gen.send(None)
    replies, states = {}, {}
    for cid in clients:
        replies[cid], states[cid] = algorithm.client_update(anchor_msgs[cid], None, host.runtime(cid, rnd, Tally()))
    train_msgs = round_gen.send(replies)
    ours_anchors = train_msgs[clients[0]].arrays["anchors"]["mean"]
    bs = cfg.train.batch_size
    loaders = {}
    for cid in clients:
        data = host.client_data(cid)
        everything = data.batch(torch.arange(len(data.train_idx)))
        batches = [(everything.x[i:i + bs], everything.y[i:i + bs]) for i in range(0, len(everything.y), bs)]
        loaders[cid] = CpuLoader(batches, len(everything.y), bs)
    local, counts, theirs_anchors = authors_anchors(authors, model, init, loaders, fed.num_classes)
    mean_diff = max(float((replies[c].arrays["anchors"]["mean"].double() - local[c].double()).abs().max())
                    for c in clients)
    counts_equal = all(torch.equal(replies[c].arrays["anchors"]["count"].double(), counts[c].double()) for c in clients)
    anchor_diff = float((ours_anchors.double() - theirs_anchors.double()).abs().max())
    print(f"round {rnd + 1}, {len(clients)} clients' anchors: local means differ by up to {mean_diff:.3g}, "
          f"counts {'equal' if counts_equal else 'DIFFER'}; global anchors by up to {anchor_diff:.3g}", flush=True)
    out: dict = {"command": " ".join(["python", "benchmarks/fedfm_vs_authors.py", *sys.argv[1:]]),
                 "commit": git_commit(), "machine": machine_info(), "authors_commit": checkout_commit(a.authors_src),
                 "config": str(a.config), "broken_on_purpose": a.break_fedhet, "round": rnd,
                 "lam": algorithm.params.lam, "temperature": algorithm.params.temperature, "lr": cfg.train.lr,
                 "momentum": cfg.train.momentum, "weight_decay": cfg.train.weight_decay,
                 "local_epochs": cfg.train.local_epochs,
                 "anchors": {"clients": len(clients), "local_means_max_abs_diff": mean_diff,
                             "counts_equal": counts_equal, "global_max_abs_diff": anchor_diff,
                             "global_scale": float(theirs_anchors.abs().max())},
                 "cases": []}

    # 2. each probed client's training on the round's message, then the authors' on the same batches
    for matching in a.matching:
        trainer = make_algorithm(load_config(a.config, [f"algorithm.params.matching={matching}",
                                                        "run.memory_format=contiguous", "run.precision=fp32"]))
        trainer_host = ClientHost(trainer, fed, models, client_arch, train_settings(cfg, "fp32"), cfg.seed)
        args = types.SimpleNamespace(reg=cfg.train.weight_decay, l2match=matching == "l2", lam_fm=algorithm.params.lam,
                                     cg_tau=algorithm.params.temperature, print_local_test_acc=0)
        case: dict = {"matching": matching, "clients": []}
        print(f"{matching}:", flush=True)
        for cid in a.clients:
            runtime = trainer_host.runtime(cid, rnd, Tally())
            calls: list[list] = []
            runtime.train = recording(runtime.train, calls)     # type: ignore[method-assign]
            reply, _ = trainer.client_update(train_msgs[cid], states[cid], runtime)
            (drawn,) = calls                                       # FedFM trains once a round
            ours = reply.arrays["model"]
            training = partial(authors_training, authors, model, drawn, theirs_anchors, cfg.train.lr, args)
            theirs, their_losses = training(init)
            rows = compare(ours, theirs, init)
            floors = noise_floors(weights_only(training), init, theirs)
            worst = max(rows, key=lambda k: rows[k]["max_abs_diff"])
            c = {"client": cid, "steps": len(drawn), "samples": sum(len(y) for _, y in drawn),
                 "fedhet_loss": float(reply.scalars.get("loss", float("nan"))),
                 "authors_loss": their_losses[0] if their_losses else float("nan"),
                 "max_abs_diff": rows[worst]["max_abs_diff"], "worst_tensor": worst,
                 "noise_floor": max(floors), "noise_floors": floors,
                 "max_moved": max(r["moved"] for r in rows.values()), "tensors": rows}
            case["clients"].append(c)
            print(f"  client {cid}: {c['steps']} steps; largest |fedhet - authors| {c['max_abs_diff']:.3g} ({worst}); "
                  f"the authors' own after a {NUDGE:g} nudge: up to {c['noise_floor']:.3g}; the round moved weights by "
                  f"up to {c['max_moved']:.3g}; mean loss fedhet {c['fedhet_loss']:.5f}, authors {c['authors_loss']:.5f}",
                  flush=True)
        out["cases"].append(case)

    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "fedfm_vs_authors.json").write_text(json.dumps(out, indent=2) + "\n")
    (a.out / "fedfm_vs_authors.md").write_text(report(out))
    print(f"wrote {a.out / 'fedfm_vs_authors.md'}")
    return 0


def report(out: dict) -> str:
    lines = ["# FedFM's anchors and client update against the authors' code", "", "Command:", "", "```bash",
             out["command"], "```", "",
             *([f"**fedhet broken on purpose** (`--break-fedhet {out['broken_on_purpose']}`): this file shows the "
                "check failing.", ""] if out["broken_on_purpose"] else []),
             f"rui-ye/FedFM at {out['authors_commit']} (its pytorch/ code), config `{out['config']}`: the first matching "
             f"round (round {out['round'] + 1}) from the run seed's initial weights, every client taking part; "
             f"lambda {out['lam']:g}, temperature {out['temperature']:g}, SGD lr {out['lr']:g}, momentum "
             f"{out['momentum']:g}, weight decay {out['weight_decay']:g}, {out['local_epochs']} local epoch(s); "
             "fp32, default layout, one thread.", "",
             "Anchors (Eq. 8-9; the same for either matching loss): fedhet's clients and server against the authors' "
             "`get_client_centroids_info` and `get_global_centroids` with the same model and weights.", "",
             "| clients | local class means: largest abs. difference | class counts | global anchors: largest abs. "
             "difference | largest anchor element |", "|---|---|---|---|---|"]
    an = out["anchors"]
    lines.append(f"| {an['clients']} | {an['local_means_max_abs_diff']:.3g} | "
                 f"{'equal' if an['counts_equal'] else '**differ**'} | {an['global_max_abs_diff']:.3g} | "
                 f"{an['global_scale']:.3g} |")
    lines += ["", "Training (Eq. 10): fedhet's `FedFM.client_update` against the authors' `train_net_fm` on the "
              "batches fedhet drew, each side with its own global anchors.", "",
              f"| matching | client | steps | largest abs. difference | in tensor | noise floor (authors' vs authors' "
              f"from weights nudged by {NUDGE:g}, largest of {NUDGES}) | largest change in the round | mean loss: "
              "fedhet / authors |", "|---|---|---|---|---|---|---|---|"]
    for case in out["cases"]:
        for c in case["clients"]:
            lines.append(f"| {case['matching']} | {c['client']} | {c['steps']} | {c['max_abs_diff']:.3g} | "
                         f"`{c['worst_tensor']}` | {c['noise_floor']:.3g} | {c['max_moved']:.3g} | "
                         f"{c['fedhet_loss']:.5f} / {c['authors_loss']:.5f} |")
    outside = [f"{case['matching']} client {c['client']}" for case in out["cases"] for c in case["clients"]
               if c["max_abs_diff"] > c["noise_floor"]]
    lines += ["", "Reading: fedhet's trained weights " + ("lie within the noise floor in every case" if not outside else
              "lie outside the noise floor for " + ", ".join(outside))
              + ("" if an["counts_equal"] else "; the class counts differ")
              + " (the floor: how far the authors' own training moves when its starting weights change by "
              f"{NUDGE:g} of their value, largest of {NUDGES} draws)."]
    m = out["machine"]
    lines += ["", f"Machine: {cpu_name(m)}, torch {m.get('torch', '?')}; commit {out['commit']}.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
