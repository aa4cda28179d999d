"""Table of the FedClassAvg reduced reproduction (runs of ``benchmarks/fedclassavg_fmnist.sweep.yaml``).

    .venv/bin/fedhet sweep benchmarks/fedclassavg_fmnist.sweep.yaml
    .venv/bin/python benchmarks/fedclassavg_table.py benchmarks/fedclassavg_fmnist.sweep.yaml
    .venv/bin/python benchmarks/fedclassavg_table.py benchmarks/fedclassavg_fmnist_full_cnn.sweep.yaml --runs FOLDER \
        --set run.device=cuda --set run.engine=vectorized --out /tmp/table      # a folder a GPU call returned

Per partition, method and seed: the mean over clients of each client's current model on its own
local test set (``personal_acc``, the paper's metric), final (mean of the last evaluations, the
run's ``eval.final_window``), best over rounds, and at the round of the lowest ``personal_loss``
(the authors' selection rule; runs made before that metric existed show -), with the std over
clients at the final round (the paper's ±), beside the number of the paper config the run was made
from (its ``paper`` section: Table 2 / Table 4, Fashion-MNIST). A Local or FedProto run trained with
FedClassAvg's augmentation (``augment: supcon_view``) is marked "augmented". Writes ``benchmarks/results/fedclassavg_fmnist_<tag>.{md,json,png}``
where <tag> is the sweep's output folder name without its prefix.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from fedhet.experiment.config import load_config
from fedhet.experiment.report import (
    format_value,
    load_summary,
    provenance_lines,
    run_table_script,
    write_result_files,
)
from fedhet.experiment.rundir import read_metrics
from fedhet.experiment.summary import machine_info, summarize_metrics
from fedhet.experiment.sweep import load_sweep

PARTITIONS = {"dir0.5": "Dir(0.5)", "skewed": "Skewed (2 classes)"}
METHODS = {"local": "Local", "local_noaug": "Local", "fedproto": "FedProto", "ktpfl": "KT-pFL", "ca": "FedClassAvg CA (Table 4)",
           "ca_pr": "FedClassAvg CA+PR (Table 4)", "ca_cl": "FedClassAvg CA+CL (Table 4)",
           "fedclassavg": "FedClassAvg (CA+PR+CL)"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("sweep", type=Path)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--runs", type=Path, help="the sweep's output folder, if not the file's out (e.g. one a GPU call returned)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="the --set values the sweep ran with (they name its run folders), e.g. run.device=cuda")
    a = p.parse_args(argv)
    sweep = load_sweep(a.sweep, out=a.runs, extra_set=a.set)

    rows, curves, missing = [], {}, []
    for job in sweep.jobs:
        part, method = job.tag.split("_", 1)
        summary = load_summary(job.run_dir) if (job.run_dir / "summary.json").is_file() else None
        metrics = read_metrics(job.run_dir) if (job.run_dir / "metrics.jsonl").is_file() else []
        evaluated = [r for r in metrics if r.get("personal_acc") is not None]
        if not evaluated:
            missing.append((job.name, summary["status"] if summary else "not started"))
            continue
        completed = summary is not None and summary["status"] == "completed"
        cfg = load_config(job.run_dir / "config.yaml")
        paper, window = cfg.paper, cfg.eval.final_window
        augmented = cfg.algorithm.params.get("augment", "none") != "none"
        acc = summarize_metrics(evaluated, "personal_acc", window)
        losses = [(r["personal_loss"], r["round"], r["personal_acc"]) for r in evaluated if r.get("personal_loss") is not None]
        at_min_loss = min(losses) if losses else None
        rows.append({"partition": part, "method": method, "augmented": augmented, "seed": job.seed,
                     "rounds": metrics[-1]["round"], "completed": completed, "final": acc["final"],
                     "window": window, "best": acc["best"], "best_round": acc["best_round"],
                     "at_min_loss": at_min_loss[2] if at_min_loss else None,
                     "min_loss_round": at_min_loss[1] if at_min_loss else None,
                     "by_round": {r["round"]: r["personal_acc"] for r in evaluated},
                     "std_over_clients": evaluated[-1].get("personal_acc_std"),
                     "seconds_per_round": statistics.median(r["seconds"]["total"] for r in evaluated),
                     "paper": paper.value if paper else None, "paper_std": paper.std if paper else None})
        label = f"{PARTITIONS[part]} {METHODS[method]}{' augmented' if augmented else ''}"
        curves.setdefault(label, []).append([(r["round"], r["personal_acc"]) for r in evaluated])
    if not rows:
        raise SystemExit(f"no evaluated runs of {a.sweep} under {sweep.out}")
    # like for like: the last round that every run below evaluated (runs may stop early or evaluate every k rounds)
    shared = set.intersection(*(set(r["by_round"]) for r in rows))
    if not shared:
        raise SystemExit("the runs evaluated no round in common, so no column compares them at one round")
    common = max(shared)

    lines = ["# FedClassAvg reduced reproduction, Fashion-MNIST", "",
             "Command:", "", "```bash", f"fedhet sweep {a.sweep}", f"python benchmarks/fedclassavg_table.py {a.sweep}",
             "```", "",
             "personal_acc = mean over the 20 clients of each client's current model on its own local test set "
             f"(final: mean over the last {rows[0]['window']} evaluated rounds; best: max over rounds, at the round "
             "given; at min loss: at the round of the lowest personal_loss, the authors' rule; "
             f"@{common}: at round {common}, the last that every run below evaluated); ± clients = std over clients at the "
             "last round. A run stopped before its last round is marked with the rounds it ran. Paper: Table 2 / "
             "Table 4 (Fashion-MNIST), chosen by the authors' minimum mean local test loss over up to 1,000 rounds; "
             "its ± is the std over clients.", "",
             f"| partition | method | seed | rounds | final (%) | ± clients | best (%) @round | at min loss (%) @round | "
             f"@{common} (%) | paper (%) | final - paper | s/round |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    order = {m: i for i, m in enumerate(METHODS)}
    for r in sorted(rows, key=lambda r: (list(PARTITIONS).index(r["partition"]), order[r["method"]], r["seed"])):
        paper = "-" if r["paper"] is None else (format_value(r["paper"])
                                                + (f" ± {format_value(r['paper_std'])}" if r["paper_std"] else ""))
        diff = "-" if r["paper"] is None else f"{100 * (r['final'] - r['paper']):+.2f}"
        rounds = str(r["rounds"]) if r["completed"] else f"{r['rounds']} (stopped)"
        at_loss = "-" if r["at_min_loss"] is None else f"{format_value(r['at_min_loss'])} @{r['min_loss_round']}"
        method = METHODS[r["method"]] + (" (augmented)" if r["augmented"] else "")
        lines.append(f"| {PARTITIONS[r['partition']]} | {method} | {r['seed']} | {rounds} | {format_value(r['final'])} | "
                     f"{format_value(r['std_over_clients'])} | {format_value(r['best'])} @{r['best_round']} | {at_loss} | "
                     f"{format_value(r['by_round'][common])} | {paper} | {diff} | {r['seconds_per_round']:.1f} |")
    if missing:
        lines += ["", "Runs not in the table (nothing evaluated yet):", ""] + [f"- `{n}`: {s}" for n, s in missing]
    m = machine_info()
    done = [job.run_dir for job in sweep.jobs if (job.run_dir / "summary.json").is_file()]
    lines += provenance_lines(done, "algorithm, partition and `data.public`", m)
    tag = sweep.out.name.replace("fedclassavg_fmnist_", "")
    print(write_result_files(a.out, f"fedclassavg_fmnist_{tag}", lines, {"rows": rows, "missing": missing, "machine": m},
                             curves, "personal_acc"))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_table_script(main))
