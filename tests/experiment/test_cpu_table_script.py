"""scripts/test_cpu_table.py, behind benchmarks/results/test_suite_time.md: a hand-made CPU log
(FEDHET_TEST_CPU_LOG lines) and the sums and timeline it must print."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "test_cpu_table.py"


def table(log: Path, *args: str) -> str:
    done = subprocess.run([sys.executable, str(SCRIPT), str(log), *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_files_are_summed_and_the_timeline_shows_each_worker_and_the_long_tests_at_the_end(tmp_path):
    # two workers from t = 1000 s; the run's tests end at 1100 s, so its last tenth starts at 1090 s
    rows = [
        {"test": "tests/a.py::one", "wall": 30.0, "cpu": 10.0, "children_cpu": 5.0, "start": 1000.0, "worker": "gw0"},
        {"test": "tests/a.py::two", "wall": 70.0, "cpu": 20.0, "children_cpu": 0.0, "start": 1030.0, "worker": "gw0"},
        {"test": "tests/b.py::three", "wall": 92.0, "cpu": 4.0, "children_cpu": 1.0, "start": 1002.0, "worker": "gw1"},
        {"test": "tests/b.py::short", "wall": 1.0, "cpu": 0.5, "children_cpu": 0.0, "start": 1094.0, "worker": "gw1"},
    ]
    log = tmp_path / "cpu.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = table(log, "--tests", "1", "--timeline")
    assert "| tests/a.py | 2 | 35 | 100 |" in out and "| tests/b.py | 2 | 6 | 93 |" in out
    assert "| total | 4 | 40 | 193 |" in out
    assert "| tests/a.py::two | 20.0 | 70.0 |" in out          # the one test with the most CPU
    assert "| gw0 | 2 | 0 | 100 | 100 | 35 |" in out and "| gw1 | 2 | 2 | 95 | 93 | 6 |" in out
    assert "tests from the first start to the last end: 100 s" in out
    tail = out.split("still running after", 1)[1]
    # ended after 90 s and took 2 s or more: a.py::two (ends 100) and b.py::three (ends 94), not the 1-s one
    assert "tests/a.py::two | gw0 | 30 | 70.0 | 20.0" in tail and "tests/b.py::three | gw1 | 2 | 92.0 | 5.0" in tail
    assert "short" not in tail and "tests/a.py::one" not in tail


def test_a_log_without_start_times_gets_the_sums_and_says_it_has_no_timeline(tmp_path):
    log = tmp_path / "cpu.jsonl"
    log.write_text(json.dumps({"test": "tests/a.py::one", "wall": 3.0, "cpu": 1.0, "children_cpu": 0.0}) + "\n")
    out = table(log, "--timeline")
    assert "| tests/a.py | 1 | 1 | 3 |" in out and "no start times in this log" in out
