"""What users see of a run: a progress bar on rank 0 and metrics.jsonl in the run folder."""

from __future__ import annotations

import json
import math
import resource
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this rank: CUDA allocator peak on GPU, peak resident set size on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def peak_memory_per_rank(device: torch.device) -> list[int]:
    """Every rank's `peak_memory_bytes`, on every rank (collective)."""
    peak = torch.tensor([peak_memory_bytes(device)], dtype=torch.float64, device=device)
    peaks = [torch.zeros_like(peak) for _ in range(dist.get_world_size())]
    dist.all_gather(peaks, peak)
    return [int(p.item()) for p in peaks]


def peak_memory_source(device: torch.device) -> str:
    """What `peak_memory_bytes` measures on this device."""
    return ("torch.cuda.max_memory_allocated (tensors only)" if device.type == "cuda" else
            "resource.getrusage ru_maxrss (the whole process: Python, torch, data and tensors)")


class MetricsLog:
    """Appends one JSON object per line; only rank 0 writes. `due` says which steps' records are written
    (every `every` steps and the last); a step with an eval loss is written as well (the loop decides)."""

    def __init__(self, path: Path | None, *, every: int = 1, last: int | None = None):
        self.path, self.every, self.last = path, every, last
        self._file = open(path, "a", buffering=1) if path is not None else None

    def due(self, number: int) -> bool:
        return number % self.every == 0 or number == self.last

    def write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def step_record(number: int, loss: float, lr: float, grad_norm: float | None, tokens: int, elapsed: float,
                peak_bytes: int) -> dict[str, Any]:
    """A step's line of metrics.jsonl (non-finite numbers written as null)."""
    return {"step": number, "loss": loss if math.isfinite(loss) else None, "lr": lr,
            "grad_norm": grad_norm if grad_norm is not None and math.isfinite(grad_norm) else None,
            "tokens_per_s": tokens / elapsed, "step_time_s": elapsed, "peak_mem_bytes": peak_bytes}


class Progress:
    """A tqdm bar: step, loss, tokens/s and ETA; silent on ranks other than 0."""

    def __init__(self, *, total: int, initial: int, enabled: bool):
        self._bar = tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True,
                         disable=not enabled, file=sys.stderr, mininterval=0.5)

    def update(self, *, loss: float, tokens_per_s: float, lr: float) -> None:
        self._bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_s:,.0f}", lr=f"{lr:.2e}", refresh=False)
        self._bar.update(1)

    def write(self, text: str) -> None:
        if not self._bar.disable:
            self._bar.write(text, file=sys.stderr)

    def close(self) -> None:
        self._bar.close()
