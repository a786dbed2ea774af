"""What users see of a run: a progress bar on rank 0 and metrics.jsonl in the run folder."""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this rank: CUDA allocator peak on GPU, peak resident set size on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


class MetricsLog:
    """Appends one JSON object per line; only rank 0 writes."""

    def __init__(self, path: Path | None):
        self.path = path
        self._file = open(path, "a", buffering=1) if path is not None else None

    def write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


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
