"""Why Per-FedAvg falls short on the FedReMa Table 1 setting: probes of a run's global model.

    .venv/bin/python benchmarks/perfedavg_probe.py RUN_DIR [--clients 0 5 10 15] [--out benchmarks/results]

RUN_DIR is a Per-FedAvg run (its config.yaml and checkpoint.pt). Measured, single-threaded:

1. **The update rule against PFLlib's.** fedhet's ``meta_step`` (first-order) against the rule of
   PFLlib's ``clientperavg.train`` written out on an ``nn.Module`` here: an SGD step of alpha on
   the first batch in place, the gradient of the second batch at the adapted weights, the weights
   restored, an SGD step of beta with that gradient. Same two batches, at the initialisation and
   at the checkpoint's global model; the largest absolute difference of the results.
2. **The global model** (the meta-model the server averages) on each probed client's local test
   split: accuracy, the classes it predicts, the mean top probability, the loss and gradient
   norm on one training batch; and the personalized accuracy after the one adaptation step the
   evaluation takes, for several step sizes alpha (the run's alpha is train.lr).
3. **Curvature**: the Hessian eigenvalue of largest magnitude of one training batch's loss (power iteration on
   exact Hessian-vector products), at the initialisation and at the global model; alpha times it
   says whether the adaptation step is still a small perturbation (<< 1) or not (about 1).

Writes perfedavg_probe.{md,json} to --out.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from fedhet.algorithms.perfedavg import hessian_vector_product, meta_step
from fedhet.experiment.build import algorithm_and_federation, build_models
from fedhet.experiment.config import load_config
from fedhet.experiment.summary import git_commit
from fedhet.training.local import forward
from fedhet.training.objective import CrossEntropy


def loss_and_grad(model, weights, batch):
    params = {k: v.detach().clone().requires_grad_(True) for k, v in weights.items()}
    loss = F.cross_entropy(forward(model, params, batch.x).logits, batch.y)
    grads = torch.autograd.grad(loss, list(params.values()))
    return float(loss.detach()), dict(zip(params, grads))


def pfllib_rule(model, weights, first, second, alpha: float, beta: float):
    """PFLlib's Per-FedAvg local step, as its client does it on a module (module docstring)."""
    m = copy.deepcopy(model)
    m.load_state_dict(weights)
    saved = [p.detach().clone() for p in m.parameters()]
    m.zero_grad()
    F.cross_entropy(m(first.x), first.y).backward()
    with torch.no_grad():
        for p in m.parameters():
            p -= alpha * p.grad
    m.zero_grad()
    F.cross_entropy(m(second.x), second.y).backward()
    with torch.no_grad():
        for p, s in zip(m.parameters(), saved):
            p.copy_(s - beta * p.grad)
    return {k: v.detach() for k, v in m.state_dict().items()}


