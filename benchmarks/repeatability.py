"""Does a seed repeat bit for bit on this device, with and without ``run.deterministic``?

    python benchmarks/repeatability.py --device cuda                   # FedACD's FedAvg setting, 10 rounds
    .venv/bin/python benchmarks/repeatability.py --device cpu --rounds 2 --set train.local_epochs=1

Each mode ("plain": run.deterministic false; "deterministic": true) gets a process of its own, started
from the same environment (torch reads CUBLAS_WORKSPACE_CONFIG once per process, and the
deterministic setting is process-wide), which runs the config ``--repeats`` times (default 2)
through the real runner, one after the other, so the thread count and the machine are the same for
every repeat. Per mode: whether the final server state is bit-identical across the repeats, whether
every number recorded per round is (accuracies, losses, per-client values; times left out; NaN
equals NaN), the largest |difference| from the first repeat of a recorded number and of a
server-state value, and the median seconds a round spends training, over the rounds after the
first (what the deterministic kernels cost; start-up, graph capture and evaluation left out). The
result files are rewritten after every mode, and a mode stopped by a time limit keeps its finished
repeats: benchmarks/results/repeatability_<device>.{md,json} (or ``--out STEM``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from fedhet.experiment.config import load_config
from fedhet.experiment.runner import Experiment, read_metrics
from fedhet.experiment.summary import cpu_name, git_commit, machine_info

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
    """Of names, dtypes, shapes and bytes (0-dim tensors such as BatchNorm's step count included)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def difference(a: float, b: float) -> float:
    """|a - b|, 0 for two NaNs (the same number recorded twice), inf for a NaN against a number."""
    if math.isnan(a) or math.isnan(b):
        return 0.0 if math.isnan(a) and math.isnan(b) else math.inf
    return abs(a - b)


def compare(first: dict, other: dict) -> dict:
    """How far ``other`` is from ``first``: every recorded number, round by round, and the server state."""
    worst_row, where_row = 0.0, None
    mismatched = []                 # rows or keys that only one of the two recorded
    if len(first["rows"]) != len(other["rows"]):
        mismatched.append(f"{len(first['rows'])} rows against {len(other['rows'])}")
    for a, b in zip(first["rows"], other["rows"]):
        if a.keys() != b.keys():
            mismatched.append(f"round {a.get('round')}: {', '.join(sorted(a.keys() ^ b.keys()))}")
        for key in a.keys() & b.keys():
            d = difference(a[key], b[key])
            if d > worst_row:
                worst_row, where_row = d, f"round {a['round']} {key}"
    worst_state, where_state = 0.0, None
    for name in first["state"].keys() & other["state"].keys():
        x, y = first["state"][name], other["state"][name]
        if x.shape == y.shape and x.numel() and not x.is_complex():
            xd, yd = x.double(), y.double()
            gaps = (xd - yd).abs().masked_fill(xd.isnan() ^ yd.isnan(), math.inf)   # NaN against a number
            d = float(gaps.masked_fill(xd.isnan() & yd.isnan(), 0.0).max())        # NaN against NaN: the same
            if d > worst_state:
                worst_state, where_state = d, name
    return {"state_identical": digest(first["state"]) == digest(other["state"]),
            "rows_identical": not mismatched and worst_row == 0.0, "rows_mismatched": mismatched,
            "max_metric_diff": worst_row, "max_metric_diff_at": where_row,
            "max_state_diff": worst_state, "max_state_diff_at": where_state}


def run_once(config: Path, overrides: list[str], deterministic: bool, folder: Path) -> dict:
    cfg = load_config(config, [*overrides, f"run.deterministic={str(deterministic).lower()}",
                               "run.progress=false"])
    exp = Experiment.create(cfg, folder)
    exp.run(progress=False)
    rows = read_metrics(exp.run_dir)
    trained = [r["seconds"]["train"] for r in rows[1:]] or [r["seconds"]["train"] for r in rows]
    return {"rows": [float_leaves(r) | {"round": r["round"]} for r in rows],
            "state": state_tensors(exp.loop.server_state), "train_seconds": statistics.median(trained)}


def worker(a: argparse.Namespace, overrides: list[str]) -> int:
    """One mode's repeats in this process; its entry goes to ``a.worker_json`` after every repeat."""
    if a.threads:
        torch.set_num_threads(a.threads)
    entry: dict = {"mode": a.worker, "runs": 0, "comparisons": [], "train_seconds": [],
                   "threads": torch.get_num_threads()}
    first = None
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.repeats):
            print(f"{a.worker} run {i + 1} of {a.repeats} ({a.rounds} rounds on {a.device})", flush=True)
            done = run_once(a.config, overrides, MODES[a.worker], Path(tmp) / f"run{i}")
            entry["runs"] += 1
            entry["train_seconds"].append(done["train_seconds"])
            if first is None:
                first = done
            else:
                entry["comparisons"].append(compare(first, done))
            Path(a.worker_json).write_text(json.dumps(entry))
    return 0


