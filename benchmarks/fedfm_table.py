"""Table of the FedFM reduced reproduction (runs of ``benchmarks/fedfm_fmnist.sh``).

    .venv/bin/python benchmarks/fedfm_table.py runs/fedfm_fmnist_p0.2_r24_e2 [--features]

Per partition and method (mean +- sample std over seeds; one seed: no std): the test accuracy
at the best-validation round (the paper's rule, ``summary.json`` ``model_selection``), the
final (the summary's: mean over the run's last ``eval.final_window`` evaluations) and best test
accuracy, the communication of the whole run
(floats up + down, relative to FedAvg's), and with ``--features`` the feature-space NMI and
silhouette of the final global model (``fedhet features``, seed-0 runs; computed if missing).
Writes ``benchmarks/results/fedfm_fmnist_<tag>.{md,json}`` and a curve plot.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from fedhet.experiment.report import (
    format_mean_std,
    provenance_lines,
    read_run_folder,
    run_table_script,
    unfinished_lines,
    write_result_files,
)
from fedhet.experiment.rundir import read_metrics
from fedhet.experiment.summary import machine_info

METHODS = ["fedavg", "scaffold", "fedfm_l2", "fedfm", "fedfm_lam5", "fedfm_lite_a2_lam5"]
LABELS = {"fedavg": "FedAvg", "scaffold": "SCAFFOLD", "fedfm_l2": "FedFM-l2 (lambda 50)",
          "fedfm": "FedFM (CG, lambda 50)", "fedfm_lam5": "FedFM (CG, lambda 5)",
          "fedfm_lite_a2_lam5": "FedFM-Lite (a=2, lambda 5)"}
PAPER = {"niid1": {"fedavg": 66.69, "scaffold": 69.91, "fedfm_l2": 67.98, "fedfm": 72.89},
         "niid2": {"fedavg": 69.47, "scaffold": 71.48, "fedfm": 74.52}}


def features_of(run: Path) -> dict | None:
    found = sorted(run.glob("features_round*.json"))
    if found:
        return json.loads(found[-1].read_text())
    from fedhet.experiment.features import features_report

    return features_report(run, plot=run.name.startswith("niid1_") and run.name.endswith("_s0"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("folder", type=Path)
    p.add_argument("--features", action="store_true", help="also the feature-space metrics (t-SNE for niid1 s0)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    a = p.parse_args(argv)

    completed, failed = read_run_folder(a.folder)
    if not completed:
        raise SystemExit(f"no completed runs in {a.folder}")
    runs: dict[tuple[str, str], list[tuple[Path, dict]]] = {}
    for d, summary in completed:
        part, rest = d.name.split("_", 1)
        runs.setdefault((part, rest.rsplit("_s", 1)[0]), []).append((d, summary))

    rows, curves = [], {}
    for part in ("niid1", "niid2"):
        base_floats = None
        for method in METHODS:
            if (part, method) not in runs:
                continue
            dirs = [d for d, _ in runs[(part, method)]]
            sums = [s for _, s in runs[(part, method)]]
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
            curves[f"{part} {LABELS[method]}"] = [[(r["round"], r["global_acc"]) for r in read_metrics(d)
                                                   if r.get("global_acc") is not None] for d in dirs]

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
        lines.append(f"| {r['partition']} | {LABELS[r['method']]} | {len(r['seeds'])} | {format_mean_std(r['selected'])} | "
                     f"{format_mean_std(r['final'])} | {format_mean_std(r['best'])} | {r['floats']:.3g} ({ratio}) | "
                     f"{r['seconds_per_round']:.1f} |{feat} {r['paper'] if r['paper'] else '-'} |")
    m = machine_info()
    lines += unfinished_lines(failed) + provenance_lines([d for d, _ in completed], "algorithm and seed only", m)
    tag = a.folder.name.replace("fedfm_fmnist_", "")
    print(write_result_files(a.out, f"fedfm_fmnist_{tag}", lines, {"rows": rows, "machine": m}, curves, "global_acc"))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_table_script(main))