def top_eigenvalue(model, weights, batch, generator, iterations: int = 15) -> float:
    v = {k: torch.randn(t.shape, generator=generator) for k, t in weights.items()}
    value = 0.0
    for _ in range(iterations):
        norm = torch.sqrt(sum((t ** 2).sum() for t in v.values()))
        v = {k: t / norm for k, t in v.items()}
        hv = hessian_vector_product(model, weights, {}, [CrossEntropy()], batch, v, "exact")
        value = float(sum((hv[k] * v[k]).sum() for k in v))
        v = hv
    return value


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("--clients", type=int, nargs="+", default=[0, 5, 10, 15])
    p.add_argument("--alphas", type=float, nargs="+", default=[0.003, 0.01, 0.02])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    a = p.parse_args()
    torch.set_num_threads(1)
    cfg = load_config(a.run_dir / "config.yaml")
    _, fed = algorithm_and_federation(cfg)
    models, arch = build_models(cfg, fed)
    model = models[arch[0]]
    init = {k: v.clone() for k, v in model.state_dict().items()}
    checkpoint = torch.load(a.run_dir / "checkpoint.pt", weights_only=False, map_location="cpu")
    glob = {k: v.float() for k, v in checkpoint["sim"]["server_state"]["model"].items()}
    lr, batch_size = cfg.train.lr, cfg.train.batch_size
    g = torch.Generator().manual_seed(0)
    out: dict = {"command": " ".join(["python", "benchmarks/perfedavg_probe.py", *sys.argv[1:]]),
                 "commit": git_commit(), "run_dir": str(a.run_dir), "round": checkpoint["round"], "lr": lr,
                 "rule_difference": {}, "clients": [], "eigen": {}}

    data = fed.client_data(a.clients[0])
    for tag, weights in (("init", init), ("global", glob)):
        perm = torch.randperm(len(data.train_idx), generator=g)
        first, second = data.batch(perm[:batch_size]), data.batch(perm[batch_size:2 * batch_size])
        ours, _, _ = meta_step(model, weights, {}, [CrossEntropy()], [first, second], lr, lr, "fo")
        theirs = pfllib_rule(model, weights, first, second, lr, lr)
        out["rule_difference"][tag] = max(float((ours[k] - theirs[k]).abs().max()) for k in ours)
        out["eigen"][tag] = top_eigenvalue(model, weights, data.batch(perm[:batch_size]), g)

    model.eval()
    for cid in a.clients:
        data = fed.client_data(cid)
        perm = torch.randperm(len(data.train_idx), generator=g)
        batch = data.batch(perm[:batch_size])
        tx, ty = fed.local_test(cid)
        x = fed.normalize(tx)
        with torch.no_grad():
            logits = forward(model, glob, x).logits
        loss, grads = loss_and_grad(model, glob, batch)
        row = {"client": cid, "global_acc": float((logits.argmax(1) == ty).float().mean()),
               "predicted_classes": torch.bincount(logits.argmax(1), minlength=fed.num_classes).tolist(),
               "mean_top_probability": float(logits.softmax(1).max(1).values.mean()),
               "batch_loss": loss, "grad_norm": float(torch.sqrt(sum((t ** 2).sum() for t in grads.values()))),
               "adapted_acc": {}}
        for alpha in a.alphas:
            adapted = {k: glob[k] - alpha * grads[k] for k in glob}
            with torch.no_grad():
                row["adapted_acc"][alpha] = float((forward(model, adapted, x).logits.argmax(1) == ty).float().mean())
        out["clients"].append(row)
        print(row, flush=True)

    lines = [f"# Per-FedAvg probe of `{a.run_dir.name}` (round {out['round']})", "", "```bash", out["command"], "```",
             "", f"Commit {out['commit']}; lr (alpha = beta) {lr}; batch {batch_size}; one thread.", "",
             "| | at the initialisation | at the global model |", "|---|---|---|",
             f"| max abs difference, fedhet meta_step vs PFLlib's rule | {out['rule_difference']['init']:.1e} | "
             f"{out['rule_difference']['global']:.1e} |",
             f"| Hessian eigenvalue of largest magnitude (one batch, power iteration) | {out['eigen']['init']:.1f} | {out['eigen']['global']:.1f} |",
             f"| alpha x eigenvalue | {lr * out['eigen']['init']:.2f} | {lr * out['eigen']['global']:.2f} |", "",
             "| client | global model acc | predicted classes (test split) | mean top prob. | batch loss | grad norm | "
             + " | ".join(f"acc after one step, alpha {x}" for x in a.alphas) + " |",
             "|---|---|---|---|---|---|" + "---|" * len(a.alphas)]
    for r in out["clients"]:
        lines.append(f"| {r['client']} | {r['global_acc']:.3f} | {r['predicted_classes']} | "
                     f"{r['mean_top_probability']:.3f} | {r['batch_loss']:.2f} | {r['grad_norm']:.1f} | "
                     + " | ".join(f"{r['adapted_acc'][x]:.3f}" for x in a.alphas) + " |")
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "perfedavg_probe.json").write_text(json.dumps(out, indent=2))
    (a.out / "perfedavg_probe.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
