"""What a large federation costs besides training: the bookkeeping of 10,000 clients.

Times, each as the median of ``--repeats`` runs (fewer when they take over 15 s together):

* **federation**: ``build_federation`` (the partition, each client's local test split, the index
  tensors) for IID, Dirichlet(0.5), Dirichlet(0.1) and the label-sorted shards on data of
  Fashion-MNIST's size (60,000 training and 10,000 test images: the real files when
  ``load_dataset("fashion_mnist")`` finds them, else synthetic arrays of the same shape), with the
  default local test split (``test_set``) and with ``holdout``; the partitioner alone beside it;
  and a CIFAR-sized synthetic pool (50,000 images, 3x32x32) split 1,000 x 50. Loading the images
  is timed once and left out of the builds. A Dirichlet partition that leaves some client with
  no sample (60,000 samples over 10,000 clients, about 6 each) is refused after
  ``max_tries`` draws; the row gives the time to that refusal, and the partitioner alone is timed
  with ``min_size: 0`` (one draw). ``dirichlet_per_client`` (each client's class mix drawn, at equal
  sizes) is the Dirichlet form that serves such federations, timed beside it.
* **sampling**: the round loop's own sampler (``RoundLoop.sample_clients``) and round context
  (``RoundLoop.round_context``: the sample, every client's size, the server's stream) for
  ``--rounds`` rounds of ``--cohort`` clients; the loop is built without training.
* **ledger**: ``CommLedger`` recording ``--rounds`` x ``--cohort`` downlink and uplink messages of
  cnn2 (8 tensors), taking each round out as the runner does, then the totals and the checkpoint
  state.
* **eval**: choosing the clients (``evaluation_clients``, as the runner does every evaluated round)
  for ``--rounds`` rounds, and one ``evaluate_loop`` of the round loop with ``eval.clients``
  ``sampled`` and 100, with a one-layer linear model so that the time is the bookkeeping rather
  than the forward passes: FedAvg (every client tested with the global model), Local-only (each
  tested client with its own weights) and FedAvg with ``holdout`` local splits (the validation
  pass covers every client's split).
* **sweep**: a sweep of ``--sweep-runs`` runs (one config x a grid x seeds), every run folder
  completed (copies of one real one-round run, each with its own recorded config): reading and
  expanding the sweep file (``load_sweep``), the status of every job (``fedhet sweep --list``),
  the table (``write_report``, ``fedhet sweep --table``) and adopting every run into an empty
  folder (``adopt_runs``, ``fedhet sweep --adopt``), each first in a fresh process (as the command
  line runs them), and the status again in the same process (a running sweep counts its completed
  runs every minute, and ends with the table).

Everything runs on one torch thread (``--threads``): the bookkeeping is one thread's work, and on a
loaded machine a second intra-op thread that gets descheduled stalls every forward pass.

Writes ``benchmarks/results/federation_scale.{md,json}`` (``--out``) with the machine, the commit,
the command and the date. ``--compare REV`` measures the library of commit ``REV`` (``git archive``
of its ``src/`` into a temporary folder) and the working tree's (or commit ``--after REV2``'s) in
one call, each step in its own process, the sides taking turns step by step (ABBA...; with
``--passes 2`` each step twice, in both orders), and writes both side by side.

    .venv/bin/python benchmarks/federation_scale.py                      # 10,000 clients, and 1,000
    .venv/bin/python benchmarks/federation_scale.py --clients 2000 --steps federation sampling
    .venv/bin/python benchmarks/federation_scale.py --compare HEAD~3     # before / after
    .venv/bin/python benchmarks/federation_scale.py --compare 51213a8 --after 91efeb6 --passes 2
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parent.parent
STEPS = ("federation", "sampling", "ledger", "eval", "sweep")
PARTITIONS = {
    "iid": {"kind": "iid"},
    "dirichlet a0.5": {"kind": "dirichlet", "alpha": 0.5, "min_size": 1},
    "dirichlet a0.1": {"kind": "dirichlet", "alpha": 0.1, "min_size": 1},
    "dirichlet_per_client a0.5": {"kind": "dirichlet_per_client", "alpha": 0.5},
    "dirichlet_per_client a0.1": {"kind": "dirichlet_per_client", "alpha": 0.1},
    "shards 2/client": {"kind": "shards", "shards_per_client": 2},
}


# --------------------------------------------------------------------------------------------
# timing


# A step's repeats stop early once they have taken this long together (a slow step is slow anyway).
BUDGET_S = 15.0


def measure(repeats: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> dict:
    """Median seconds of ``repeats`` calls ``fn(*args, **kwargs)``, fewer once they have taken
    :data:`BUDGET_S` together (each call's seconds kept)."""
    secs: list[float] = []
    for _ in range(repeats):
        if sum(secs) > BUDGET_S:
            break
        t0 = time.perf_counter()
        fn(*args, **kwargs)
        secs.append(time.perf_counter() - t0)
    return {"seconds": statistics.median(secs), "runs": [round(s, 4) for s in secs]}


def measure_in_child(repeats: int, fn: Callable[..., Any], *args: Any) -> dict:
    """:func:`measure` with each call in a forked child: what a fresh process pays (nothing that
    this process has cached or loaded since the fork comes back)."""
    secs: list[float] = []
    for _ in range(repeats):
        if sum(secs) > BUDGET_S:
            break
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:                                   # the child: time, report, leave at once
            os.close(read)
            try:
                t0 = time.perf_counter()
                fn(*args)
                os.write(write, repr(time.perf_counter() - t0).encode())
            finally:
                os._exit(0)
        os.close(write)
        with os.fdopen(read) as f:
            answer = f.read()
        os.waitpid(pid, 0)
        if not answer:
            raise RuntimeError(f"{getattr(fn, '__name__', fn)} failed in the child process")
        secs.append(float(answer))
    return {"seconds": statistics.median(secs), "runs": [round(s, 4) for s in secs]}


def each_round(rounds: int, fn: Callable[..., Any], *args: Any) -> None:
    for r in range(rounds):
        fn(*args, r)


class Recorder:
    def __init__(self) -> None:
        self.rows: list[dict] = []

    def add(self, step: str, what: str, clients: int | None, result: dict, note: str = "") -> None:
        row = {"step": step, "what": what, "clients": clients, **result, "note": note}
        self.rows.append(row)
        n = "-" if clients is None else f"{clients:,}"
        print(f"{step:10s} {what:62s} {n:>7s} {row['seconds']:9.3f} s  {note}", flush=True)


# --------------------------------------------------------------------------------------------
# data


def fashion_mnist_sized() -> tuple[Any, Any, str]:
    """(train, test) ImageData of Fashion-MNIST's size: the real files when found, else synthetic."""
    from fedhet.core.errors import DataError
    from fedhet.data.datasets import load_dataset

    try:
        t0 = time.perf_counter()
        train, test = load_dataset("fashion_mnist", train=True), load_dataset("fashion_mnist", train=False)
        return train, test, f"real Fashion-MNIST (loaded in {time.perf_counter() - t0:.2f} s, not counted below)"
    except DataError:
        return (synthetic("fashion_mnist", 60_000, 1, 28, 0), synthetic("fashion_mnist", 10_000, 1, 28, 1),
                "synthetic arrays of Fashion-MNIST's shape (the real files were not found)")


def synthetic(name: str, n: int, channels: int, side: int, seed: int) -> Any:
    """Balanced labels in random order and zero images: partitions read only the labels."""
    import torch

    from fedhet.data.datasets import ImageData

    y = np.random.default_rng(seed).permutation(np.arange(n) % 10)
    return ImageData(torch.zeros((n, channels, side, side), dtype=torch.uint8), torch.from_numpy(y.astype(np.int64)),
                     10, (0.5,) * channels, (0.25,) * channels, name=name)


@contextlib.contextmanager
def data_in_memory(train: Any, test: Any) -> Iterator[None]:
    """``build_federation`` reads these splits instead of loading files."""
    from fedhet.data import federated

    original = federated.load_dataset
    federated.load_dataset = lambda *args, train=True, **kw: train_data if train else test_data
    train_data, test_data = train, test
    try:
        yield
    finally:
        federated.load_dataset = original


def data_config(dataset: str, clients: int, partition: dict, local_test: str) -> Any:
    from fedhet.experiment.config import load_config

    return load_config(raw={"data": {"dataset": dataset, "num_clients": clients, "partition": dict(partition),
                                     "local_test": {"source": local_test, "fraction": 0.2}}}).data


# --------------------------------------------------------------------------------------------
# steps


def bench_federation(rec: Recorder, sizes: list[int], repeats: int, fmnist: tuple, cifar_clients: int) -> dict:
    """Every partition's federation at every size; returns the IID Fashion-MNIST federations by size."""
    from fedhet.core.errors import PartitionError
    from fedhet.data import partition as partitioners
    from fedhet.data.federated import build_federation

    train, test, _ = fmnist
    cifar = (synthetic("cifar10", 50_000, 3, 32, 2), synthetic("cifar10", 10_000, 3, 32, 3))
    settings = [("fmnist", n, train, test) for n in sizes] + [("cifar 3x32x32", cifar_clients, *cifar)]
    iid_feds: dict[int, Any] = {}
    for data_name, n, tr, te in settings:
        labels = tr.y.numpy()
        dataset = "cifar10" if data_name.startswith("cifar") else "fashion_mnist"
        for pname, spec in PARTITIONS.items():
            alone = {k: v for k, v in spec.items() if k != "kind"}
            one_draw = spec["kind"] == "dirichlet"
            if one_draw:
                alone["min_size"] = 0
            rec.add("federation", f"{data_name}: partition {pname}{' (min_size 0)' if one_draw else ''}", n,
                    measure(repeats, partitioners.partition, spec["kind"], labels, n, 0, **alone),
                    "partitioner alone")
            with data_in_memory(tr, te):
                for source in ("test_set", "holdout"):
                    cfg = data_config(dataset, n, spec, source)
                    what = f"{data_name}: federation {pname}, local_test {source}"
                    t0 = time.perf_counter()
                    try:
                        fed = build_federation(cfg, 0)
                    except PartitionError as e:
                        secs = time.perf_counter() - t0
                        reason = str(e).split(";")[0][:110]
                        rec.add("federation", what, n, {"seconds": secs, "runs": [round(secs, 4)]},
                                f"refused, one run: {reason}")
                        if "dirichlet" in str(e):
                            break      # the partition refused: the other local test source is refused alike
                        continue
                    first = time.perf_counter() - t0
                    res = measure(repeats - 1, build_federation, cfg, 0) if repeats > 1 else {"runs": []}
                    res["runs"].insert(0, round(first, 4))
                    res["seconds"] = statistics.median(res["runs"])
                    sizes_ = [len(t) for t in fed.train_idx]
                    rec.add("federation", what, n, res, f"train sizes {min(sizes_)}..{max(sizes_)}")
                    if data_name == "fmnist" and pname == "iid" and source == "test_set":
                        iid_feds[n] = fed
    return iid_feds


def tiny_loop(fed: Any, algorithm: str, cohort: int) -> Any:
    """A RoundLoop over ``fed`` with a one-layer linear model, built without training."""
    import torch
    from torch import nn

    from fedhet.engine import ClientHost
    from fedhet.engine.loop import RoundLoop
    from fedhet.experiment.build import make_algorithm, train_settings
    from fedhet.experiment.config import load_config
    from fedhet.models.base import SplitModel

    cfg = load_config(raw={"algorithm": {"name": algorithm}, "train": {"clients_per_round": cohort},
                           "data": {"num_clients": fed.num_clients}})
    torch.manual_seed(0)
    side = fed.image_size
    model = SplitModel([("flat", nn.Flatten()), ("out", nn.Linear(fed.in_channels * side * side, fed.num_classes))],
                       "out", (fed.in_channels, side, side))
    host = ClientHost(make_algorithm(cfg), fed, {"linear": model}, ["linear"] * fed.num_clients,
                      train_settings(cfg, "fp32"), cfg.seed)
    return RoundLoop(host, cohort)


def bench_sampling(rec: Recorder, feds: dict, rounds: int, cohort: int, repeats: int) -> None:
    for n, fed in feds.items():
        loop = tiny_loop(fed, "fedavg", cohort)
        rec.add("sampling", f"sample_clients, {rounds} rounds of {cohort}", n,
                measure(repeats, each_round, rounds, loop.sample_clients))
        rec.add("sampling", f"round_context (sample + sizes + stream), {rounds} rounds", n,
                measure(repeats, each_round, rounds, loop.round_context))


def bench_ledger(rec: Recorder, rounds: int, cohort: int, repeats: int) -> None:
    from fedhet.core.contract import Message
    from fedhet.engine.ledger import CommLedger
    from fedhet.models import build_model

    weights = {k: v.detach().clone() for k, v in build_model("cnn2", 1, 10, 28).state_dict().items()}
    down = Message("train", {"model": weights})
    up = Message("update", {"model": weights}, {"num_samples": 100})

    def run() -> None:
        ledger = CommLedger()
        for r in range(rounds):
            for _ in range(cohort):
                ledger.record(r, "down", down)
            for _ in range(cohort):
                ledger.record(r, "up", up)
            ledger.take_round(r)
        ledger.totals()
        ledger.state_dict()

    rec.add("ledger", f"record {rounds} rounds x {cohort} clients (down+up, cnn2), take_round, totals",
            None, measure(repeats, run))


def choose(which: str | int, n: int, loop: Any, rnd: int) -> list[int]:
    """The runner's choice of the clients an evaluated round tests (Experiment.eval_clients)."""
    from fedhet.metrics.evaluate import evaluation_clients

    return evaluation_clients(which, n, loop.sample_clients(rnd), 0)


def bench_eval(rec: Recorder, feds: dict, fmnist: tuple, rounds: int, cohort: int, repeats: int) -> None:
    from fedhet.data.federated import build_federation
    from fedhet.metrics.evaluate import evaluate_loop, evaluation_clients, predict

    train, test, _ = fmnist
    for n, fed in feds.items():
        loop = tiny_loop(fed, "fedavg", cohort)
        for which in ("sampled", 100):
            rec.add("eval", f"evaluation_clients({which!r}) + the round's sample, {rounds} rounds", n,
                    measure(repeats, each_round, rounds, choose, which, n, loop))
        weights = loop.algorithm.global_model(loop.server_state)
        model = loop.host.client_models["linear"]
        predict(model, weights, fed.test.x, fed.test.y, fed.normalize, 2048)          # warm-up
        rec.add("eval", "for reference: the global pass alone (predict, 10,000 test images)", n,
                measure(repeats, predict, model, weights, fed.test.x, fed.test.y, fed.normalize, 2048))
        local = tiny_loop(fed, "local", cohort)
        with data_in_memory(train, test):
            holdout = tiny_loop(build_federation(data_config("fashion_mnist", n, PARTITIONS["iid"], "holdout"), 0),
                                "fedavg", cohort)
        for which in ("sampled", 100):
            chosen = evaluation_clients(which, n, loop.sample_clients(0), 0)
            local.client_states.clear()
            local.client_states.update({c: {"model": {k: v + 0.0 for k, v in weights.items()}} for c in chosen})
            for label, lp in (("fedavg, test_set", loop), ("local (own weights), test_set", local),
                              ("fedavg, holdout (validation pass)", holdout)):
                evaluate_loop(lp, clients=chosen)          # warm-up
                rec.add("eval", f"evaluate_loop, eval.clients={which!r} ({len(chosen)}), {label}", n,
                        measure(repeats, evaluate_loop, lp, clients=chosen))


def template_run(tmp: Path) -> Path:
    """One real completed one-round run (synthetic data): the summary and metrics every run copies."""
    from fedhet.data.user_data import save_arrays
    from fedhet.experiment.api import run

    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 255, (400, 28, 28), dtype=np.uint8), np.arange(400) % 10
    dataset = save_arrays(tmp / "data.npz", x[:300], y[:300], x[300:], y[300:])
    (tmp / "base.yaml").write_text(
        f"name: scale\ndata: {{dataset: '{dataset}', num_clients: 4, partition: {{kind: iid}}}}\n"
        "model: {arch: cnn2}\nalgorithm: {name: fedavg}\n"
        "train: {rounds: 1, clients_per_round: 2, local_epochs: 1, batch_size: 50}\n"
        "run: {threads: 1, progress: false, checkpoint_every: 1000}\n")
    with contextlib.redirect_stderr(open(os.devnull, "w")):
        res = run(str(tmp / "base.yaml"), out=str(tmp / "template"))
    return res.run_dir


