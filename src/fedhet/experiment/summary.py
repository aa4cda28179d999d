"""What summary.json says about a run: best and final values with their rules, speed, memory,
machine and commit."""

from __future__ import annotations

import functools
import os
import platform
import resource
import statistics
import subprocess
from pathlib import Path

from fedhet import __version__

SUMMARIZED_METRICS = ("global_acc", "global_labeldist_acc", "global_val_acc", "personal_acc", "personal_acc_pooled")


@functools.cache
def git_commit(source: Path | None = None) -> str | None:
    """The short commit of the checkout fedhet runs from, with ``-dirty`` when the package's source
    (or the folder ``source``) differs from it, new files included: the code that ran is not that
    commit's. None where the package is not tracked by git (an installed copy, no git). Read once
    per process, so a run's records all name the code it started with."""
    package = source or Path(__file__).resolve().parents[1]

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "--no-optional-locks", *args], cwd=package, capture_output=True, text=True,
                              timeout=5)
    try:
        commit = git("rev-parse", "--short", "HEAD").stdout.strip()
        if not commit or not git("ls-files", "--", ".").stdout.strip():
            return None
        changed = git("status", "--porcelain", "--", ".").stdout.strip()
        return f"{commit}-dirty" if changed else commit
    except (OSError, subprocess.SubprocessError):
        return None


def cpu_fields(cpuinfo: str | None = None) -> dict[str, str]:
    """The first processor's block of ``cpuinfo`` (default /proc/cpuinfo) as key -> value; empty
    where there is nothing to read."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return {}
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            if fields:                                   # the first processor's block is enough
                break
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_model(fields: dict[str, str] | None = None) -> str:
    """The CPU's model name ("AMD EPYC ..."), where platform.processor() says only "x86_64"."""
    name = (cpu_fields() if fields is None else fields).get("model name")
    return name or platform.processor() or platform.machine()


def cpu_isa(fields: dict[str, str] | None = None) -> str:
    """What a CPU's model name leaves out ("AMD EPYC" covers generations that train at quite
    different speeds here): the widest vector instructions (AVX512 or AVX2), the bf16 and AMX
    units, and the family and model numbers, from :func:`cpu_fields` (default this machine's),
    e.g. "AVX512, bf16; family 26 model 2"; "" where there is nothing to read."""
    fields = cpu_fields() if fields is None else fields
    flags = set(fields.get("flags", "").split())
    units = ["AVX512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"] if flags else []
    units += [name for flag, name in (("avx512_bf16", "bf16"), ("amx_tile", "amx")) if flag in flags]
    family = (f"family {fields['cpu family']} model {fields['model']}"
              if "cpu family" in fields and "model" in fields else "")
    return "; ".join(part for part in (", ".join(units), family) if part)


def cpu_name(machine: dict) -> str:
    """A recorded machine's CPU for a report: its model name and, where recorded, :func:`cpu_isa`'s
    line, e.g. "AMD EPYC (AVX512, bf16; family 26 model 2)"."""
    name = str(machine.get("cpu_model") or machine.get("processor"))
    return f"{name} ({machine['cpu_isa']})" if machine.get("cpu_isa") else name


def cpu_identity() -> dict:
    """This machine's CPU as a run's ``machine`` records it: model name, :func:`cpu_isa` and count."""
    fields = cpu_fields()                                # /proc/cpuinfo read once
    return {"cpu_model": cpu_model(fields), "cpu_isa": cpu_isa(fields), "cpus": os.cpu_count()}


def machine_info() -> dict:
    import torch  # here, not at the top: reading runs (sweep tables, compare) needs no torch

    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            **cpu_identity(), "python": platform.python_version(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "fedhet": __version__,
            "commit": git_commit()}


def peak_memory_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def summarize_metrics(rows: list[dict], metric: str, window: int) -> dict:
    """Best (max over evaluated rounds) and final (mean of the last ``window`` evaluations) of ``metric``."""
    values = [(r["round"], r[metric]) for r in rows if r.get(metric) is not None]
    if not values:
        return {}
    best_round, best = max(values, key=lambda rv: (rv[1], -rv[0]))
    tail = [v for _, v in values[-window:]]
    return {"best": best, "best_round": best_round, "best_rule": f"max of {metric} over evaluated rounds",
            "final": sum(tail) / len(tail), "final_rule": f"mean of {metric} over the last {len(tail)} evaluations",
            "last": values[-1][1]}


def model_selection(rows: list[dict], selected_by: str = "global_val_acc", report: str = "global_acc") -> dict:
    """``report`` at the evaluated round with the best ``selected_by`` (the first such round on ties):
    the FedFM paper's rule, validation on the union of the clients' held-out splits and the test
    accuracy of that round's model (Ye et al., Sec. VII-A). Empty when either metric is missing."""
    values = [(r["round"], r[selected_by], r[report]) for r in rows
              if r.get(selected_by) is not None and r.get(report) is not None]
    if not values:
        return {}
    rnd, val, test = max(values, key=lambda v: (v[1], -v[0]))
    return {"value": test, "round": rnd, "validation": val, "metric": report,
            "rule": f"{report} at the first evaluated round with the highest {selected_by}"}


def selected_value(summary: dict, metric: str) -> float | None:
    """``metric`` at the best-validation round (``model_selection``) of a run's summary, or None
    when the run recorded no validation metric or selected another metric."""
    chosen = summary.get("model_selection") or {}
    if not chosen:
        return None
    reported = chosen.get("metric") or chosen["rule"].split(" at ", 1)[0]     # summaries before "metric"
    return chosen["value"] if reported == metric else None


def speed(rows: list[dict]) -> dict:
    secs = [r["seconds"]["total"] for r in rows]
    train_secs = [r["seconds"]["train"] for r in rows]
    samples = sum(r["samples"] for r in rows)
    return {"seconds_per_round_median": statistics.median(secs) if secs else None,
            "train_seconds_per_round_median": statistics.median(train_secs) if train_secs else None,
            "client_samples_per_second": samples / sum(train_secs) if train_secs and sum(train_secs) > 0 else None}
