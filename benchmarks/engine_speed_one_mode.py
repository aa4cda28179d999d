"""One engine mode of one setting, measured by a given side's own engine_speed.py: a narrow follow-up
to a benchmarks/engine_speed_vs.sh sitting, where one ratio sits at the edge of the noise.

    PYTHONPATH=$TREE/src python benchmarks/engine_speed_one_mode.py $TREE/benchmarks/engine_speed.py LABEL \
        [--setting cross_device] [--engine parallel] [--precision fp32] [--rounds 2]

Prints one JSON line: the label, the median training samples/s of the measured rounds (after one
warm-up round) and each round's figure. ``$TREE`` is a worktree of the commit to measure (git
worktree add --detach), so each side runs its own sources.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("script", type=Path, help="the engine_speed.py of the side to measure")
    p.add_argument("label")
    p.add_argument("--setting", default="cross_device")
    p.add_argument("--engine", default="parallel")
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args()
    sys.path.insert(0, str(a.script.parent))
    spec = importlib.util.spec_from_file_location("engine_speed", a.script)
    assert spec is not None and spec.loader is not None
    side = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(side)
    with tempfile.TemporaryDirectory() as tmp:
        r = side.run_mode(a.setting, a.engine, a.precision, a.rounds, Path(tmp), False)
    print(json.dumps({"label": a.label, "setting": a.setting, "engine": a.engine, "precision": a.precision,
                      "samples_per_s": r["samples_per_s"], "rounds": r["samples_per_s_all"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
