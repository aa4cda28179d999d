"""Seconds per round of one small config in fedhet's simulator and on Flower.

Runs FedAvg and FedCME on the same config - Fashion-MNIST, 3 clients all sampled every round,
cnn2, two local epochs (FedCME exchanges after the first), personalized evaluation every round,
one torch thread per process - in turn in:

* the in-process simulator (``fedhet run``, reference engine);
* a loopback Flower deployment (``fedhet flower run``: SuperLink + one SuperNode per client on
  127.0.0.1);
* Flower's simulation runtime (Ray), when ``fedhet[flower-sim]`` is installed.

Per mode it reports the median seconds per round over rounds 2.. (round 1 carries warm-up and,
on Flower, the identify handshake), and for Flower the median time of each phase split into
what the nodes report (``client_app.profile``: process start-up and flwr, the app's imports,
building the federation, the clients' work) and the rest (message transport and polling).
Writes ``benchmarks/results/flower_latency.{json,md}`` with the machine and the commit.

    .venv/bin/python benchmarks/flower_latency.py [--rounds 3] [--algorithms fedavg fedcme]

``--write-config YAML`` writes the config instead (of the first ``--algorithms``), for measuring
one deployment of it alone, e.g. its memory with ``scripts/process_cpu.py --memory -- fedhet flower
run YAML [--simulation]``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from fedhet.experiment.config import ExperimentConfig, dump_config, load_config
from fedhet.experiment.rundir import read_metrics
from fedhet.experiment.runner import Experiment
from fedhet.experiment.summary import cpu_name, machine_info

RESULTS = Path(__file__).resolve().parent / "results"
PROFILE_KEYS = ("flwr", "imports", "setup", "build", "work")


def bench_config(algorithm: str, rounds: int, data_root: str | None) -> ExperimentConfig:
    raw = {
        "name": f"flower-latency-{algorithm}", "seed": 0,
        "data": {"dataset": "fashion_mnist", "num_clients": 3, "pool_fraction": 0.05,
                 "partition": {"kind": "dirichlet", "alpha": 0.5, "min_size": 10},
                 "local_test": {"source": "test_set", "fraction": 0.2}},
        "model": {"arch": "cnn2"},
        "algorithm": {"name": algorithm},
        "train": {"rounds": rounds, "clients_per_round": 3, "local_epochs": 2, "batch_size": 32, "lr": 0.01},
        "eval": {"every": 1},
        "run": {"threads": 1, "engine": "reference", "precision": "fp32", "progress": False},
    }
    if data_root:
        raw["data"]["root"] = data_root
    return load_config(raw=raw)


def round_seconds(rows: list[dict]) -> list[float]:
    return [float(r["seconds"]["total"]) for r in rows]


def median_after_first(values: list[float]) -> float:
    rest = values[1:] or values
    return round(statistics.median(rest), 3)


def simulator(cfg: ExperimentConfig, out: Path) -> dict:
    t0 = time.perf_counter()
    exp = Experiment.create(cfg, out)
    exp.run(progress=False)
    rows = read_metrics(out)
    secs = round_seconds(rows)
    return {"round_seconds": secs, "median_round_s": median_after_first(secs),
            "wall_s": round(time.perf_counter() - t0, 2), "final_global_acc": rows[-1].get("global_acc")}


def phase_breakdown(rows: list[dict]) -> list[dict]:
    """Median over rounds 2.. of each phase (train phases, then evaluate): its wall time at the
    server and the slowest node's profile; what the nodes do not account for is transport."""
    phases: dict[str, list[dict]] = {}
    for r in rows[1:] or rows:
        flower = r.get("flower", {})
        for p in flower.get("phases", []):
            phases.setdefault("/".join(p["kinds"]), []).append(p)
        if "evaluate" in flower:
            phases.setdefault("evaluate", []).append(flower["evaluate"])
    out = []
    for name, seen in phases.items():
        entry: dict = {"phase": name, "seconds": round(statistics.median(p["seconds"] for p in seen), 3)}
        slowest = [max(p["node_profiles"], key=lambda q: sum(q.values())) for p in seen if p.get("node_profiles")]
        for key in PROFILE_KEYS:
            entry[key] = round(statistics.median(q.get(key, 0.0) for q in slowest), 3) if slowest else None
        if slowest:
            entry["transport"] = round(entry["seconds"] - sum(entry[k] for k in PROFILE_KEYS), 3)
        out.append(entry)
    return out


def flower(cfg: ExperimentConfig, out: Path, work: Path, simulation: bool = False) -> dict:
    """A loopback deployment, or (``simulation``) Flower's simulation runtime, of ``cfg``."""
    from fedhet.flower.deploy import run_loopback

    res = run_loopback(cfg, out, nodes=cfg.data.num_clients, workdir=work, timeout=1800, simulation=simulation,
                       phase_timeout=600.0, node_timeout=300.0)
    rows = read_metrics(out)
    secs = round_seconds(rows)
    return {"round_seconds": secs, "median_round_s": median_after_first(secs),
            "deployment_s": {k: round(v, 2) for k, v in res.seconds.items()},
            "discover_s": [r.get("flower", {}).get("discover_seconds") for r in rows],
            "phases": phase_breakdown(rows), "final_global_acc": rows[-1].get("global_acc")}


