"""The lines a run prints as it starts (rank 0): what runs, where it writes, and where it resumes from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..config import Strategy
from ..version import __version__

RUN_INFO_SHOWN = ("corpus", "model", "data", "tokenizer", "pretrained")


def start_banner(*, world: int, strategy: Strategy, parameters: int, accumulation: int, micro_batch_size: int,
                 run_dir: Path, run_info: dict[str, Any], engine_lines: list[str], plan: str | None, start: int,
                 resumed_from: Path | None, attempt: int) -> str:
    lines = [f"autopar {__version__}: {world} process(es), strategy dp={strategy.dp} "
             f"tp={strategy.stage_tp or strategy.tp} pp={strategy.pp}{f' cp={strategy.cp}' if strategy.cp > 1 else ''}"
             f"{f' ep={strategy.ep}' if getattr(strategy, 'ep', 1) > 1 else ''}, {parameters:,} parameters, "
             f"{accumulation} micro-batch(es) of {micro_batch_size} per replica per step",
             f"run folder: {run_dir}"]
    lines += [f"{k}: {v}" for k, v in run_info.items() if k in RUN_INFO_SHOWN]
    lines += engine_lines
    if plan is not None:
        lines.append(plan)
    if start:
        lines.append(f"resumed at step {start} from {resumed_from}")
    if attempt:
        lines.append(f"restart {attempt} of this job")
    return "\n".join(lines)