def run_mode(mode: str, argv: list[str], folder: Path, results: list[dict]) -> dict:
    """The mode's entry, from a process of its own, appended to ``results``; stopped (SIGTERM,
    Ctrl-C), it stops that process, and the entry holds the repeats it finished."""
    out = folder / f"{mode}.json"
    child = subprocess.Popen([sys.executable, __file__, *argv, "--worker", mode, "--worker-json", str(out)])
    try:
        child.wait()
    except BaseException:
        child.terminate()
        child.wait()
        raise
    finally:
        entry = json.loads(out.read_text()) if out.exists() else {"mode": mode, "runs": 0, "comparisons": [],
                                                                   "train_seconds": []}
        entry["exit_status"] = child.returncode
        results.append(entry)
    return entry


def verdict(comps: list[dict], key: str) -> str:
    if not comps:
        return "-"
    differing = sum(not c[key] for c in comps)
    return "yes" if not differing else f"no ({differing} of {len(comps)})"


def write(stem: Path, header: dict, results: list[dict]) -> None:
    lines = [f"# Repeatability on {header['device']}", "",
             f"Config `{header['config']}` with {', '.join(f'`{o}`' for o in header['overrides'])}; "
             f"{header['repeats']} repeats per mode, one after the other in a process of the mode's own. Machine: "
             f"{cpu_name(header['machine'])}, {header['gpu']}; torch {header['machine']['torch']}; "
             f"commit {header['commit']}; {header['date']}.", "", f"Command: `{header['command']}`", "",
             "| mode | runs done | final server state bit-identical | every recorded number identical | "
             "max abs diff of a recorded number (where) | max abs diff of a server-state value (where) | "
             "training s/round after round 1 (median per run) | torch threads |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        comps = r["comparisons"]
        worst = max(comps, key=lambda c: c["max_metric_diff"], default=None)
        worst_state = max(comps, key=lambda c: c["max_state_diff"], default=None)
        lines.append(f"| {r['mode']} | {r['runs']} of {header['repeats']} | {verdict(comps, 'state_identical')} | "
                     f"{verdict(comps, 'rows_identical')} | "
                     + (f"{worst['max_metric_diff']:.3g} ({worst['max_metric_diff_at'] or '-'})" if worst else "-") + " | "
                     + (f"{worst_state['max_state_diff']:.3g} ({worst_state['max_state_diff_at'] or '-'})"
                        if worst_state else "-") + " | "
                     + " / ".join(f"{s:.3f}" for s in r["train_seconds"]) + f" | {r.get('threads', '-')} |")
    mismatches = [f"{r['mode']}: {'; '.join(c['rows_mismatched'])}" for r in results for c in r["comparisons"]
                  if c["rows_mismatched"]]
    if mismatches:
        lines += ["", "Rows or numbers only one repeat recorded: " + " | ".join(mismatches)]
    stopped = [f"{r['mode']} (exit status {r.get('exit_status')})" for r in results if r.get("exit_status")]
    if stopped:
        lines += ["", "Not finished: " + ", ".join(stopped)]
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    stem.with_suffix(".json").write_text(json.dumps({**header, "results": results}, indent=1) + "\n")
    print("\n".join(lines), flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
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
    p.add_argument("--worker", choices=list(MODES), help=argparse.SUPPRESS)
    p.add_argument("--worker-json", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    modes = a.modes.split(",")
    if unknown := [m for m in modes if m not in MODES]:
        p.error(f"--modes: unknown {', '.join(unknown)} (choose from {', '.join(MODES)})")
    if a.repeats < 2:
        p.error("--repeats: at least 2 (a repeat is compared with the first)")
    engine = a.engine or ("vectorized" if a.device.startswith("cuda") else "reference")
    overrides = [f"train.rounds={a.rounds}", f"run.device={a.device}", f"run.engine={engine}",
                 f"run.checkpoint_every={a.rounds}", *a.overrides]
    if a.worker:
        return worker(a, overrides)
    commit = git_commit()          # the package's, "-dirty" where its source differs from it
    config = a.config.resolve()
    header = {"device": a.device, "config": str(config.relative_to(ROOT)) if config.is_relative_to(ROOT) else str(config),
              "overrides": overrides, "repeats": a.repeats, "machine": machine_info(), "commit": commit,
              "date": time.strftime("%Y-%m-%d"), "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
              "gpu": torch.cuda.get_device_name(0) if a.device.startswith("cuda") else "no GPU",
              "command": "python benchmarks/repeatability.py " + " ".join(
                  [f"--device {a.device}", f"--rounds {a.rounds}", f"--repeats {a.repeats}", f"--modes {a.modes}"]
                  + ([f"--config {a.config}"] if a.config != DEFAULT_CONFIG else [])
                  + ([f"--engine {a.engine}"] if a.engine else []) + ([f"--threads {a.threads}"] if a.threads else [])
                  + [f"--set {o}" for o in a.overrides])}
    stem = Path(a.out) if a.out else ROOT / "benchmarks" / "results" / f"repeatability_{a.device.split(':')[0]}"
    signal.signal(signal.SIGTERM, signal.default_int_handler)   # a time limit's TERM: stop the mode's process too
    results: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for mode in modes:
                run_mode(mode, argv, Path(tmp), results)
                write(stem, header, results)
        except KeyboardInterrupt:
            write(stem, header, results)
            return 130
    return 1 if any(r["exit_status"] for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
