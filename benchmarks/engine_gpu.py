"""The vectorized engine on a CUDA GPU: speed against the CPU engines of the same machine and the
GPU's own large-batch ceiling, and agreement with the CPU reference on real data.

    python benchmarks/engine_gpu.py                  # on a machine with a CUDA GPU
    python benchmarks/engine_gpu.py --device cpu --rounds 1 --settings fedcme_a0.5 --quick   # smoke run here

Writes results/engine_gpu.{md,json} (``--out`` elsewhere). Settings are engine_speed.py's (FedAvg,
cnn2, Fashion-MNIST, lr 0.01, evaluation every round): ``fedcme_a0.5`` / ``fedcme_a0.1`` (50
clients, 10 per round, E=6, B=32) and ``cross_device`` (1,000 clients of 50 samples, 50 per round,
B=10, E=1).

Modes, each ``1 + --rounds`` rounds from the same seed through the real runner (the first round is
a warm-up and is not timed):

* ``reference fp32`` and ``parallel fp32`` on the machine's CPU: the baselines a user without the
  vectorized engine has on that machine;
* ``vectorized`` on the device in ``fp32`` (the engine keeps TF32 off: ``strict_fp32``) and in
  ``bf16`` autocast (``run.precision: bf16``).

Agreement: every mode's final global model against the reference's after the same rounds: the
relative L2 distance of the float tensors, and the global test accuracy of each.

Method families (``--families``, on by default; at the first setting): one method of each family
(a proximal term, control variates, a contrastive term on the previous model, prototypes, a body and
head trained apart, label skew with mixup, and three seed methods) in ``vectorized fp32`` on the
device, against the same ceiling and FedAvg's vectorized fp32, with its fallbacks and the share of
its steps that replayed a graph. FedFM's warm-up ends after the unmeasured first round, so the
measured rounds match features against anchors.

Ceiling: the same cnn2 on the device, plain ``torch.optim.SGD`` over round 1's clients' samples in
batches of clients_per_round x B (the FLOPs of a round without per-client work), in fp32 (TF32
off), tf32 (what TF32 would be worth; the engine does not use it) and bf16; median of 3 passes
(best in brackets).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import engine_speed  # noqa: E402
from engine_speed import SETTINGS, raw_config, run_mode  # noqa: E402

from fedhet.core.contract import normalize_uint8  # noqa: E402
from fedhet.core.cpus import usable_cpus  # noqa: E402
from fedhet.core.seeding import torch_generator  # noqa: E402
from fedhet.experiment.config import load_config  # noqa: E402
from fedhet.experiment.runner import Experiment  # noqa: E402
from fedhet.experiment.summary import cpu_model, cpu_name, machine_info  # noqa: E402
from fedhet.training.precision import tf32_allowed  # noqa: E402

RESULTS = engine_speed.RESULTS

# (label, engine, run.precision, runs on the device, more run settings)
MODES = [
    ("reference fp32 (CPU)", "reference", "fp32", False, {}),
    ("parallel fp32 (CPU)", "parallel", "fp32", False, {}),
    ("reference fp32 (device)", "reference", "fp32", True, {}),
    ("vectorized fp32 eager", "vectorized", "fp32", True, {"cuda_graphs": False}),
    ("vectorized fp32", "vectorized", "fp32", True, {}),
    ("vectorized bf16", "vectorized", "bf16", True, {}),
]


# (family, the config's algorithm section): one method of each family for --families
FAMILIES = [
    ("proximal term", {"name": "fedprox", "params": {"mu": 0.01}}),
    ("control variates, client state", {"name": "scaffold"}),
    ("contrastive, previous model", {"name": "moon"}),
    ("prototypes", {"name": "fedproto"}),
    ("body and head apart", {"name": "fedrep"}),
    ("label skew with mixup", {"name": "fedacd"}),
    ("seed: FedCME", {"name": "fedcme", "params": {"mu": 0.01}}),
    ("seed: FedFM", {"name": "fedfm", "params": {"lam": 5.0, "start_round": 1}}),
    ("seed: FedReMa", {"name": "fedrema"}),
]


def relative_distance(a: dict, b: dict) -> float:
    keys = [k for k, v in b.items() if v.is_floating_point()]
    diff = torch.cat([(a[k].float().cpu() - b[k].float().cpu()).flatten() for k in keys]).norm()
    return float(diff / torch.cat([b[k].float().cpu().flatten() for k in keys]).norm())


def device_ceiling(setting: str, device: str, tmp: Path, quick: bool, repeats: int = 3) -> dict:
    """Samples/s of plain large-batch SGD on the device, per precision (see the module doc)."""
    cfg = load_config(raw=raw_config(setting, str(tmp), 1, "reference", quick=quick))
    exp = Experiment(cfg, tmp / "ceiling")
    fed = exp.federation
    idx = torch.cat([fed.train_idx[c] for c in exp.loop.sample_clients(0)])
    big = cfg.train.clients_per_round * cfg.train.batch_size
    x = normalize_uint8(fed.pool.x[idx], fed.mean, fed.std).to(device)
    y = fed.pool.y[idx].to(device)
    base = copy.deepcopy(next(iter(exp.loop.host.models.values()))).to(device)
    target = 2000 if quick else 20_000          # sample-steps per measurement
    out = {}
    for name, tf32_on, bf16 in (("fp32", False, False), ("tf32", True, False), ("bf16", False, True)):
        rates = []
        for r in range(repeats + 1):             # the first pass warms cuDNN's algorithm choice up
            model = copy.deepcopy(base)
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            order = torch.randperm(len(idx), generator=torch_generator(0, "ceiling", r)).to(device)
            t = time.perf_counter()
            with tf32_allowed(tf32_on):
                done = sgd_passes(model, opt, x, y, order, big, target, bf16, device)
            if torch.device(device).type == "cuda":
                torch.cuda.synchronize()
            if r:
                rates.append(done / (time.perf_counter() - t))
        out[name] = {"batch": big, "samples_per_s": statistics.median(rates), "best": max(rates),
                     "samples_per_s_all": rates}
    return out


def sgd_passes(model, opt, x, y, order, batch: int, target: int, bf16: bool, device: str) -> int:
    """Plain SGD steps over ``order`` in batches of ``batch`` until ``target`` samples; returns them."""
    done = 0
    while done < target:
        for s in range(0, len(order), batch):
            b = order[s:s + batch]
            with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=bf16):
                logits = model(x[b])
            loss = torch.nn.functional.cross_entropy(logits.float(), y[b])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            done += len(b)
            if done >= target:
                break
    return done


def report(result: dict) -> str:
    m = result["machine"]
    lines = ["# The vectorized engine on a GPU", "", "Command:", "", "```bash", result["command"], "```", "",
             f"Machine: {m.get('gpu', 'no GPU')}; CPU {cpu_name(m)}, {m['usable_cpus']} usable CPUs; torch "
             f"{m['torch']}; commit {m['commit']}; total {result['wall_s'] / 60:.1f} min.", "",
             "## Ceiling on the device (plain SGD, one batch of clients_per_round x B)", "",
             "Median of 3 passes (best in brackets).", "",
             "| setting | batch | fp32 samples/s | tf32 samples/s | bf16 samples/s |", "|---|---|---|---|---|"]
    for setting, c in result["ceiling"].items():
        lines.append(f"| {setting} | {c['fp32']['batch']} | " + " | ".join(
            f"{c[p]['samples_per_s']:.0f} ({c[p]['best']:.0f})" for p in ("fp32", "tf32", "bf16")) + " |")
    lines += ["", "## Modes (medians over the measured rounds)", "",
              "| setting | mode | samples/s | x reference | x device fp32 ceiling | train s | evaluate s | "
              "evaluate share | final global acc | rel. L2 to reference |", "|---|---|---|---|---|---|---|---|---|---|"]
    for row in result["modes"]:
        ref = next((r for r in result["modes"] if r["setting"] == row["setting"] and r["engine"] == "reference"), row)
        ceil = result["ceiling"].get(row["setting"], {}).get("fp32", {}).get("samples_per_s")
        acc = row["final_global_acc"]
        lines.append(f"| {row['setting']} | {row['label']} | {row['samples_per_s']:.0f} | "
                     f"{row['samples_per_s'] / ref['samples_per_s']:.2f} | "
                     f"{'-' if not ceil else format(row['samples_per_s'] / ceil, '.2f')} | "
                     f"{row['seconds']['train']:.2f} | {row['seconds']['evaluate']:.2f} | "
                     f"{row['seconds']['evaluate'] / row['seconds']['total']:.0%} | "
                     f"{'-' if acc is None else format(100 * acc, '.2f')} | "
                     f"{'-' if row['distance_to_reference'] is None else format(row['distance_to_reference'], '.2e')} |")
    if result.get("families"):
        lines += ["", "## Method families (vectorized fp32 on the device)", "",
                  "| setting | family | algorithm | samples/s | x FedAvg vectorized fp32 | x device fp32 ceiling | "
                  "graph steps | fallback requests | eager reasons | train s | evaluate share |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for row in result["families"]:
            fedavg = next((r for r in result["modes"] if r["setting"] == row["setting"]
                           and r["label"] == "vectorized fp32"), None)
            ceil = result["ceiling"].get(row["setting"], {}).get("fp32", {}).get("samples_per_s")
            info = row["info"]
            steps = info.get("vmapped_steps") or 0
            lines.append(f"| {row['setting']} | {row['family']} | {row['algorithm']} | {row['samples_per_s']:.0f} | "
                         f"{'-' if fedavg is None else format(row['samples_per_s'] / fedavg['samples_per_s'], '.2f')} | "
                         f"{'-' if not ceil else format(row['samples_per_s'] / ceil, '.2f')} | "
                         f"{'-' if not steps else format(info.get('graph_steps', 0) / steps, '.0%')} | "
                         f"{info.get('fallback_requests')} {info.get('fallback_reasons') or ''} | "
                         f"{info.get('eager_reasons') or '-'} | {row['seconds']['train']:.2f} | "
                         f"{row['seconds']['evaluate'] / row['seconds']['total']:.0%} |")
    lines += ["", "Samples/s = local sample-steps / time of the round's training phases. The CPU modes run on "
              "the same machine's CPU (parallel: one worker per CPU, at most one per client of a round). "
              "Evaluation runs on the mode's device (the CPU modes' on the CPU); its share is of the round's "
              "total. 'eager': the vectorized engine without CUDA graphs (run.cuda_graphs: false).", ""]
    return "\n".join(lines)


def write(result: dict, out: Path) -> None:
    text = report(result)
    out.mkdir(parents=True, exist_ok=True)
    (out / "engine_gpu.md").write_text(text)
    (out / "engine_gpu.json").write_text(json.dumps(result, indent=2, default=str))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--rounds", type=int, default=2, help="measured rounds per mode (after 1 warm-up round)")
    p.add_argument("--settings", nargs="*", choices=list(SETTINGS), default=["fedcme_a0.5", "cross_device"])
    p.add_argument("--quick", action="store_true", help="E=1 and a small ceiling: a smoke run")
    p.add_argument("--families", action=argparse.BooleanOptionalAction, default=True,
                   help="one method of each family, vectorized fp32 on the device, at the first setting")
    p.add_argument("--out", type=Path, default=RESULTS, help="folder for engine_gpu.{md,json}")
    a = p.parse_args()
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("no CUDA device here: run it on a GPU machine, or pass --device cpu for a smoke run")
    t_start = time.perf_counter()
    info = machine_info()
    info.update(cpu_model=cpu_model(), usable_cpus=usable_cpus(), threads=torch.get_num_threads())
    if torch.cuda.is_available():
        info.update(gpu=torch.cuda.get_device_name(0), cuda=torch.version.cuda,
                    cudnn=torch.backends.cudnn.version())
    result = {"command": " ".join(["python", "benchmarks/engine_gpu.py", *sys.argv[1:]]), "ceiling": {}, "modes": [],
              "families": [], "machine": info}
    models: dict[str, dict[str, dict]] = {setting: {} for setting in a.settings}
    # The parallel engine's modes first, for all settings: it forks, and torch cannot fork workers
    # that run autograd from a process whose autograd has started (on a CUDA machine its first
    # backward starts the device threads, whatever the device). Then the reference, then the device.
    order = [(phase, setting) for phase in ("parallel", "reference", "device") for setting in a.settings]
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        for phase, setting in order:
            if phase == "device":
                result["ceiling"][setting] = c = device_ceiling(setting, a.device, tmp, a.quick)
                print(f"{setting}: device ceiling fp32 {c['fp32']['samples_per_s']:.0f}, tf32 "
                      f"{c['tf32']['samples_per_s']:.0f}, bf16 {c['bf16']['samples_per_s']:.0f} samples/s",
                      flush=True)
            n_rounds = a.rounds * 4 if setting == "cross_device" and not a.quick else a.rounds
            for label, engine, precision, on_device, run_settings in MODES:
                if (phase == "device") != on_device or (not on_device and engine != phase):
                    continue
                keep = lambda exp, label=label, kept=models[setting]: kept.__setitem__(  # noqa: E731
                    label, exp.algorithm.global_model(exp.loop.server_state))
                row = run_mode(setting, engine, precision, n_rounds, tmp, a.quick,
                               device=a.device if on_device else "cpu", label=label.replace(" ", "_"), on_done=keep,
                               run=run_settings)
                row.update(label=label, distance_to_reference=None)
                result["modes"].append(row)
                reference = models[setting].get(MODES[0][0])
                for done in result["modes"]:
                    if reference is not None and done["setting"] == setting:
                        done["distance_to_reference"] = relative_distance(models[setting][done["label"]], reference)
                print(f"  {setting} {label:22s} {row['samples_per_s']:8.0f} samples/s  train "
                      f"{row['seconds']['train']:.2f}s eval {row['seconds']['evaluate']:.2f}s  acc "
                      f"{row['final_global_acc']}  rel. L2 to reference {row['distance_to_reference']}  "
                      f"{ {k: row['info'].get(k) for k in ('device', 'vectorized_requests', 'fallback_requests', 'graph_steps', 'eager_reasons')} }",
                      flush=True)
                # Written after every mode: a run stopped at a time limit keeps what it measured.
                result.update(wall_s=time.perf_counter() - t_start, load=[round(x, 2) for x in os.getloadavg()])
                write(result, a.out)
            if phase == "device" and a.families and setting == a.settings[0]:
                for family, algorithm in FAMILIES:
                    if a.quick and algorithm["name"] == "fedcme":   # a smoke run's one epoch has no first phase
                        algorithm = {**algorithm, "params": {**algorithm["params"], "exchange": "none"}}
                    row = run_mode(setting, "vectorized", "fp32", a.rounds, tmp, a.quick, device=a.device,
                                   label="_" + algorithm["name"], algorithm=algorithm)
                    row.update(family=family, algorithm=algorithm["name"])
                    result["families"].append(row)
                    print(f"  {setting} {family:32s} {algorithm['name']:9s} {row['samples_per_s']:8.0f} samples/s  "
                          f"{ {k: row['info'].get(k) for k in ('fallback_requests', 'graph_steps', 'vmapped_steps', 'eager_reasons')} }",
                          flush=True)
                    result.update(wall_s=time.perf_counter() - t_start, load=[round(x, 2) for x in os.getloadavg()])
                    write(result, a.out)
    print("\n" + report(result) + f"\nwrote {a.out / 'engine_gpu.md'} and .json", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
