"""Where a run's metric records go besides metrics.jsonl: CSV, TensorBoard, Weights & Biases.

Every record the loop writes (train/metrics.py: MetricsLog) is handed to each logger, so
each holds every metric of metrics.jsonl, evaluation included. TensorBoard and W&B are
optional packages: asking for one that is not installed is refused before any rank starts
(config/log_targets.py, called by TrainConfig.validate), not discovered at the first step.
Records of steps after the checkpoint a run resumes from are dropped, as in metrics.jsonl.
"""

from __future__ import annotations

import csv
import json
import math
import os
from pathlib import Path
from typing import Any, Protocol

from ..config.log_targets import logger_names

NOT_SCALARS = ("step", "time", "elapsed_s")  # the axes (step, wall clock), not plotted as metrics
CSV_FILE, TENSORBOARD_DIR, WANDB_DIR = "metrics.csv", "tensorboard", "wandb"


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The plottable metrics of a record, under their logger names: eval_loss -> eval/loss, x -> train/x."""
    out = {}
    for key, value in record.items():
        if key in NOT_SCALARS or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if math.isfinite(value):
            out["eval/loss" if key == "eval_loss" else f"train/{key}"] = float(value)
    return out


class Logger(Protocol):
    def log(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class JsonLinesLogger:
    """metrics.jsonl: one JSON object per record (non-finite numbers already null)."""

    def __init__(self, path: Path):
        self._file = open(path, "a", buffering=1)

    def log(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self._file.close()


class CsvLogger:
    """metrics.csv: one row per record. A metric first seen later (the first evaluation, an engine's statistic)
    widens the header: the file is rewritten then, which happens a handful of times per run."""

    def __init__(self, path: Path, start: int):
        self.path = path
        self.columns: list[str] = []
        self.rows: list[dict[str, Any]] = []
        if path.exists():  # a resumed run: keep the rows of steps up to its checkpoint
            with open(path, newline="") as f:
                reader = csv.DictReader(f)
                self.columns = list(reader.fieldnames or [])
                self.rows = [row for row in reader if int(row.get("step") or 0) <= start]
        self._rewrite()

    def log(self, record: dict[str, Any]) -> None:
        row = {k: ("" if v is None else v) for k, v in record.items()}
        self.rows.append(row)
        new = [k for k in row if k not in self.columns]
        if new:
            self.columns += new
            self._rewrite()
        else:
            with open(self.path, "a", newline="") as f:
                csv.DictWriter(f, self.columns).writerow(row)

    def _rewrite(self) -> None:
        with open(self.path, "w", newline="") as f:
            writer = csv.DictWriter(f, self.columns)
            if self.columns:
                writer.writeheader()
            writer.writerows(self.rows)

    def close(self) -> None:
        self.rows = []


class TensorBoardLogger:
    """Event files in RUN/tensorboard (`tensorboard --logdir RUN`), written by torch's own SummaryWriter."""

    def __init__(self, log_dir: Path, start: int):
        from torch.utils.tensorboard import SummaryWriter
        # purge_step: a resumed run hides the events of steps it redoes, as metrics.jsonl drops their lines
        self._writer = SummaryWriter(log_dir=str(log_dir), purge_step=start + 1 if start else None)

    def log(self, record: dict[str, Any]) -> None:
        for tag, value in scalars(record).items():
            self._writer.add_scalar(tag, value, global_step=record["step"])

    def close(self) -> None:
        self._writer.close()


class WandbLogger:
    """A W&B run in RUN/wandb, offline unless the user configured W&B (WANDB_MODE, or an API key)."""

    def __init__(self, run_dir: Path, config: dict[str, Any]):
        import wandb
        configured = "WANDB_MODE" in os.environ or "WANDB_API_KEY" in os.environ
        (run_dir / WANDB_DIR).mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(project=os.environ.get("WANDB_PROJECT", "autopar"), name=run_dir.name,
                               dir=str(run_dir / WANDB_DIR), config=config,
                               mode=None if configured else "offline")

    def log(self, record: dict[str, Any]) -> None:
        self._run.log(scalars(record), step=record["step"])

    def close(self) -> None:
        self._run.finish()


def run_loggers(config: Any, run_dir: Path, *, start: int, run_config: dict[str, Any]) -> list[Logger]:
    """Rank 0's loggers for a run of TrainConfig `config`: metrics.jsonl, each --log target, and plain lines
    where no one sees a bar (train/log_lines.py)."""
    from .log_lines import PlainLines
    from .metrics import prints_lines
    lines = PlainLines(start=start, total=config.steps) if prints_lines(config.progress) else None
    return build_loggers(config.log, run_dir, start=start, config=run_config, lines=lines)


def build_loggers(spec: str, run_dir: Path, *, start: int, config: dict[str, Any],
                  lines: Logger | None = None) -> list[Logger]:
    """metrics.jsonl, then each logger `--log` names, then `lines` (plain log lines where no bar is seen);
    rank 0 only."""
    loggers: list[Logger] = [JsonLinesLogger(run_dir / "metrics.jsonl")]
    for name in logger_names(spec):
        if name == "csv":
            loggers.append(CsvLogger(run_dir / CSV_FILE, start))
        elif name == "tensorboard":
            loggers.append(TensorBoardLogger(run_dir / TENSORBOARD_DIR, start))
        else:
            loggers.append(WandbLogger(run_dir, config))
    return loggers + ([lines] if lines is not None else [])
