"""Local training in the default layout against channels_last (``run.memory_format``) on the CPU.

    .venv/bin/python benchmarks/memory_format.py                         # simple_cnn and cnn2, batch 64, 1 and 2 threads
    .venv/bin/python benchmarks/memory_format.py --archs simple_cnn --threads 1 --repeats 3
    .venv/bin/python benchmarks/memory_format.py --name memory_format_amd_avx2   # another machine's file

Each case trains one client's epoch (``--rows`` Fashion-MNIST-shaped images, random pixels and
labels, SGD with momentum 0.9 as FedACD's protocol has it) with ``fedhet.training.local.train_local``
in both layouts from the same weights, the layouts alternating from one repeat to the next. The
speed-up is the ratio of the median times, with the range of the per-repeat ratios beside it.
channels_last sums the convolutions in another order, so the trained weights differ in the last
bits: the largest relative L2 distance over the model's tensors after the epoch is reported too.
Writes benchmarks/results/NAME.{json,md} (``--name``, default memory_format) with the machine and commit.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from fedhet.core.contract import ClientData, TrainSettings
from fedhet.core.seeding import torch_generator
from fedhet.experiment.summary import cpu_name, machine_info
from fedhet.models import build_model
from fedhet.training.local import train_local
from fedhet.training.objective import CrossEntropy

RESULTS = Path(__file__).resolve().parent / "results"
LAYOUTS = ("contiguous", "channels_last")


def client_data(rows: int) -> ClientData:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (rows, 1, 28, 28), dtype=torch.uint8, generator=g)
    y = torch.randint(0, 10, (rows,), generator=g)
    return ClientData(x, y, torch.arange(rows), torch.tensor(0.286).view(1, 1, 1, 1), torch.tensor(0.353).view(1, 1, 1, 1))


def measure(arch: str, batch: int, threads: int, rows: int, repeats: int) -> dict:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = build_model(arch, in_channels=1, num_classes=10, image_size=28)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    data = client_data(rows)

    def run(layout: str):  # type: ignore[no-untyped-def]
        settings = TrainSettings(epochs=1, batch_size=batch, lr=0.01, momentum=0.9, weight_decay=1e-5,
                                 memory_format=layout)
        return train_local(model, weights, data, [CrossEntropy()], settings,
                           lambda e: torch_generator(0, "memory_format", e))

    results = {layout: run(layout) for layout in LAYOUTS}                  # also the warm-up
    seconds: dict[str, list[float]] = {layout: [] for layout in LAYOUTS}
    for i in range(repeats):
        for layout in (LAYOUTS if i % 2 == 0 else LAYOUTS[::-1]):
            t = time.perf_counter()
            run(layout)
            seconds[layout].append(time.perf_counter() - t)
    a, b = results["contiguous"].weights, results["channels_last"].weights
    distance = max(float((b[k] - a[k]).norm() / a[k].norm().clamp_min(1e-12)) for k in a)
    median = {layout: statistics.median(s) for layout, s in seconds.items()}
    ratios = [c / cl for c, cl in zip(seconds["contiguous"], seconds["channels_last"])]
    return {"arch": arch, "batch": batch, "threads": threads, "rows": rows, "seconds": seconds,
            "samples_per_s": {layout: rows / m for layout, m in median.items()},
            "speedup": median["contiguous"] / median["channels_last"], "ratio_min": min(ratios),
            "ratio_max": max(ratios), "bit_identical": all(torch.equal(a[k], b[k]) for k in a),
            "max_relative_distance": distance}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", nargs="+", default=["simple_cnn", "cnn2"])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rows", type=int, default=1920, help="images in the client's epoch")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--note", default="", help="a line added to the result file (e.g. what else ran)")
    parser.add_argument("--name", default="memory_format",
                        help="result file name, without suffix (one per machine: the layouts' speed-up differs by CPU)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder of the result files (default: benchmarks/results, the committed record)")
    args = parser.parse_args()
    out = []
    for threads in args.threads:
        for arch in args.archs:
            r = measure(arch, args.batch, threads, args.rows, args.repeats)
            out.append(r)
            s = r["samples_per_s"]
            print(f"{arch}, batch {args.batch}, {threads} thread(s): contiguous {s['contiguous']:.0f} samples/s, "
                  f"channels_last {s['channels_last']:.0f} ({r['speedup']:.2f}x, {r['ratio_min']:.2f}-"
                  f"{r['ratio_max']:.2f}); weights' largest relative distance {r['max_relative_distance']:.1e}",
                  flush=True)
    info = machine_info()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps({"machine": info, "note": args.note, "rows": out}, indent=1))
    command = (f".venv/bin/python benchmarks/memory_format.py --archs {' '.join(args.archs)} --batch {args.batch} "
               f"--threads {' '.join(map(str, args.threads))} --rows {args.rows} --repeats {args.repeats}"
               + (f" --name {args.name}" if args.name != "memory_format" else ""))
    lines = ["# Local training's layout on the CPU: default against channels_last", "", "Command:", "", "```bash",
             command, "```", "", f"Commit {info['commit']}, {cpu_name(info)}, torch {info['torch']}; one client's "
             f"epoch of {args.rows} random 28x28 grayscale images, fp32, SGD momentum 0.9; medians of {args.repeats} "
             "epochs a layout, the layouts alternating; the speed-up is the ratio of the medians (per-repeat "
             "ratios' range beside it).", ""]
    if args.note:
        lines += [args.note, ""]
    lines += ["| model | batch | threads | default (samples/s) | channels_last (samples/s) | speed-up | per-repeat "
              "| bit-identical | largest relative distance |", "|---|---|---|---|---|---|---|---|---|"]
    for r in out:
        s = r["samples_per_s"]
        lines.append(f"| {r['arch']} | {r['batch']} | {r['threads']} | {s['contiguous']:.0f} | {s['channels_last']:.0f} | "
                     f"{r['speedup']:.2f}x | {r['ratio_min']:.2f}-{r['ratio_max']:.2f} | "
                     f"{'yes' if r['bit_identical'] else 'no'} | {r['max_relative_distance']:.1e} |")
    (args.out / f"{args.name}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
