"""Ratio table of two commits' engine_speed.py runs (written by ``benchmarks/engine_speed_vs.sh``).

    .venv/bin/python benchmarks/engine_speed_vs.py benchmarks/results/engine_speed_vs --base REV --head REV

Reads ``{base,head}_<rev>_<setting>_<i>.json``; per setting and mode it reports both sides' samples/s
(median over the runs of that side), head/base, and each side's fp32 ceiling measured in the same
run. Writes ``engine_speed_vs.md`` and ``.json`` into the same folder.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


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


def ceiling(results: list[dict], setting: str) -> float:
    return statistics.median(r["ceiling"][setting]["fp32"]["samples_per_s"] for r in results)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("folder", type=Path)
    p.add_argument("--base", required=True)
    p.add_argument("--head", required=True)
    a = p.parse_args()
    base, head = load(a.folder, "base", a.base), load(a.folder, "head", a.head)
    rows = []
    for setting in head:
        if setting not in base:
            continue
        modes = sorted({f"{m['engine']} {m['precision']}" for r in head[setting] for m in r["modes"]
                        if m["setting"] == setting})
        c_base, c_head = ceiling(base[setting], setting), ceiling(head[setting], setting)
        for mode in modes:
            b, h = mode_speed(base[setting], setting, mode), mode_speed(head[setting], setting, mode)
            rows.append({"setting": setting, "mode": mode, "base_samples_per_s": b, "head_samples_per_s": h,
                         "ratio": None if not b or h is None else h / b,
                         "base_x_fp32_ceiling": None if b is None else b / c_base,
                         "head_x_fp32_ceiling": None if h is None else h / c_head,
                         "base_fp32_ceiling": c_base, "head_fp32_ceiling": c_head})
    any_run = next(iter(head.values()))[0]
    lines = ["# Engine speed: head vs base, one sitting", "",
             "Command:", "", "```bash", f"bash benchmarks/engine_speed_vs.sh {a.base}", "```", "",
             f"Base {a.base}, head {a.head}. Machine: {any_run['machine']['cpu_model']}, "
             f"{any_run['machine']['usable_cpus']} usable CPUs, torch {any_run['machine']['torch']}. "
             "Each setting ran once per side, alternating which side went first; ceilings are each run's own "
             "fp32 ceiling (train_local, one large batch).", "",
             "| setting | mode | base samples/s | head samples/s | head/base | base x fp32 ceiling | "
             "head x fp32 ceiling |", "|---|---|---|---|---|---|---|"]

    def f(x, spec):
        return "-" if x is None else format(x, spec)

    for r in rows:
        lines.append(f"| {r['setting']} | {r['mode']} | {f(r['base_samples_per_s'], '.0f')} | "
                     f"{f(r['head_samples_per_s'], '.0f')} | {f(r['ratio'], '.2f')} | "
                     f"{f(r['base_x_fp32_ceiling'], '.2f')} | {f(r['head_x_fp32_ceiling'], '.2f')} |")
    best = max((r for r in rows if r["setting"] == "cross_device" and r["mode"].endswith("fp32")
                and r["head_x_fp32_ceiling"] is not None), key=lambda r: r["head_x_fp32_ceiling"], default=None)
    if best:
        lines += ["", f"Cross-device best fp32 mode at head: {best['mode']}, "
                      f"{best['head_x_fp32_ceiling']:.2f}x the fp32 ceiling of the same run."]
    (a.folder / "engine_speed_vs.md").write_text("\n".join(lines) + "\n")
    (a.folder / "engine_speed_vs.json").write_text(json.dumps(rows, indent=2))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
