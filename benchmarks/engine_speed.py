"""Engine speed: client-samples/s of each engine mode against the ceiling measured in the same run.

    .venv/bin/python benchmarks/engine_speed.py                # full: writes results/engine_speed.{md,json}
    .venv/bin/python benchmarks/engine_speed.py --quick        # smoke run: results/engine_speed_quick.*

Settings (FedAvg, cnn2, Fashion-MNIST, lr 0.01, evaluation every round on the global test set and
every client's local test split):

* ``fedcme_a0.1`` / ``fedcme_a0.5``: the FedCME FMNIST setting - 50 clients, Dirichlet(alpha),
  10 clients per round, E=6, batch 32;
* ``cross_device``: 1,000 clients of 50 samples (iid), 50 per round, batch 10, E=1.

Modes: reference fp32/bf16 (one process, torch's default threads), parallel fp32/bf16 (one
worker per usable CPU up to one per client of a round, one thread each), vectorized fp32 when ``fedhet.engine.vectorized``
imports. Each mode runs ``1 + --rounds`` rounds through the real runner (``Experiment``); the
first round (worker start-up, first-call allocations) is dropped and the medians of the others
are reported (cross-device rounds last about a second: 4x as many are measured there). "train"
is the time the round's phases took (the engine's whole job, transport included), so samples/s
= sample-steps / train seconds; "aggregate" is the server's side of the round, "evaluate" the
metrics, "other" the rest of the runner (ledger, metrics line, checkpoint).

Ceiling: ``train_local`` on the same model and the same samples (the clients sampled in round 1,
concatenated; 8,000 of them, repeated if fewer) in batches of clients_per_round x batch_size, at
torch's default threads: the same FLOPs without per-client or small-batch overhead. Measured in
fp32 and bf16, 3 times before and 3 times after each setting's modes; the best is the ceiling
(load only slows a measurement down).

Peak memory: a fresh subprocess per (clients, engine) runs 2 rounds of the cross-device setting
with 50 and with 1,000 clients (50 per round, 50 samples each) and reports the main process's
peak RSS and the peak proportional set size of the main process plus its workers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from fedhet.core.contract import ClientData, TrainSettings
from fedhet.core.cpus import usable_cpus
from fedhet.core.seeding import torch_generator
from fedhet.engine import choose_engine, round_sample_estimate
from fedhet.experiment.config import load_config
from fedhet.experiment.runner import Experiment, read_metrics
from fedhet.experiment.summary import cpu_model, cpu_name, machine_info
from fedhet.training.local import train_local
from fedhet.training.objective import CrossEntropy
from fedhet.training.precision import bf16_native

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

SETTINGS = {
    "fedcme_a0.1": dict(num_clients=50, partition={"kind": "dirichlet", "alpha": 0.1}, clients_per_round=10,
                        local_epochs=6, batch_size=32),
    "fedcme_a0.5": dict(num_clients=50, partition={"kind": "dirichlet", "alpha": 0.5}, clients_per_round=10,
                        local_epochs=6, batch_size=32),
    "cross_device": dict(num_clients=1000, partition={"kind": "iid", "samples_per_client": 50},
                         clients_per_round=50, local_epochs=1, batch_size=10),
}


def raw_config(setting: str, out_dir: str, rounds: int, engine: str = "reference", workers="auto",
               precision: str = "fp32", quick: bool = False, device: str = "cpu", **override) -> dict:
    s = {**SETTINGS[setting], **override}
    epochs = 1 if quick else s["local_epochs"]
    return {
        "name": f"{setting}-{engine}-{precision}", "seed": 0,
        "data": {"dataset": "fashion_mnist", "num_clients": s["num_clients"], "partition": s["partition"],
                 "local_test": {"source": "test_set", "fraction": 0.2}},
        "model": {"arch": "cnn2"},
        "algorithm": {"name": "fedavg"},
        "train": {"rounds": rounds, "clients_per_round": s["clients_per_round"], "local_epochs": epochs,
                  "batch_size": s["batch_size"], "lr": 0.01},
        "eval": {"every": 1},
        "run": {"out_dir": out_dir, "checkpoint_every": 10_000, "engine": engine, "workers": workers,
                "precision": precision, "progress": False, "device": device},
    }


def median(xs):
    return statistics.median(xs) if xs else None


# --- engine modes ----------------------------------------------------------------------------
def run_mode(setting: str, engine: str, precision: str, rounds: int, tmp: Path, quick: bool,
             device: str = "cpu", label: str = "", on_done=None, run: dict | None = None,
             algorithm: dict | None = None) -> dict:
    """``on_done(experiment)``, when given, sees the finished run (its final global model, say);
    ``run``: more ``run.*`` settings (``cuda_graphs``); ``algorithm``: the config's algorithm
    section instead of FedAvg's."""
    workers = min(usable_cpus(), SETTINGS[setting]["clients_per_round"]) if engine == "parallel" else "auto"
    raw = raw_config(setting, str(tmp), rounds + 1, engine, workers, precision, quick, device)
    raw["run"].update(run or {})
    if algorithm is not None:
        raw["algorithm"] = algorithm
    cfg = load_config(raw=raw)
    exp = Experiment.create(cfg, tmp / f"{setting}-{engine}-{precision}{label}")
    t0 = time.perf_counter()
    exp.run(progress=False)
    wall = time.perf_counter() - t0
    if on_done is not None:
        on_done(exp)
    rows = read_metrics(exp.run_dir)[1:]          # round 1 is the warm-up
    parts = {k: [r["seconds"][k] for r in rows] for k in ("train", "aggregate", "evaluate", "total")}
    parts["other"] = [r["seconds"]["total"] - r["seconds"]["train"] - r["seconds"]["aggregate"]
                      - r["seconds"]["evaluate"] for r in rows]
    rates = [r["samples"] / r["seconds"]["train"] for r in rows]
    non_train = [(r["seconds"]["total"] - r["seconds"]["train"]) / r["seconds"]["total"] for r in rows]
    return {"setting": setting, "engine": engine, "precision": precision, "info": exp.engine_info(),
            "rounds_measured": len(rows), "samples_per_round": median([r["samples"] for r in rows]),
            "samples_per_s": median(rates), "samples_per_s_all": rates,
            "seconds": {k: median(v) for k, v in parts.items()}, "non_train_share": median(non_train),
            "final_global_acc": rows[-1].get("global_acc") if rows else None, "wall_s": wall}


