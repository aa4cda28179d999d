"""The cross-device speed benchmark (configs/benchmarks/cross_device_cifar10.yaml): whole-run wall
time, training samples/s and their ratio to the device's one-batch ceiling, per engine and precision.

    .venv/bin/python benchmarks/cross_device.py                       # CPU: 20 rounds per mode
    python benchmarks/cross_device.py --device cuda --rounds 1500     # the whole run on a GPU
    .venv/bin/python benchmarks/cross_device.py --modes vectorized:fp32 --rounds 10

The setting is pfl-research's (Granqvist et al., NeurIPS 2024, Sec. 4.1): CIFAR-10 as 1,000 users of
50 images, 50 a round, E=1 at batch 10, SGD lr 0.1, plain averaging, their CNN with dropout, the
global model evaluated on the 10,000 test images every 10 rounds. Real CIFAR-10 is used where
``load_dataset("cifar10")`` finds it; otherwise CIFAR-shaped random images are written in CIFAR-10's
own format to a temporary folder (speed does not depend on the pixels), and the output says so.

Per mode (engine:precision) the run goes through the real runner (``Experiment``) for ``--rounds``
rounds, or until ``--limit`` seconds of it have passed (the round then running is finished and the
run stops there, so a device call of bounded length always brings back a figure). "wall" is the
whole run, start-up and evaluations included; with fewer than 1,500 rounds, "whole run" is projected
(and marked so): start-up, plus 1,500 times the measured rounds' mean time without evaluation, plus
150 times their mean evaluation time. Samples/s is the training
sample-steps over the seconds the engine took to train them (the runner's per-round "train"
time), over every round but the first (warm-up). The ceiling is ``train_local`` on the same model
over the samples of round 1's cohort in batches of 50 x 10 = 500 (the same FLOPs without per-client
or small-batch overhead), the best of 3. Writes benchmarks/results/cross_device_<device>.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from fedhet.core.contract import ClientData, TrainSettings
from fedhet.core.errors import DataError
from fedhet.core.seeding import torch_generator
from fedhet.data.datasets import load_dataset
from fedhet.experiment.callbacks import Callback
from fedhet.experiment.config import load_config
from fedhet.experiment.runner import Experiment, read_metrics
from fedhet.experiment.summary import cpu_name, git_commit, machine_info
from fedhet.training.local import train_local
from fedhet.training.objective import CrossEntropy

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "benchmarks" / "cross_device_cifar10.yaml"
RESULTS = ROOT / "benchmarks" / "results"
FULL_ROUNDS = 1500
CPU_MODES = ["reference:fp32", "reference:bf16", "parallel:fp32", "vectorized:fp32", "vectorized:bf16"]
GPU_MODES = ["vectorized:fp32", "vectorized:bf16", "reference:fp32"]


def write_synthetic_cifar10(root: Path) -> None:
    """CIFAR-10's python pickles (5 train batches of 10,000, a test batch) holding random images."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for name in names:
        batch = {b"batch_label": name.encode(), b"data": rng.integers(0, 256, (10_000, 3072), dtype=np.uint8),
                 b"labels": rng.integers(0, 10, 10_000).tolist(), b"filenames": [b"x.png"] * 10_000}
        with open(folder / name, "wb") as f:
            pickle.dump(batch, f, protocol=2)


def data_overrides(tmp: Path) -> tuple[list[str], str]:
    """Config overrides pointing at the data, and what the data is."""
    try:
        load_dataset("cifar10", "test")
        return [], "CIFAR-10 (real)"
    except DataError:
        write_synthetic_cifar10(tmp / "data")
        return [f"data.root={tmp / 'data'}", "data.verify=false"], "CIFAR-shaped random images (CIFAR-10 not found)"


class StopAfter(Callback):
    """Stops a run once ``seconds`` have passed since it was made, after the round then running is
    recorded (the runner treats it as an interruption: the rows so far are kept)."""

    def __init__(self, seconds: float | None):
        self.deadline = None if seconds is None else time.perf_counter() + seconds
        self.stopped = False

    def on_row_written(self, exp, row: dict) -> None:
        if self.deadline is not None and time.perf_counter() > self.deadline:
            self.stopped = True
            raise KeyboardInterrupt