def bench_sweep(rec: Recorder, runs: int, repeats: int) -> None:
    from fedhet.experiment.config import dump_config, load_config
    from fedhet.experiment.sweep import adopt_runs, job_status, load_sweep, write_report

    warnings.filterwarnings("ignore", message="Tight layout not applied")   # a plot of 100 curves
    seeds = 10
    lrs = max(1, runs // (seeds * 10))
    with tempfile.TemporaryDirectory(prefix="fedhet-sweep-scale-") as tmp_name:
        tmp = Path(tmp_name)
        template = template_run(tmp)
        grid = {"train.lr": [round(0.001 * (i + 1), 4) for i in range(lrs)], "train.momentum": [0.1 * i for i in range(10)]}
        sweep_file = tmp / "scale.sweep.yaml"
        sweep_file.write_text(json.dumps({"name": "scale", "out": str(tmp / "runs"), "seeds": list(range(seeds)),
                                          "grid": grid, "runs": [{"config": str(tmp / "base.yaml"), "tag": "base"}]}))
        sweep = load_sweep(sweep_file)
        n = len(sweep.jobs)
        summary = json.loads((template / "summary.json").read_text())
        for job in sweep.jobs:            # every run completed, with the config the sweep asks for
            job.run_dir.mkdir(parents=True)
            cfg = load_config(job.config, job.overrides)
            (job.run_dir / "config.yaml").write_text(dump_config(cfg))
            (job.run_dir / "summary.json").write_text(json.dumps({**summary, "name": cfg.name, "seed": cfg.seed}))
            for name in ("metrics.jsonl", "partition.json"):
                shutil.copy2(template / name, job.run_dir / name)
        rec.add("sweep", "load_sweep (read and expand the sweep file)", None,
                measure(repeats, load_sweep, sweep_file), f"{n} runs")

        def statuses() -> list[str]:
            return [job_status(j) for j in sweep.jobs]

        targets = iter(range(repeats))

        def adopt() -> None:
            adopt_runs(load_sweep(sweep_file, out=tmp / f"adopted{next(targets)}"), tmp / "runs", log=lambda m: None)

        # Each first pass in a fresh process forked before this one reads any run (`fedhet sweep --list`,
        # `--table`, `--adopt` each start one); then the status again in one process (a running sweep
        # counts its completed runs every minute and ends with the table).
        rec.add("sweep", "job_status of every run, first in a process (fedhet sweep --list)", None,
                measure_in_child(repeats, statuses), f"{n} runs")
        rec.add("sweep", "write_report, first in a process (fedhet sweep --table: statuses, table, plot)", None,
                measure_in_child(1, write_report, sweep), f"{n} runs, one run")
        rec.add("sweep", "adopt_runs of every run into an empty folder, first in a process (--adopt)", None,
                measure_in_child(repeats, adopt), f"{n} runs")
        done = statuses().count("completed")
        rec.add("sweep", "job_status of every run, again in the same process", None, measure(repeats, statuses),
                f"{n} runs, {done} completed")


# --------------------------------------------------------------------------------------------
# one side: this process's library


def measure_side(a: argparse.Namespace) -> dict:
    import torch

    import fedhet

    torch.set_num_threads(a.threads)
    rec = Recorder()
    sizes = sorted({a.trend, a.clients} - {0})
    info: dict = {"fedhet_file": fedhet.__file__, "torch_threads": torch.get_num_threads()}
    fmnist = fashion_mnist_sized()
    info["data"] = fmnist[2]
    print(f"library: {Path(fedhet.__file__).parent}; data: {fmnist[2]}", flush=True)
    feds: dict = {}
    if "federation" in a.steps:
        feds = bench_federation(rec, sizes, a.repeats, fmnist, a.cifar_clients)
    if {"sampling", "eval"} & set(a.steps) and not feds:
        from fedhet.data.federated import build_federation

        with data_in_memory(fmnist[0], fmnist[1]):
            feds = {n: build_federation(data_config("fashion_mnist", n, PARTITIONS["iid"], "test_set"), 0)
                    for n in sizes}
    if "sampling" in a.steps:
        bench_sampling(rec, feds, a.rounds, a.cohort, a.repeats)
    if "ledger" in a.steps:
        bench_ledger(rec, a.rounds, a.cohort, a.repeats)
    if "eval" in a.steps:
        bench_eval(rec, feds, fmnist, a.rounds, a.cohort, a.repeats)
    if "sweep" in a.steps:
        bench_sweep(rec, a.sweep_runs, a.repeats)
    return {"rows": rec.rows, **info}


# --------------------------------------------------------------------------------------------
# the result files


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def merge_passes(rows: list[dict]) -> list[dict]:
    """One row per step: the median of every run of every pass (the last pass's note)."""
    merged: dict[tuple, dict] = {}
    for row in rows:
        key = (row["step"], row["what"], row["clients"])
        if key in merged:
            merged[key]["runs"] = merged[key]["runs"] + row["runs"]
            merged[key]["note"] = row["note"]
        else:
            merged[key] = dict(row)
    for row in merged.values():
        row["seconds"] = statistics.median(row["runs"])
    return list(merged.values())


def strip_options(argv: list[str], names: tuple[str, ...]) -> list[str]:
    """``argv`` without the options ``names`` and their values."""
    out: list[str] = []
    skipping = False
    for item in argv:
        if item.startswith("--"):
            skipping = item.split("=", 1)[0] in names and "=" not in item
            if item.split("=", 1)[0] in names:
                continue
        elif skipping:
            continue
        out.append(item)
    return out


def archived_src(rev: str, folder: Path) -> tuple[Path, str]:
    """``src/`` of commit ``rev`` extracted into ``folder`` (``git archive``); (its path, a label)."""
    short = git("rev-parse", "--short", rev)
    folder.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", short, "src"], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return folder / "src", f"commit {short}"


def run_side(label: str, src: Path, argv: list[str]) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = Path(f.name)
    env = {**os.environ, "PYTHONPATH": str(src) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    print(f"\n== {label}: library {src}", flush=True)
    subprocess.run([sys.executable, __file__, *argv, "--side-json", str(out)], env=env, check=True)
    side = json.loads(out.read_text())
    out.unlink()
    return side


def markdown(result: dict) -> str:
    from fedhet.experiment.summary import cpu_name

    m = result["machine"]
    sides = result["sides"]
    labels = list(sides)
    lines = ["# Federation scale: the bookkeeping of many clients", "",
             f"Command: `{result['command']}`  ",
             f"Machine: {cpu_name(m)}, {m['cpus']} CPUs, torch {m['torch']}, {sides[labels[-1]]['torch_threads']} torch "
             "thread(s) in the measuring processes; "
             f"commit {result['commit']}; {result['date']}; load average before/after: {result['load_before']} / "
             f"{result['load_after']}.  ",
             f"Data: {sides[labels[-1]]['data']}.  ",
             "Sides: " + "; ".join(f"**{k}** = {v['library']}" for k, v in sides.items()) + ".", "",
             f"Median seconds of every repeat of {result['settings']['passes']} pass(es) (`runs` in the JSON), the "
             "sides taking turns step by step. The machine is shared: figures move by tens of percent from run to "
             "run; compare the columns of one file.", ""]
    head = "| step | what | clients | " + " | ".join(f"{k} (s)" for k in labels)
    head += " | " + f"{labels[0]} / {labels[-1]}" + " | note |" if len(labels) > 1 else " | note |"
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    keyed = [{(r["step"], r["what"], r["clients"]): r for r in sides[k]["rows"]} for k in labels]
    for key, row in keyed[-1].items():
        cells = [f"{k[key]['seconds']:.3f}" if key in k else "-" for k in keyed]
        if len(labels) > 1:
            first = keyed[0].get(key)
            ratio = f"{first['seconds'] / row['seconds']:.1f}x" if first and row["seconds"] > 0 else "-"
            cells.append(ratio)
        note = row["note"]
        if len(labels) > 1 and key in keyed[0] and keyed[0][key]["note"] != note:
            note = f"{labels[0]}: {keyed[0][key]['note']}; {labels[-1]}: {note}"
        clients = "-" if key[2] is None else f"{key[2]:,}"
        lines.append(f"| {key[0]} | {key[1]} | {clients} | " + " | ".join(cells) + f" | {note} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=10_000, help="the large federation (default 10,000)")
    ap.add_argument("--trend", type=int, default=1_000, help="a smaller one for the trend (0: none)")
    ap.add_argument("--cifar-clients", type=int, default=1_000, help="clients of the CIFAR-sized split")
    ap.add_argument("--rounds", type=int, default=1_500)
    ap.add_argument("--cohort", type=int, default=50)
    ap.add_argument("--sweep-runs", type=int, default=1_000, help="runs of the sweep (rounded to a multiple of 100)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1: the bookkeeping is "
                    "one thread's, and threads a loaded machine deschedules stall every pass)")
    ap.add_argument("--steps", nargs="+", choices=STEPS, default=list(STEPS))
    ap.add_argument("--compare", metavar="REV", help="also measure the library of commit REV ('before'), side by side")
    ap.add_argument("--after", metavar="REV", help="with --compare: measure commit REV as 'after' instead of the "
                    "working tree")
    ap.add_argument("--passes", type=int, default=1, help="go through the steps this many times, the sides' "
                    "order turned round each pass; a step's figure is the median of all its runs")
    ap.add_argument("--out", type=Path, default=RESULTS / "federation_scale")
    ap.add_argument("--side-json", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.side_json:
        a.side_json.write_text(json.dumps(measure_side(a)))
        return 0
    argv = strip_options(sys.argv[1:], ("--compare", "--after", "--steps", "--passes"))
    command = "python benchmarks/" + " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])
    load_before = [round(x, 2) for x in os.getloadavg()]
    t0 = time.perf_counter()
    head = git("rev-parse", "--short", "HEAD")
    dirty = bool(git("status", "--porcelain", "--", "src"))
    with tempfile.TemporaryDirectory(prefix="fedhet-scale-") as tmp:
        libraries: dict[str, tuple[Path, str]] = {}
        if a.compare:
            libraries["before"] = archived_src(a.compare, Path(tmp) / "before")
        if a.after:
            libraries["after"] = archived_src(a.after, Path(tmp) / "after")
        else:
            libraries["after" if a.compare else "this commit"] = (
                ROOT / "src", f"working tree at {head}" + (" (uncommitted changes under src/)" if dirty else ""))
        # The sides take turns step by step, in the order ABBA..., so that the machine's load moving
        # during the call weighs on both alike.
        sides: dict[str, dict] = {label: {"rows": [], "library": what} for label, (_, what) in libraries.items()}
        for p in range(a.passes):
            for i, step in enumerate(a.steps):
                order = list(libraries) if (i + p) % 2 == 0 else list(reversed(libraries))
                for label in order:
                    side = run_side(f"{label}, {step}, pass {p + 1}", libraries[label][0], [*argv, "--steps", step])
                    sides[label]["rows"] += side.pop("rows")
                    sides[label].update(side)
        for side in sides.values():
            side["rows"] = merge_passes(side["rows"])
    from fedhet.experiment.summary import machine_info

    result = {"command": command, "commit": head, "date": time.strftime("%Y-%m-%d %H:%M"),
              "machine": machine_info(), "load_before": load_before,
              "load_after": [round(x, 2) for x in os.getloadavg()], "wall_s": round(time.perf_counter() - t0, 1),
              "settings": {k: v for k, v in vars(a).items() if k not in ("out", "side_json")}, "sides": sides}
    result["settings"]["steps"] = list(a.steps)
    text = markdown(result)
    print("\n" + text)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".md").write_text(text)
    a.out.with_suffix(".json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"wrote {a.out.with_suffix('.md')} and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
