"""How much memory one rank of a run may use here: what the memory gate holds a run's prediction against.

CPU ranks share the host's memory, so each gets the memory the kernel says is available now
(/proc/meminfo MemAvailable: free memory plus what the page cache would give back) divided over the
ranks this host starts; not the total, which other programs hold part of. A CUDA rank gets its
device's total memory (shared when more ranks than devices start on the host). Read without a new
dependency; None where it cannot be read, and then a run is not gated.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

GIB = 2**30


@dataclass(frozen=True)
class RankMemory:
    """Bytes one rank may use, and where the figure comes from (said in the gate's messages)."""

    bytes: float
    source: str

    def describe(self) -> str:
        return f"{size(self.bytes)} per rank ({self.source})"


def host_available_bytes() -> int | None:
    """The host's available memory now: MemAvailable where the kernel reports it, else free pages."""
    try:
        with open("/proc/meminfo") as lines:
            for line in lines:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def rank_memory(device: str, ranks_on_host: int, *, memory_per_device_gb: float | None = None) -> RankMemory | None:
    """The memory one of `ranks_on_host` ranks may use on `device` ("cpu" or "cuda"); None when unknown."""
    if memory_per_device_gb is not None:
        return RankMemory(float(memory_per_device_gb) * GIB, f"--memory-per-device-gb {memory_per_device_gb:g}")
    if device == "cuda":
        import torch
        if not torch.cuda.is_available():
            return None  # the run itself says that no GPU is visible
        count = torch.cuda.device_count()
        properties = [torch.cuda.get_device_properties(i) for i in range(count)]
        smallest = min(properties, key=lambda p: p.total_memory)
        share = math.ceil(ranks_on_host / count)  # ranks take devices local_rank % count
        shared = f", shared by {share} ranks" if share > 1 else ""
        return RankMemory(smallest.total_memory / share,
                          f"{smallest.name}: {size(smallest.total_memory)} per device{shared}")
    available = host_available_bytes()
    if available is None:
        return None
    ranks = max(1, ranks_on_host)
    return RankMemory(available / ranks, f"{size(available)} available on this host (MemAvailable) over "
                                         f"{ranks} rank{'s' if ranks > 1 else ''}")


def size(nbytes: float) -> str:
    """Bytes as people read them: 3 significant digits (whole numbers from 100 up), in MiB below 1000 MiB."""
    value, unit = (nbytes / GIB, "GiB") if nbytes >= 1000 * 2**20 else (nbytes / 2**20, "MiB")
    return f"{value:.0f} {unit}" if value >= 100 else f"{value:.3g} {unit}"