def run_mode(mode: str, rounds: int, device: str, tmp: Path, data: list[str],
             limit: float | None = None) -> dict | None:
    """One mode's figures, or None when ``limit`` stopped it before a second round (nothing to time)."""
    engine, precision = mode.split(":")
    cfg = load_config(CONFIG, [*data, f"train.rounds={rounds}", f"run.engine={engine}", f"run.precision={precision}",
                               f"run.device={device}", "run.progress=false", f"run.checkpoint_every={rounds}"])
    t0 = time.perf_counter()
    stop = StopAfter(limit)
    exp = Experiment.create(cfg, tmp / mode.replace(":", "-"), callbacks=[stop])
    try:
        exp.run(progress=False)
    except KeyboardInterrupt:
        if not stop.stopped:          # a real Ctrl-C
            raise
    wall = time.perf_counter() - t0
    rows = read_metrics(exp.run_dir)
    if stop.stopped and len(rows) < 2:
        return None
    rounds = len(rows)
    measured = rows[1:] or rows
    train_s = sum(r["seconds"]["train"] for r in measured)
    samples = sum(r["samples"] for r in measured)
    # Projected whole run: start-up, plus the measured rounds' mean time without evaluation for each
    # of 1,500 rounds, plus their mean evaluation time for each of its 150 evaluations.
    evaluated = [r["seconds"]["evaluate"] for r in rows if r["seconds"]["evaluate"] > 0]
    startup = wall - sum(r["seconds"]["total"] for r in rows)
    per_round = statistics.mean(r["seconds"]["total"] - r["seconds"]["evaluate"] for r in measured)
    evaluations = -(-FULL_ROUNDS // cfg.eval.every)
    projection = startup + FULL_ROUNDS * per_round + evaluations * (statistics.mean(evaluated) if evaluated else 0.0)
    return {"mode": mode, "rounds": rounds, "wall_s": wall, "startup_s": startup,
            "whole_run_s": wall if rounds == FULL_ROUNDS else projection, "projected": rounds != FULL_ROUNDS,
            "evaluations_measured": len(evaluated),
            "samples_per_s": samples / train_s,
            "seconds_per_round": {k: statistics.median(r["seconds"][k] for r in measured)
                                  for k in ("train", "aggregate", "evaluate", "total")},
            "final_global_acc": next((r["global_acc"] for r in reversed(rows) if r.get("global_acc") is not None),
                                     None),
            "engine": exp.engine_info()}


def ceiling(precision: str, device: str, tmp: Path, data: list[str]) -> float:
    """Samples/s of train_local over round 1's cohort in batches of clients_per_round x batch_size."""
    cfg = load_config(CONFIG, [*data, "train.rounds=1", "run.engine=reference", f"run.device={device}",
                               "run.progress=false"])
    exp = Experiment(cfg, tmp / f"ceiling-{precision}")
    loop, fed = exp.loop, exp.federation
    idx = torch.cat([fed.train_idx[c] for c in loop.sample_clients(0)])
    big = cfg.train.clients_per_round * cfg.train.batch_size
    dev = torch.device(device)
    data_ = ClientData(fed.pool.x.to(dev), fed.pool.y.to(dev), idx.to(dev), fed.mean.to(dev), fed.std.to(dev))
    model = next(iter(loop.host.models.values())).to(dev)
    weights = {k: v.to(dev) for k, v in loop.host.init_models[loop.host.client_arch[0]].items()}
    settings = TrainSettings(epochs=4, batch_size=big, lr=cfg.train.lr, precision=precision)
    gen = lambda e: torch_generator(0, "ceiling", e)  # noqa: E731
    train_local(model, weights, data_, [CrossEntropy()], settings, gen)          # warm-up
    rates = []
    for _ in range(3):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        res = train_local(model, weights, data_, [CrossEntropy()], settings, gen)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        rates.append(res.samples / (time.perf_counter() - t))
    return max(rates)


def profile(mode: str, rounds: int, device: str) -> int:
    """Where one mode's time goes: cProfile of a run of ``rounds`` rounds without evaluation."""
    import cProfile
    import pstats

    engine, precision = mode.split(":")
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        data, data_note = data_overrides(tmp)
        cfg = load_config(CONFIG, [*data, f"train.rounds={rounds}", f"run.engine={engine}",
                                   f"run.precision={precision}", f"run.device={device}", "run.progress=false",
                                   f"run.checkpoint_every={rounds}", f"eval.every={rounds + 1}"])
        exp = Experiment.create(cfg, tmp / "profile")
        print(f"profile of {mode} on {device}, {rounds} rounds, {data_note}", flush=True)
        prof = cProfile.Profile()
        prof.enable()
        exp.run(progress=False)
        prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--rounds", type=int, help=f"rounds per mode (default: {FULL_ROUNDS} on CUDA, 20 on the CPU)")
    p.add_argument("--modes", help="comma-separated engine:precision (default: every engine with fp32 and bf16)")
    p.add_argument("--out", default=None, help="result files' stem (default: cross_device_<device>)")
    p.add_argument("--limit", type=float, metavar="SECONDS",
                   help="stop each mode's run after the round running at SECONDS and project the whole run from "
                        "the rounds done (default: no limit)")
    p.add_argument("--profile", metavar="MODE", help="instead: cProfile --rounds rounds of one engine:precision "
                                                     "(evaluation off) and print the 15 costliest calls")
    a = p.parse_args()
    if a.profile:
        return profile(a.profile, a.rounds or 3, a.device)
    rounds = a.rounds or (FULL_ROUNDS if a.device == "cuda" else 20)
    modes = a.modes.split(",") if a.modes else (GPU_MODES if a.device == "cuda" else CPU_MODES)
    commit = git_commit()          # the package's, "-dirty" where its source differs from it
    command = "python benchmarks/cross_device.py " + " ".join(
        x for x in [f"--device {a.device}", f"--rounds {rounds}", f"--modes {','.join(modes)}",
                    f"--limit {a.limit:g}" if a.limit is not None else ""] if x)
    results, ceilings = [], {}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        data, data_note = data_overrides(tmp)
        print(f"cross-device benchmark on {a.device}: {data_note}; {rounds} rounds per mode", flush=True)
        for precision in sorted({m.split(":")[1] for m in modes}):
            ceilings[precision] = ceiling(precision, a.device, tmp, data)
            print(f"ceiling {precision}: {ceilings[precision]:,.0f} samples/s", flush=True)
        for mode in modes:
            r = run_mode(mode, rounds, a.device, tmp, data, a.limit)
            if r is None:
                print(f"{mode:18s} not measured: --limit {a.limit:g} s stopped it before its second round", flush=True)
                continue
            r["ceiling_ratio"] = r["samples_per_s"] / ceilings[mode.split(":")[1]]
            results.append(r)
            print(f"{mode:18s} wall {r['wall_s']:8.1f} s  whole run {r['whole_run_s']:8.1f} s"
                  f"{' (projected)' if r['projected'] else ''}"
                  f"{'' if r['evaluations_measured'] else ' (no evaluation measured)'}  {r['samples_per_s']:9,.0f} samples/s "
                  f"({r['ceiling_ratio']:.2f}x ceiling)  fallbacks {r['engine'].get('fallback_reasons', {})}",
                  flush=True)
    machine = machine_info()
    machine["gpu"] = torch.cuda.get_device_name(0) if a.device == "cuda" else "no GPU"
    stem = a.out or f"cross_device_{a.device}"
    lines = [f"# Cross-device benchmark ({a.device})", "",
             f"Setting: `{CONFIG.relative_to(ROOT)}`; data: {data_note}; {rounds} rounds per mode"
             f"{f', each stopped after about {a.limit:g} s (rounds done: the table)' if a.limit is not None else ''}"
             f"{' (whole run projected to 1,500 rounds: start-up + rounds + evaluations)' if any(r['projected'] for r in results) else ''}.",
             f"Machine: {cpu_name(machine)} ({machine['cpus']} CPUs), {machine['gpu']}; commit {commit}; "
             f"`{command}`; {time.strftime('%Y-%m-%d')}.", "",
             "| mode | rounds | wall (s) | whole run (s) | train samples/s | x ceiling | train / aggregate / evaluate "
             "per round (s, median) | fallbacks |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        s = r["seconds_per_round"]
        projected = " (projected, no evaluation measured)" if not r["evaluations_measured"] else " (projected)"
        lines.append(f"| {r['mode']} | {r['rounds']} | {r['wall_s']:.1f} | {r['whole_run_s']:.0f}"
                     f"{projected if r['projected'] else ''} | {r['samples_per_s']:,.0f} | "
                     f"{r['ceiling_ratio']:.2f} | {s['train']:.3f} / {s['aggregate']:.3f} / {s['evaluate']:.3f} | "
                     f"{r['engine'].get('fallback_reasons') or '-'} |")
    lines += ["", "Ceilings (train_local, batches of 500, best of 3): "
              + ", ".join(f"{k} {v:,.0f} samples/s" for k, v in ceilings.items()) + "."]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{stem}.md").write_text("\n".join(lines) + "\n")
    (RESULTS / f"{stem}.json").write_text(json.dumps(
        {"command": command, "commit": commit, "machine": machine, "data": data_note, "rounds": rounds,
         "ceilings": ceilings, "results": results}, indent=1, default=str) + "\n")
    print("\n".join(lines))
    return 0 if results else 1


if __name__ == "__main__":
    raise SystemExit(main())
