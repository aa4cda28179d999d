"""Client states in bounded memory: peak RSS and round time of a large federation whose clients keep
state (SCAFFOLD's control variates, Local's own models), with the states in memory or spilled.

    .venv/bin/python benchmarks/client_state_store.py                     # 1,000 clients, cnn2
    .venv/bin/python benchmarks/client_state_store.py --clients 10000 --arch fca_tiny_a --methods local

Each (method, store) runs in a fresh process: Fashion-MNIST (real where installed, else random
images of its shape) split iid into ``--clients`` clients of ``--samples`` images, ``--cohort``
clients a round for ``--rounds`` rounds (one local epoch, so every sampled client writes its state),
with ``run.client_state_store`` memory (every state in RAM), auto with ``--budget-mb``, or disk
(every state written and read back each time: the store's cost where the states would fit in
memory). It reports the process's peak RSS (VmHWM), the states held and spilled, the bytes of the
states, the median round time, and the store's own time (``ClientStates.seconds``: its reads, writes
and snapshots) with its share of the rounds' time. ``--stores`` takes ``auto:MB`` for an auto store
with its own budget. ``--eval-clients`` adds the personalized evaluation after the last round
(``all``, ``sampled`` or a number: ``eval.clients``), which reads the evaluated clients' states
back; by default (``none``) only the global model is evaluated. Writes
benchmarks/results/client_state_store.{md,json} (``--out``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def peak_rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def one(a: argparse.Namespace) -> dict:
    """One (method, store) run in this process."""
    from fedhet.core.errors import DataError
    from fedhet.data.datasets import load_dataset
    from fedhet.engine.client_store import state_size
    from fedhet.experiment.config import load_config
    from fedhet.experiment.runner import Experiment, read_metrics

    with tempfile.TemporaryDirectory() as tmp:
        data: dict = {"dataset": "fashion_mnist"}
        try:
            load_dataset("fashion_mnist", "test")
            note = "Fashion-MNIST"
        except DataError:
            import numpy as np

            from fedhet.data.user_data import save_arrays
            rng = np.random.default_rng(0)
            path = Path(tmp) / "fmnist.npz"
            save_arrays(path, rng.integers(0, 256, (60000, 1, 28, 28), dtype=np.uint8), rng.integers(0, 10, 60000),
                        rng.integers(0, 256, (10000, 1, 28, 28), dtype=np.uint8), rng.integers(0, 10, 10000))
            data = {"dataset": f"npz:{path}"}
            note = "random images of Fashion-MNIST's shape"
        raw = {"name": "store", "seed": 0,
               "data": {**data, "num_clients": a.clients,
                        "partition": {"kind": "iid", "samples_per_client": a.samples}},
               "model": {"arch": a.arch},
               "algorithm": {"name": a.method},
               "train": {"rounds": a.rounds, "clients_per_round": a.cohort, "local_epochs": 1,
                         "batch_size": a.samples, "lr": 0.01},
               "eval": {"every": a.rounds, "personalized": a.eval_clients != "none",
                        **({} if a.eval_clients == "none" else
                           {"clients": int(a.eval_clients) if a.eval_clients.isdigit() else a.eval_clients})},
               "run": {"engine": "reference", "progress": False, "checkpoint_every": a.rounds,
                       "client_state_store": a.store,
                       **({"client_state_memory_mb": a.budget_mb} if a.store == "auto" else {})}}
        exp = Experiment.create(load_config(raw=raw), Path(tmp) / "run")
        t0 = time.perf_counter()
        exp.run(progress=False)
        wall = time.perf_counter() - t0
        rows = read_metrics(exp.run_dir)
        store = exp.loop.client_states
        # the run's figures, before anything below loads a spilled state
        peak, store_s, counters = peak_rss_mb(), store.seconds, dict(store.counters)
        one_state = store[next(iter(store))] if len(store) else None     # one state, not every one
        folder = exp.run_dir / "client_states"
        disk = sum(p.stat().st_size for p in folder.iterdir()) if folder.exists() else 0
        return {"method": a.method, "store": a.store, "budget_mb": a.budget_mb if a.store == "auto" else None,
                "clients": a.clients, "arch": a.arch, "data": note, "rounds": a.rounds, "cohort": a.cohort,
                "states": len(store), "spilled": store.spilled(),
                "state_mb": state_size(one_state)[0] / 2**20 if one_state is not None else 0.0,
                "states_mb": store.tensor_floats() * 4 / 2**20, "disk_mb": disk / 2**20,
                "round_s": statistics.median(r["seconds"]["total"] - r["seconds"]["evaluate"] for r in rows),
                "eval_clients": a.eval_clients, "evaluate_s": sum(r["seconds"]["evaluate"] for r in rows),
                "store_s": store_s, "store_counters": counters,
                "store_share": store_s / sum(r["seconds"]["total"] - r["seconds"]["evaluate"] for r in rows),
                "wall_s": wall, "peak_rss_mb": peak}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--clients", type=int, default=1000)
    p.add_argument("--samples", type=int, default=10)
    p.add_argument("--cohort", type=int, default=200)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--arch", default="cnn2")
    p.add_argument("--methods", default="scaffold,local")
    p.add_argument("--stores", default="memory,auto,disk")
    p.add_argument("--budget-mb", type=int, default=256)
    p.add_argument("--eval-clients", default="none",
                   help="personalized evaluation after the last round: all, sampled or a number (default: none, "
                        "the global model only)")
    p.add_argument("--out", default="client_state_store")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--method", help=argparse.SUPPRESS)
    p.add_argument("--store", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:
        print(json.dumps(one(a)))
        return 0
    from fedhet.experiment.summary import cpu_name, git_commit, machine_info

    results = []
    for method in a.methods.split(","):
        for spec in a.stores.split(","):
            store, _, budget = spec.partition(":")            # auto:MB, an auto store with its own budget
            cmd = [sys.executable, __file__, "--one", "--method", method, "--store", store,
                   "--clients", str(a.clients), "--samples", str(a.samples), "--cohort", str(a.cohort),
                   "--rounds", str(a.rounds), "--arch", a.arch, "--budget-mb", budget or str(a.budget_mb),
                   "--eval-clients", a.eval_clients]
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode != 0:
                print(out.stderr[-3000:], file=sys.stderr)
                return out.returncode
            r = json.loads(out.stdout.strip().splitlines()[-1])
            results.append(r)
            print(f"{method:9s} {store:7s} states {r['states']:6d} (spilled {r['spilled']:6d}, "
                  f"{r['states_mb']:8.0f} MB, on disk {r['disk_mb']:8.0f} MB)  round {r['round_s']:6.2f} s  "
                  f"store {r['store_s']:6.2f} s ({100 * r['store_share']:.1f}% of the rounds)  "
                  f"peak RSS {r['peak_rss_mb']:7.0f} MB", flush=True)
    machine = machine_info()
    commit = git_commit()          # the package's, "-dirty" where its source differs from it
    command = (f"python benchmarks/client_state_store.py --clients {a.clients} --samples {a.samples} "
               f"--cohort {a.cohort} --rounds {a.rounds} --arch {a.arch} --methods {a.methods} "
               f"--stores {a.stores} --budget-mb {a.budget_mb}"
               + (f" --eval-clients {a.eval_clients}" if a.eval_clients != "none" else ""))
    lines = [f"# Client states in bounded memory ({a.clients:,} clients, {a.arch})", "",
             f"Machine: {cpu_name(machine)} ({machine['cpus']} CPUs); commit {commit}; `{command}`; "
             f"{time.strftime('%Y-%m-%d')}. Data: {results[0]['data']}; {a.rounds} rounds of {a.cohort} clients "
             f"of {a.samples} images, one local epoch; reference engine; evaluated after the last round: "
             + ("the global model only" if a.eval_clients == "none" else
                f"the global model and the clients' own (eval.clients: {a.eval_clients})") + ".", "",
             "| method | store | states | spilled | one state (MB) | all states (MB) | on disk (MB) | "
             "round (s, median) | store (s, all rounds) | store / rounds | evaluation (s) | peak RSS (MB) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        store = r["store"] + (f" ({r['budget_mb']} MB)" if r["budget_mb"] is not None else "")
        lines.append(f"| {r['method']} | {store} | {r['states']} | {r['spilled']} | {r['state_mb']:.2f} | "
                     f"{r['states_mb']:.0f} | {r['disk_mb']:.0f} | {r['round_s']:.2f} | {r['store_s']:.2f} | "
                     f"{100 * r['store_share']:.1f}% | {r['evaluate_s']:.2f} | {r['peak_rss_mb']:.0f} |")
    lines += ["", "store = the seconds spent in the client state store's reads, writes and snapshots (bookkeeping, "
              "spilling, loading), measured inside the run; store / rounds = their share of the rounds' time in the "
              "same run."]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{a.out}.md").write_text("\n".join(lines) + "\n")
    (RESULTS / f"{a.out}.json").write_text(json.dumps({"command": command, "commit": commit, "machine": machine,
                                                       "results": results}, indent=1) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
