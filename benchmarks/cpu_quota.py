"""Slower devices on one host: each emulated device a cgroup (v1 cpu controller) with its own CPU quota.

    with CpuQuotas({0: 0.5, 1: 0.25}) as quotas:   # device -> cores' worth of CPU per period
        ...                                        # in a rank: quotas.enter(device) before any work

A rank moved into a group with half the quota of another computes at about half its rate, whatever the
model; that is the mixed-generation cluster's property the heterogeneity-aware plans are for. Every group
is removed on exit, on an error and on SIGTERM (its processes moved back to the root group first). Needs
root and the cgroup v1 cpu controller at /sys/fs/cgroup/cpu (cgroup v2's cpu.max is not mounted here);
`CpuQuotas.check()` refuses clearly otherwise. This is an emulation on shared cores, not a cluster.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

ROOT = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 100_000


class CpuQuotaError(RuntimeError):
    """The quotas cannot be set here; the message says what is missing."""


class CpuQuotas:
    def __init__(self, cores: dict[int, float]):
        bad = {d: c for d, c in cores.items() if not 0 < c <= (os.cpu_count() or 1)}
        if bad:
            raise CpuQuotaError(f"cpu quotas: cores per device must be in (0, {os.cpu_count()}], got {bad}")
        self.cores = dict(cores)
        self.tag = f"autopar{os.getpid()}"
        self._made: list[Path] = []
        self._old_term = None

    @staticmethod
    def check() -> None:
        if os.geteuid() != 0:
            raise CpuQuotaError(f"cpu quotas need root (cgroups), but this runs as uid {os.geteuid()}")
        if not (ROOT / "cpu.cfs_quota_us").exists():
            raise CpuQuotaError(f"cpu quotas need the cgroup v1 cpu controller at {ROOT}; not mounted here")

    def path(self, device: int) -> Path:
        return ROOT / f"{self.tag}d{device}"

    def describe(self) -> str:
        return "cpu quotas: " + ", ".join(f"device {d}: {c:g} core(s)" for d, c in sorted(self.cores.items()))

    def up(self) -> None:
        self.check()
        for device, cores in sorted(self.cores.items()):
            group = self.path(device)
            group.mkdir()
            self._made.append(group)
            (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (group / "cpu.cfs_quota_us").write_text(str(int(cores * PERIOD_US)))

    def down(self) -> list[str]:
        """Move any process left back to the root group and remove every group; returns what stayed."""
        left = []
        for group in reversed(self._made):
            try:
                for pid in (group / "cgroup.procs").read_text().split():
                    try:
                        (ROOT / "cgroup.procs").write_text(pid)
                    except OSError:
                        pass  # gone meanwhile
                group.rmdir()
            except OSError:
                left.append(str(group))
        self._made = []
        return left

    def __enter__(self) -> CpuQuotas:
        self._old_term = signal.signal(signal.SIGTERM, _raise_exit)
        try:
            self.up()
        except BaseException:
            self.down()
            signal.signal(signal.SIGTERM, self._old_term)
            raise
        return self

    def __exit__(self, *exc) -> None:
        left = self.down()
        signal.signal(signal.SIGTERM, self._old_term)
        if left:
            print(f"cpu quotas: could not remove {left}; remove them with rmdir", flush=True)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_made": [], "_old_term": None}

    def enter(self, device: int) -> None:
        """Move this process (a rank) into `device`'s group."""
        (self.path(device) / "cgroup.procs").write_text(str(os.getpid()))


def _raise_exit(signum, frame) -> None:
    raise SystemExit(128 + signum)
