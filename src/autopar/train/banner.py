"""The lines a run prints as it starts (rank 0): what runs, on what data, where it writes, and where it resumes from.

Printed even without the progress bar, so a log that is not a terminal starts with them. Each fact is
one entry of the `lines` list: another part of the run adds its own line in one place.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..config import Strategy
from ..version import __version__

RUN_INFO_SHOWN = ("corpus", "model", "data", "tokenizer", "pretrained")


def parameters_text(total: int | None, on_rank: int) -> str:
    """The model's parameters, and this rank's share labelled as such when it holds less (pp, tp, ZeRO-3)."""
    if total is None or total == on_rank:
        return f"{on_rank:,} parameters"
    return f"{total:,} parameters ({on_rank:,} on rank 0)"


def batch_line(*, global_batch_size: int, tokens_per_sample: int | None, train_samples: int,
               eval_samples: int | None, steps: int) -> str:
    """Global batch x sequence = tokens per step, and how much data that is."""
    if tokens_per_sample is not None:
        batch = (f"global batch {global_batch_size} x {tokens_per_sample} tokens = "
                 f"{global_batch_size * tokens_per_sample:,} tokens per step")
    else:
        batch = f"global batch {global_batch_size} samples per step"
    held_out = f", {eval_samples:,} held out" if eval_samples is not None else ""
    epochs = steps * global_batch_size / train_samples
    return f"{batch}; train data {train_samples:,} samples{held_out} ({epochs:.3g} epochs in {steps} steps)"


def start_banner(*, world: int, strategy: Strategy, parameters: int, accumulation: int, micro_batch_size: int,
                 run_dir: Path, run_info: dict[str, Any], engine_lines: list[str], plan: str | None, start: int,
                 resumed_from: Path | None, attempt: int, total_parameters: int | None = None,
                 facts: list[str] = ()) -> str:
    """`facts`: lines the trainer adds after the run's own (the batch and data, the FLOPs per step, notes)."""
    lines = [f"autopar {__version__}: {world} process(es), strategy dp={strategy.dp} "
             f"tp={strategy.stage_tp or strategy.tp} pp={strategy.pp}{f' cp={strategy.cp}' if strategy.cp > 1 else ''}"
             f"{f' ep={strategy.ep}' if getattr(strategy, 'ep', 1) > 1 else ''}, "
             f"{parameters_text(total_parameters, parameters)}, "
             f"{accumulation} micro-batch(es) of {micro_batch_size} per replica per step"
             + ("" if strategy.replicas.shares == "even" else
                f" at most (uneven shares, weights {strategy.replicas.shares})"),
             f"run folder: {run_dir}"]
    lines += [f"{k}: {v}" for k, v in run_info.items() if k in RUN_INFO_SHOWN]
    lines += facts
    lines += engine_lines
    if plan is not None:
        lines.append(plan)
    if start:
        lines.append(f"resumed at step {start} from {resumed_from}")
    if attempt:
        lines.append(f"restart {attempt} of this job")
    return "\n".join(lines)
