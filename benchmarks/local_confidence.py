"""Where a local model's uncertainty on its own data goes: the mass of ``P`` (FedACD's per-class mean
prediction, Zhou et al. Eq. 10) split into the true class, the client's other classes and the classes
it lacks, for several methods' local training from one common start.

The FedACD sweep's ``local_kl`` (``eval.local_risk``; FedACD Table 9's KL(P || Q), mean over a
client's present rows) ends higher for FedLC's local models than for FedAvg's at every seed, where
Table 9 has it lower. FedLC (Zhang et al., "Federated Learning with Label Distribution Skew via
Logits Calibration", Eq. 7) trains on ``f(x) - tau n_c^(-1/4)``: an absent class's logit is lowered by
``tau * 100`` before the softmax, so its probability is about 0 in training and no gradient pushes
its raw logit down; evaluation uses the raw logits. FedAvg's cross-entropy pushes the logits of the
classes a client lacks down at every step. Hypothesis: FedLC's local models keep mass on the classes
their client lacks, and that mass is what raises their KL.

Rule, fixed before the first run: the hypothesis holds if, averaged over the round's clients, FedLC's
mass on absent classes exceeds FedAvg's by at least half of the difference of their off-true mass
(``1 - P_yy``), and it does not if FedLC's absent mass is not above FedAvg's. Otherwise (more absent
mass, but not half of the extra off-true mass, or no extra off-true mass at all) it is inconclusive.

What it does: the start is the global model after ``--start-rounds`` rounds of the first run's
config (the sweep's own partition, sampling and training; a FedAvg run in the usual case); then one
more round, the runs' round ``--start-rounds + 1`` (as ``metrics.jsonl`` counts), of every named run's
config from that start (each method's own loss and optimizer; the same sampled clients), keeping each
client's uploaded ``model`` as the runner keeps it for ``eval.local_risk``. For each local model: ``P``
on its client's whole training split (``local_probability_matrix``), its KL against FedACD's template
(``template_kl``, as ``eval.local_risk`` records it) and the split of each present row's mass. A method
whose ``model`` upload is not the whole model (FedPer uploads its body) is refused with a message.

Limits: each method's measured round starts from its own fresh server and client state with the start's
weights, so the comparison is fair for methods whose round reads only the received model (FedAvg, FedLC,
FedACD, FedProx, mixup); a method that builds state over rounds (FedNH's prototypes, SCAFFOLD's control
variates, a client's kept optimizer state) is measured from that state's initial value, not its value in a
run. One round from one start shows where the mass goes in that round, not the size of a gap at the end of
a run.

    .venv/bin/python benchmarks/local_confidence.py benchmarks/runs/fedacd_fmnist_e5_r50/fedavg_s0 \
        benchmarks/runs/fedacd_fmnist_e5_r50/fedlc_s0 --start-rounds 2

Writes ``benchmarks/results/local_confidence.{md,json}`` (``--out``, ``--name``) with the machine,
the commit, the command and the date.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from fedhet.algorithms.fedacd import local_probability_matrix, template_kl
from fedhet.engine import RoundLoop
from fedhet.experiment.build import build
from fedhet.experiment.config import load_config
from fedhet.experiment.rundir import CONFIG
from fedhet.experiment.summary import cpu_name, machine_info


def mass_split(P: torch.Tensor, present: torch.Tensor) -> dict[str, float]:
    """Mean over the present rows ``y`` of ``P_yy`` (``true``), of ``P``'s mass on the other present
    classes (``other_present``) and on the absent classes (``absent``); the three sum to 1 for
    rows of probabilities."""
    rows = present.bool()
    if not rows.any():
        raise ValueError("the mass split needs at least one present class")
    P = P.double()[rows]
    idx = rows.nonzero().squeeze(1)
    true = P[torch.arange(len(idx)), idx]
    absent = P[:, ~rows].sum(1)
    other = P[:, rows].sum(1) - true
    return {"true": float(true.mean()), "other_present": float(other.mean()), "absent": float(absent.mean())}


def load_run_config(path: str, overrides: list[str]):
    """The config of a run folder (its ``config.yaml``) or of a config file, with ``overrides``."""
    p = Path(path)
    if p.is_dir():
        p = p / CONFIG
    if not p.is_file():
        raise SystemExit(f"{path}: no run folder with a config.yaml and no config file there; name a run folder "
                         "such as benchmarks/runs/fedacd_fmnist_e5_r50/fedavg_s0")
    return load_config(p, overrides)


Models = dict[str, dict[str, torch.Tensor]]     # {architecture: weights}


def copied(models: Models) -> Models:
    return {a: {k: v.clone() for k, v in w.items()} for a, w in models.items()}


def start_weights(cfg, rounds: int) -> Models:
    """The server's models after ``rounds`` rounds of ``cfg`` (the init at 0)."""
    built = build(cfg)
    if rounds == 0:
        return copied(built.host.init_models)
    with RoundLoop(built.host, cfg.train.clients_per_round) as loop:
        for rnd in range(rounds):
            t0 = time.perf_counter()
            loop.run_round(rnd)
            print(f"  start: round {rnd} of {cfg.algorithm.name} in {time.perf_counter() - t0:.0f} s", flush=True)
        model = built.algorithm.global_model(loop.server_state)
    if model is None:
        raise SystemExit(f"{cfg.algorithm.name} keeps no global model to start from; name a FedAvg run first")
    return copied({built.client_arch[0]: model})


