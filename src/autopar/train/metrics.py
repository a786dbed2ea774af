"""What users see of a run: a progress bar or plain lines on rank 0, and the metric records every logger gets.

The bar is drawn only on a terminal (elsewhere it would be one long carriage-return line in a log);
plain lines (train/log_lines.py) are printed when stdout is not a terminal or the bar is off, so a
Slurm or CI log shows the run as it goes."""

from __future__ import annotations

import math
import os
import resource
import sys
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from ..launch import STDERR_TTY_ENV


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this rank: CUDA allocator peak on GPU, peak resident set size on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def peak_memory_per_rank(device: torch.device) -> list[int]:
    """Every rank's `peak_memory_bytes`, on every rank (collective)."""
    return every_rank(peak_memory_bytes(device), device)


def every_rank(value: int, device: torch.device) -> list[int]:
    """Every rank's `value` (a byte count), on every rank (collective)."""
    mine = torch.tensor([value], dtype=torch.float64, device=device)
    values = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(values, mine)
    return [int(v.item()) for v in values]


def peak_memory_source(device: torch.device) -> str:
    """What `peak_memory_bytes` measures on this device."""
    return ("torch.cuda.max_memory_allocated (tensors only)" if device.type == "cuda" else
            "resource.getrusage ru_maxrss (the whole process: Python, torch, data and tensors)")


def shows_bar(progress: bool) -> bool:
    """The tqdm bar only where someone watches a terminal (the launcher's, when it passes our stderr on)."""
    return progress and (sys.stderr.isatty() or os.environ.get(STDERR_TTY_ENV) == "1")


def prints_lines(progress: bool) -> bool:
    """Plain periodic lines: when stdout is a log (not a terminal), or there is no bar."""
    return not sys.stdout.isatty() or not shows_bar(progress)


class MetricsLog:
    """Hands each record to every logger (train/loggers.py: metrics.jsonl, CSV, TensorBoard, W&B, plain lines);
    rank 0 has loggers, the others none. `due` says which steps' records are written (every `every` steps and the
    last); a step with an eval loss is written as well (the loop decides). `stamp`: each record gets its wall
    clock time (UTC, ISO 8601) and the seconds since the log was opened, when written as the step ends."""

    def __init__(self, loggers: Sequence[Any] | None, *, every: int = 1, last: int | None = None, stamp: bool = True):
        self.loggers, self.every, self.last, self.stamp = list(loggers or []), every, last, stamp
        self._opened = time.monotonic()

    def due(self, number: int) -> bool:
        return number % self.every == 0 or number == self.last

    def write(self, record: dict[str, Any]) -> None:
        if self.stamp:
            record.update(time=datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
                          elapsed_s=round(time.monotonic() - self._opened, 3))
        for logger in self.loggers:
            logger.log(record)

    def close(self) -> None:
        loggers, self.loggers = self.loggers, []
        for logger in loggers:
            logger.close()


def step_record(number: int, loss: float, lr: float, grad_norm: float | None, tokens: int, elapsed: float,
                peak_bytes: int) -> dict[str, Any]:
    """A step's line of metrics.jsonl (non-finite numbers written as null)."""
    return {"step": number, "loss": loss if math.isfinite(loss) else None, "lr": lr,
            "grad_norm": grad_norm if grad_norm is not None and math.isfinite(grad_norm) else None,
            "tokens_per_s": tokens / elapsed, "step_time_s": elapsed, "peak_mem_bytes": peak_bytes}


class Progress:
    """A tqdm bar (step, loss, tokens/s and ETA) when `enabled` (rank 0, --progress, a terminal). `write` prints
    rank 0's messages (the banner) above the bar, or on stdout when there is no bar: `main` says this is rank 0."""

    def __init__(self, *, total: int, initial: int, enabled: bool, main: bool | None = None):
        self.main = enabled if main is None else main
        self._bar = tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True,
                         disable=not enabled, file=sys.stderr, mininterval=0.5)

    def update(self, *, loss: float, tokens_per_s: float, lr: float) -> None:
        self._bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_s:,.0f}", lr=f"{lr:.2e}", refresh=False)
        self._bar.update(1)

    def write(self, text: str) -> None:
        if not self._bar.disable:
            self._bar.write(text, file=sys.stderr)
        elif self.main:
            print(text, flush=True)

    def close(self) -> None:
        self._bar.close()
