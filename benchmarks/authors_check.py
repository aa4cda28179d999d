"""What the checks against a paper's public code share (``*_vs_authors.py``): the weight
comparison, the authors' procedure's own noise floor, and the checkout's commit.

The noise floor: how far the authors' procedure moves when its starting weights change by about
one float32 rounding (``NUDGE`` of their value, random signs, ``NUDGES`` draws). A difference
between fedhet and the authors within it is rounding; one above it is a change of method.
"""

from __future__ import annotations

import argparse
import subprocess
from collections.abc import Callable
from pathlib import Path

import torch

NUDGE = 1e-7     # relative change of the initial weights for the noise floor: about one float32 rounding
NUDGES = 4       # random sign patterns of that change; the floor is the largest of their differences

Weights = dict[str, torch.Tensor]
RESULTS = Path("benchmarks/results")


def parse_arguments(description: str, authors_help: str, default_config: Path, default_clients: list[int],
                    breaks: list[str], extra: Callable[[argparse.ArgumentParser], None] = lambda p: None
                    ) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """The options every check takes (``extra`` adds its own), parsed; a broken fedhet's result is
    refused in ``benchmarks/results``."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--authors-src", type=Path, required=True, help=authors_help)
    p.add_argument("--config", type=Path, default=default_config)
    p.add_argument("--clients", type=int, nargs="+", default=default_clients)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--break-fedhet", choices=breaks,
                   help="change fedhet's update on purpose, to see the check fail (give another --out)")
    extra(p)
    a = p.parse_args()
    if a.break_fedhet and a.out == RESULTS:
        p.error("--break-fedhet writes a result of a broken fedhet: give another --out")
    return p, a


def recording(train: Callable, calls: list[list]) -> Callable:
    """A client runtime's ``train`` that records, in a new list of ``calls`` per call, every batch
    the training step sees: after the method's own augmentation (FedClassAvg's two views), or as
    drawn where the method has none (an identity augmentation, which draws nothing)."""
    def wrapped(weights, terms=None, **options):
        drawn: list = []
        calls.append(drawn)
        augment = options.get("augment")

        def record(batch, generator):
            seen = augment(batch, generator) if augment is not None else batch
            drawn.append((seen.x.clone(), seen.y.clone()))
            return seen
        options["augment"] = record
        return train(weights, terms, **options)
    return wrapped


def weights_only(authors_run: Callable[[Weights], tuple]) -> Callable[[Weights], Weights]:
    """``authors_run(init) -> (weights, ...)`` as :func:`noise_floors` takes it."""
    return lambda init: authors_run(init)[0]


def checkout_commit(path: Path) -> str:
    try:
        return subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"


def compare(ours: Weights, theirs: Weights, init: Weights) -> dict:
    """Per floating-point tensor: the largest |ours - theirs|, how far the authors' run moved it
    from ``init`` and its scale. Integer tensors (BatchNorm's step counters) must be equal."""
    rows = {}
    for k in theirs:
        if not theirs[k].is_floating_point():
            if not torch.equal(ours[k], theirs[k]):
                raise AssertionError(f"{k}: fedhet {ours[k].tolist()} != the authors' {theirs[k].tolist()}")
            continue
        a, b = ours[k].double(), theirs[k].double()
        rows[k] = {"max_abs_diff": float((a - b).abs().max()),
                   "moved": float((b - init[k].double()).abs().max()),
                   "scale": float(b.abs().max())}
    return rows


def nudged(weights: Weights, draw: int) -> Weights:
    """``weights`` with every float element changed by +-NUDGE of its value (signs from ``draw``)."""
    signs = torch.Generator().manual_seed(draw)
    return {k: v * (1 + NUDGE * (2 * torch.randint(0, 2, v.shape, generator=signs) - 1))
            if v.is_floating_point() else v for k, v in weights.items()}


def noise_floors(authors_run: Callable[[Weights], Weights], init: Weights, theirs: Weights) -> list[float]:
    """The largest difference between ``theirs`` (the authors' run from ``init``) and the same run
    from each of ``NUDGES`` nudged copies of ``init``."""
    floors = []
    for draw in range(NUDGES):
        again = authors_run(nudged(init, draw))
        floors.append(max(float((theirs[k].double() - again[k].double()).abs().max()) for k in theirs))
    return floors