# --- ceiling ----------------------------------------------------------------------------------
def ceiling(setting: str, precision: str, tmp: Path, quick: bool) -> dict:
    """One large batch (clients_per_round x batch) over the samples of round 1's clients."""
    cfg = load_config(raw=raw_config(setting, str(tmp), 1, "reference", quick=quick))
    exp = Experiment(cfg, tmp / "ceiling")
    sim, fed = exp.loop, exp.federation
    clients = sim.sample_clients(0)
    idx = torch.cat([fed.train_idx[c] for c in clients])
    big = cfg.train.clients_per_round * cfg.train.batch_size
    target, repeats = (2000, 2) if quick else (8000, 3)     # samples per measurement, measurements
    if len(idx) > target:
        idx = idx[torch.randperm(len(idx), generator=torch_generator(0, "ceiling"))[:target]]
    data = ClientData(fed.pool.x, fed.pool.y, idx, fed.mean, fed.std)
    epochs = max(1, -(-target // len(idx)))
    settings = TrainSettings(epochs=epochs, batch_size=big, lr=0.01, precision=precision)
    model = next(iter(sim.host.models.values()))
    weights = sim.host.init_models[sim.host.client_arch[0]]
    gen = lambda e: torch_generator(0, "ceiling", e)  # noqa: E731
    warm = ClientData(fed.pool.x, fed.pool.y, idx[:4 * big], fed.mean, fed.std)
    train_local(model, weights, warm, [CrossEntropy()], TrainSettings(epochs=1, batch_size=big, lr=0.01,
                                                                      precision=precision), gen)
    rates = []
    for _ in range(repeats):
        t = time.perf_counter()
        res = train_local(model, weights, data, [CrossEntropy()], settings, gen)
        rates.append(res.samples / (time.perf_counter() - t))
    return {"setting": setting, "precision": precision, "batch": big, "samples": len(idx) * epochs,
            "threads": torch.get_num_threads(), "samples_per_s": median(rates), "samples_per_s_all": rates}


# --- memory -----------------------------------------------------------------------------------
def _pss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def memory_probe(clients: int, engine: str) -> dict:
    """Run in a fresh process: 2 rounds of the cross-device setting with ``clients`` clients.

    ``peak_rss_mb`` is this process's VmHWM (ru_maxrss would carry over the launching process's
    high-water mark through fork+exec). ``peak_total_pss_mb`` samples, every 20 ms, the
    proportional set size of this process plus its workers: forked workers share the data pool
    and torch with the parent, so adding their RSS would count those pages several times.
    """
    import threading

    peak = [0.0]
    done = threading.Event()

    def sample():
        me = os.getpid()
        while not done.is_set():
            peak[0] = max(peak[0], _pss_mb(me) + sum(_pss_mb(c) for c in _children(me)))
            done.wait(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    with tempfile.TemporaryDirectory() as tmp:
        raw = raw_config("cross_device", tmp, 2, engine, usable_cpus() if engine == "parallel" else "auto",
                         num_clients=clients)
        exp = Experiment.create(load_config(raw=raw), Path(tmp) / "mem")
        exp.run(progress=False)
    done.set()
    sampler.join()
    hwm = next(int(line.split()[1]) / 1024 for line in Path("/proc/self/status").read_text().splitlines()
               if line.startswith("VmHWM:"))
    return {"clients": clients, "engine": engine, "peak_rss_mb": round(hwm, 1),
            "peak_total_pss_mb": round(peak[0], 1)}


def memory(engine: str, threads: int | None) -> list[dict]:
    out = []
    for k in (50, 1000):
        extra = ["--threads", str(threads)] if threads else []
        r = subprocess.run([sys.executable, __file__, "--memory-probe", str(k), engine, *extra], capture_output=True,
                           text=True, cwd=ROOT)
        if r.returncode != 0:
            raise RuntimeError(f"memory probe ({k} clients, {engine}) failed:\n{r.stderr[-3000:]}")
        out.append(json.loads(r.stdout.strip().splitlines()[-1]))
    return out


# --- report -----------------------------------------------------------------------------------
def fmt(x, spec=".0f"):
    return "-" if x is None else format(x, spec)


def report(result: dict) -> str:
    lines = [f"# Engine speed{' (quick: E=1, not the acceptance figures)' if result['quick'] else ''}", "",
             "Command:", "", "```bash", result["command"], "```", "",
             f"Machine: {cpu_name(result['machine'])}, {result['machine']['usable_cpus']} usable CPUs, "
             f"bf16 native: {result['machine']['bf16_native']}, torch {result['machine']['torch']}, "
             f"commit {result['machine']['commit']}; load average before/after: "
             f"{result['load_before']} / {result['load_after']}; total {result['wall_s'] / 60:.1f} min.", ""]
    lines += ["## Ceiling (same model, same samples, one large batch, default threads)", "",
              "Best of the measurements before and after the setting's modes (median; lowest in brackets).", "",
              "| setting | batch | fp32 samples/s | bf16 samples/s |", "|---|---|---|---|"]
    for setting, c in result["ceiling"].items():
        lines.append(f"| {setting} | {c['fp32']['batch']} | {fmt(c['fp32']['samples_per_s'])} "
                     f"({fmt(c['fp32']['median'])}; {fmt(c['fp32']['min'])}) | {fmt(c['bf16']['samples_per_s'])} "
                     f"({fmt(c['bf16']['median'])}; {fmt(c['bf16']['min'])}) |")
    lines += ["", "## Engine modes (medians over the measured rounds; seconds per round)", "",
              "| setting | mode | workers | samples/s | x fp32 ceiling | x own-precision ceiling | "
              "train s | evaluate s | aggregate s | other s | not training |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for m in result["modes"]:
        c = result["ceiling"][m["setting"]]
        r32 = m["samples_per_s"] / c["fp32"]["samples_per_s"]
        rown = m["samples_per_s"] / c[m["precision"]]["samples_per_s"]
        s = m["seconds"]
        lines.append(f"| {m['setting']} | {m['engine']} {m['precision']} | {m['info']['workers']} | "
                     f"{fmt(m['samples_per_s'])} | {r32:.2f} | {rown:.2f} | {s['train']:.2f} | {s['evaluate']:.2f} | "
                     f"{s['aggregate']:.3f} | {s['other']:.3f} | {100 * m['non_train_share']:.1f}% |")
    lines += ["", "bf16 speed-up over fp32 (same engine): " + ", ".join(
        f"{k}: {v:.2f}x" for k, v in result["bf16_speedup"].items()), ""]
    lines += ["`auto` chooses: " + ", ".join(f"{k}: {v['engine']} ({v['workers']} workers)"
                                               for k, v in result["auto_choice"].items()), ""]
    lines += ["## Peak memory (fresh process, cross-device setting, 50 clients per round, 2 rounds)", "",
              "| engine | clients | peak RSS MB (main process) | peak PSS MB (main + workers) |", "|---|---|---|---|"]
    for m in result["memory"]:
        lines.append(f"| {m['engine']} | {m['clients']} | {m['peak_rss_mb']} | {m['peak_total_pss_mb']} |")
    lines += ["", "Ratio 1,000 / 50 clients (PSS): " + ", ".join(f"{k}: {v:.2f}"
                                                                for k, v in result["memory_ratio"].items()),
              "", "Samples/s = local sample-steps / time of the round's training phases (message transport "
              "included). The first round of every mode is a warm-up and is not counted.", ""]
    if result.get("step_profile"):
        import step_profile

        lines += ["## One local step, phase by phase (benchmarks/step_profile.py; cnn2, one thread)", "",
                  step_profile.report(result["step_profile"])]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="measured rounds per mode (after 1 warm-up round)")
    p.add_argument("--quick", action="store_true",
                   help="E=1, 1 measured round, alpha 0.5 and cross-device only: a smoke run")
    p.add_argument("--settings", nargs="*", choices=list(SETTINGS), help="only these settings")
    p.add_argument("--no-vectorized", action="store_true", help="skip the vectorized engine")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    p.add_argument("--no-profile", action="store_true", help="skip the per-phase profile of one local step")
    p.add_argument("--threads", type=int, help="torch threads of the main process (default: torch's choice); "
                                                "1 gives usable figures on a busy machine")
    p.add_argument("--memory-probe", nargs=2, metavar=("CLIENTS", "ENGINE"), help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=RESULTS, help="folder of the result files (default: benchmarks/results, the committed record)")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.memory_probe:
        print(json.dumps(memory_probe(int(a.memory_probe[0]), a.memory_probe[1])))
        return 0
    t_start = time.perf_counter()
    load_before = [round(x, 2) for x in os.getloadavg()]
    rounds = 1 if a.quick and a.rounds == 3 else a.rounds
    settings = a.settings or (["fedcme_a0.5", "cross_device"] if a.quick else list(SETTINGS))
    engines = [("reference", "fp32"), ("reference", "bf16"), ("parallel", "fp32"), ("parallel", "bf16")]
    if not a.no_vectorized:
        try:
            import fedhet.engine.vectorized  # noqa: F401
            engines.append(("vectorized", "fp32"))
        except ImportError:
            pass
    result = {"command": " ".join(["python", "benchmarks/engine_speed.py", *sys.argv[1:]]), "quick": a.quick,
              "rounds_measured": rounds, "ceiling": {}, "modes": [], "auto_choice": {}, "bf16_speedup": {},
              "memory": [], "memory_ratio": {}}
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        for setting in settings:
            before = {prec: ceiling(setting, prec, tmp, a.quick) for prec in ("fp32", "bf16")}
            print(f"{setting}: ceiling before the modes: fp32 {before['fp32']['samples_per_s']:.0f}, "
                  f"bf16 {before['bf16']['samples_per_s']:.0f} samples/s", flush=True)
            # Cross-device rounds take about a second: more of them for a stable median.
            n_rounds = rounds * 4 if setting == "cross_device" and not a.quick else rounds
            for engine, prec in engines:
                m = run_mode(setting, engine, prec, n_rounds, tmp, a.quick)
                result["modes"].append(m)
                s = m["seconds"]
                print(f"  {engine:10s} {prec}: {m['samples_per_s']:7.0f} samples/s  train {s['train']:.2f}s "
                      f"eval {s['evaluate']:.2f}s agg {s['aggregate']:.3f}s other {s['other']:.3f}s  "
                      f"not training {100 * m['non_train_share']:.1f}%", flush=True)
            # The ceiling again after the modes. Its figure is the best of all its measurements:
            # other load only ever slows a measurement down (two-thread runs by a lot), so the
            # best one is the machine's capability, and the ratios against it are conservative.
            after = {prec: ceiling(setting, prec, tmp, a.quick) for prec in ("fp32", "bf16")}
            result["ceiling"][setting] = {}
            for prec in ("fp32", "bf16"):
                allr = before[prec]["samples_per_s_all"] + after[prec]["samples_per_s_all"]
                result["ceiling"][setting][prec] = {**before[prec], "samples_per_s": max(allr),
                                                    "samples_per_s_all": allr, "min": min(allr),
                                                    "median": median(allr)}
            c = result["ceiling"][setting]
            print(f"{setting}: ceiling (best before+after): fp32 {c['fp32']['samples_per_s']:.0f}, "
                  f"bf16 {c['bf16']['samples_per_s']:.0f} samples/s", flush=True)
            by = {(m["engine"], m["precision"]): m["samples_per_s"] for m in result["modes"] if m["setting"] == setting}
            for engine in ("reference", "parallel"):
                result["bf16_speedup"][f"{setting} {engine}"] = by[(engine, "bf16")] / by[(engine, "fp32")]
            cfg = load_config(raw=raw_config(setting, str(tmp), 1, quick=a.quick))
            exp = Experiment(cfg, tmp / "auto")
            est = round_sample_estimate(exp.federation, exp.loop.host.settings, cfg.train.clients_per_round)
            result["auto_choice"][setting] = choose_engine(clients_per_round=cfg.train.clients_per_round,
                                                           round_samples=est).as_dict()
    if not a.no_memory:
        for engine in ("reference", "parallel"):
            mem = memory(engine, a.threads)
            result["memory"] += mem
            result["memory_ratio"][engine] = mem[1]["peak_total_pss_mb"] / mem[0]["peak_total_pss_mb"]
            print(f"memory {engine}: " + ", ".join(f"{m['clients']} clients {m['peak_total_pss_mb']} MB"
                                                  for m in mem), flush=True)
    if not a.no_profile:
        # Where a step's time goes, at each setting's batch size on one thread (benchmarks/step_profile.py).
        import step_profile

        batches = sorted({SETTINGS[s]["batch_size"] for s in settings}, reverse=True)
        result["step_profile"] = [step_profile.profile(b, 1, steps=20 if a.quick else 60) for b in batches]
        print(step_profile.report(result["step_profile"]), flush=True)
    info = machine_info()
    info.update(cpu_model=cpu_model(), usable_cpus=usable_cpus(), bf16_native=bf16_native("cpu"))
    result.update(machine=info, load_before=load_before, load_after=[round(x, 2) for x in os.getloadavg()],
                  wall_s=time.perf_counter() - t_start)
    text = report(result)
    print("\n" + text)
    stem = "engine_speed_quick" if a.quick else "engine_speed"
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / f"{stem}.md").write_text(text)
    (a.out / f"{stem}.json").write_text(json.dumps(result, indent=2, default=str))
    print(f"wrote {a.out / stem}.md and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
