"""Plain log lines: one short line per written record, for logs that are not a terminal (Slurm, CI, `| tee`).

    step 40/200 | loss 3.2154 | lr 2.85e-03 | 41,210 tok/s | 1.92 TFLOP/s/dev | MFU 4.1% | mem 1.3 GiB | eta 0:02:11

A logger like the others (train/loggers.py), so it follows the records' cadence (--log-every) and sees
the eval loss when there is one. The ETA assumes the remaining steps take the mean time of those done
since the log opened (evaluations and checkpoints included).
"""

from __future__ import annotations

import sys
from datetime import timedelta
from typing import Any, TextIO

# (record key, how it is shown): one entry per field; a metric another part adds is one more line here
FIELDS: tuple[tuple[str, Any], ...] = (
    ("loss", lambda v: f"loss {v:.4f}"),
    ("eval_loss", lambda v: f"eval loss {v:.4f}"),
    ("lr", lambda v: f"lr {v:.2e}"),
    ("tokens_per_s", lambda v: f"{v:,.0f} tok/s"),
    ("tflops_per_device", lambda v: f"{v:.3g} TFLOP/s/dev"),
    ("mfu", lambda v: f"MFU {100 * v:.1f}%"),
    ("peak_mem_bytes", lambda v: f"mem {v / 2**30:.2f} GiB"),
)


def format_line(record: dict[str, Any], *, total: int, eta_s: float | None) -> str:
    parts = [f"step {record['step']}/{total}"]
    parts += [show(record[key]) for key, show in FIELDS if isinstance(record.get(key), (int, float))]
    if eta_s is not None:
        parts.append(f"eta {timedelta(seconds=round(eta_s))}")
    return " | ".join(parts)


class PlainLines:
    """Prints `format_line` for each record on rank 0's stdout."""

    def __init__(self, *, start: int, total: int, stream: TextIO | None = None):
        self.start, self.total, self.stream = start, total, stream

    def log(self, record: dict[str, Any]) -> None:
        done, elapsed = record["step"] - self.start, record.get("elapsed_s")
        eta = elapsed / done * (self.total - record["step"]) if elapsed is not None and done > 0 else None
        print(format_line(record, total=self.total, eta_s=eta), file=self.stream or sys.stdout, flush=True)

    def close(self) -> None:
        pass
