"""FedClassAvg against its authors' code, step by step: one client, its first round.

    python benchmarks/fedclassavg_vs_authors.py --authors-src PATH/src [--config RUN/config.yaml]
        [--clients 0 2] [--out benchmarks/results] [--break-fedhet ce_on_both_views --out /tmp/broken]

PATH is a checkout of the authors' repository (hukla/FedClassAvg, Jang et al., "FedClassAvg: Local
Representation Learning for Personalized Federated Learning on Heterogeneous Neural Networks",
ICPP 2022). Its client update, ``heteropfl_utils.train_cl`` (with its ``losses.SupConLoss``), is
imported from there and run as it is; nothing of it is copied here.

For each probed client, from the same initial weights and the same global classifier:

1. fedhet: ``FedClassAvg.client_update`` of the client's first participation, through the
   in-process client host the runner uses: one pre-training epoch with the client's own classifier,
   then the global classifier loaded and one epoch of L_CL + L_CE + L_R. Every batch of two views
   it draws is recorded.
2. The authors' procedure (their ``fedclassavg.py``: ``train_cl`` before round 1, then
   ``classifier.load_state_dict(global)`` and ``train_cl`` again) on those recorded batches, with
   their two modules built from the same fedhet model: the feature extractor (its body) and the
   classifier (ReLU + Linear, its head).

The global classifier is the initial head of another architecture of the federation, so that the
proximal term has something to pull towards. Reported: the largest absolute difference between
the two results over every weight and BatchNorm statistic, beside how far the round moved them,
the mean losses of the two epochs on each side, and the procedure's own noise floor: the largest
difference between the authors' procedure and itself started from initial weights changed by
+-1e-7 of their value (about one float32 rounding, random signs, 4 draws). ``--break-fedhet
ce_on_both_views`` changes fedhet's side on purpose (its cross-entropy on both views instead of the
first), to see the check fail. Writes fedclassavg_vs_authors.{md,json}.
"""

from __future__ import annotations

import copy
import importlib
import json
import sys
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from fedhet.algorithms.fedclassavg import FedClassAvg, FirstViewCrossEntropy
from fedhet.core.contract import Batch, Message
from fedhet.core.split import HEAD, select
from fedhet.data.federated import build_federation
from fedhet.engine.host import ClientHost, Tally
from fedhet.experiment.build import build_models, make_algorithm, train_settings
from fedhet.experiment.config import load_config
from fedhet.experiment.summary import cpu_name, git_commit, machine_info
from fedhet.training.local import forward

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

DEFAULT_CONFIG = Path("benchmarks/runs/fedclassavg_fmnist_tiny/dir0.5_fedclassavg_s0/config.yaml")


class FeatureExtractor(nn.Module):
    """The authors' ``model``: images in, the 512-d features out (fedhet's body, flattened)."""

    def __init__(self, body: nn.Module):
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x).flatten(1)


def as_authors_loader(drawn: list) -> list:
    """fedhet's stacked views ``[x'; x'']`` as the authors' loader yields them: ``([x', x''], y)``."""
    out = []
    for x, y in drawn:
        b = len(y) // 2
        out.append(([x[:b], x[b:]], y[:b]))
    return out


def authors_round(train_cl, model: nn.Module, init: dict, global_head: dict, batches: list[list],
                  lr: float, mu: float) -> tuple[dict, list[float]]:
    m = copy.deepcopy(model)
    m.load_state_dict(init)
    body, classifier = FeatureExtractor(m.body), m.head
    configs = {"learning_rate": lr}
    losses = []
    # pre-training with the client's own classifier (their fedclassavg.py, before round 1)
    _, loss, _ = train_cl(model=body, classifier=classifier, device="cpu", train_dataloader=as_authors_loader(batches[0]),
                          mu=mu, configs=configs, local_epochs=1)
    losses.append(loss)
    classifier.load_state_dict({k.removeprefix("head."): v for k, v in global_head.items()})
    _, loss, _ = train_cl(model=body, classifier=classifier, device="cpu", train_dataloader=as_authors_loader(batches[1]),
                          mu=mu, configs=configs, local_epochs=1)
    losses.append(loss)
    return {k: v.detach().clone() for k, v in m.state_dict().items()}, losses


