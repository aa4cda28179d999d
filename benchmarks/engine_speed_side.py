"""One side of ``engine_speed_vs.sh``: a commit's own ``engine_speed.py`` measured in chosen precisions.

    PYTHONPATH=TREE/src .venv/bin/python benchmarks/engine_speed_side.py TREE/benchmarks/engine_speed.py \
        SETTING OUT.json [--precisions fp32] [--rounds 2]

It loads the given engine_speed.py (the base commit's or the head's) and calls its own ``ceiling`` and
``run_mode`` - their signatures are the same on both sides - so each side is measured by its own code,
in the same order: ceiling, every engine mode, ceiling again (the best ceiling figure counts, as in
engine_speed.py). Only the precisions asked for run: on a CPU without native bf16, bf16 is emulated at
a tenth of fp32's speed and measuring it would take hours and say nothing about the engines.
The JSON has engine_speed.py's shape (``ceiling``, ``modes``, ``machine``) for engine_speed_vs.py.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("script", type=Path, help="the engine_speed.py of the side to measure")
    p.add_argument("setting")
    p.add_argument("out", type=Path)
    p.add_argument("--precisions", nargs="+", default=["fp32"], choices=["fp32", "bf16"])
    p.add_argument("--rounds", type=int, default=2, help="measured rounds per mode (after 1 warm-up round)")
    a = p.parse_args()
    spec = importlib.util.spec_from_file_location("side_engine_speed", a.script)
    assert spec and spec.loader
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    engines = ["reference", "parallel"]
    try:
        import fedhet.engine.vectorized  # noqa: F401
        engines.append("vectorized")
    except ImportError:
        pass
    n_rounds = a.rounds * 4 if a.setting == "cross_device" else a.rounds
    result: dict = {"command": " ".join(["python", "benchmarks/engine_speed_side.py", *sys.argv[1:]]),
                    "ceiling": {a.setting: {}}, "modes": []}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        before = {prec: bench.ceiling(a.setting, prec, tmp, False) for prec in a.precisions}
        for engine in engines:
            for prec in a.precisions:
                if engine == "vectorized" and prec != "fp32":
                    continue
                m = bench.run_mode(a.setting, engine, prec, n_rounds, tmp, False)
                result["modes"].append(m)
                print(f"  {a.setting} {engine:10s} {prec}: {m['samples_per_s']:7.0f} samples/s", flush=True)
        after = {prec: bench.ceiling(a.setting, prec, tmp, False) for prec in a.precisions}
    for prec in a.precisions:
        rates = before[prec]["samples_per_s_all"] + after[prec]["samples_per_s_all"]
        result["ceiling"][a.setting][prec] = {**before[prec], "samples_per_s": max(rates),
                                              "samples_per_s_all": rates}
        print(f"  {a.setting} ceiling {prec}: {max(rates):.0f} samples/s", flush=True)
    machine = bench.machine_info()
    machine.update(cpu_model=bench.cpu_model(), usable_cpus=bench.usable_cpus())
    result.update(machine=machine, wall_s=time.perf_counter() - t0)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
