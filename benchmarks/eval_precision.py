"""What ``eval.precision: run`` changes: global test accuracy, loss and time of trained models
evaluated in fp32 and under bf16 autocast (metrics/evaluate.predict), side by side.

    .venv/bin/python benchmarks/eval_precision.py RUN_DIR [RUN_DIR ...]

Each RUN_DIR is a finished (or checkpointed) run of a method with a global model; that model
(``Algorithm.global_model`` of the checkpoint's server state) is evaluated on the whole global
test set - not the clients' local splits - in both precisions, ``--repeats`` times each, the
order of the two precisions swapping from one repeat to the next. The accuracies, the number of
test images whose correctness flips, and the median seconds are written to
benchmarks/results/NAME.{md,json} (``--name``, default eval_precision) with the machine and commit.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from fedhet.experiment.build import build
from fedhet.experiment.config import load_config
from fedhet.experiment.rundir import CHECKPOINT, CONFIG
from fedhet.experiment.summary import cpu_name, machine_info
from fedhet.metrics.evaluate import predict
from fedhet.training.precision import bf16_native

RESULTS = Path(__file__).resolve().parent / "results"


def measure(run_dir: Path, repeats: int) -> dict:
    cfg = load_config(run_dir / CONFIG)
    built = build(cfg)
    checkpoint = torch.load(run_dir / CHECKPOINT, weights_only=False)
    weights = built.algorithm.global_model(checkpoint["sim"]["server_state"])
    if weights is None:
        raise SystemExit(f"{run_dir}: {cfg.algorithm.name} has no global model to evaluate on the global test set")
    fed = built.federation
    model = built.host.models[built.host.client_arch[0]]
    out: dict = {"run": str(run_dir), "round": checkpoint["round"], "images": len(fed.test.y)}
    seconds: dict[str, list[float]] = {"fp32": [], "bf16": []}
    hits = {}
    for repeat in range(repeats):
        for precision in ("fp32", "bf16") if repeat % 2 == 0 else ("bf16", "fp32"):
            t0 = time.perf_counter()
            hits[precision], loss = predict(model, weights, fed.test.x, fed.test.y, fed.normalize,
                                            cfg.eval.batch_size, precision)
            seconds[precision].append(time.perf_counter() - t0)
            out[f"{precision}_acc"] = float(hits[precision].float().mean())
            out[f"{precision}_loss"] = float(loss.double().sum()) / len(fed.test.y)
    out["flipped"] = int((hits["fp32"] != hits["bf16"]).sum())
    out["seconds"] = {p: statistics.median(s) for p, s in seconds.items()}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--note", default="", help="a line added to the result file (e.g. what else ran)")
    parser.add_argument("--name", default="eval_precision",
                        help="result files OUT/NAME.{md,json} (another name keeps the earlier ones)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder of the result files (default: benchmarks/results, the committed record)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for run in args.runs:
        row = measure(run, args.repeats)
        rows.append(row)
        print(f"{run}: fp32 {100 * row['fp32_acc']:.2f}% ({row['seconds']['fp32']:.2f} s), "
              f"bf16 {100 * row['bf16_acc']:.2f}% ({row['seconds']['bf16']:.2f} s), {row['flipped']} flipped",
              flush=True)
    info = {**machine_info(), "bf16_native": bf16_native("cpu"), "threads": args.threads, "repeats": args.repeats}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps({"machine": info, "rows": rows}, indent=1))
    lines = ["# Evaluation in fp32 and in bf16 (eval.precision)", "", "Command:", "", "```bash",
             ".venv/bin/python benchmarks/eval_precision.py " + " ".join(str(r) for r in args.runs)
             + f" --repeats {args.repeats} --threads {args.threads}"
             + ("" if args.name == "eval_precision" else f" --name {args.name}"), "```", "",
             f"Commit {info['commit']}, {cpu_name(info)}, bf16 native: {info['bf16_native']}, "
             f"torch {info['torch']}, {args.threads} thread(s); seconds are medians of {args.repeats} "
             "passes over the whole global test set, the order of the two precisions swapping each repeat.", ""]
    if args.note:
        lines += [args.note, ""]
    lines += ["| run | round | fp32 acc | bf16 acc | difference (pp) | flipped images | fp32 loss | bf16 loss "
              "| fp32 s | bf16 s | bf16/fp32 time |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['run']} | {r['round']} | {100 * r['fp32_acc']:.2f} | {100 * r['bf16_acc']:.2f} | "
                     f"{100 * (r['bf16_acc'] - r['fp32_acc']):+.2f} | {r['flipped']} of {r['images']} | "
                     f"{r['fp32_loss']:.5f} | {r['bf16_loss']:.5f} | {r['seconds']['fp32']:.2f} | "
                     f"{r['seconds']['bf16']:.2f} | {r['seconds']['bf16'] / r['seconds']['fp32']:.2f} |")
    (args.out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out / f'{args.name}.md'}")


if __name__ == "__main__":
    main()
