"""Local training with fedhet's layer order (max-pool, then ReLU) against the papers' (ReLU, then max-pool).

    .venv/bin/python benchmarks/pool_order.py                          # cnn2 and simple_cnn, batch 64, 1 and 2 threads
    .venv/bin/python benchmarks/pool_order.py --archs cnn2 --threads 1 --layout contiguous
    .venv/bin/python benchmarks/pool_order.py --name pool_order_amd_avx2    # another machine's file

fedhet's builders pool before the ReLU (``fedhet.models.cnn`` says why the two orders are the same
function); ``fedhet.models.base.relu_before_pool`` gives the papers' order of the same model. Each
case trains one client's epoch (``--rows`` Fashion-MNIST-shaped images, random pixels and labels, SGD
with momentum 0.9) with ``fedhet.training.local.train_local`` in both orders from the same weights,
the orders alternating from one repeat to the next. The speed-up is the ratio of the median times,
with the range of the per-repeat ratios beside it; whether the two trained models are bit for bit
the same is reported too. Writes benchmarks/results/NAME.{json,md} (``--name``, default pool_order)
with the machine and commit.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from memory_format import client_data  # the same random client as the layout benchmark

from fedhet.core.contract import TrainSettings
from fedhet.core.seeding import torch_generator
from fedhet.experiment.summary import cpu_name, machine_info
from fedhet.models import build_model
from fedhet.models.base import relu_before_pool
from fedhet.training.local import train_local
from fedhet.training.objective import CrossEntropy

RESULTS = Path(__file__).resolve().parent / "results"
ORDERS = ("relu_then_pool", "pool_then_relu")


def measure(arch: str, batch: int, threads: int, rows: int, repeats: int, layout: str) -> dict:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    built = build_model(arch, in_channels=1, num_classes=10, image_size=28)
    paper, swapped = relu_before_pool(built)
    models = {"relu_then_pool": paper, "pool_then_relu": built}
    weights = {k: v.detach().clone() for k, v in built.state_dict().items()}
    data = client_data(rows)
    settings = TrainSettings(epochs=1, batch_size=batch, lr=0.01, momentum=0.9, weight_decay=1e-5,
                             memory_format=layout)

    def run(order: str):  # type: ignore[no-untyped-def]
        return train_local(models[order], weights, data, [CrossEntropy()], settings,
                           lambda e: torch_generator(0, "pool_order", e))

    results = {order: run(order) for order in ORDERS}                     # also the warm-up
    seconds: dict[str, list[float]] = {order: [] for order in ORDERS}
    for i in range(repeats):
        for order in (ORDERS if i % 2 == 0 else ORDERS[::-1]):
            t = time.perf_counter()
            run(order)
            seconds[order].append(time.perf_counter() - t)
    a, b = results["relu_then_pool"].weights, results["pool_then_relu"].weights
    median = {order: statistics.median(s) for order, s in seconds.items()}
    ratios = [p / f for p, f in zip(seconds["relu_then_pool"], seconds["pool_then_relu"])]
    return {"arch": arch, "batch": batch, "threads": threads, "rows": rows, "layout": layout,
            "pairs_swapped": swapped, "seconds": seconds,
            "samples_per_s": {order: rows / m for order, m in median.items()},
            "speedup": median["relu_then_pool"] / median["pool_then_relu"], "ratio_min": min(ratios),
            "ratio_max": max(ratios), "bit_identical": all(torch.equal(a[k], b[k]) for k in a)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", nargs="+", default=["cnn2", "simple_cnn"])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--layout", choices=("channels_last", "contiguous"), default="channels_last",
                        help="run.memory_format of both orders (channels_last: the CPU runs' setting)")
    parser.add_argument("--rows", type=int, default=1920, help="images in the client's epoch")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--note", default="", help="a line added to the result file (e.g. what else ran)")
    parser.add_argument("--name", default="pool_order",
                        help="result file name, without suffix (one per machine: the speed-up differs by CPU)")
    args = parser.parse_args()
    out = []
    for threads in args.threads:
        for arch in args.archs:
            r = measure(arch, args.batch, threads, args.rows, args.repeats, args.layout)
            out.append(r)
            s = r["samples_per_s"]
            print(f"{arch}, batch {args.batch}, {threads} thread(s), {args.layout}: ReLU then pool "
                  f"{s['relu_then_pool']:.0f} samples/s, pool then ReLU {s['pool_then_relu']:.0f} "
                  f"({r['speedup']:.2f}x, {r['ratio_min']:.2f}-{r['ratio_max']:.2f}); trained weights "
                  f"{'bit-identical' if r['bit_identical'] else 'DIFFER'}", flush=True)
    info = machine_info()
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps({"machine": info, "note": args.note, "rows": out}, indent=1))
    command = (f".venv/bin/python benchmarks/pool_order.py --archs {' '.join(args.archs)} --batch {args.batch} "
               f"--threads {' '.join(map(str, args.threads))} --layout {args.layout} --rows {args.rows} "
               f"--repeats {args.repeats}" + (f" --name {args.name}" if args.name != "pool_order" else ""))
    lines = ["# Local training's layer order on the CPU: ReLU then max-pool (the papers') against max-pool then "
             "ReLU (fedhet's)", "", "Command:", "", "```bash", command, "```", "",
             f"Commit {info['commit']}, {cpu_name(info)}, torch {info['torch']}; one client's epoch of {args.rows} "
             f"random 28x28 grayscale images, fp32, {args.layout}, SGD momentum 0.9; medians of {args.repeats} "
             "epochs an order, the orders alternating; the speed-up is the ratio of the medians (per-repeat "
             "ratios' range beside it).", ""]
    if args.note:
        lines += [args.note, ""]
    lines += ["| model | batch | threads | ReLU then pool (samples/s) | pool then ReLU (samples/s) | speed-up | "
              "per-repeat | trained weights bit-identical |", "|---|---|---|---|---|---|---|---|"]
    for r in out:
        s = r["samples_per_s"]
        lines.append(f"| {r['arch']} | {r['batch']} | {r['threads']} | {s['relu_then_pool']:.0f} | "
                     f"{s['pool_then_relu']:.0f} | {r['speedup']:.2f}x | {r['ratio_min']:.2f}-{r['ratio_max']:.2f} | "
                     f"{'yes' if r['bit_identical'] else 'no'} |")
    (RESULTS / f"{args.name}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