def local_models(cfg, start: Models, rnd: int):
    """Round ``rnd`` of ``cfg``'s method from the server state built on ``start``: the built run and
    each sampled client's uploaded ``model``."""
    built = build(cfg)
    if set(start) != set(built.models):
        raise SystemExit(f"{cfg.name}: its models ({sorted(built.models)}) are not the start's ({sorted(start)}); "
                         "compare runs of one architecture")
    kept: dict[int, dict[str, torch.Tensor]] = {}
    whole = set(next(iter(start.values())))

    def keep(cid: int, reply) -> None:
        if "model" not in reply.arrays or set(reply.arrays["model"]) != whole:
            raise SystemExit(f"{cfg.algorithm.name} uploads no whole local model as 'model', so its local model's P "
                             "cannot be measured here; leave that run out")
        kept[cid] = reply.arrays["model"]

    with RoundLoop(built.host, cfg.train.clients_per_round) as loop:
        loop.server_state = built.algorithm.init_server_state(copied(start))
        loop.run_round(rnd, on_reply=keep)
    return built, kept


def measure(built, kept: dict[int, dict[str, torch.Tensor]]) -> list[dict]:
    fed = built.federation
    rows = []
    for cid in sorted(kept):
        model = built.models[built.client_arch[cid]]
        P, counts = local_probability_matrix(model, kept[cid], fed.client_data(cid), fed.num_classes,
                                             fast_passes=True)      # as eval.local_risk records it
        present = counts > 0
        rows.append({"client": cid, "present_classes": int(present.sum()), "samples": int(counts.sum()),
                     "local_kl": template_kl(P, present), **mass_split(P, present)})
    return rows


