"""Run every combination of two built-in methods that fedhet accepts for a few rounds, and report the
ones that stop with an error or a non-finite loss after they were built.

    .venv/bin/python scripts/composition_smoke.py                        # every accepted ordered pair
    .venv/bin/python scripts/composition_smoke.py --only fedbabu fednh   # the pairs with either of them
    .venv/bin/python scripts/composition_smoke.py --pairs fedprox+fedlc  # these pairs only
    .venv/bin/python scripts/composition_smoke.py --alone fedfm --param fedfm.lam=5   # one method, another setting
    .venv/bin/python scripts/composition_smoke.py --results out.jsonl    # goes on from the pairs in it

``fedhet.algorithms.compose`` refuses, when a config is loaded, the combinations it knows to drop a
part or to disagree on what travels; this finds what it does not know yet. Each pair runs on a toy
image set (random noise with a class-coloured square, 12 clients, 2 sampled a round), 2 rounds of 2
local epochs, on the architecture its methods need (``simple_cnn`` with FedNH, whose prototypes are a
bias-free head; ``cnn2`` otherwise), with the parameters that let every part act within 2 rounds
(FedFM's matching from round 0 at lambda 1, one FedRep head epoch, a small CReFF). One process runs the pairs one
after another; a line per pair goes to ``--results`` (JSON), so a stopped call goes on from there. It
prints the pairs that failed and exits 1 when there is one. Every accepted pair took about 6 minutes
on 2 cores, beside another job (``benchmarks/results/composition_smoke.md``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import numpy as np

# A pair's parameters that let each part act within two rounds of the toy set.
PARAMS = {"fedfm": {"start_round": 0, "lam": 1.0}, "fedfm_lite": {"start_round": 0, "lam": 1.0}, "fedrep": {"rep_head_epochs": 1},
          "creff": {"creff_features": 4, "creff_match_iters": 2, "creff_crt_epochs": 1}}


def toy_dataset(path: Path, seed: int = 0) -> str:
    """A 10-class toy set of noisy 28x28 images, a bright square at a class's own place."""
    from fedhet.extend import save_arrays

    rng = np.random.default_rng(seed)

    def images(labels: np.ndarray) -> np.ndarray:
        x = rng.integers(0, 90, (labels.size, 28, 28))
        for c in range(10):
            row, col = divmod(c, 4)
            x[labels == c, 2 + 7 * row:7 + 7 * row, 2 + 7 * col:7 + 7 * col] += 150
        return x.astype(np.uint8)

    y_train, y_test = rng.integers(0, 10, 600), rng.integers(0, 10, 200)
    return save_arrays(path, images(y_train), y_train, images(y_test), y_test)


def pair_config(pair: tuple[str, ...], dataset: str, out: Path) -> dict:
    params = {k: v for name in pair for k, v in PARAMS.get(name, {}).items()}
    return {"name": "+".join(pair), "seed": 0,
            "data": {"dataset": dataset, "pool": "train", "num_clients": 12, "verify": False,
                     "partition": {"kind": "dirichlet", "alpha": 0.5, "min_size": 20},
                     "local_test": {"source": "test_set", "fraction": 0.2}},
            "model": {"arch": "simple_cnn" if "fednh" in pair else "cnn2"},
            "algorithm": {"name": "+".join(pair), "params": params},
            "train": {"rounds": 2, "clients_per_round": 2, "local_epochs": 2, "batch_size": 16, "lr": 0.05},
            "eval": {"every": 1, "final_window": 1},
            "run": {"out_dir": str(out), "checkpoint_every": 2, "progress": False, "threads": 1}}


def accepted_pairs(only: list[str]) -> list[tuple[str, str]]:
    from fedhet.algorithms import ALGORITHMS, algorithm_class
    from fedhet.algorithms.fedavg import FedAvg
    from fedhet.core.errors import ConfigError

    family = sorted(n for n, c in ALGORITHMS.items() if issubclass(c, FedAvg) and n != "fedavg")
    pairs = []
    for pair in itertools.permutations(family, 2):
        if only and not set(pair) & set(only):
            continue
        try:
            algorithm_class("+".join(pair))
        except ConfigError:
            continue
        pairs.append(pair)
    return pairs


