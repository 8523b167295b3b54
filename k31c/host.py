"""What this machine gives the process: the CPUs it may run on (compile pools size by it)."""
from __future__ import annotations

import os


def usable_cpus() -> int:
    """The CPUs this process may use (its affinity mask where the OS has one, else all)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:          # not on Linux
        return os.cpu_count() or 1