def simulation_runtime_available() -> str | None:
    """None when Flower's simulation runtime can run here, else why not."""
    from fedhet.flower import FlowerMissingError
    from fedhet.flower.loopback import require_simulation_runtime

    try:
        require_simulation_runtime()
    except FlowerMissingError as e:
        return str(e)
    return None


def report(result: dict) -> str:
    m = result["machine"]
    lines = [f"# Seconds per round: simulator vs Flower ({result['config']})", "",
             f"Command: `{result['command']}`  ",
             f"Machine: {cpu_name(m)}, {m['cpus']} CPUs, load before {result['load_before']}, "
             f"torch {m['torch']}, flwr {result['flwr']}, commit {m['commit']}. One torch thread per process.",
             "", "Median seconds per round over rounds 2.. (round 1: warm-up, identify handshake):", "",
             "| algorithm | simulator | loopback Flower | ratio | Flower simulation runtime | final global_acc "
             "(simulator / loopback / runtime) |",
             "|---|---|---|---|---|---|"]
    for algo, modes in result["modes"].items():
        sim, lb = modes["simulator"]["median_round_s"], modes["loopback"]["median_round_s"]
        if "simulation_runtime" in modes:
            rt = modes["simulation_runtime"]["median_round_s"]
            runtime = f"{rt:.2f} ({rt / sim:.1f}x)"
        else:
            runtime = result.get("simulation_runtime_note", "-")
        accs = " / ".join(f"{m['final_global_acc']:.4f}" for m in modes.values())
        lines.append(f"| {algo} | {sim:.2f} | {lb:.2f} | {lb / sim:.1f}x | {runtime} | {accs} |")
    lines += ["", "Flower phases (median over rounds 2..; the slowest node's own account, seconds):", "",
              "| algorithm | phase | wall at the server | process start + flwr | imports | setup | build "
              "| work | transport and polling |", "|---|---|---|---|---|---|---|---|---|"]
    for algo, modes in result["modes"].items():
        for mode in ("loopback", "simulation_runtime"):
            for p in modes.get(mode, {}).get("phases", []):
                cells = [f"{p[k]:.2f}" if p.get(k) is not None else "-" for k in (*PROFILE_KEYS, "transport")]
                lines.append(f"| {algo} | {mode} {p['phase']} | {p['seconds']:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _stop(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--algorithms", nargs="+", default=["fedavg", "fedcme"])
    ap.add_argument("--data-root", help="Fashion-MNIST directory (default: the config's)")
    ap.add_argument("--out", type=Path, default=RESULTS / "flower_latency")
    ap.add_argument("--write-config", type=Path, metavar="YAML",
                    help="write the config of the first --algorithms as YAML and stop, e.g. for `fedhet flower "
                         "run YAML` under `scripts/process_cpu.py --memory` (what a deployment holds in memory)")
    a = ap.parse_args(argv)
    if a.write_config:
        a.write_config.write_text(dump_config(bench_config(a.algorithms[0], a.rounds, a.data_root)))
        print(f"wrote {a.write_config}")
        return 0
    import flwr

    t_start = time.perf_counter()
    result: dict = {"command": "python benchmarks/" + " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
                    "config": "Fashion-MNIST 5% pool, 3 clients (3 per round), cnn2, E=2, B=32, "
                              f"{a.rounds} rounds, evaluation every round",
                    "flwr": flwr.__version__, "load_before": [round(x, 2) for x in os.getloadavg()], "modes": {}}
    why_no_runtime = simulation_runtime_available()
    if why_no_runtime:
        result["simulation_runtime_note"] = why_no_runtime
    with tempfile.TemporaryDirectory(prefix="fedhet-flower-latency-") as tmp:
        for algo in a.algorithms:
            cfg = bench_config(algo, a.rounds, a.data_root)
            modes = result["modes"].setdefault(algo, {})
            modes["simulator"] = simulator(cfg, Path(tmp) / f"{algo}-sim")
            print(f"{algo} simulator: {modes['simulator']['median_round_s']} s/round", flush=True)
            modes["loopback"] = flower(cfg, Path(tmp) / f"{algo}-flower", Path(tmp) / f"{algo}-work")
            print(f"{algo} loopback: {modes['loopback']['median_round_s']} s/round", flush=True)
            if not why_no_runtime:
                modes["simulation_runtime"] = flower(cfg, Path(tmp) / f"{algo}-ray", Path(tmp) / f"{algo}-ray-work",
                                                     simulation=True)
                print(f"{algo} simulation runtime: {modes['simulation_runtime']['median_round_s']} s/round",
                      flush=True)
    result.update(machine=machine_info(), load_after=[round(x, 2) for x in os.getloadavg()],
                  wall_s=round(time.perf_counter() - t_start, 1))
    text = report(result)
    print("\n" + text)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".md").write_text(text)
    a.out.with_suffix(".json").write_text(json.dumps(result, indent=2, default=str))
    print(f"wrote {a.out}.md and .json")
    return 0


if __name__ == "__main__":
    # SIGTERM (timeout, kill) stops like Ctrl-C, so the deployments' finally blocks stop their processes
    signal.signal(signal.SIGTERM, _stop)
    sys.exit(main())
