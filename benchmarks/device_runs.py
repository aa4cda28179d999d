"""Whole runs on a device, timed: what a user of ``run.device: cuda`` waits for.

    python benchmarks/device_runs.py --run fedcme_t2 --rounds 20 --out /tmp/out       # on a GPU machine
    python benchmarks/device_runs.py --run fedclassavg_full --rounds 2 --device cpu --limit 60   # smoke run

Each named run is ``fedhet run`` of a paper config with ``run.device`` set, in its own process
under a time limit (``--limit`` seconds per run; a run stopped there keeps the rounds it
recorded), and is reported from its metrics.jsonl and summary.json: seconds per round (median of
the rounds after the first, which warms cuDNN and, for FedClassAvg, pre-trains every client), its
training and evaluation parts, evaluation's share of a round, the engine's counters (vectorized
and fallback requests, graph steps, the reasons for any slower path) and the last accuracy. A
100-round figure, where given, is the first round plus 99 times the median: an extrapolation,
named so. The wall time is the whole process; the rounds' own seconds are summed beside it, and the
rest is what the process spent outside them (start-up: imports, CUDA, data; the end: summary, plot).

Runs:

* ``fedcme_t2``: the FedCME paper's Table II setting (Fashion-MNIST, Dir(0.5), K=50, M=10, E=6,
  B=32, lr 0.01), FedAvg and FedCME (mu 0.01), vectorized engine;
* ``fedcme_keep_graphs``: FedCME at that setting with ``run.keep_graphs`` off and on, side by side;
* ``fedclassavg_full``: the FedClassAvg paper's full-size Fashion-MNIST federation (20 clients of
  about 3,000 images, ResNet-18 / ShuffleNetV2 / GoogLeNet / AlexNet by client, Adam, SupCon on two
  views), on the reference engine and on the vectorized one (clients grouped by architecture, the
  views drawn on the host and applied under vmap).

Writes device_runs.{md,json} (with ``--tag T``: device_runs_T.*) to ``--out`` (default
benchmarks/results) after every run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from fedhet.experiment.summary import cpu_name, git_commit, machine_info

RUNS = {
    "fedcme_t2": [
        ("FedAvg", "configs/papers/fedcme/fmnist_a0.5_k50_m10_fedavg.yaml", ["run.engine=vectorized"]),
        ("FedCME mu 0.01", "configs/papers/fedcme/fmnist_a0.5_k50_m10_fedcme_mu0.01.yaml", ["run.engine=vectorized"]),
    ],
    # run.keep_graphs off and on, side by side (the same machine, one after the other)
    "fedcme_keep_graphs": [
        ("FedCME mu 0.01, keep_graphs off", "configs/papers/fedcme/fmnist_a0.5_k50_m10_fedcme_mu0.01.yaml",
         ["run.engine=vectorized", "run.keep_graphs=false"]),
        ("FedCME mu 0.01, keep_graphs on", "configs/papers/fedcme/fmnist_a0.5_k50_m10_fedcme_mu0.01.yaml",
         ["run.engine=vectorized", "run.keep_graphs=true"]),
    ],
    "fedclassavg_full": [
        ("FedClassAvg", "configs/papers/fedclassavg/t2_fmnist_dir0.5_fedclassavg.yaml", ["run.engine=reference"]),
        ("FedClassAvg vectorized", "configs/papers/fedclassavg/t2_fmnist_dir0.5_fedclassavg.yaml",
         ["run.engine=vectorized"]),
    ],
}


def one_run(label: str, config: str, sets: list[str], rounds: int, device: str, limit: float, tmp: Path) -> dict:
    out = tmp / label.replace(" ", "_")
    cmd = [sys.executable, "-m", "fedhet.cli", "run", config, "--out", str(out), "--no-progress",
           "--set", f"train.rounds={rounds}", "--set", f"run.device={device}", "--set", "run.checkpoint_every=1000",
           *[x for s in sets for x in ("--set", s)]]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit)
        status, tail = f"exit {proc.returncode}", (proc.stdout + proc.stderr)[-1500:]
    except subprocess.TimeoutExpired as e:
        status, tail = f"stopped at the {limit:.0f} s limit", str(e.stderr or "")[-1500:]
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()] \
        if (out / "metrics.jsonl").exists() else []
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    later = rows[1:] or rows
    rounds_sum = sum(r["seconds"]["total"] for r in rows) if rows else None
    med = {k: statistics.median(r["seconds"][k] for r in later) if later else None
           for k in ("train", "evaluate", "total")}
    acc_key = summary.get("headline_metric", "global_acc")
    result = {"label": label, "config": config, "sets": sets, "rounds_planned": rounds, "status": status,
              "rounds_done": len(rows), "wall_s": wall, "first_round_s": rows[0]["seconds"]["total"] if rows else None,
              "median_s": med, "eval_share": (med["evaluate"] / med["total"]) if later else None,
              "last_acc": rows[-1].get(acc_key) if rows else None, "metric": acc_key,
              "engine": summary.get("engine"), "device": summary.get("device"),
              "samples_per_s": statistics.median(r["samples"] / r["seconds"]["train"] for r in later) if later else None,
              "extrapolated_100_rounds_s": (rows[0]["seconds"]["total"] + 99 * med["total"]) if later else None,
              # what the process spent outside its rounds: start (imports, CUDA, data), the end (summary, plot)
              "rounds_sum_s": rounds_sum, "outside_rounds_s": wall - rounds_sum if rows else None,
              "output_tail": tail if not rows or status != "exit 0" else ""}
    print(f"{label}: {status}, {len(rows)} rounds in {wall:.1f} s; median {med}; acc {result['last_acc']}; "
          f"engine {result['engine']}", flush=True)
    return result


def report(result: dict) -> str:
    m = result["machine"]
    lines = ["# Whole runs on a device", "", "```bash", result["command"], "```", "",
             f"Machine: {m.get('gpu', 'no GPU')}, CPU {cpu_name(m)}; torch {m.get('torch')}; commit {m.get('commit')}.", "",
             "| run | rounds done | wall s | rounds s (sum) | outside the rounds s | s/round (median, after round 1) | "
             "train s | evaluate s | evaluate share | round 1 s | 100 rounds, extrapolated s | samples/s | last acc | "
             "engine counters |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["runs"]:
        med = r["median_s"]
        fmt = (lambda v, f=".2f": "-" if v is None else format(v, f))  # noqa: E731
        eng = r.get("engine") or {}
        counters = {k: eng[k] for k in ("engine", "vectorized_requests", "fallback_requests", "graph_steps",
                                        "fallback_reasons", "eager_reasons") if k in eng}
        lines.append(f"| {r['label']} | {r['rounds_done']} of {r['rounds_planned']} ({r['status']}) | "
                     f"{fmt(r['wall_s'], '.1f')} | {fmt(r.get('rounds_sum_s'), '.1f')} | "
                     f"{fmt(r.get('outside_rounds_s'), '.1f')} | {fmt(med['total'])} | {fmt(med['train'])} | {fmt(med['evaluate'])} | "
                     f"{fmt(r['eval_share'], '.1%')} | {fmt(r['first_round_s'])} | "
                     f"{fmt(r['extrapolated_100_rounds_s'], '.0f')} | {fmt(r['samples_per_s'], '.0f')} | "
                     f"{fmt(r['last_acc'], '.4f')} | `{json.dumps(counters)}` |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run", nargs="+", choices=list(RUNS), required=True)
    p.add_argument("--only", nargs="*", help="run only these labels of the named runs (e.g. 'FedCME mu 0.01')")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--device", default="cuda")
    p.add_argument("--limit", type=float, default=120, help="seconds per run")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--tag", default="", help="write device_runs_TAG.{md,json} (several calls into one --out)")
    a = p.parse_args()
    info = machine_info()
    info["commit"] = git_commit()
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    result = {"command": " ".join(["python", "benchmarks/device_runs.py", *sys.argv[1:]]), "machine": info, "runs": []}
    a.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmpdir:
        for name in a.run:
            for label, config, sets in RUNS[name]:
                if a.only and label not in a.only:
                    continue
                result["runs"].append(one_run(label, config, sets, a.rounds, a.device, a.limit, Path(tmpdir)))
                stem = f"device_runs_{a.tag}" if a.tag else "device_runs"
                (a.out / f"{stem}.json").write_text(json.dumps(result, indent=2, default=str))
                (a.out / f"{stem}.md").write_text(report(result))
    print(report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
