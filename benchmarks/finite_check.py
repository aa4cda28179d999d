"""The finite check of a local run's weights: ``torch.isfinite(t).all()`` per tensor against
``training.local.all_finite`` (one aminmax pass, no boolean copy), beside the ``train_local``
call of one cross-device client (50 samples, batch 10, E=1) that the check ends.

    .venv/bin/python benchmarks/finite_check.py [--repeats 15]

One intra-op thread; the three are timed in every repeat, their order rotating from one repeat
to the next; medians and the range of the per-repeat ratio are written to
benchmarks/results/finite_check.{md,json} with the machine and commit.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from pathlib import Path

import torch

from fedhet.core.contract import ClientData, TrainSettings
from fedhet.core.seeding import torch_generator
from fedhet.experiment.summary import machine_info
from fedhet.models import build_model
from fedhet.training.local import all_finite, train_local
from fedhet.training.objective import CrossEntropy

RESULTS = Path(__file__).resolve().parent / "results"


def isfinite_all(weights: dict[str, torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in weights.values())


def aminmax_all(weights: dict[str, torch.Tensor]) -> bool:
    return all(all_finite(t) for t in weights.values())


def timed(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e3


def measure(arch: str, channels: int, size: int, repeats: int) -> dict:
    model = build_model(arch, in_channels=channels, num_classes=10, image_size=size)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    x = torch.randint(0, 256, (50, channels, size, size), dtype=torch.uint8)
    data = ClientData(x, torch.randint(0, 10, (50,)), torch.arange(50), torch.full((1, 1, 1, 1), 0.3),
                      torch.full((1, 1, 1, 1), 0.3))
    settings = TrainSettings(epochs=1, batch_size=10, lr=0.01, momentum=0.9)
    train = functools.partial(train_local, model, weights, data, [CrossEntropy()], settings,
                              functools.partial(torch_generator, 0, "finite_check"))
    train()
    calls = [("isfinite_all", functools.partial(isfinite_all, weights), 20),
             ("all_finite", functools.partial(aminmax_all, weights), 20), ("train_local", train, 1)]
    times: dict[str, list[float]] = {name: [] for name, _, _ in calls}
    for repeat in range(repeats):
        for name, fn, n in calls[repeat % 3:] + calls[:repeat % 3]:
            times[name].append(timed(fn, n))
    med = {k: statistics.median(v) for k, v in times.items()}
    ratios = [a / b for a, b in zip(times["isfinite_all"], times["all_finite"])]
    print(f"{arch}: isfinite_all {med['isfinite_all']:.3f} ms, all_finite {med['all_finite']:.3f} ms, "
          f"train_local (one cross-device client, which includes one check) {med['train_local']:.1f} ms", flush=True)
    return {"tensors": len(weights), "floats": sum(t.numel() for t in weights.values()), "ms": med, "ms_all": times,
            "ratio_range": [min(ratios), max(ratios)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = {arch: measure(arch, channels, size, args.repeats)
            for arch, channels, size in (("cnn2", 1, 28), ("resnet18", 3, 32))}
    info = machine_info()
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "finite_check.json").write_text(json.dumps({"machine": info, "rows": rows}, indent=1))
    lines = ["# The finite check of a local run's weights", "", "Command:", "", "```bash",
             f".venv/bin/python benchmarks/finite_check.py --repeats {args.repeats}", "```", "",
             f"Commit {info['commit']}, {info['cpu_model']}, torch {info['torch']}, 1 thread; medians of "
             f"{args.repeats} repeats, the order of the three rotating from one repeat to the next.", "",
             "| model | tensors | floats | isfinite(t).all() ms | all_finite ms | ratio (per-repeat range) | train_local of one "
             "cross-device client ms | old check's share | new check's share |", "|---|---|---|---|---|---|---|---|---|"]
    for arch, r in rows.items():
        m = r["ms"]
        lines.append(f"| {arch} | {r['tensors']} | {r['floats']:,} | {m['isfinite_all']:.3f} | {m['all_finite']:.3f} "
                     f"| {m['isfinite_all'] / m['all_finite']:.1f}x ({r['ratio_range'][0]:.1f}-{r['ratio_range'][1]:.1f}) | "
                     f"{m['train_local']:.1f} | "
                     f"{100 * m['isfinite_all'] / m['train_local']:.1f}% | {100 * m['all_finite'] / m['train_local']:.1f}% |")
    (RESULTS / "finite_check.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {RESULTS / 'finite_check.md'}")


if __name__ == "__main__":
    main()
