"""What the cut and the layout of a no-grad pass cost on the CPU: the per-class statistics pass and
evaluation's test-set pass, side by side in one process.

    .venv/bin/python benchmarks/no_grad_passes.py                    # simple_cnn and cnn2, 1 thread
    .venv/bin/python benchmarks/no_grad_passes.py --threads 1 2 --rows 3000 3009 --test-rows 10000 --repeats 5

* **Statistics pass** (``fedhet.algorithms.prototypes.class_statistics``; here FedACD's probability
  matrix, the per-class mean softmax, which FedACD takes at the start of every local round and
  evaluation takes for every uploaded local model's ``local_kl``; FedProto, FedPAC, FedReMa, FedNH
  and FedFM take the same pass for their class means) over ``--rows`` training images, three ways:
  one forward per 1,024 rows in the default layout (training's statistics, and evaluation's before),
  a few dozen rows per thread (``fedhet.training.inference.pass_rows``) in the default layout, and
  the same in channels_last (``fast_passes=True``, evaluation's now). ``identical`` says whether
  the second's counts, means and squared norms are bit-identical to the first's: with a last pass
  of under 16 rows (3,009 rows at 64 a pass) the matrix multiplies take another path and they are
  not, which is why training's statistics keep their large passes. The channels_last pass's
  largest difference in the mean softmax is reported beside it.
* **Evaluation pass** (``fedhet.metrics.evaluate.predict``) over ``--test-rows`` images, with
  ``contiguous(memory_format=channels_last)`` as it was (a no-op on one-channel images and on the
  first convolution's weights there) against ``fedhet.training.inference.channels_last``, which
  does restride them; the number of images whose correctness differs is reported.

Each repeat times the modes in a rotating order on the same random images and weights; the
figures are medians over ``--repeats``, the ratios those of the medians. Writes
benchmarks/results/no_grad_passes.{json,md} with the machine and commit.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import torch

import fedhet.algorithms.prototypes as prototypes
import fedhet.metrics.evaluate as evaluate
from fedhet.core.contract import ClientData, normalize_uint8
from fedhet.experiment.summary import cpu_name, machine_info
from fedhet.models import build_model

RESULTS = Path(__file__).resolve().parent / "results"
STATS = ("1024 rows a pass", "rows per thread", "rows per thread, channels_last")   # training, -, evaluation
PREDICT = ("contiguous(channels_last)", "to(channels_last)")
MEAN, STD = torch.full((1, 1, 1, 1), 0.286), torch.full((1, 1, 1, 1), 0.353)


def contiguous_channels_last(t: torch.Tensor) -> torch.Tensor:
    """Evaluation's layout helper before ``inference.channels_last``."""
    return t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 else t


def statistics_pass(mode: str, model: torch.nn.Module, weights: dict, data: ClientData) -> prototypes.ClassStatistics:
    def softmax(out):  # type: ignore[no-untyped-def]
        return out.logits.softmax(1)

    if mode == STATS[1]:          # evaluation's cut, without its layout
        with mock.patch.object(prototypes, "channels_last", lambda t: t):
            return prototypes.class_statistics(model, weights, data, 10, of=softmax, fast_passes=True)
    return prototypes.class_statistics(model, weights, data, 10, of=softmax, fast_passes=mode == STATS[2])


