"""Ratio tables of one sitting of ``benchmarks/engine_speed_vs.sh``: head against each base commit.

    .venv/bin/python benchmarks/engine_speed_vs.py FOLDER --head REV --base REV [REV ...]

Reads ``{base,head}_<rev>_<setting>_<i>.json``; per base, setting and mode it reports both sides'
samples/s (median over the repeats of that side), head/base, and each side's fp32 ceiling measured in
the same runs. Writes ``engine_speed_vs.md`` and ``.json`` into FOLDER.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from fedhet.experiment.summary import cpu_name


def load(folder: Path, side: str, rev: str) -> dict[str, list[dict]]:
    runs: dict[str, list[dict]] = {}
    for path in sorted(folder.glob(f"{side}_{rev}_*.json")):
        result = json.loads(path.read_text())
        for setting in result["ceiling"]:
            runs.setdefault(setting, []).append(result)
    return runs


def mode_speed(results: list[dict], setting: str, mode: str) -> float | None:
    speeds = [m["samples_per_s"] for r in results for m in r["modes"]
              if m["setting"] == setting and f"{m['engine']} {m['precision']}" == mode]
    return statistics.median(speeds) if speeds else None


def ceiling(results: list[dict], setting: str) -> float | None:
    """The median fp32 ceiling of ``results``; None for a sitting without fp32 (PRECISIONS=bf16)."""
    speeds = [r["ceiling"][setting]["fp32"]["samples_per_s"] for r in results if "fp32" in r["ceiling"][setting]]
    return statistics.median(speeds) if speeds else None


def compare(base: dict[str, list[dict]], head: dict[str, list[dict]]) -> list[dict]:
    rows = []
    for setting in head:
        if setting not in base:
            continue
        modes = sorted({f"{m['engine']} {m['precision']}" for r in head[setting] for m in r["modes"]
                        if m["setting"] == setting})
        c_base, c_head = ceiling(base[setting], setting), ceiling(head[setting], setting)
        for mode in modes:
            b, h = mode_speed(base[setting], setting, mode), mode_speed(head[setting], setting, mode)
            rows.append({"setting": setting, "mode": mode, "repeats": len(head[setting]),
                         "base_samples_per_s": b, "head_samples_per_s": h,
                         "ratio": None if not b or h is None else h / b,
                         "base_x_fp32_ceiling": None if b is None or c_base is None else b / c_base,
                         "head_x_fp32_ceiling": None if h is None or c_head is None else h / c_head,
                         "base_fp32_ceiling": c_base, "head_fp32_ceiling": c_head})
    return rows


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("folder", type=Path)
    p.add_argument("--head", required=True)
    p.add_argument("--base", required=True, nargs="+")
    p.add_argument("--command", default=None, help="the command that made the sitting, for the report")
    a = p.parse_args()
    head = load(a.folder, "head", a.head)
    if not head:
        raise SystemExit(f"no head_{a.head}_*.json in {a.folder}")
    any_run = next(iter(head.values()))[0]
    repeats = max(len(v) for v in head.values())
    command = a.command or f"bash benchmarks/engine_speed_vs.sh {' '.join(a.base)}"
    lines = ["# Engine speed: head vs base commits, one sitting", "",
             "Command:", "", "```bash", command, "```", "",
             f"Head {a.head}; bases {', '.join(a.base)}. Machine: {cpu_name(any_run['machine'])}, "
             f"{any_run['machine']['usable_cpus']} usable CPUs, torch {any_run['machine']['torch']}. "
             f"Each side ran {repeats} time(s) per setting, the order of the sides rotating from one setting "
             "to the next; samples/s are medians over those runs, and each side's ceiling is the fp32 "
             "ceiling of its own runs (train_local, one large batch; \"-\" where the sitting measured no "
             "fp32).", ""]
    out: dict[str, list[dict]] = {}
    for rev in a.base:
        rows = compare(load(a.folder, "base", rev), head)
        out[rev] = rows
        lines += [f"## Head {a.head} vs base {rev}", "",
                  "| setting | mode | base samples/s | head samples/s | head/base | base x fp32 ceiling | "
                  "head x fp32 ceiling |", "|---|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['setting']} | {r['mode']} | {fmt(r['base_samples_per_s'], '.0f')} | "
                         f"{fmt(r['head_samples_per_s'], '.0f')} | {fmt(r['ratio'], '.2f')} | "
                         f"{fmt(r['base_x_fp32_ceiling'], '.2f')} | {fmt(r['head_x_fp32_ceiling'], '.2f')} |")
        lines.append("")
    rows = next(iter(out.values()), [])
    best = max((r for r in rows if r["setting"] == "cross_device" and r["mode"].endswith("fp32")
                and r["head_x_fp32_ceiling"] is not None), key=lambda r: r["head_x_fp32_ceiling"], default=None)
    if best:
        lines += [f"Cross-device best fp32 mode at head: {best['mode']}, "
                  f"{best['head_x_fp32_ceiling']:.2f}x the fp32 ceiling of the same runs."]
    (a.folder / "engine_speed_vs.md").write_text("\n".join(lines) + "\n")
    (a.folder / "engine_speed_vs.json").write_text(json.dumps({"head": a.head, "bases": out}, indent=2))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