def verdict(by_method: dict[str, dict], baseline: str, method: str) -> str:
    base, other = by_method[baseline], by_method[method]
    extra_absent = other["absent"] - base["absent"]
    extra_off_true = (1 - other["true"]) - (1 - base["true"])
    if extra_absent <= 0:
        return (f"does not hold: {method}'s mass on absent classes ({other['absent']:.4f}) is not above "
                f"{baseline}'s ({base['absent']:.4f})")
    if extra_off_true > 0 and extra_absent >= 0.5 * extra_off_true:
        return (f"holds: {method}'s absent mass exceeds {baseline}'s by {extra_absent:.4f}, "
                f"{extra_absent / extra_off_true:.0%} of the {extra_off_true:.4f} more mass off the true class")
    return (f"inconclusive: {method}'s absent mass exceeds {baseline}'s by {extra_absent:.4f}, against "
            f"{extra_off_true:.4f} more mass off the true class")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="run folders (or config files); the first one's method makes the start")
    ap.add_argument("--start-rounds", type=int, default=2, help="rounds of the first run's method before the "
                    "measured round (default 2)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config value of every run, e.g. data.pool_fraction=0.1 (repeatable)")
    ap.add_argument("--compare", nargs=2, metavar=("BASELINE", "METHOD"), default=None,
                    help="the two runs the rule compares (default: the first two; a run folder goes by its "
                    "folder's name, a config file by its file name's stem)")
    ap.add_argument("--out", default="benchmarks/results", help="folder for the result files")
    ap.add_argument("--name", default="local_confidence", help="the result files' name")
    args = ap.parse_args(argv)
    if args.start_rounds < 0:
        ap.error("--start-rounds must be 0 or more")
    torch.set_num_threads(1)
    machine = machine_info()          # the commit the measurement starts from
    # runs recorded on a GPU measure here on whatever this machine has (--set run.device=... to choose)
    configs = [load_run_config(r, ["run.device=auto", *args.overrides]) for r in args.runs]
    # a run folder is named by its folder (fedavg_s0), a config file by its file name's stem
    names = [Path(r).name if Path(r).is_dir() else Path(r).stem for r in args.runs]
    if len(set(names)) != len(names):
        ap.error(f"two runs share a name ({names}); name distinct runs")
    same_clients = [(c.data.model_dump(), c.seed, c.train.clients_per_round) for c in configs]
    if any(s != same_clients[0] for s in same_clients[1:]):
        ap.error("the runs' data sections, seeds or train.clients_per_round differ, so their clients would not be "
                 "the same; name runs of one partition, seed and sample size")
    baseline, method = args.compare or (names[:2] if len(names) > 1 else (names[0], names[0]))
    for n in (baseline, method):
        if n not in names:
            ap.error(f"--compare names {n}, which is none of the runs ({names})")

    print(f"start: {args.start_rounds} round(s) of {names[0]}", flush=True)
    start = start_weights(configs[0], args.start_rounds)
    results: dict[str, dict] = {}
    for cfg, name in zip(configs, names):
        t0 = time.perf_counter()
        built, kept = local_models(cfg, start, args.start_rounds)
        rows = measure(built, kept)
        mean = {k: float(np.mean([r[k] for r in rows])) for k in ("local_kl", "true", "other_present", "absent")}
        results[name] = {"algorithm": cfg.algorithm.name, "clients": rows, "mean": mean}
        print(f"{name}: local KL {mean['local_kl']:.3f}, true {mean['true']:.4f}, other present "
              f"{mean['other_present']:.4f}, absent {mean['absent']:.4f} ({len(rows)} clients, "
              f"{time.perf_counter() - t0:.0f} s)", flush=True)

    rule = verdict({n: r["mean"] for n, r in results.items()}, baseline, method) if baseline != method else None
    if rule:
        print(f"hypothesis ({method} keeps mass on absent classes): {rule}")

    command = " ".join(["python", "benchmarks/local_confidence.py", *(argv if argv is not None else sys.argv[1:])])
    record = {"command": command, "date": time.strftime("%Y-%m-%d"), "machine": machine,
              "start_rounds": args.start_rounds, "measured_round": args.start_rounds + 1, "runs": list(args.runs),
              "overrides": args.overrides, "verdict": rule, "results": results}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(record, indent=1) + "\n")
    lines = [f"# Where the local models' mass goes on their own data ({args.name})", "",
             f"`{command}`; machine: {cpu_name(record['machine'])}, commit {record['machine']['commit']}, "
             f"{record['date']}. Start: {args.start_rounds} round(s) of {names[0]}; measured: round "
             f"{args.start_rounds + 1} (as metrics.jsonl counts) of each run from that start, the same clients.", "",
             "| run | clients | local KL | P_yy (true) | other present classes | absent classes |",
             "|---|---|---|---|---|---|"]
    for name, r in results.items():
        m = r["mean"]
        lines.append(f"| {name} | {len(r['clients'])} | {m['local_kl']:.3f} | {m['true']:.4f} | "
                     f"{m['other_present']:.4f} | {m['absent']:.4f} |")
    lines += ["", "Means over the round's clients of the means over each client's present rows.", ""]
    if rule:
        lines.append(f"Hypothesis ({method} keeps mass on the classes its client lacks; rule in the script's "
                     f"docstring): {rule}.")
    (out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / args.name}.md and .json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
