"""Cost of one round of the FedClassAvg paper's full-size federation on this machine.

    .venv/bin/python benchmarks/fedclassavg_fullsize_cost.py [--threads 1]

The paper's Fashion-MNIST Table 2 setting (configs/papers/fedclassavg/t2_fmnist_dir0.5_fedclassavg.yaml:
20 clients on the whole training set, Dir(0.5), client i with ResNet-18 / ShuffleNetV2 / GoogLeNet /
AlexNet by i mod 4, SupCon on two views + CE + proximal term, Adam, one epoch of batch 64, fp32).
A whole round trains all 20 clients; on a 2-core CPU that is too long to repeat here, so this
script runs the real client update (``ClientHost.run``, the code every engine runs) of one client
of each architecture (clients 0-3) and the evaluation of those four clients, times each, and
extrapolates the round: each architecture's seconds per local step times the steps of its five
clients, plus four times the measured evaluation. Round 1 also pre-trains every client for one
epoch (the authors' code), about doubling its training; the figures are for a later round. Peak
memory is this process's maximum resident set size, with all 20 clients' states held (each a copy
of its architecture's trained weights). Writes benchmarks/results/fedclassavg_fullsize_cost.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from pathlib import Path

import torch

from fedhet.engine.host import Job, Tally
from fedhet.engine.loop import RoundLoop
from fedhet.experiment.build import build
from fedhet.experiment.config import load_config
from fedhet.experiment.summary import git_commit, machine_info
from fedhet.metrics.evaluate import predict

CONFIG = "configs/papers/fedclassavg/t2_fmnist_dir0.5_fedclassavg.yaml"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    cfg = load_config(CONFIG, ["run.precision=fp32", "algorithm.params.pretrain=false"])
    built = build(cfg)
    host, fed = built.host, built.federation
    loop = RoundLoop(host, cfg.train.clients_per_round)
    ctx = loop.round_context(0)
    state = built.algorithm.init_server_state(host.init_models)
    batch = cfg.train.batch_size

    per_arch: dict[str, dict] = {}
    states = {}
    for cid in range(len(cfg.model.archs())):
        arch = host.client_arch[cid]
        msg = built.algorithm.train_message(state, cid, ctx)
        t0 = time.perf_counter()
        result = host.run(0, Job(cid, msg, None, Tally()))
        train_s = time.perf_counter() - t0
        states[cid] = result.state
        x, y = fed.local_test(cid)
        t0 = time.perf_counter()
        hits, _ = predict(host.models[arch], result.state["model"], x, y, fed.normalize, cfg.eval.batch_size)
        eval_s = time.perf_counter() - t0
        steps = result.tally.steps
        per_arch[arch] = {"client": cid, "samples": len(fed.train_idx[cid]), "steps": steps, "train_s": train_s,
                          "s_per_step": train_s / max(steps, 1), "eval_s": eval_s, "test_samples": len(y),
                          "params": sum(v.numel() for v in result.state["model"].values()),
                          "local_acc": float(hits.float().mean())}
        print(f"client {cid} {arch}: {steps} steps in {train_s:.1f} s ({train_s / max(steps, 1):.3f} s/step), "
              f"eval {eval_s:.2f} s", flush=True)

    # every client's state, as a round leaves them (copies of its architecture's trained weights)
    held = {cid: {k: v.clone() for k, v in states[cid % 4]["model"].items()} for cid in range(fed.num_clients)}
    state_bytes = sum(v.numel() * v.element_size() for s in held.values() for v in s.values())
    train_total = sum(per_arch[host.client_arch[cid]]["s_per_step"] * (len(fed.train_idx[cid]) // batch)
                      for cid in range(fed.num_clients))
    eval_total = sum(per_arch[host.client_arch[cid]]["eval_s"] / per_arch[host.client_arch[cid]]["test_samples"]
                     * len(fed.test_idx[cid]) for cid in range(fed.num_clients))
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    m = machine_info()
    lines = ["# FedClassAvg full-size federation: cost of one round on this machine", "",
             "Command:", "", "```bash", f".venv/bin/python benchmarks/fedclassavg_fullsize_cost.py --threads {a.threads}",
             "```", "", f"Config: `{CONFIG}` (fp32, pre-training off: the cost of a round after the first).", "",
             "| client | architecture | parameters | samples | local steps | train (s) | s/step | eval (s) |",
             "|---|---|---|---|---|---|---|---|"]
    for arch, r in per_arch.items():
        lines.append(f"| {r['client']} | {arch} | {r['params']:,} | {r['samples']} | {r['steps']} | "
                     f"{r['train_s']:.1f} | {r['s_per_step']:.3f} | {r['eval_s']:.2f} |")
    lines += ["", f"One round of all 20 clients, extrapolated from these per-step times and each client's own "
              f"number of steps: **{train_total / 60:.1f} min of training + {eval_total:.0f} s of evaluation** "
              f"with {a.threads} thread(s) (the first round pre-trains too: about {2 * train_total / 60:.1f} min). "
              f"The paper's protocol runs up to 1,000 rounds (early stopping after 100 without a better "
              f"validation loss): {1000 * (train_total + eval_total) / 3600 / 24:.1f} days here at this rate, "
              f"{200 * (train_total + eval_total) / 3600:.0f} h for the configs' 200 rounds.", "",
              f"Peak resident memory of this process: **{peak_mib:,.0f} MiB**, holding the data, the four models "
              f"and all 20 clients' states ({state_bytes / 2**20:,.0f} MiB of weights and BatchNorm statistics).",
              "", f"Machine: {m['processor']}, {m['cpus']} CPUs, torch {m['torch']}, commit {git_commit()}; other "
              "processes may have shared the CPU.", ""]
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "fedclassavg_fullsize_cost.md").write_text("\n".join(lines) + "\n")
    (a.out / "fedclassavg_fullsize_cost.json").write_text(json.dumps(
        {"per_arch": per_arch, "round_train_s": train_total, "round_eval_s": eval_total, "peak_rss_mib": peak_mib,
         "client_state_mib": state_bytes / 2**20, "threads": a.threads,
         "median_s_per_step": statistics.median(r["s_per_step"] for r in per_arch.values()), "machine": m},
        indent=2))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
