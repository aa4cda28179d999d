"""Does a seed repeat bit for bit on this device, with and without ``run.deterministic``?

    python benchmarks/repeatability.py --device cuda                   # FedACD's FedAvg setting, 10 rounds
    .venv/bin/python benchmarks/repeatability.py --device cpu --rounds 2 --set train.local_epochs=1

Each mode runs the config ``--repeats`` times (default 2) through the real runner, one after the
other in one process, so the thread count and the machine are the same for every repeat: modes
"plain" (run.deterministic: false) first, then "deterministic" (true; it is process-wide and stays
on, hence the order). Per mode: whether the final server state is bit-identical across the
repeats, the largest |difference| from the first repeat of every number recorded per round
(accuracies, losses, per-client values; times left out) and of any server-state tensor, and the
median seconds a round (what the deterministic kernels cost). The result files are rewritten after
every run, so a call stopped by its time limit keeps the runs done:
benchmarks/results/repeatability_<device>.{md,json} (or ``--out STEM``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from fedhet.experiment.config import load_config
from fedhet.experiment.runner import Experiment, read_metrics
from fedhet.experiment.summary import machine_info

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = ROOT / "configs" / "papers" / "fedacd" / "fmnist_b0.1_fedavg.yaml"
MODES = {"plain": False, "deterministic": True}


def float_leaves(obj, path: str = "") -> dict[str, float]:
    """Every number of a metrics row by its path, times (``seconds``) left out."""
    if isinstance(obj, bool):
        return {}
    if isinstance(obj, (int, float)):
        return {path: float(obj)}
    if isinstance(obj, dict):
        return {k: v for key, value in obj.items() if key != "seconds"
                for k, v in float_leaves(value, f"{path}.{key}" if path else str(key)).items()}
    if isinstance(obj, (list, tuple)):
        return {k: v for i, value in enumerate(obj) for k, v in float_leaves(value, f"{path}[{i}]").items()}
    return {}


def state_tensors(obj, path: str = "") -> dict[str, torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return {path: obj.detach().cpu()}
    if isinstance(obj, dict):
        return {k: v for key, value in obj.items() for k, v in state_tensors(value, f"{path}.{key}").items()}
    if isinstance(obj, (list, tuple)):
        return {k: v for i, value in enumerate(obj) for k, v in state_tensors(value, f"{path}[{i}]").items()}
    return {}


def digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().view(torch.uint8).numpy().tobytes()
                 if tensors[name].numel() else b"")
    return h.hexdigest()[:16]


def run_once(config: Path, overrides: list[str], deterministic: bool, folder: Path) -> dict:
    cfg = load_config(config, [*overrides, f"run.deterministic={str(deterministic).lower()}",
                               "run.progress=false"])
    exp = Experiment.create(cfg, folder)
    exp.run(progress=False)
    rows = read_metrics(exp.run_dir)
    return {"rows": [float_leaves(r) | {"round": r["round"]} for r in rows],
            "state": state_tensors(exp.loop.server_state),
            "seconds_per_round": statistics.median(r["seconds"]["total"] for r in rows),
            "engine": exp.engine_info().get("engine"), "device": cfg.run.device}


def compare(first: dict, other: dict) -> dict:
    """How far ``other`` is from ``first``: recorded numbers (over shared rounds) and server state."""
    worst_row, where_row = 0.0, None
    for a, b in zip(first["rows"], other["rows"]):
        for key in a.keys() & b.keys():
            d = abs(a[key] - b[key])
            if d > worst_row:
                worst_row, where_row = d, f"round {a['round']} {key}"
    worst_state, where_state = 0.0, None
    for name in first["state"].keys() & other["state"].keys():
        x, y = first["state"][name], other["state"][name]
        if x.is_floating_point() and x.shape == y.shape and x.numel():
            d = float((x.double() - y.double()).abs().max())
            if d > worst_state:
                worst_state, where_state = d, name
    return {"bitwise": digest(first["state"]) == digest(other["state"]) and first["rows"] == other["rows"],
            "max_metric_diff": worst_row, "max_metric_diff_at": where_row,
            "max_state_diff": worst_state, "max_state_diff_at": where_state}


def write(stem: Path, header: dict, results: list[dict]) -> None:
    lines = [f"# Repeatability on {header['device']}", "",
             f"Config `{header['config']}` with {', '.join(f'`{o}`' for o in header['overrides']) or 'no overrides'}; "
             f"{header['repeats']} repeats per mode, one after the other in one process (torch threads: {header['threads']})"
             f". Machine: {header['machine']['cpu_model']}, {header['gpu']}; torch {header['machine']['torch']}; "
             f"commit {header['commit']}; {header['date']}.", "", f"Command: `{header['command']}`", "",
             "| mode | runs done | final server state bit-identical | every recorded number identical | "
             "max abs diff of a recorded number (where) | max abs diff of a server-state value (where) | "
             "s/round (median per run) |", "|---|---|---|---|---|---|---|"]
    for r in results:
        comps = r["comparisons"]
        same_state = "-" if not comps else ("yes" if all(c["bitwise"] for c in comps) else
                                            f"no ({sum(not c['bitwise'] for c in comps)} of {len(comps)})")
        rows_same = "-" if not comps else ("yes" if all(c["max_metric_diff"] == 0 for c in comps) else "no")
        worst = max(comps, key=lambda c: c["max_metric_diff"], default=None)
        worst_state = max(comps, key=lambda c: c["max_state_diff"], default=None)
        lines.append(f"| {r['mode']} | {r['runs']} | {same_state} | {rows_same} | "
                     + (f"{worst['max_metric_diff']:.3g} ({worst['max_metric_diff_at'] or '-'})" if worst else "-") + " | "
                     + (f"{worst_state['max_state_diff']:.3g} ({worst_state['max_state_diff_at'] or '-'})"
                        if worst_state else "-") + " | "
                     + " / ".join(f"{s:.2f}" for s in r["seconds_per_round"]) + " |")
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    stem.with_suffix(".json").write_text(json.dumps({**header, "results": results}, indent=1) + "\n")
    print("\n".join(lines[-len(results) - 2:]), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--engine", default=None, help="run.engine (default: vectorized on CUDA, reference on a CPU)")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--modes", default="plain,deterministic", help="comma-separated, from: plain, deterministic")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--out", default=None, help="result files' stem (default: benchmarks/results/repeatability_<device>)")
    a = p.parse_args(argv)
    modes = a.modes.split(",")
    if unknown := [m for m in modes if m not in MODES]:
        p.error(f"--modes: unknown {', '.join(unknown)} (choose from {', '.join(MODES)})")
    if modes != sorted(modes, key=list(MODES).index):
        p.error("--modes: plain before deterministic (run.deterministic stays on in the process once set)")
    if a.repeats < 2:
        p.error("--repeats: at least 2 (a repeat is compared with the first)")
    if a.threads:
        torch.set_num_threads(a.threads)
    engine = a.engine or ("vectorized" if a.device.startswith("cuda") else "reference")
    overrides = [f"train.rounds={a.rounds}", f"run.device={a.device}", f"run.engine={engine}",
                 f"run.checkpoint_every={a.rounds}", *a.overrides]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    config = a.config.resolve()
    header = {"device": a.device, "config": str(config.relative_to(ROOT)) if config.is_relative_to(ROOT) else str(config),
              "overrides": overrides, "repeats": a.repeats, "threads": torch.get_num_threads(),
              "machine": machine_info(), "commit": commit, "date": time.strftime("%Y-%m-%d"),
              "gpu": torch.cuda.get_device_name(0) if a.device.startswith("cuda") else "no GPU",
              "command": "python benchmarks/repeatability.py " + " ".join(
                  [f"--device {a.device}", f"--rounds {a.rounds}", f"--repeats {a.repeats}", f"--modes {a.modes}"]
                  + ([f"--config {a.config}"] if a.config != DEFAULT_CONFIG else [])
                  + ([f"--engine {a.engine}"] if a.engine else []) + ([f"--threads {a.threads}"] if a.threads else [])
                  + [f"--set {o}" for o in a.overrides])}
    stem = Path(a.out) if a.out else ROOT / "benchmarks" / "results" / f"repeatability_{a.device.split(':')[0]}"
    results: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in modes:
            entry = {"mode": mode, "runs": 0, "comparisons": [], "seconds_per_round": []}
            results.append(entry)
            first = None
            for i in range(a.repeats):
                print(f"{mode} run {i + 1} of {a.repeats} ({a.rounds} rounds on {a.device}, {engine})", flush=True)
                done = run_once(config, overrides, MODES[mode], Path(tmp) / f"{mode}_{i}")
                entry["runs"] += 1
                entry["seconds_per_round"].append(done["seconds_per_round"])
                if first is None:
                    first = done
                else:
                    entry["comparisons"].append(compare(first, done))
                write(stem, header, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
