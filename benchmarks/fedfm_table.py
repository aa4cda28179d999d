"""Table of the FedFM reduced reproduction (runs of ``benchmarks/fedfm_fmnist.sh``).

    .venv/bin/python benchmarks/fedfm_table.py runs/fedfm_fmnist_p0.2_r24_e2 [--features]

Per partition and method (mean +- sample std over seeds; one seed: no std): the test accuracy
at the best-validation round (the paper's rule, ``summary.json`` ``model_selection``), the
final (mean of the last 5 rounds) and best test accuracy, the communication of the whole run
(floats up + down, relative to FedAvg's), and with ``--features`` the feature-space NMI and
silhouette of the final global model (``fedhet features``, seed-0 runs; computed if missing).
Writes ``benchmarks/results/fedfm_fmnist_<tag>.{md,json}`` and a curve plot.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from fedhet.experiment.plots import plot_compare
from fedhet.experiment.rundir import read_metrics
from fedhet.experiment.summary import git_commit, machine_info

METHODS = ["fedavg", "scaffold", "fedfm_l2", "fedfm", "fedfm_lam5", "fedfm_lite_a2_lam5"]
LABELS = {"fedavg": "FedAvg", "scaffold": "SCAFFOLD", "fedfm_l2": "FedFM-l2 (lambda 50)",
          "fedfm": "FedFM (CG, lambda 50)", "fedfm_lam5": "FedFM (CG, lambda 5)",
          "fedfm_lite_a2_lam5": "FedFM-Lite (a=2, lambda 5)"}
PAPER = {"niid1": {"fedavg": 66.69, "scaffold": 69.91, "fedfm_l2": 67.98, "fedfm": 72.89},
         "niid2": {"fedavg": 69.47, "scaffold": 71.48, "fedfm": 74.52}}


def mean_std(xs: list[float]) -> str:
    if not xs:
        return "-"
    m = 100 * statistics.mean(xs)
    return f"{m:.2f} ± {100 * statistics.stdev(xs):.2f}" if len(xs) > 1 else f"{m:.2f}"


def features_of(run: Path) -> dict | None:
    found = sorted(run.glob("features_round*.json"))
    if found:
        return json.loads(found[-1].read_text())
    from fedhet.experiment.features import features_report

    return features_report(run, plot=run.name.startswith("niid1_") and run.name.endswith("_s0"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("folder", type=Path)
    p.add_argument("--features", action="store_true", help="also the feature-space metrics (t-SNE for niid1 s0)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    a = p.parse_args()

    runs: dict[tuple[str, str], list[Path]] = {}
    failed = []
    for d in sorted(a.folder.iterdir()):
        s = d / "summary.json"
        if not (d.is_dir() and s.is_file()):
            continue
        summary = json.loads(s.read_text())
        if summary["status"] != "completed":
            failed.append((d.name, summary["rounds_completed"], summary.get("error") or summary["status"]))
            continue
        part, rest = d.name.split("_", 1)
        method = rest.rsplit("_s", 1)[0]
        runs.setdefault((part, method), []).append(d)
    if not runs:
        raise SystemExit(f"no completed runs in {a.folder}")

    rows, curves = [], {}
    for part in ("niid1", "niid2"):
        base_floats = None
        for method in METHODS:
            dirs = runs.get((part, method), [])
            if not dirs:
                continue
            sums = [json.loads((d / "summary.json").read_text()) for d in dirs]
            comm = sums[0]["communication"]
            floats = comm["up"]["floats"] + comm["down"]["floats"]
            base_floats = base_floats or (floats if method == "fedavg" else None)
            row = {"partition": part, "method": method, "seeds": [s["seed"] for s in sums],
                   "selected": [s["model_selection"]["value"] for s in sums],
                   "selected_round": [s["model_selection"]["round"] for s in sums],
                   "final": [s["metrics"]["global_acc"]["final"] for s in sums],
                   "best": [s["metrics"]["global_acc"]["best"] for s in sums],
                   "floats": floats, "floats_vs_fedavg": floats / base_floats if base_floats else None,
                   "seconds_per_round": statistics.median(s["seconds_per_round_median"] for s in sums),
                   "paper": PAPER.get(part, {}).get(method)}
            if a.features:
                seed0 = next((d for d, s in zip(dirs, sums) if s["seed"] == 0), dirs[0])
                f = features_of(seed0)
                row.update(nmi=f["feature_nmi"], silhouette=f["feature_silhouette"])
            rows.append(row)
            curves[f"{part} {LABELS[method]}"] = [[(r["round"], r["global_acc"]) for r in read_metrics(d)] for d in dirs]

    first = json.loads(next(iter(runs.values()))[0].joinpath("summary.json").read_text())
    cfg_text = next(iter(runs.values()))[0].joinpath("config.yaml").read_text()
    lines = ["# FedFM reduced reproduction, Fashion-MNIST", "",
             "Command:", "", "```bash", "bash benchmarks/fedfm_fmnist.sh",
             f"python benchmarks/fedfm_table.py {a.folder}{' --features' if a.features else ''}", "```", "",
             "| partition | method | seeds | test acc at best val round (%) | final (%) | best (%) | "
             "floats up+down (x FedAvg) | s/round |" + (" NMI | silhouette |" if a.features else "") +
             " paper CIFAR-10 (%) |",
             "|---|---|---|---|---|---|---|---|" + ("---|---|" if a.features else "") + "---|"]
    for r in rows:
        ratio = f"{r['floats_vs_fedavg']:.3f}" if r["floats_vs_fedavg"] else "-"
        feat = f" {r['nmi']:.3f} | {r['silhouette']:.3f} |" if a.features else ""
        lines.append(f"| {r['partition']} | {LABELS[r['method']]} | {len(r['seeds'])} | {mean_std(r['selected'])} | "
                     f"{mean_std(r['final'])} | {mean_std(r['best'])} | {r['floats']:.3g} ({ratio}) | "
                     f"{r['seconds_per_round']:.1f} |{feat} {r['paper'] if r['paper'] else '-'} |")
    if failed:
        lines += ["", "Runs that did not finish (left out of the table above):", ""]
        lines += [f"- `{name}`: {rounds} rounds recorded; {error}" for name, rounds, error in failed]
    m = machine_info()
    lines += ["", f"Machine: {m['processor']}, {m['cpus']} CPUs, torch {m['torch']}; runs at commit "
              f"{first['machine']['commit']}, table at commit {git_commit()}.", "",
              "Config of the first run (the others differ in algorithm and seed only):", "", "```yaml",
              cfg_text.strip(), "```", ""]
    tag = a.folder.name.replace("fedfm_fmnist_", "")
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / f"fedfm_fmnist_{tag}.md").write_text("\n".join(lines) + "\n")
    (a.out / f"fedfm_fmnist_{tag}.json").write_text(json.dumps({"rows": rows, "machine": m}, indent=2))
    plot_compare(curves, "global_acc", a.out / f"fedfm_fmnist_{tag}.png")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
