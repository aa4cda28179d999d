"""How large FedFM's contrastive-guiding term pushes against cross-entropy on cnn2: gradient norms.

    python benchmarks/fedfm_cg_gradient.py [--config configs/papers/fedfm/fmnist_niid1_fedfm.yaml]
                                           [--steps 0 300] [--batch 256]

On one client's real training data (client 0 of the config's federation), for cnn2 at its
initialisation and after ``--steps`` plain SGD steps of cross-entropy on that client (the model
FedFM's matching starts from after its FedAvg warm-up is of that kind), with the anchors taken as
the class means of the features over the client's data (Eq. 8-9 with one client), it measures per
sample of one batch:

* ``|f|``: the norm of the features the term matches (the head's input, before normalisation);
* ``|dCE/df|`` and ``|dL_FM/df|``: the gradients of cross-entropy and of the unweighted CG loss with
  respect to those features; since L_FM sees only f / |f|, its gradient scales as 1 / |f| and is
  bounded by 2 / (temperature * |f|);
* ``|dCE/dtheta|`` and ``|dL_FM/dtheta|``: the same for the whole model's parameters (batch mean).

and from them the ratio lambda * |dL_FM/dtheta| / |dCE/dtheta| for lambda 1, 5 and 50 (the paper's).
Writes benchmarks/results/fedfm_cg_gradient.{md,json} with the machine and commit.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from fedhet.algorithms.fedfm import AnchorMatching, local_anchors
from fedhet.core.contract import Batch, Forward
from fedhet.data.federated import build_federation
from fedhet.experiment.build import build_models
from fedhet.experiment.config import load_config
from fedhet.experiment.summary import machine_info
from fedhet.training.local import forward

OUT = Path(__file__).parent / "results" / "fedfm_cg_gradient"


def measure(model, weights, data, num_classes, batch_idx, temperature):
    means, counts = local_anchors(model, weights, data, num_classes)
    params = {k: v.detach().clone().requires_grad_(v.is_floating_point()) for k, v in weights.items()}
    trainable = [v for v in params.values() if v.requires_grad]
    model.train()
    x, y = data.inputs(batch_idx), data.y[batch_idx]
    out = forward(model, params, x)
    features = out.features
    term = AnchorMatching(means, counts > 0, lam=1.0, kind="cg", temperature=temperature)
    ce = F.cross_entropy(out.logits, y)
    fm = term(Forward(features, out.logits), Batch(x, y, torch.arange(len(y))), params)
    n = len(y)
    # per-sample feature gradients: the batch means carry 1/n, so scale back by n
    g_ce_f = torch.autograd.grad(ce, features, retain_graph=True)[0] * n
    g_fm_f = torch.autograd.grad(fm, features, retain_graph=True)[0] * n
    g_ce = torch.autograd.grad(ce, trainable, retain_graph=True)
    g_fm = [g for g in torch.autograd.grad(fm, trainable, allow_unused=True) if g is not None]   # not the head

    def norm(gs):
        return float(torch.sqrt(sum((g.double() ** 2).sum() for g in gs)))

    f_norm = features.detach().norm(dim=1)
    return {
        "feature_norm_median": float(f_norm.median()), "feature_norm_min": float(f_norm.min()),
        "dce_df_median": float(g_ce_f.norm(dim=1).median()), "dfm_df_median": float(g_fm_f.norm(dim=1).median()),
        "dfm_df_bound_median": float((2 / (temperature * f_norm)).median()),
        "dce_dtheta": norm(g_ce), "dfm_dtheta": norm(g_fm), "ce": float(ce), "fm": float(fm),
    }


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="configs/papers/fedfm/fmnist_niid1_fedfm.yaml")
    p.add_argument("--steps", nargs="*", type=int, default=[0, 300])
    p.add_argument("--batch", type=int, default=256)
    a = p.parse_args()
    torch.set_num_threads(1)
    cfg = load_config(a.config)
    fed = build_federation(cfg.data, cfg.seed)
    models, archs = build_models(cfg, fed)
    model = models[archs[0]]
    data = fed.client_data(0)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    batch_idx = data.train_idx[torch.randperm(len(data.train_idx), generator=gen)[:a.batch]]
    temperature = cfg.algorithm.params.get("temperature", 0.1)
    rows, done = [], 0
    for target in sorted(a.steps):
        params = {k: v.requires_grad_(v.is_floating_point()) for k, v in weights.items()}
        while done < target:       # plain SGD on cross-entropy, batches of train.batch_size
            pos = torch.randint(len(data.train_idx), (cfg.train.batch_size,), generator=gen)
            idx = data.train_idx[pos]
            loss = F.cross_entropy(forward(model, params, data.inputs(idx)).logits, data.y[idx])
            grads = torch.autograd.grad(loss, [v for v in params.values() if v.requires_grad])
            with torch.no_grad():
                for v, g in zip([v for v in params.values() if v.requires_grad], grads):
                    v -= cfg.train.lr * g
            done += 1
        weights = {k: v.detach() for k, v in params.items()}
        m = measure(model, weights, data, fed.num_classes, batch_idx, temperature)
        m["sgd_steps"] = target
        m["ratio"] = {lam: lam * m["dfm_dtheta"] / m["dce_dtheta"] for lam in (1, 5, 50)}
        rows.append(m)
        print(json.dumps(m))
    lines = [
        "# FedFM's CG term against cross-entropy on cnn2: gradient norms",
        "",
        f"`python benchmarks/fedfm_cg_gradient.py --config {a.config} --steps {' '.join(map(str, a.steps))} "
        f"--batch {a.batch}`; client 0 of that config's federation ({len(data.train_idx)} training images), one batch "
        f"of {a.batch}; temperature {temperature}; anchors = the client's class means of the features (Eq. 8).",
        "",
        "| SGD steps of CE before | median \\|f\\| | min \\|f\\| | median \\|dCE/df\\| | median \\|dL_FM/df\\| "
        "| median 2/(T\\|f\\|) | \\|dCE/dθ\\| | \\|dL_FM/dθ\\| | λ·ratio, λ=1 / 5 / 50 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for m in rows:
        r = m["ratio"]
        lines.append(f"| {m['sgd_steps']} | {m['feature_norm_median']:.3g} | {m['feature_norm_min']:.3g} | "
                     f"{m['dce_df_median']:.3g} | {m['dfm_df_median']:.3g} | {m['dfm_df_bound_median']:.3g} | "
                     f"{m['dce_dtheta']:.3g} | {m['dfm_dtheta']:.3g} | {r[1]:.3g} / {r[5]:.3g} / {r[50]:.3g} |")
    info = machine_info()
    lines += ["", f"Machine: {info['cpu_model']}, torch {info['torch']}, commit {info['commit']}."]
    OUT.with_suffix(".md").write_text("\n".join(lines) + "\n")
    OUT.with_suffix(".json").write_text(json.dumps({"rows": rows, "machine": info, "args": vars(a)}, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
