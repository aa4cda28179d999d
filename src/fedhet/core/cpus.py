"""How many CPUs this process may use (torch-free, so the sweep's parent process stays light)."""

from __future__ import annotations

import os


def usable_cpus() -> int:
    """CPUs this process may run on (the affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1
