"""scripts/process_cpu.py, behind the Flower figures of benchmarks/results/test_suite_time.md: it
counts a process the command never waits for (an orphan, as Flower's ClientApps are to a test)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "process_cpu.py"


def test_an_orphan_that_burns_cpu_is_counted_under_its_command():
    # the command starts a process that outlives it by ~1 s of busy work, then exits without waiting:
    # the script's own child exits first, so only the /proc samples see the orphan
    burn = "import time; t = time.process_time()\nwhile time.process_time() - t < 0.8: pass"
    command = (f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {burn!r}, 'orphan-marker']); "
               "import time; time.sleep(1.5)")
    done = subprocess.run([sys.executable, str(SCRIPT), "--every", "0.05", "--", sys.executable, "-c", command],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    rows = {m[0]: (int(m[1]), float(m[2])) for m in re.findall(r"^\| (\S+) \| (\d+) \| ([\d.]+) \|$", done.stdout, re.M)}
    count, cpu = rows[Path(sys.executable).name]
    assert count == 2 and cpu >= 0.6, done.stdout          # the command and its orphan, ~0.8 s of it
    assert re.search(r"machine busy \d+ CPU s", done.stdout)
