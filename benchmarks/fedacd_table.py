"""Table of the FedACD reduced reproduction (runs of ``benchmarks/fedacd_fmnist.sh``).

    .venv/bin/python benchmarks/fedacd_table.py runs/fedacd_fmnist_p0.1_r20

Per beta and method (one seed: no std): the global model on the balanced test set (Table 1's
metric; final = mean of the last 2 evaluations, and best), on the clients' label distributions
(``global_labeldist_acc``, Table 2), the risk of the round's local models over every client's
distribution (``local_risk``, Table 3, lower is better) and their KL(P || Q) on their own data
(``local_kl``, Table 9), both final. Beside them the paper's CIFAR-10 numbers for the same beta
(the paper has no Fashion-MNIST results). Writes ``benchmarks/results/fedacd_fmnist_<tag>.{md,json,png}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from fedhet.experiment.plots import plot_compare
from fedhet.experiment.rundir import read_metrics
from fedhet.experiment.summary import git_commit, machine_info

METHODS = ["fedavg", "fedprox", "fedlc", "fedrod", "fedntd", "fednh", "fedacd_base", "fedacd"]
LABELS = {"fedavg": "FedAvg", "fedprox": "FedProx", "fedlc": "FedLC", "fedrod": "FedROD", "fedntd": "FedNTD",
          "fednh": "FedNH", "fedacd_base": "FedACD_base", "fedacd": "FedACD"}
# CIFAR-10 Table 1 (%) and Table 3 (risk) of the FedACD paper (Zhou et al.), by beta
PAPER_T1 = {"0.1": dict(fedavg=68.35, fedrod=71.12, fedlc=69.40, fedntd=70.41, fednh=68.11, fedacd=73.13),
            "0.05": dict(fedavg=60.47, fedrod=62.46, fedlc=52.71, fedntd=60.48, fednh=60.54, fedacd=63.57)}
PAPER_T3 = {"0.1": dict(fedavg=0.57, fedacd=0.31), "0.05": dict(fedavg=0.70, fedacd=0.39)}


def final(rows: list[dict], metric: str, window: int = 2) -> float | None:
    values = [r[metric] for r in rows if r.get(metric) is not None]
    return statistics.mean(values[-window:]) if values else None


def best(rows: list[dict], metric: str) -> float | None:
    values = [r[metric] for r in rows if r.get(metric) is not None]
    return max(values) if values else None


def fmt(x: float | None, scale: float = 100, spec: str = ".2f") -> str:
    return "-" if x is None else format(scale * x, spec)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("folder", type=Path)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    a = p.parse_args()

    runs: dict[tuple[str, str], Path] = {}
    unfinished = []
    for d in sorted(a.folder.iterdir()):
        s = d / "summary.json"
        if not (d.is_dir() and s.is_file()):
            continue
        summary = json.loads(s.read_text())
        beta, rest = d.name.split("_", 1)
        method = rest.rsplit("_s", 1)[0]
        if summary["status"] != "completed":
            unfinished.append((d.name, summary["rounds_completed"], summary.get("error") or summary["status"]))
            continue
        runs[(beta[1:], method)] = d
    if not runs:
        raise SystemExit(f"no completed runs in {a.folder}")

    rows, curves = [], {}
    for beta in ("0.1", "0.05"):
        for method in METHODS:
            d = runs.get((beta, method))
            if d is None:
                continue
            metrics = read_metrics(d)
            summary = json.loads((d / "summary.json").read_text())
            rows.append({"beta": beta, "method": method, "seed": summary["seed"],
                         "rounds": summary["rounds_completed"],
                         "global_final": final(metrics, "global_acc"), "global_best": best(metrics, "global_acc"),
                         "labeldist_final": final(metrics, "global_labeldist_acc"),
                         "local_risk_final": final(metrics, "local_risk"),
                         "local_kl_final": final(metrics, "local_kl"),
                         "seconds_per_round": summary["seconds_per_round_median"],
                         "paper_t1": PAPER_T1[beta].get(method), "paper_t3": PAPER_T3[beta].get(method)})
            curves[f"beta {beta} {LABELS[method]}"] = [[(r["round"], r["global_acc"]) for r in metrics
                                                        if r.get("global_acc") is not None]]

    first = next(iter(runs.values()))
    summary0 = json.loads((first / "summary.json").read_text())
    lines = ["# FedACD reduced reproduction, Fashion-MNIST", "",
             "Command:", "", "```bash", "bash benchmarks/fedacd_fmnist.sh",
             f"python benchmarks/fedacd_table.py {a.folder}", "```", "",
             "Global model on the balanced test set (Table 1's metric) and on the clients' label distributions "
             "(Table 2's), risk of the round's local models over every client's distribution (Table 3's, lower is "
             "better) and their mean KL(P || Q) on their own data (Table 9's). final = mean of the last 2 "
             "evaluations (rounds evaluated every 5). Paper columns: CIFAR-10 at the same beta (no Fashion-MNIST "
             "numbers exist).", "",
             "| beta | method | rounds | global acc final (%) | best (%) | labeldist acc final (%) | "
             "local risk final | local KL final | s/round | paper C-10 T1 (%) | paper C-10 T3 risk |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['beta']} | {LABELS[r['method']]} | {r['rounds']} | {fmt(r['global_final'])} | "
                     f"{fmt(r['global_best'])} | {fmt(r['labeldist_final'])} | {fmt(r['local_risk_final'], 1, '.3f')} | "
                     f"{fmt(r['local_kl_final'], 1, '.2f')} | {r['seconds_per_round']:.1f} | "
                     f"{r['paper_t1'] if r['paper_t1'] else '-'} | {r['paper_t3'] if r['paper_t3'] else '-'} |")
    if unfinished:
        lines += ["", "Runs that did not finish (left out of the table above):", ""]
        lines += [f"- `{name}`: {rounds} rounds recorded; {error}" for name, rounds, error in unfinished]
    m = machine_info()
    lines += ["", f"Machine: {m['processor']}, {m['cpus']} CPUs, torch {m['torch']}; runs at commit "
              f"{summary0['machine']['commit']}, table at commit {git_commit()}.", "",
              "Config of the first run (the others differ in algorithm and beta only):", "", "```yaml",
              (first / "config.yaml").read_text().strip(), "```", ""]
    tag = a.folder.name.replace("fedacd_fmnist_", "")
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / f"fedacd_fmnist_{tag}.md").write_text("\n".join(lines) + "\n")
    (a.out / f"fedacd_fmnist_{tag}.json").write_text(json.dumps({"rows": rows, "machine": m}, indent=2))
    plot_compare(curves, "global_acc", a.out / f"fedacd_fmnist_{tag}.png")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
