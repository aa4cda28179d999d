"""How many of a run's vectorized steps would replay a CUDA graph, counted on the CPU.

The vectorized engine decides from a group's schedule alone which steps run eagerly, which are
captured and which replay a graph (engine/vectorized/graphs.py). This script trains a config's
first rounds with the vectorized engine on the CPU and, for each group, counts what a CUDA run
with graphs would do with that group's schedule (``count_actions``, keeping one book of graphs
per kept group as ``run.keep_graphs`` does): per round, the eager steps (full batches and
remainder batches apart), the captures and the replays. It measures no time; it predicts what a
change to the graph rules does to a GPU run before a GPU is lent.

    python benchmarks/graph_schedule.py configs/papers/fedcme/fmnist_a0.5_k50_m10_fedcme_mu0.01.yaml \\
        --rounds 8 [--min-repeats 4] [--set run.keep_graphs=false]
"""

from __future__ import annotations

import argparse
import collections
import tempfile

from fedhet.engine.vectorized import GRAPH_MIN_REPEATS, Vectorized
from fedhet.engine.vectorized.graphs import GraphBook, count_actions
from fedhet.experiment.config import load_config
from fedhet.experiment.runner import Experiment

NAMES = ["eager, full batch", "eager, remainder batch", "capture", "replay, full width", "replay, narrow"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("config")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--min-repeats", type=int, default=GRAPH_MIN_REPEATS, help="instead of the engine's")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    a = p.parse_args()
    cfg = load_config(a.config, ["run.engine=vectorized", f"train.rounds={a.rounds}", "run.progress=false",
                                 "run.device=cpu", *a.set])
    kinds: collections.Counter = collections.Counter()
    books: dict[int, GraphBook] = {}     # per kept group (the same object while its signature is kept)

    def count(group, schedule):
        book = books.setdefault(id(group), GraphBook()) if cfg.run.keep_graphs else GraphBook()
        kinds.update(count_actions(book, schedule.steps, a.min_repeats, group.requests[0].settings.batch_size))

    with tempfile.TemporaryDirectory() as tmp:
        loop = Experiment(cfg, tmp).loop
        # The schedule CUDA would run: wide steps and kept groups on, as they are wherever graphs replay.
        loop.transport = Vectorized("cpu", wide_steps=True, keep_graphs=cfg.run.keep_graphs,
                                    graph_min_repeats=a.min_repeats, on_schedule=count)
        loop.transport.attach(loop.host)
        print("| round | " + " | ".join(NAMES) + " |")
        print("|---" * (len(NAMES) + 1) + "|")
        for rnd in range(a.rounds):
            before = dict(kinds)
            loop.run_round(rnd)
            print(f"| {rnd + 1} | " + " | ".join(str(kinds[k] - before.get(k, 0)) for k in NAMES) + " |")
        print("| all | " + " | ".join(str(kinds[k]) for k in NAMES) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
