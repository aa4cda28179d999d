"""Where a round's time goes on a device: a ``torch.profiler`` trace of whole rounds of a paper config.

    python benchmarks/profile_device.py --out /tmp/out                            # on a GPU machine
    python benchmarks/profile_device.py --device cpu --rounds 1 --set train.local_epochs=1 --out /tmp/p   # smoke run

Runs ``--config`` (default: FedAvg at the FedCME paper's Table II setting, Fashion-MNIST Dir(0.5),
K=50, M=10, E=6, B=32) on ``--device`` with the vectorized engine, through the real runner. The
first ``--skip`` rounds (default 2: cuDNN's autotuning and the first allocations happen there)
run unprofiled; the profiler (CPU and CUDA activities) starts after them and stops after the next
``--rounds`` rounds. Progress goes to stderr with timestamps.

Writes to ``--out``:

* ``profile_device.md`` / ``.json``: per profiled round, its wall seconds and the device's busy
  time (the sum of kernel and memory-copy times, an upper bound of the device's occupancy since
  overlapping kernels are counted twice), the number of kernel launches, graph launches and
  host-device copies, and the 25 operators that take the most device time;
* ``profile_device_trace.json.gz``: the Chrome trace (chrome://tracing or https://ui.perfetto.dev).
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from fedhet.experiment.callbacks import Callback
from fedhet.experiment.config import load_config
from fedhet.experiment.runner import Experiment
from fedhet.experiment.summary import cpu_name, git_commit, machine_info

DEFAULT_CONFIG = "configs/papers/fedcme/fmnist_a0.5_k50_m10_fedavg.yaml"


class ProfiledRounds(Callback):
    """Starts the profiler after round ``skip`` and stops it after round ``skip + rounds``; the wall
    time of every round. (A profiler opened before the run, with a schedule that skipped the first
    rounds, did not finish within a minute on an H100, for a reason its log did not show; this one
    starts later and logs every stage.)"""

    def __init__(self, prof: profile, skip: int, rounds: int):
        self.prof, self.skip, self.rounds = prof, skip, rounds
        self.round_seconds: list[float] = []
        self.t0 = time.perf_counter()
        if skip == 0:
            self.prof.start()

    def on_row_written(self, exp: Experiment, row: dict) -> None:
        self.round_seconds.append(row["seconds"]["total"])
        done = len(self.round_seconds)
        log(self.t0, f"round {done}: {row['seconds']['total']:.2f} s")
        if done == self.skip:
            self.prof.start()
        elif done == self.skip + self.rounds:
            self.prof.stop()


def log(t0: float, what: str) -> None:
    print(f"[{time.perf_counter() - t0:7.1f} s] {what}", file=sys.stderr, flush=True)


def device_events(events, cuda: bool) -> dict:
    """Counts and times of what ran on the device, from the profiler's raw events."""
    kernels = copies = 0
    kernel_us = copy_us = 0.0
    launches = {"cudaLaunchKernel": 0, "cudaGraphLaunch": 0, "cudaMemcpyAsync": 0, "cudaStreamSynchronize": 0}
    for e in events:
        if e.name in launches:
            launches[e.name] += 1
        if not cuda or e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        dur = e.time_range.end - e.time_range.start
        if e.name.startswith("Memcpy") or e.name.startswith("Memset"):
            copies += 1
            copy_us += dur
        else:
            kernels += 1
            kernel_us += dur
    return {"kernels": kernels, "kernel_s": kernel_us / 1e6, "copies": copies, "copy_s": copy_us / 1e6,
            "host_calls": launches}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=DEFAULT_CONFIG)
    p.add_argument("--device", default="cuda")
    p.add_argument("--engine", default="vectorized")
    p.add_argument("--skip", type=int, default=2, help="unprofiled rounds first (warm-up, graph capture)")
    p.add_argument("--rounds", type=int, default=1, help="profiled rounds")
    p.add_argument("--set", action="append", default=[], help="more config overrides, key=value")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    a = p.parse_args()
    cuda = a.device.startswith("cuda")
    overrides = [f"train.rounds={a.skip + a.rounds}", f"run.device={a.device}", f"run.engine={a.engine}",
                 "run.checkpoint_every=100000", "run.progress=false", *a.set]
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    a.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(a.config, overrides)
        prof = profile(activities=activities, record_shapes=False)
        steps = ProfiledRounds(prof, a.skip, a.rounds)
        exp = Experiment.create(cfg, Path(tmp) / "run", callbacks=[steps])
        log(steps.t0, "built")
        t0 = time.perf_counter()
        exp.run(progress=False)
        wall = time.perf_counter() - t0
        log(steps.t0, "run finished; reading the profile")
        averages = prof.key_averages()
        sort_key = "self_device_time_total" if cuda else "self_cpu_time_total"
        table = averages.table(sort_by=sort_key, row_limit=25, max_name_column_width=60)
        counts = device_events(prof.events(), cuda)
        trace = Path(tmp) / "trace.json"
        log(steps.t0, "key averages done")
        prof.export_chrome_trace(str(trace))
        with trace.open("rb") as src, gzip.open(a.out / "profile_device_trace.json.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
    profiled = steps.round_seconds[a.skip:]
    info = machine_info()
    info["commit"] = git_commit()
    if cuda:
        info["gpu"] = torch.cuda.get_device_name(0)
    busy = counts["kernel_s"] + counts["copy_s"]
    result = {"command": " ".join(["python", "benchmarks/profile_device.py", *sys.argv[1:]]), "machine": info,
              "config": a.config, "overrides": overrides, "engine": exp.engine_info(), "wall_s": wall,
              "round_seconds": steps.round_seconds, "profiled_seconds": sum(profiled),
              "device_busy_share": busy / sum(profiled) if profiled and cuda else None, **counts}
    (a.out / "profile_device.json").write_text(json.dumps(result, indent=2, default=str))
    md = ["# Profile of whole rounds on a device", "", "```bash", result["command"], "```", "",
          f"Machine: {info.get('gpu', 'no GPU')}, CPU {cpu_name(info)}; torch {info.get('torch')}; commit {info.get('commit')}.", "",
          f"Rounds (s): {', '.join(f'{s:.2f}' for s in steps.round_seconds)}; profiled: the last {a.rounds}, "
          f"{sum(profiled):.2f} s.", "",
          f"- kernels: {counts['kernels']}, {counts['kernel_s']:.3f} s; copies and memsets: {counts['copies']}, "
          f"{counts['copy_s']:.3f} s",
          f"- device busy (sum of kernel and copy times / profiled wall): "
          f"{'-' if result['device_busy_share'] is None else format(result['device_busy_share'], '.1%')}",
          f"- host calls: {json.dumps(counts['host_calls'])}",
          f"- engine counters: `{json.dumps(result['engine'])}`", "", "```", table, "```", ""]
    (a.out / "profile_device.md").write_text("\n".join(md))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
