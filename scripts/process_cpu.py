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

``--memory`` also reads, for every process started after this script (the command's, and anyone
else's: run it on a quiet machine), its peak resident memory (VmHWM: what ``ps`` shows at its
highest; shared libraries count in every process that maps them) and, at every sample, their
proportional set sizes summed (PSS: a shared page split among its users), whose largest value is
the memory they held at once. A peak shorter than one sample may be missed; compare commands at one
``--every`` and the same ``--memory`` (reading memory is busy CPU too).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field

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


def memory_kb(pid: str) -> tuple[int | None, int | None]:
    """(peak RSS, PSS now) of a process in kB; None where /proc does not say (the process is gone, a
    zombie, not ours, or the kernel has no smaps_rollup)."""
    def field(path: str, name: str) -> int | None:
        try:
            for line in open(path):
                if line.startswith(name):
                    return int(line.split()[1])
        except (OSError, ValueError):
            pass
        return None
    return field(f"/proc/{pid}/status", "VmHWM:"), field(f"/proc/{pid}/smaps_rollup", "Pss:")


@dataclass
class MemorySamples:
    """What ``--memory`` gathers of the processes started meanwhile: per process, (peak RSS kB since
    its last exec, its last VmHWM); the largest sum of their PSS at one sample (None: never readable)."""

    rss: dict = field(default_factory=dict)
    pss_kb: int | None = None


def sample(seen: dict, stop: threading.Event, every: float, before: set, memory: MemorySamples | None = None) -> None:
    """Every ``every`` s until ``stop``: each process's last CPU seconds into ``seen[key] = (cpu,
    name)``; with ``memory``, the memory of the processes not in ``before``."""
    while not stop.is_set():
        pss_now: int | None = None
        for key, cpu, cmdline in processes():
            last_cpu, name = seen.get(key, (0.0, "?"))
            if memory is not None and key not in before:
                hwm, pss = memory_kb(key[0])
                if hwm is not None:
                    peak, last_hwm = memory.rss.get(key, (0, 0))
                    # VmHWM only grows within one program: a drop means exec replaced the memory the
                    # process shared with its parent after fork, which is not its own
                    memory.rss[key] = (hwm if hwm < last_hwm else max(peak, hwm), hwm)
                # not at its first sample: between vfork and exec a child reads as its parent
                if pss is not None and key in seen:
                    pss_now = (pss_now or 0) + pss
            seen[key] = (max(cpu, last_cpu), command_name(cmdline) if cmdline else name)   # a zombie has none
        if memory is not None and pss_now is not None:
            memory.pss_kb = max(memory.pss_kb or 0, pss_now)
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
    memory = MemorySamples() if args.memory else None
    sampler = threading.Thread(target=sample, args=(seen, stop, args.every, before, memory), daemon=True)
    busy0, t0 = busy_seconds(), time.monotonic()
    sampler.start()
    rc = subprocess.call(command)
    busy1, t1 = busy_seconds(), time.monotonic()
    stop.set()
    sampler.join()
    by_command: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0])
    for key, (cpu, name) in seen.items():
        if key not in before:
            by_command[name][0] += 1
            by_command[name][1] += cpu
            if memory is not None:
                by_command[name][2] = max(by_command[name][2], memory.rss.get(key, (0, 0))[0])
    held = ""
    if memory is not None:
        held = ("; the processes started meanwhile held at most "
                + (f"{memory.pss_kb / 1024:.0f} MiB together (PSS)" if memory.pss_kb is not None
                   else "? MiB together (PSS unavailable: no readable /proc/PID/smaps_rollup)"))
    print(f"\nexit status {rc}; wall {t1 - t0:.1f} s; machine busy {busy1 - busy0:.0f} CPU s{held}")
    mem_head = (" peak RSS of one (MiB) |", "---|") if memory is not None else ("", "")
    print(f"| command | processes | CPU s |{mem_head[0]}\n|---|---|---|{mem_head[1]}")
    for name, (count, cpu, hwm) in sorted(by_command.items(), key=lambda kv: -kv[1][1]):
        print(f"| {name} | {count} | {cpu:.1f} |" + (f" {hwm / 1024:.0f} |" if memory is not None else ""))
    sys.exit(rc)


if __name__ == "__main__":
    main()
