"""Table of the FedACD reduced reproduction (runs of ``benchmarks/fedacd_fmnist.sweep.yaml``, folders
``b<beta>_<method>_s<seed>``), or of one beta's sweep (``--sweep BETA``: folders ``<tag>_s<seed>`` of
``fedhet sweep``, several seeds a tag).

    .venv/bin/fedhet sweep benchmarks/fedacd_fmnist.sweep.yaml
    .venv/bin/python benchmarks/fedacd_table.py runs/fedacd_fmnist_p0.1_r20
    .venv/bin/python benchmarks/fedacd_table.py runs/fedacd_fmnist_full_r20_e1 --sweep 0.1 --name full_b0.1

Per beta and method (one seed: no std): the global model on the balanced test set (Table 1's
metric; final = mean of the last 2 evaluations, and best), on the clients' label distributions
(``global_labeldist_acc``, Table 2), the risk of the round's local models over every client's
distribution (``local_risk``, Table 3, lower is better) and their KL(P || Q) on their own data
(``local_kl``, Table 9), both final. Beside them the paper's CIFAR-10 numbers for the same beta
(the paper has no Fashion-MNIST results). Writes ``benchmarks/results/fedacd_fmnist_<tag>.{md,json,png}``.
With ``--sweep``: mean +- sample std over each tag's seeds, each seed's final accuracy, and for
FedACD and FedACD_base the range of the aggregation scores V over all rounds and seeds and the
largest weight ratio of a round (max V / min V).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from fedhet.experiment.report import (
    format_mean_std,
    format_value,
    provenance_lines,
    read_run_folder,
    run_table_script,
    unfinished_lines,
    write_result_files,
)
from fedhet.experiment.rundir import read_metrics
from fedhet.experiment.summary import cpu_name, git_commit, machine_info, summarize_metrics

METHODS = ["fedavg", "fedavg_mixup", "fedprox", "fednova", "fedlc", "fedrod", "fedntd", "fednh", "feddecorr", "creff",
           "fedacd_base", "fedacd_nomixup", "fedacd_clean", "fedacd_delta1e-4", "fedacd_delta1", "fedacd",
           "fedacd_perlabel_trainingV", "fedacd_perlabel_cleanV", "fedacd_pair_cleanV", "fedacd_base_pair",
           "fedacd_pair_trainingV"]
LABELS = {"fedavg": "FedAvg", "fedavg_mixup": "FedAvg with Input Mixup", "fedprox": "FedProx", "fednova": "FedNova", "fedlc": "FedLC", "fedrod": "FedROD",
          "fedntd": "FedNTD", "fednh": "FedNH", "feddecorr": "FedDecorr", "creff": "CReFF",
          "fedacd_base": "FedACD_base", "fedacd_nomixup": "FedACD without mixup",
          "fedacd_clean": "FedACD, P from a clean pass", "fedacd_delta1e-4": "FedACD, delta_missing 1e-4",
          "fedacd_delta1": "FedACD, delta_missing 1", "fedacd": "FedACD",
          "fedacd_perlabel_trainingV": "FedACD, per-label flattening, V from training",
          "fedacd_perlabel_cleanV": "FedACD, per-label flattening, V from a clean pass",
          "fedacd_pair_cleanV": "FedACD, pair flattening, V from a clean pass",
          "fedacd_base_pair": "FedACD_base (pair flattening)",
          "fedacd_pair_trainingV": "FedACD, pair flattening, V from training (the default)"}
# CIFAR-10 Table 1 (%) and Table 3 (risk) of the FedACD paper (Zhou et al.), by beta
PAPER_T1 = {"0.1": dict(fedavg=68.35, fedprox=68.80, fednova=67.02, creff=69.40, fedrod=71.12, fedlc=69.40,
                       fedntd=70.41, feddecorr=71.80, fednh=68.11, fedacd=73.13),
            "0.05": dict(fedavg=60.47, fedprox=62.18, fednova=56.63, creff=61.71, fedrod=62.46, fedlc=52.71,
                         fedntd=60.48, feddecorr=61.19, fednh=60.54, fedacd=63.57)}
# summary.json's memory_format (runs from before it trained in the default layout)
LAYOUTS = {"contiguous": "default layout", "channels_last": "channels_last"}
PAPER_T3 = {"0.1": dict(fedavg=0.57, fedacd=0.31), "0.05": dict(fedavg=0.70, fedacd=0.39)}


def final(rows: list[dict], metric: str) -> float | None:
    """Mean of ``metric`` over the last 2 evaluations (the table's final), None if never recorded."""
    return summarize_metrics(rows, metric, window=2).get("final")


def best(rows: list[dict], metric: str) -> float | None:
    return summarize_metrics(rows, metric, window=2).get("best")


def sweep_table(a: argparse.Namespace, completed: list[tuple[Path, dict]],
                unfinished: list[tuple[str, int, str]]) -> int:
    """One beta's sweep: a row per tag over its seeds (completed runs only)."""
    beta, by_tag = a.sweep, {}
    for d, summary in completed:
        by_tag.setdefault(d.name.rsplit("_s", 1)[0], []).append((summary, read_metrics(d)))
    rows, curves = [], {}
    for method in [m for m in METHODS if m in by_tag] + sorted(set(by_tag) - set(METHODS)):
        runs = sorted(by_tag[method], key=lambda r: r[0]["seed"])
        every = [m for _, ms in runs for m in ms]
        scores = [m[k] for m in every for k in ("fedacd_score_min", "fedacd_score_max") if m.get(k) is not None]
        ratios = [m["fedacd_weight_ratio"] for m in every if m.get("fedacd_weight_ratio") is not None]
        per_seed_spread = []       # (seed, V min, V max, median and max weight ratio of a round)
        for sm, ms in runs:
            lo = [m["fedacd_score_min"] for m in ms if m.get("fedacd_score_min") is not None]
            hi = [m["fedacd_score_max"] for m in ms if m.get("fedacd_score_max") is not None]
            wr = [m["fedacd_weight_ratio"] for m in ms if m.get("fedacd_weight_ratio") is not None]
            if lo and hi and wr:
                per_seed_spread.append((sm["seed"], min(lo), max(hi), statistics.median(wr), max(wr)))
        rows.append({"method": method, "seeds": [sm["seed"] for sm, _ in runs],
                     "rounds": runs[0][0]["rounds_completed"],
                     "global_final": [final(ms, "global_acc") for _, ms in runs],
                     "global_best": [best(ms, "global_acc") for _, ms in runs],
                     "labeldist_final": [final(ms, "global_labeldist_acc") for _, ms in runs],
                     "local_risk_final": [final(ms, "local_risk") for _, ms in runs],
                     "local_kl_final": [final(ms, "local_kl") for _, ms in runs],
                     "score_range": [min(scores), max(scores)] if scores else None,
                     "weight_ratio_max": max(ratios) if ratios else None,
                     "score_spread_by_seed": per_seed_spread,
                     # per seed: the seeds of one tag may have run on different machines ("Runs on" below)
                     "seconds_per_round": [sm["seconds_per_round_median"] for sm, _ in runs],
                     "paper_t1": PAPER_T1.get(beta, {}).get(method)})
        curves[LABELS.get(method, method)] = [[(r["round"], r["global_acc"]) for r in ms if r.get("global_acc") is not None]
                                              for _, ms in runs]
    first_summary = by_tag[rows[0]["method"]][0][0]
    lines = [f"# FedACD sweep, Fashion-MNIST, beta {beta}: {a.folder.name}", "",
             "Command:", "", "```bash", f"python benchmarks/fedacd_table.py {a.folder} --sweep {beta} --name {a.name}",
             "```", "",
             "Per tag, mean ± sample std over its seeds: the global model on the balanced test set (Table 1's "
             "metric; final = mean of the last 2 evaluations), on the clients' label distributions (Table 2's), "
             "the risk of the round's local models over every client's distribution (Table 3's, lower is better) "
             "and their mean KL(P || Q) on their own data (Table 9's); each seed's final; the aggregation scores "
             "V = sigmoid(1/KL) over all rounds and seeds and the largest max V / min V of a round; s/round: the "
             "median seconds of a round, per seed (where each ran: below). Paper: CIFAR-10 Table 1 at the same "
             "beta (no Fashion-MNIST numbers exist).", "",
             "| method | seeds | global acc final (%) | per seed (%) | best (%) | labeldist acc final (%) | "
             "local risk final | local KL final | V range | max weight ratio | s/round | paper C-10 T1 (%) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        per_seed = ", ".join(f"s{sd}: {format_value(v)}" for sd, v in zip(r["seeds"], r["global_final"]))
        vr = "-" if r["score_range"] is None else f"{r['score_range'][0]:.3f}-{r['score_range'][1]:.3f}"
        wr = "-" if r["weight_ratio_max"] is None else f"{r['weight_ratio_max']:.3f}"
        lines.append(f"| {LABELS.get(r['method'], r['method'])} | {len(r['seeds'])} | {format_mean_std(r['global_final'])} | "
                     f"{per_seed} | {format_mean_std(r['global_best'])} | {format_mean_std(r['labeldist_final'])} | "
                     f"{format_mean_std(r['local_risk_final'], 1, '.3f')} | {format_mean_std(r['local_kl_final'], 1, '.2f')} | "
                     f"{vr} | {wr} | {' / '.join(f'{x:.2f}' for x in r['seconds_per_round'])} | {r['paper_t1'] or '-'} |")
    spread = [(LABELS.get(r["method"], r["method"]), sp) for r in rows for sp in r["score_spread_by_seed"]]
    if spread:
        lines += ["", "The scores per seed (over all rounds of the run):", "",
                  "| method | seed | V min-max | max V / min V of a round: median (max) |", "|---|---|---|---|"]
        lines += [f"| {label} | {seed} | {lo:.3f}-{hi:.3f} | {med:.3f} ({top:.3f}) |"
                  for label, (seed, lo, hi, med, top) in spread]
    rm = first_summary["machine"]
    # a run resumed elsewhere (a GPU run finished on a CPU) records where it ended: name each place
    where: dict[str, list[str]] = {}
    for d, sm in completed:
        m = sm["machine"]
        place = (f"{cpu_name(m)}, {m['cpus']} CPUs, torch {m['torch']}, "
                 f"device {sm.get('device', 'cpu')}, engine {sm['engine'].get('engine', '-')}, "
                 f"{LAYOUTS[sm.get('memory_format', 'contiguous')]}")
        where.setdefault(place, []).append(d.name)
    if len(where) == 1:
        lines += ["", f"Runs on: {next(iter(where))}; table at commit {git_commit()}."]
    else:
        lines += ["", "Runs on (where each run ended; a run resumed on another machine ran its earlier rounds "
                  "elsewhere, and its s/round mixes the two):", ""]
        lines += [f"- {place}: {', '.join(sorted(names))}" for place, names in where.items()]
        lines += ["", f"Table at commit {git_commit()}."]
    print(write_result_files(a.out, f"fedacd_fmnist_{a.name}", lines + unfinished_lines(unfinished),
                             {"beta": beta, "rows": rows, "machine_of_runs": rm}, curves, "global_acc"))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("folder", type=Path)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--sweep", metavar="BETA", help="the folder is one beta's fedhet sweep (tags <method>_s<seed>)")
    p.add_argument("--name", help="with --sweep: the result files' name, fedacd_fmnist_<name>.{md,json,png}")
    a = p.parse_args(argv)
    if a.sweep and not a.name:
        p.error("--sweep needs --name")
    completed, unfinished = read_run_folder(a.folder)
    if not completed:
        raise SystemExit(f"no completed runs in {a.folder}")
    if a.sweep:
        return sweep_table(a, completed, unfinished)

    runs: dict[tuple[str, str], tuple[Path, dict]] = {}
    for d, summary in completed:
        beta, rest = d.name.split("_", 1)
        runs[(beta[1:], rest.rsplit("_s", 1)[0])] = (d, summary)

    rows, curves = [], {}
    for beta in ("0.1", "0.05"):
        for method in METHODS:
            if (beta, method) not in runs:
                continue
            d, summary = runs[(beta, method)]
            metrics = read_metrics(d)
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

    lines = ["# FedACD reduced reproduction, Fashion-MNIST", "",
             "Command:", "", "```bash", "fedhet sweep benchmarks/fedacd_fmnist.sweep.yaml",
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
        lines.append(f"| {r['beta']} | {LABELS[r['method']]} | {r['rounds']} | {format_value(r['global_final'])} | "
                     f"{format_value(r['global_best'])} | {format_value(r['labeldist_final'])} | "
                     f"{format_value(r['local_risk_final'], 1, '.3f')} | {format_value(r['local_kl_final'], 1, '.2f')} | "
                     f"{r['seconds_per_round']:.1f} | "
                     f"{r['paper_t1'] if r['paper_t1'] else '-'} | {r['paper_t3'] if r['paper_t3'] else '-'} |")
    m = machine_info()
    lines += provenance_lines([d for d, _ in runs.values()], "algorithm and beta only", m)
    print(write_result_files(a.out, f"fedacd_fmnist_{a.folder.name.replace('fedacd_fmnist_', '')}",
                             lines + unfinished_lines(unfinished), {"rows": rows, "machine": m}, curves, "global_acc"))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_table_script(main))
