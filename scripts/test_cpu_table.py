"""Per-file table of a test run's CPU log (FEDHET_TEST_CPU_LOG, see tests/conftest.py).

    FEDHET_TEST_CPU_LOG=/tmp/cpu.jsonl bash scripts/test.sh
    .venv/bin/python scripts/test_cpu_table.py /tmp/cpu.jsonl [--tests 20] [--timeline]

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
    ap.add_argument("--timeline", action="store_true",
                    help="also each worker's span and busy time, and the tests still running near the end")
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
    if args.timeline:
        timeline(rows)


def timeline(rows: list[dict]) -> None:
    """Per worker: when its first test started and its last ended (seconds from the run's first
    start), the wall seconds its tests took and their CPU; then the tests of 2 s or more that ended
    in the run's last tenth, which a shorter suite would have to shorten or start earlier."""
    timed = [r for r in rows if "start" in r]
    if not timed:
        print("\n(no start times in this log: it predates them)")
        return
    t0 = min(r["start"] for r in timed)
    end = max(r["start"] + r["wall"] for r in timed) - t0
    workers: dict[str, list[dict]] = defaultdict(list)
    for r in timed:
        workers[r["worker"]].append(r)
    print("\n| worker | tests | first start s | last end s | wall in tests s | CPU s |\n|---|---|---|---|---|---|")
    for name, rs in sorted(workers.items()):
        first = min(r["start"] for r in rs) - t0
        last = max(r["start"] + r["wall"] for r in rs) - t0
        cpu = sum(r["cpu"] + r["children_cpu"] for r in rs)
        print(f"| {name} | {len(rs)} | {first:.0f} | {last:.0f} | {sum(r['wall'] for r in rs):.0f} | {cpu:.0f} |")
    print(f"\ntests from the first start to the last end: {end:.0f} s; those of 2 s or more still running after "
          f"{0.9 * end:.0f} s:")
    print("| test | worker | start s | wall s | CPU s |\n|---|---|---|---|---|")
    for r in sorted(timed, key=lambda r: r["start"]):
        if r["start"] + r["wall"] - t0 > 0.9 * end and r["wall"] >= 2:
            print(f"| {r['test']} | {r['worker']} | {r['start'] - t0:.0f} | {r['wall']:.1f} | "
                  f"{r['cpu'] + r['children_cpu']:.1f} |")


if __name__ == "__main__":
    main()