def body_gradient_norms(model: nn.Module, weights: dict, terms: list, x: torch.Tensor, y: torch.Tensor) -> dict:
    """The norm of each loss term's gradient with respect to the feature extractor's parameters."""
    body = [k for k, _ in model.named_parameters() if k.startswith("body.")]
    work = {k: v.detach().clone().requires_grad_(k in body) for k, v in weights.items()}
    model.train()
    out = forward(model, work, x)
    batch = Batch(x, y, torch.arange(len(y)), {"views": 2})
    norms = {}
    for term in terms:
        value = term(out, batch, work)
        if not value.requires_grad:          # the proximal term: the head's parameters only
            norms[term.name] = 0.0
            continue
        grads = torch.autograd.grad(value, [work[k] for k in body], retain_graph=True, allow_unused=True)
        norms[term.name] = float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads if g is not None)))
    return norms


def main() -> int:
    p, a = parse_arguments(__doc__.split("\n")[0], "the src/ folder of a checkout of hukla/FedClassAvg", DEFAULT_CONFIG,
                           [0, 2], ["ce_on_both_views"])
    if a.break_fedhet:
        FirstViewCrossEntropy.__call__ = lambda self, out, batch, weights: F.cross_entropy(out.logits, batch.y)
    if not (a.authors_src / "heteropfl_utils.py").is_file():
        p.error(f"{a.authors_src} has no heteropfl_utils.py: pass the src/ folder of a hukla/FedClassAvg checkout")
    torch.set_num_threads(1)
    sys.path.insert(0, str(a.authors_src.resolve()))
    train_cl = importlib.import_module("heteropfl_utils").train_cl
    authors_commit = checkout_commit(a.authors_src)

    cfg = load_config(a.config)
    algorithm = make_algorithm(cfg)
    if not isinstance(algorithm, FedClassAvg):
        p.error(f"{a.config} runs {cfg.algorithm.name}, not fedclassavg")
    fed = build_federation(cfg.data, cfg.seed)
    models, client_arch = build_models(cfg, fed)
    host = ClientHost(algorithm, fed, models, client_arch, train_settings(cfg, "fp32"), cfg.seed,
                      lr_decay=cfg.train.lr_decay)
    inits = {arch: {k: v.detach().clone() for k, v in m.state_dict().items()} for arch, m in models.items()}
    archs = list(inits)
    out: dict = {"command": " ".join(["python", "benchmarks/fedclassavg_vs_authors.py", *sys.argv[1:]]),
                 "commit": git_commit(), "machine": machine_info(), "authors_commit": authors_commit,
                 "config": str(a.config), "lr": cfg.train.lr, "betas": list(cfg.train.betas),
                 "rho": algorithm.params.rho, "broken_on_purpose": a.break_fedhet, "clients": []}
    for cid in a.clients:
        arch = client_arch[cid]
        other = archs[(archs.index(arch) + 1) % len(archs)]
        global_head = select(inits[other], HEAD)
        runtime = host.runtime(cid, 0, Tally())
        batches: list[list] = []
        runtime.train = recording(runtime.train, batches)     # type: ignore[method-assign]
        reply, state = algorithm.client_update(Message("train", {"head": global_head}), None, runtime)
        assert state is not None and len(batches) == 2, "expected a pre-training epoch and the round's epoch"
        ours = state["model"]
        their_round = partial(authors_round, train_cl, models[arch], global_head=global_head, batches=batches,
                              lr=cfg.train.lr, mu=algorithm.params.rho)
        theirs, their_losses = their_round(inits[arch])
        rows = compare(ours, theirs, inits[arch])
        floors = noise_floors(weights_only(their_round), inits[arch], theirs)
        floor = max(floors)
        terms = algorithm.terms(global_head)
        start = {**inits[arch], **global_head}
        gradients = {"round start, first batch": body_gradient_norms(models[arch], start, terms, *batches[1][0]),
                     "round end, last batch": body_gradient_norms(models[arch], ours, terms, *batches[1][-1])}
        worst = max(rows, key=lambda k: rows[k]["max_abs_diff"])
        out["clients"].append({
            "client": cid, "arch": arch, "global_head_from": other, "steps": [len(b) for b in batches],
            "fedhet_round_loss": float(reply.scalars.get("loss", float("nan"))),
            "authors_losses": their_losses,
            "max_abs_diff": rows[worst]["max_abs_diff"], "worst_tensor": worst, "noise_floor": floor, "noise_floors": floors,
            "body_gradient_norms": gradients,
            "max_moved": max(r["moved"] for r in rows.values()), "tensors": rows})
        c = out["clients"][-1]
        print(f"client {cid} ({arch}): {c['steps']} steps; largest |fedhet - authors| {c['max_abs_diff']:.3g} "
              f"({worst}); the authors' own after a {NUDGE:g} nudge: up to {floor:.3g}; the round moved weights by up to {c['max_moved']:.3g}; authors' mean losses "
              f"{their_losses[0]:.4f} (pre-training), {their_losses[1]:.4f} (round); fedhet's round loss "
              f"{c['fedhet_round_loss']:.4f}", flush=True)

    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "fedclassavg_vs_authors.json").write_text(json.dumps(out, indent=2) + "\n")
    lines = ["# FedClassAvg's client update against the authors' code", "", "Command:", "", "```bash",
             out["command"], "```", "",
             *([f"**fedhet broken on purpose** (`--break-fedhet {a.break_fedhet}`): this file shows the check "
                "failing.", ""] if a.break_fedhet else []),
             f"The authors' `heteropfl_utils.train_cl` (hukla/FedClassAvg at {authors_commit}) run on the batches of "
             "two views fedhet drew, from the same initial weights and global classifier: the client's pre-training "
             "epoch with its own classifier, then the global classifier loaded and the round's epoch "
             f"(lr {cfg.train.lr}, betas {tuple(cfg.train.betas)}, rho = mu = {algorithm.params.rho}, fp32, one thread).",
             "", "| client | architecture | steps (pre-training, round) | largest abs. difference | in tensor | "
             f"noise floor (authors' vs authors' from weights nudged by {NUDGE:g}, largest of {NUDGES}) | largest change in the round | authors' mean loss (pre-training / round) | fedhet's round loss |",
             "|---|---|---|---|---|---|---|---|---|"]
    for c in out["clients"]:
        lines.append(f"| {c['client']} | {c['arch']} | {c['steps'][0]}, {c['steps'][1]} | {c['max_abs_diff']:.3g} | "
                     f"`{c['worst_tensor']}` | {c['noise_floor']:.3g} | {c['max_moved']:.3g} | {c['authors_losses'][0]:.4f} / "
                     f"{c['authors_losses'][1]:.4f} | {c['fedhet_round_loss']:.4f} |")
    names = list(out["clients"][0]["body_gradient_norms"]["round start, first batch"])
    lines += ["", "How much of the feature extractor's gradient each loss term gives (the norm of its gradient with "
              "respect to the body's parameters, one batch of two views; the proximal term touches the head only):",
              "", "| client | where | " + " | ".join(f"`{n}`" for n in names) + " | `supcon` / `ce` |",
              "|---|---|" + "---|" * (len(names) + 1)]
    for c in out["clients"]:
        for where, norms in c["body_gradient_norms"].items():
            ratio = norms.get("supcon", float("nan")) / max(norms.get("ce", float("nan")), 1e-30)
            lines.append(f"| {c['client']} | {where} | " + " | ".join(f"{norms[n]:.3g}" for n in names)
                         + f" | {ratio:.3g} |")
    within = all(c["max_abs_diff"] <= c["noise_floor"] for c in out["clients"])
    lines += ["", "Reading: fedhet's result " + ("lies within the noise floor for every client" if within else
              "lies outside the noise floor for client(s) " + ", ".join(str(c["client"]) for c in out["clients"]
                                                                    if c["max_abs_diff"] > c["noise_floor"]))
              + " (the floor: how far the authors' own procedure moves when its starting weights change by "
              f"{NUDGE:g} of their value, largest of {NUDGES} draws)."]
    m = out["machine"]
    lines += ["", f"Machine: {cpu_name(m)}, torch {m.get('torch', '?')}; commit {out['commit']}.", ""]
    (a.out / "fedclassavg_vs_authors.md").write_text("\n".join(lines))
    print(f"wrote {a.out / 'fedclassavg_vs_authors.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
