"""How many of a run's vectorized steps would replay a CUDA graph, counted on the CPU.

The vectorized engine decides from the schedule alone which steps run eagerly, which are captured
and which replay a graph (engine/vectorized.py). This script runs a config's first rounds on the
CPU with that decision made as on CUDA, but with the captures and replays counted instead of run,
and every step's arithmetic skipped: it prints, per round, the eager steps (full batches and
remainder batches apart), the captures and the replays. It measures no time; it predicts what a
change to the graph rules does to a GPU run before a GPU is lent.

    python benchmarks/graph_schedule.py configs/papers/fedcme/fmnist_a0.5_k50_m10_fedcme_mu0.01.yaml \\
        --rounds 8 [--min-repeats 4] [--set run.keep_graphs=false]
"""

from __future__ import annotations

import argparse
import collections
import tempfile

import torch

from fedhet.engine import vectorized
from fedhet.experiment.config import load_config
from fedhet.experiment.runner import Experiment


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("config")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--min-repeats", type=int, help="GRAPH_MIN_REPEATS instead of the engine's")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    a = p.parse_args()
    kinds: collections.Counter = collections.Counter()

    class CountedGraph:
        """Stands in for a captured graph: counts its capture and replays, computes nothing."""
        ok = True

        def __init__(self, g, width):
            self.width, self.terms = width, len(g.templates)
            kinds["capture"] += 1

        def replay(self, pool_idx, pos, active=None, draws=None, idx=None):
            kinds["replay, full width" if active is not None else "replay, narrow"] += 1
            return torch.zeros(self.width), torch.zeros(self.width, self.terms)

    def counted_step(engine, g, idx, pool_idx, pos, active=None, draws=None):
        full_batch = pool_idx.shape[1] == g.requests[0].settings.batch_size
        kinds["eager, full batch" if full_batch else "eager, remainder batch"] += 1
        return torch.zeros(pool_idx.shape[0]), torch.zeros(pool_idx.shape[0], len(g.templates))

    vectorized.Vectorized._graphs_on = lambda self: True
    vectorized.Vectorized._capture = lambda self, g, width, size, idx, wide, draws: CountedGraph(g, width)
    vectorized.Vectorized._step = counted_step
    if a.min_repeats is not None:
        vectorized.GRAPH_MIN_REPEATS = a.min_repeats
    cfg = load_config(a.config, ["run.engine=vectorized", f"train.rounds={a.rounds}", "run.progress=false", *a.set])
    with tempfile.TemporaryDirectory() as tmp:
        loop = Experiment(cfg, tmp).loop
        names = ["eager, full batch", "eager, remainder batch", "capture", "replay, full width", "replay, narrow"]
        print("| round | " + " | ".join(names) + " |")
        print("|---" * (len(names) + 1) + "|")
        for rnd in range(a.rounds):
            before = dict(kinds)
            loop.run_round(rnd)
            print(f"| {rnd + 1} | " + " | ".join(str(kinds[k] - before.get(k, 0)) for k in names) + " |")
        print("| all | " + " | ".join(str(kinds[k]) for k in names) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
