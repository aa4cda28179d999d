"""Per-file table of a test run's CPU log (FEDHET_TEST_CPU_LOG, see tests/conftest.py).

    FEDHET_TEST_CPU_LOG=/tmp/cpu.jsonl bash scripts/test.sh
    .venv/bin/python scripts/test_cpu_table.py /tmp/cpu.jsonl [--tests 20]

CPU seconds (the test process plus the children it waited for) measure what a test costs the
machine whatever else runs beside it; wall seconds under pytest-xdist include waiting for a core.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log")
    ap.add_argument("--tests", type=int, default=20, help="also list the N tests with the most CPU seconds")
    args = ap.parse_args()
    rows = [json.loads(line) for line in open(args.log) if line.strip()]
    files: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for r in rows:
        f = files[r["test"].split("::")[0]]
        f[0] += 1
        f[1] += r["cpu"] + r["children_cpu"]
        f[2] += r["wall"]
    print("| file | tests | CPU s | wall s |\n|---|---|---|---|")
    for name, (n, cpu, wall) in sorted(files.items(), key=lambda kv: -kv[1][1]):
        print(f"| {name} | {n} | {cpu:.0f} | {wall:.0f} |")
    total_cpu = sum(f[1] for f in files.values())
    print(f"| total | {len(rows)} | {total_cpu:.0f} | {sum(f[2] for f in files.values()):.0f} |")
    if args.tests:
        print(f"\n| test (the {args.tests} with the most CPU) | CPU s | wall s |\n|---|---|---|")
        for r in sorted(rows, key=lambda r: -(r["cpu"] + r["children_cpu"]))[:args.tests]:
            print(f"| {r['test']} | {r['cpu'] + r['children_cpu']:.1f} | {r['wall']:.1f} |")


if __name__ == "__main__":
    main()