def evaluation_pass(mode: str, model: torch.nn.Module, weights: dict, x: torch.Tensor,
                    y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    normalize = functools.partial(normalize_uint8, mean=MEAN, std=STD)
    if mode == PREDICT[0]:
        with mock.patch.object(evaluate, "channels_last", contiguous_channels_last):
            return evaluate.predict(model, weights, x, y, normalize, 2048)
    return evaluate.predict(model, weights, x, y, normalize, 2048)


def timed(modes: tuple[str, ...], run: Callable[[str], object], repeats: int) -> dict[str, dict]:
    """Each mode's median seconds and min-max over ``repeats``, the modes in a rotating order."""
    seconds: dict[str, list[float]] = {mode: [] for mode in modes}
    for repeat in range(repeats):
        k = repeat % len(modes)
        for mode in modes[k:] + modes[:k]:
            start = time.perf_counter()
            run(mode)
            seconds[mode].append(time.perf_counter() - start)
    return {"seconds": {m: statistics.median(s) for m, s in seconds.items()},
            "spread": {m: [min(s), max(s)] for m, s in seconds.items()}}


def measure_statistics(model: torch.nn.Module, weights: dict, images: torch.Tensor, labels: torch.Tensor,
                       rows: int, repeats: int) -> dict:
    data = ClientData(images[:rows], labels[:rows], torch.arange(rows), MEAN, STD)
    results = {mode: statistics_pass(mode, model, weights, data) for mode in STATS}      # warm-up and results
    times = timed(STATS, lambda mode: statistics_pass(mode, model, weights, data), repeats)
    large, cut, fast = (results[m] for m in STATS)
    identical = (torch.equal(large.counts, cut.counts) and torch.equal(large.means, cut.means)
                 and torch.equal(large.sq_norms, cut.sq_norms))
    return {"rows": rows, **times, "cut_identical": identical,
            "cut_max_diff": float((cut.means - large.means).abs().max()),
            "channels_last_max_diff": float((fast.means - large.means).abs().max())}


def measure(arch: str, rows: list[int], test_rows: int, threads: int, repeats: int) -> dict:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = build_model(arch, 1, 10, 28)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (max(*rows, test_rows), 1, 28, 28), dtype=torch.uint8, generator=g)
    labels = torch.randint(0, 10, (len(images),), generator=g)
    stats = [measure_statistics(model, weights, images, labels, n, repeats) for n in rows]
    x, y = images[:test_rows], labels[:test_rows]
    preds = {mode: evaluation_pass(mode, model, weights, x, y) for mode in PREDICT}
    times = timed(PREDICT, lambda mode: evaluation_pass(mode, model, weights, x, y), repeats)
    (hits_a, loss_a), (hits_b, loss_b) = (preds[m] for m in PREDICT)
    return {"arch": arch, "threads": threads, "repeats": repeats, "statistics": stats,
            "evaluation": {"rows": test_rows, **times, "flipped": int((hits_a != hits_b).sum()),
                           "loss_max_diff": float((loss_a - loss_b).abs().max())}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", nargs="+", default=["simple_cnn", "cnn2"])
    parser.add_argument("--rows", type=int, nargs="+", default=[3000, 3009],
                        help="a client's training images (Fashion-MNIST over 20 clients: about 3,000; 3,009 leaves "
                             "a last pass of one row at 64 a pass)")
    parser.add_argument("--test-rows", type=int, default=10000, help="test images (Fashion-MNIST's test set: 10,000)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--note", default="", help="a line added to the result file (e.g. what else ran)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder of the result files (default: benchmarks/results, the committed record)")
    args = parser.parse_args()
    out = []
    for threads in args.threads:
        for arch in args.archs:
            r = measure(arch, args.rows, args.test_rows, threads, args.repeats)
            out.append(r)
            for st in r["statistics"]:
                s = st["seconds"]
                print(f"{arch}, {threads} thread(s), statistics over {st['rows']} rows: "
                      + ", ".join(f"{m} {s[m]:.3f} s" for m in STATS) + f" (cut identical {st['cut_identical']})",
                      flush=True)
            ev = r["evaluation"]
            print(f"{arch}, {threads} thread(s), evaluation: " + ", ".join(f"{m} {ev['seconds'][m]:.3f} s" for m in PREDICT)
                  + f" ({ev['flipped']} flipped)", flush=True)
    info = machine_info()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "no_grad_passes.json").write_text(json.dumps({"machine": info, "note": args.note, "rows": out},
                                                            indent=1))
    command = (f".venv/bin/python benchmarks/no_grad_passes.py --archs {' '.join(args.archs)} "
               f"--rows {' '.join(map(str, args.rows))} --test-rows {args.test_rows} "
               f"--threads {' '.join(map(str, args.threads))} --repeats {args.repeats}")
    lines = ["# No-grad passes on the CPU: how they are cut and laid out", "", "Command:", "", "```bash", command,
             "```", "", f"Commit {info['commit']}, {cpu_name(info)}, torch {info['torch']}; seconds are medians "
             f"of {args.repeats} passes on random 28x28 grayscale images and random weights, the modes in a rotating "
             "order; speed-ups are ratios of the medians.", ""]
    if args.note:
        lines += [args.note, ""]
    lines += ["Statistics pass (FedACD's probability matrix): training's (1,024 rows a pass, default layout), the "
              "same cut into rows per thread, and evaluation's (rows per thread, channels_last); the differences "
              "are the largest in the mean softmax against training's pass:", "",
              "| model | threads | rows | 1,024 rows a pass (s) | rows per thread (s) | bit-identical | max diff "
              "| + channels_last (s) | speed-up | max diff |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in out:
        for st in r["statistics"]:
            s = st["seconds"]
            lines.append(f"| {r['arch']} | {r['threads']} | {st['rows']} | {s[STATS[0]]:.3f} | {s[STATS[1]]:.3f} | "
                         f"{'yes' if st['cut_identical'] else 'no'} | {st['cut_max_diff']:.1e} | {s[STATS[2]]:.3f} | "
                         f"{s[STATS[0]] / s[STATS[2]]:.2f}x | {st['channels_last_max_diff']:.1e} |")
    lines += ["", f"Evaluation pass (`predict`) over {args.test_rows} images:", "",
              "| model | threads | contiguous(channels_last) (s) | to(channels_last) (s) | speed-up "
              "| correctness flipped | loss max diff |", "|---|---|---|---|---|---|---|"]
    for r in out:
        ev = r["evaluation"]
        p = ev["seconds"]
        lines.append(f"| {r['arch']} | {r['threads']} | {p[PREDICT[0]]:.3f} | {p[PREDICT[1]]:.3f} | "
                     f"{p[PREDICT[0]] / p[PREDICT[1]]:.2f}x | {ev['flipped']} of {args.test_rows} | "
                     f"{ev['loss_max_diff']:.1e} |")
    (args.out / "no_grad_passes.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out / 'no_grad_passes.md'}")


if __name__ == "__main__":
    main()
