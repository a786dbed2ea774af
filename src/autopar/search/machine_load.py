"""How much of this machine other work took while the calibration measured (standard library only).

A calibration taken while other jobs hold cores reads the machine slower than it is: the reference step
(reference_step.py) and the sharing probe (calibrate_ranks.sharing_probe) get the cores those jobs leave. The
1-minute load average lags by a minute and counts our own ranks, so the calibration reads the machine's busy
CPU (/proc/stat) around each timed span instead: what the machine spent beyond our ranks' own CPU is what other
work took, and a quiet machine would have given it to our ranks (they are runnable whenever they time-share).

Loaded by path from calibrate_ranks.py (which imports nothing of autopar's) as well as from the package.
"""

from __future__ import annotations

import os


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def busy_seconds() -> float | None:
    """CPU seconds every core of this machine has spent busy since boot; None where /proc/stat is missing or
    counts other cores than this process may use (a container given part of a host: its figures are the host's)."""
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
        per_core = sum(1 for line in lines if line.startswith("cpu") and line[3:4].isdigit())
        if per_core != cores():
            return None
        fields = [int(v) for v in lines[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle and iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")  # user..steal; guest time is inside user


def others_cores(busy_s: float | None, ours_cpu_s: float, wall_s: float) -> float:
    """Cores' worth of CPU other processes took over a span of `wall_s` in which the machine was busy `busy_s`
    (busy_seconds() after less before; None: unknown, 0) and our ranks used `ours_cpu_s` together."""
    if busy_s is None or wall_s <= 0:
        return 0.0
    return max(0.0, busy_s - ours_cpu_s) / wall_s


def quiet_factor(ours_cpu_s: float, others: float, wall_s: float) -> float:
    """How much faster the span would have run on a quiet machine: the cores our ranks would have had (theirs
    and the others', at most every core) over the cores they had. 1 when nothing else ran."""
    had = ours_cpu_s / wall_s if wall_s > 0 else 0.0
    if had <= 0 or others <= 0:
        return 1.0
    return max(1.0, min(float(cores()), had + others) / had)
