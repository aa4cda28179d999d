"""scripts/process_cpu.py, behind the Flower figures of benchmarks/results/test_suite_time.md: it
counts a process the command never waits for (an orphan, as Flower's ClientApps are to a test)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "process_cpu.py"


def test_a_process_the_command_never_waits_for_is_counted_under_its_command(tmp_path):
    # the command starts a process (python under its own name, so that other tests' processes on a
    # busy machine do not mix in) that burns 0.8 CPU s and marks its end; the command waits for the
    # mark, never for the process, so only the /proc samples can see its CPU
    burner = tmp_path / "orphan-burner"
    os.symlink(sys.executable, burner)
    done_mark = tmp_path / "burnt"
    burn = ("import time, pathlib; t = time.process_time()\nwhile time.process_time() - t < 0.8: pass\n"
            f"pathlib.Path({str(done_mark)!r}).touch()")
    command = (f"import subprocess, pathlib, time; subprocess.Popen([{str(burner)!r}, '-c', {burn!r}])\n"
               f"while not pathlib.Path({str(done_mark)!r}).exists(): time.sleep(0.05)\n"
               "time.sleep(0.5)")
    done = subprocess.run([sys.executable, str(SCRIPT), "--every", "0.05", "--", sys.executable, "-c", command],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    rows = {m[0]: (int(m[1]), float(m[2])) for m in re.findall(r"^\| (\S+) \| (\d+) \| ([\d.]+) \|$", done.stdout, re.M)}
    count, cpu = rows["orphan-burner"]
    assert count == 1 and cpu >= 0.7, done.stdout           # its 0.8 s, less at most a sample's worth
    assert re.search(r"machine busy \d+ CPU s", done.stdout)


@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists(), reason="this kernel has no smaps_rollup")
def test_memory_reports_a_process_peak_and_what_the_new_processes_held_together(tmp_path):
    # a process under its own name holds 200 MB (written, so resident) for a second, then frees it
    # and lives on: its peak, not its last size, is reported; its interpreter adds tens of MB at most
    holder = tmp_path / "memory-holder"
    os.symlink(sys.executable, holder)
    hold = "import time; x = bytearray(b'\\x01') * 200_000_000; time.sleep(1.0); del x; time.sleep(0.5)"
    done = subprocess.run([sys.executable, str(SCRIPT), "--every", "0.05", "--memory", "--", str(holder), "-c", hold],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    rows = {m[0]: float(m[1]) for m in re.findall(r"^\| (\S+) \| \d+ \| [\d.]+ \| (\d+) \|$", done.stdout, re.M)}
    mib = 200_000_000 / 2**20
    assert mib <= rows["memory-holder"] < mib + 60, done.stdout
    # every process started meanwhile counts (other tests' too, on a busy machine): a floor only
    together = float(re.search(r"held at most (\d+) MiB together \(PSS\)", done.stdout)[1])
    assert together >= mib, done.stdout
