"""How large a run's checkpoint is: ``checkpoint.pt`` after one round of the README's main job.

    .venv/bin/python benchmarks/checkpoint_size.py            # needs Fashion-MNIST (FEDHET_DATA)

configs/quickstart.yaml (20 clients, all of them every round, cnn2 split at fc1) for one round with
``run.checkpoint_every=1``: FedAvg, Local-only and FedReMa with ``train.optimizer_state: auto`` (each
method's own default: keep for FedReMa, reset for the rest), then FedReMa with ``reset`` to show what
the kept optimizers cost. A checkpoint holds everything an exact resume needs (server state, every
client's state, the optimizers it keeps, the random streams), so its size follows the per-client
state. Prints a table and writes benchmarks/results/checkpoint_size.{md,json} (``--out``).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
CASES = (("fedavg", "auto"), ("local", "auto"), ("fedrema", "auto"), ("fedrema", "reset"))


def checkpoint_mb(algorithm: str, optimizer_state: str, work: Path) -> dict:
    from fedhet.experiment.config import load_config
    from fedhet.experiment.runner import Experiment

    cfg = load_config(ROOT / "configs" / "quickstart.yaml", [
        f"algorithm.name={algorithm}", f"train.optimizer_state={optimizer_state}", "train.rounds=1",
        "run.checkpoint_every=1", "run.progress=false"])
    run_dir = work / f"{algorithm}_{optimizer_state}"
    Experiment.create(cfg, run_dir).run(progress=False)
    size = (run_dir / "checkpoint.pt").stat().st_size
    return {"algorithm": algorithm, "optimizer_state": optimizer_state, "checkpoint_bytes": size,
            "checkpoint_mb": round(size / 2**20, 2), "clients": cfg.data.num_clients, "model": cfg.model.arch}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=RESULTS / "checkpoint_size", help="result files' path without suffix")
    args = ap.parse_args()
    from fedhet.experiment.summary import cpu_name, machine_info

    with tempfile.TemporaryDirectory() as tmp:
        rows = [checkpoint_mb(algorithm, state, Path(tmp)) for algorithm, state in CASES]
    machine = machine_info()
    lines = ["# Checkpoint size of the README's main job", "",
             "```bash", ".venv/bin/python benchmarks/checkpoint_size.py", "```", "",
             "configs/quickstart.yaml (20 clients, cnn2 split at fc1) after one round with run.checkpoint_every=1. "
             "`auto` is each method's own optimizer-state default (keep for FedReMa, reset for the rest).", "",
             f"Machine: {cpu_name(machine)}, torch {machine['torch']}, commit {machine['commit']}.", "",
             "| method | train.optimizer_state | checkpoint.pt (MiB) |", "|---|---|---|"]
    lines += [f"| {r['algorithm']} | {r['optimizer_state']} | {r['checkpoint_mb']:.2f} |" for r in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(text)
    args.out.with_suffix(".json").write_text(json.dumps({"rows": rows, "machine": machine}, indent=2) + "\n")


if __name__ == "__main__":
    main()
