"""Where a command's CPU goes on the whole machine, including processes nobody waits for.

    .venv/bin/python scripts/process_cpu.py -- .venv/bin/python -m pytest -n 0 tests/flower/test_flower_deploy.py

A test's own CPU log (FEDHET_TEST_CPU_LOG) counts only the child processes it reaps; Flower's
ClientApps and SuperExecs are reaped by other processes and are missed. This runs the command,
reads /proc/stat before and after (the machine's busy CPU seconds while it ran: anything else
running is counted too, so run it on a quiet machine), and samples every process in /proc every
``--every`` seconds, keeping each one's last CPU seconds; it prints both, the processes summed by
command (a process shorter than one sample may be missed, its last tick uncounted). The sampling
itself is busy CPU too (a Flower deployment test: 67 busy CPU s sampled at 0.25 s, 55 unsampled):
compare commands at one ``--every``.

``--memory`` also reads each sampled process's peak resident memory (VmHWM: what ``ps`` shows at
its highest; shared libraries count in every process that maps them) and, at every sample, the
command's processes' proportional set sizes summed (PSS: a shared page split among its users), whose
largest value is the memory the command held at once. A peak shorter than one sample may be missed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from collections import defaultdict

TICK = os.sysconf("SC_CLK_TCK")


def busy_seconds() -> float:
    """The machine's non-idle CPU seconds since boot (/proc/stat: all but idle and iowait)."""
    fields = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / TICK


def command_name(cmdline: list[str]) -> str:
    """A process's command: the first word naming flwr/flower/pytest/fedhet, else the program."""
    for word in cmdline:
        base = os.path.basename(word)
        if any(key in base for key in ("flwr", "flower", "pytest", "fedhet", "ray::")):
            return base
    return os.path.basename(cmdline[0]) if cmdline else "?"


def processes():
    """(key, CPU seconds, command line) of every process now; key = (pid, start time): one process."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = open(f"/proc/{pid}/stat").read()
            cmdline = open(f"/proc/{pid}/cmdline").read().split("\0")[:-1]
        except OSError:                   # gone meanwhile
            continue
        fields = stat.rsplit(")", 1)[1].split()
        yield (pid, fields[19]), (int(fields[11]) + int(fields[12])) / TICK, cmdline   # utime + stime


def memory_kb(pid: str) -> tuple[int, int]:
    """(peak RSS, PSS now) of a process in kB; (0, 0) once it is gone or a zombie."""
    def field(path: str, name: str) -> int:
        try:
            for line in open(path):
                if line.startswith(name):
                    return int(line.split()[1])
        except OSError:
            pass
        return 0
    return field(f"/proc/{pid}/status", "VmHWM:"), field(f"/proc/{pid}/smaps_rollup", "Pss:")


def sample(seen: dict, stop: threading.Event, every: float, before: set, memory: dict | None = None) -> None:
    """Every ``every`` s until ``stop``: each process's last CPU seconds into ``seen[key] = (cpu,
    name, peak RSS kB)``; with ``memory``, also the largest PSS sum of the processes not in
    ``before`` (``memory["pss_kb"]``)."""
    while not stop.is_set():
        pss_now = 0
        for key, cpu, cmdline in processes():
            last_cpu, name, hwm = seen.get(key, (0.0, "?", 0))
            name = command_name(cmdline) if cmdline else name       # a zombie has no command line
            if memory is not None:
                peak, pss = memory_kb(key[0])
                hwm = max(hwm, peak)
                if key not in before:
                    pss_now += pss
            seen[key] = (max(cpu, last_cpu), name, hwm)
        if memory is not None:
            memory["pss_kb"] = max(memory.get("pss_kb", 0), pss_now)
        stop.wait(every)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--every", type=float, default=0.25, help="seconds between samples of /proc")
    ap.add_argument("--memory", action="store_true",
                    help="also each command's largest peak RSS and the processes' largest PSS sum")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ...")
    args = ap.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("give the command after --")
    seen: dict = {}
    stop = threading.Event()
    before = {key for key, _, _ in processes()}          # running already: not the command's
    memory: dict | None = {} if args.memory else None
    sampler = threading.Thread(target=sample, args=(seen, stop, args.every, before, memory), daemon=True)
    busy0, t0 = busy_seconds(), time.monotonic()
    sampler.start()
    rc = subprocess.call(command)
    busy1, t1 = busy_seconds(), time.monotonic()
    stop.set()
    sampler.join()
    by_command: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0])
    for key, (cpu, name, hwm) in seen.items():
        if key not in before:
            by_command[name][0] += 1
            by_command[name][1] += cpu
            by_command[name][2] = max(by_command[name][2], hwm)
    print(f"\nexit status {rc}; wall {t1 - t0:.1f} s; machine busy {busy1 - busy0:.0f} CPU s"
          + (f"; the command's processes together held at most {memory.get('pss_kb', 0) / 1024:.0f} MiB (PSS)"
             if memory is not None else ""))
    mem_head = (" peak RSS of one (MiB) |", "---|") if memory is not None else ("", "")
    print(f"| command | processes | CPU s |{mem_head[0]}\n|---|---|---|{mem_head[1]}")
    for name, (count, cpu, hwm) in sorted(by_command.items(), key=lambda kv: -kv[1][1]):
        print(f"| {name} | {count} | {cpu:.1f} |" + (f" {hwm / 1024:.0f} |" if memory is not None else ""))
    sys.exit(rc)


if __name__ == "__main__":
    main()
