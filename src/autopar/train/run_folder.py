"""The run folder a training run writes: its config, facts, metrics records and restart log.

The Trainer decides what goes in; this module decides how it is laid out on disk, so that the
loop stays about steps. Rank 0 writes, other ranks only read the folder's name.
"""

from __future__ import annotations

import dataclasses
import json
import math
from datetime import datetime
from pathlib import Path
from typing import Any

import tomli_w
import torch.distributed as dist

from ..config import JobConfig, Strategy, TrainConfig, to_dict, to_toml
from ..config.run_identity import given_paths_comment, with_absolute_paths
from ..launch import RESTARTS_LOG


def config_toml(strategy: Strategy, train: TrainConfig, job_config: JobConfig | None, *, planned: bool) -> str:
    """The run's configuration, without where it was written or resumed from: rerunning the file starts a
    new run folder, and `--resume RUN_DIR` reads it back, from any directory: paths are written absolute (with
    the ones typed as a comment). A plan also chose the micro-batches: write what runs."""
    if job_config is not None:
        chosen = train if planned else job_config.train
        chosen = dataclasses.replace(chosen, out=None, resume=None)
        job, given = with_absolute_paths(dataclasses.replace(job_config, strategy=strategy, train=chosen))
        return given_paths_comment(given) + to_toml(job)
    return tomli_w.dumps({"strategy": to_dict(strategy), "train": to_dict(dataclasses.replace(train, out=None,
                                                                                               resume=None))})


def agree_on_run_dir(out: str | None) -> Path:
    """The run folder, the same on every rank: `out`, or a new one named by rank 0's clock. Collective."""
    shared = [out or f"runs/{datetime.now():%Y%m%d-%H%M%S}"]
    dist.broadcast_object_list(shared, src=0)
    return Path(shared[0])


def open_run_dir(out: str | None, *, main: bool, config: str, info: dict[str, Any], files: dict[str, str],
                 plan: Any = None) -> tuple[Path, bool]:
    """The run folder, agreed on every rank (collective), written by rank 0 (`main`): config.toml, run.json,
    the files, and the plan that chose the strategy (plan.json, without an earlier run's measurements).
    Returns (folder, whether rank 0 made it now: such a folder is removed again if the run fails before step 1)."""
    run_dir = agree_on_run_dir(out)
    fresh = main and not run_dir.exists()
    if main:
        write_run_folder(run_dir, config=config, info=info, files=files)
        if plan is not None:  # --strategy auto / --plan: what was chosen and predicted
            plan.record.pop("measured", None)  # a rerun plan's old measurements belong to its old run
            plan.save(run_dir / "plan.json")
    return run_dir, fresh


def write_run_folder(run_dir: Path, *, config: str, info: dict[str, Any], files: dict[str, str]) -> None:
    """config.toml, run.json and the engine's and job's own files (tp_plan.txt, hf/config.json, ...)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(config)
    (run_dir / "run.json").write_text(json.dumps(info, indent=2) + "\n")
    for name, text in files.items():
        (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / name).write_text(text)


def write_summary(run_dir: Path, steps: int, losses: list[float], eval_loss: float | None,
                  facts: dict[str, Any] | None = None) -> None:
    """summary.json, and the run's last line ("done: ..."). `facts`: the trainer's account of the run (duration,
    tokens, mean tokens/s, TFLOP/s per device and MFU over the steps of this call)."""
    summary = {"steps": steps, "final_loss": losses[-1] if losses else None, "eval_loss": eval_loss,
               "run_dir": str(run_dir), **(facts or {})}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"done: {steps} steps, final loss {summary['final_loss']}, eval loss "
          f"{eval_loss if eval_loss is not None else 'n/a'}; run folder {run_dir}", flush=True)


def log_torchrun_restart(run_dir: Path, attempt: int, resumes_from: Path | None) -> None:
    log_restart(run_dir, {"restart": attempt, "by": "torchrun", "world_size": dist.get_world_size(),
                          "cause": "torchrun restarted the workers (see its log)",
                          "resumes_from": resumes_from and resumes_from.name})


def log_restart(run_dir: Path, record: dict[str, Any]) -> None:
    record = {**record, "time": datetime.now().isoformat(timespec="seconds")}
    with open(run_dir / RESTARTS_LOG, "a") as f:
        f.write(json.dumps(record) + "\n")


def truncate_metrics(path: Path, last_step: int) -> None:
    """On resume, drop records of steps after the checkpoint (they will be redone)."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines() if line and json.loads(line).get("step", 0) <= last_step]
    path.write_text("".join(line + "\n" for line in kept))


def non_finite_message(loss: float, step: int, lr: float, grad_norm: float, run_dir: Path, in_a_row: int = 1,
                       allowed: int = 0) -> str:
    """Why training stopped on a non-finite loss or norm, and what to try."""
    what = f"the loss is {loss}" if not math.isfinite(loss) else f"the gradient norm is {grad_norm}"
    streak = (f" ({in_a_row} non-finite steps in a row, more than --max-bad-steps {allowed}; each was skipped)"
              if allowed else "")
    return (f"{what} at step {step} (lr {lr:g}, loss {loss:g}, gradient norm {grad_norm}){streak}; training "
            f"stopped rather than go on with non-finite weights (no checkpoint holds them). Lower the learning rate "
            f"(--lr) or clip gradients (--grad-clip), or look in the model and loss for a log, division or square "
            f"root of a value that can reach zero or below; {run_dir}/metrics.jsonl has the steps before")
