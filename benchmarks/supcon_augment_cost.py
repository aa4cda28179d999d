"""What FedClassAvg's two-view SupCon augmentation costs, as a fraction of a local step.

    .venv/bin/python benchmarks/supcon_augment_cost.py [--threads 1]

Times ``SupConViews`` (random resized crop, flip, colour jitter, grayscale; two views) on batches of
64 Fashion-MNIST images, as local training calls it (one call per step), median over an epoch of
a 3,000-image client, and sets it beside the seconds per local step measured by
``benchmarks/fedclassavg_fullsize_cost.py`` (results/fedclassavg_fullsize_cost.json) for each of
the paper's architectures, and beside a step of the small CNNs (measured here: one step of each,
same batch). Writes benchmarks/results/supcon_augment_cost.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from fedhet.core.contract import Batch
from fedhet.data.datasets import load_dataset
from fedhet.experiment.summary import git_commit, machine_info
from fedhet.models import build_model
from fedhet.training.augment import SupConViews

BATCH, STEPS = 64, 46          # one epoch of a 3,000-image client (drop_last)
SMALL = ("fca_cnn_a", "fca_cnn_b", "fca_cnn_c", "fca_cnn_d")


def median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    data = load_dataset("fashion_mnist", train=True)
    mean = torch.tensor(data.mean).view(1, 1, 1, 1)
    std = torch.tensor(data.std).view(1, 1, 1, 1)
    views = SupConViews(mean, std)
    g = torch.Generator().manual_seed(0)
    batches = [Batch((data.x[i * BATCH:(i + 1) * BATCH].float() / 255 - mean) / std,
                     data.y[i * BATCH:(i + 1) * BATCH], torch.arange(BATCH)) for i in range(STEPS)]
    aug_times = []
    for b in batches:
        t0 = time.perf_counter()
        views(b, g)
        aug_times.append(time.perf_counter() - t0)
    aug = statistics.median(aug_times)

    steps = {}
    two_views = views(batches[0], g)
    for name in SMALL:
        model = build_model(name, 1, 10, 28)
        opt = torch.optim.Adam(model.parameters(), lr=6e-4, betas=(0.5, 0.999))

        def step(model: torch.nn.Module = model, opt: torch.optim.Optimizer = opt) -> None:
            opt.zero_grad()
            feats = model.body(two_views.x)
            logits = model.head(feats[:BATCH])
            (feats.pow(2).mean() + torch.nn.functional.cross_entropy(logits, two_views.y[:BATCH])).backward()
            opt.step()

        step()
        steps[name] = median_seconds(step, 10)
    full_path = a.out / "fedclassavg_fullsize_cost.json"
    if full_path.is_file():
        steps.update({arch: r["s_per_step"] for arch, r in json.loads(full_path.read_text())["per_arch"].items()})

    m = machine_info()
    lines = ["# SupCon two-view augmentation: cost per local step", "", "Command:", "", "```bash",
             f".venv/bin/python benchmarks/supcon_augment_cost.py --threads {a.threads}", "```", "",
             f"Augmenting one batch of {BATCH} images into two views: median **{1000 * aug:.2f} ms** over {STEPS} "
             f"batches (min {1000 * min(aug_times):.2f}, max {1000 * max(aug_times):.2f}).", "",
             "| model | s per local step (forward + backward of both views, Adam) | augmentation / (step + augmentation) |",
             "|---|---|---|"]
    for name, s in steps.items():
        lines.append(f"| {name} | {s:.4f} | {100 * aug / (s + aug):.1f}% |")
    lines += ["", "The small CNNs' steps are measured here (a stand-in loss of the same shapes); the paper "
              "architectures' come from benchmarks/results/fedclassavg_fullsize_cost.json (the real client "
              "update, which includes the augmentation, so their fraction is slightly overstated).", "",
              f"Machine: {m['processor']}, {m['cpus']} CPUs, torch {m['torch']}, {a.threads} thread(s), "
              f"commit {git_commit()}.", ""]
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "supcon_augment_cost.md").write_text("\n".join(lines) + "\n")
    (a.out / "supcon_augment_cost.json").write_text(json.dumps(
        {"augment_s_per_batch": aug, "batch": BATCH, "step_s": steps, "machine": m}, indent=2))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