def run_pair(pair: tuple[str, ...], dataset: str, out: Path) -> dict:
    import fedhet
    from fedhet.core.errors import ConfigError

    start = time.perf_counter()
    try:
        res = fedhet.run(pair_config(pair, dataset, out))
    except ConfigError as e:           # refused as the run is built: a setting, not the combination
        return {"pair": "+".join(pair), "status": "refused", "error": str(e)}
    except Exception as e:  # noqa: BLE001 - any other error is what this script looks for
        frames = [f for f in traceback.extract_tb(e.__traceback__) if "/fedhet/" in f.filename]
        where = f"{frames[-1].filename.split('/src/')[-1]}:{frames[-1].lineno}" if frames else "?"
        return {"pair": "+".join(pair), "status": "error", "error": f"{type(e).__name__}: {e}", "where": where}
    losses = [row.get("train_loss") for row in res.rows]
    finite = all(v is not None and math.isfinite(v) for v in losses)
    return {"pair": "+".join(pair), "status": "completed" if finite else "non-finite loss",
            "train_loss": losses, "seconds": round(time.perf_counter() - start, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", default=[], help="only the pairs with one of these methods")
    ap.add_argument("--pairs", nargs="*", default=[], help="only these pairs (a+b), when accepted")
    ap.add_argument("--alone", nargs="*", default=[],
                    help="run these methods by themselves instead, under the same settings (to tell a pair's "
                         "failure from its methods')")
    ap.add_argument("--param", action="append", default=[], metavar="METHOD.KEY=VALUE",
                    help="change a method's parameter from the script's (e.g. fedfm.lam=5, FedFM's default)")
    ap.add_argument("--results", type=Path, default=Path("composition_smoke.jsonl"),
                    help="one JSON line per pair; pairs already in it are skipped")
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    done = {}
    if args.results.exists():
        done = {r["pair"]: r for r in map(json.loads, args.results.read_text().splitlines()) if r}
    for item in args.param:
        target, _, value = item.partition("=")
        method, _, key = target.partition(".")
        if not (method and key and value):
            ap.error(f"--param {item!r}: write METHOD.KEY=VALUE, e.g. fedfm.lam=5")
        PARAMS.setdefault(method, {})[key] = json.loads(value)
    if args.alone:
        pairs: list[tuple[str, ...]] = [(name,) for name in args.alone if name not in done]
    else:
        pairs = [p for p in accepted_pairs(args.only) if "+".join(p) not in done
                 and (not args.pairs or "+".join(p) in args.pairs)]
    print(f"{len(pairs)} pairs to run ({len(done)} in {args.results} already)", file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp, args.results.open("a") as log:
        dataset = toy_dataset(Path(tmp) / "toy.npz")
        for i, pair in enumerate(pairs, 1):
            row = run_pair(pair, dataset, Path(tmp) / "runs")
            done[row["pair"]] = row
            log.write(json.dumps(row) + "\n")
            log.flush()
            print(f"[{i}/{len(pairs)}] {row['pair']}: {row['status']} {row.get('where', '')}", file=sys.stderr)
    refusals: dict[str, list[str]] = {}
    for r in done.values():
        if r["status"] == "refused":
            refusals.setdefault(r["error"].splitlines()[-1].strip()[:160], []).append(r["pair"])
    for reason, names in sorted(refusals.items(), key=lambda kv: -len(kv[1])):
        print(f"refused as built ({len(names)}, e.g. {names[0]}): {reason}")
    failed = [r for r in done.values() if r["status"] not in ("completed", "refused")]
    for r in failed:
        print(f"{r['pair']}: {r['status']} {r.get('error', '')[:300]} {r.get('where', '')}")
    print(f"{sum(r['status'] == 'completed' for r in done.values())} completed, "
          f"{sum(r['status'] == 'refused' for r in done.values())} refused as built, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
