"""Measure several plans in one launch: the ranks of `--strategy auto`'s "measured when unsure" (autoplan.confirm).

One short run per plan, each in a launch of its own, paid the start of every rank (torch and autopar imported,
the job built) once per plan: 50 s of wall time against 16 s for the run itself on gpt-mini at 4 ranks. Here
the ranks start once and build the job once, then measure the plans in rounds: in each round every plan in turn
is set up (a Trainer with its own process groups), stepped a few times and released (its groups destroyed), so a
load that drifts on a shared machine slows every plan alike, instead of the one that happened to run during it.

One Trainer is alive at a time (`alone`): the others' idle process groups (gloo keeps threads per group that wake
every 10 ms), their memory and the allocator churn of their steps would otherwise tax whichever plan is timed,
and unevenly: on hf:gpt2 at 4 ranks a pipeline plan timed among 6 other live Trainers measured 101 ms against
73-81 ms alone. Each visit's first step is untimed (allocations, cold caches), the rest are timed.

    python -m autopar.confirm_ranks SPEC.json        (started on N ranks by launch.py)

SPEC holds the command's argv (`train ...`), the plan files, the steps per visit, the rounds, and where rank 0
writes the result: per plan its step times (the slowest rank's, each timed step) and peak memory, or the error
that stopped it.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist


@contextlib.contextmanager
def alone(build: Callable[[], object]) -> Iterator:
    """The Trainer `build()` makes, released on the way out: its engine closed and every process group made since
    entering destroyed (a barrier first: every rank is done with them), so the next plan measured in this process
    runs with none of its threads, groups or tensors alive. Collective: every rank enters and leaves together."""
    from .distributed import destroy_groups, process_groups
    before = process_groups()
    trainer = build()
    try:
        yield trainer
    finally:
        engine = getattr(trainer, "engine", None)
        if engine is not None:
            engine.close()
        dist.barrier()
        destroy_groups(process_groups() - before)
        del trainer, engine
        gc.collect()


def _trainer(parts, job, plan_path: str, out: Path, steps: int):
    from .trainer import Trainer
    strategy = dataclasses.replace(job.strategy, plan=plan_path, confirm=0)
    config = dataclasses.replace(job.train, out=str(out), steps=steps, log_every=1, eval_every=0, eval_batches=1,
                                 checkpoint_every=0, progress=False)
    return Trainer(copy.deepcopy(parts.model), parts.train_data, strategy=strategy, config=config,
                   eval_data=parts.eval_data, job_config=parts.job, run_info=dict(parts.run_info),
                   pretrained=parts.pretrained, run_files=parts.run_files)


def all_ranks_ok(ok: bool) -> bool:
    """Whether every rank got here without an error (a plan one rank could not set up is dropped on all)."""
    flag = torch.tensor([0 if ok else 1])
    dist.all_reduce(flag)
    return int(flag) == 0


def _timed_step(trainer, step: int) -> tuple[float, int]:
    """One step of `trainer` from a common start: the slowest rank's seconds, and the step's peak bytes."""
    dist.barrier()
    began = time.perf_counter()
    result = trainer.train_step(step)
    elapsed = torch.tensor([time.perf_counter() - began], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed), int(result.peak_bytes)


def _set_up(trainer, record: dict) -> bool:
    """Set the trainer up and run its first step (allocations, warm caches; not timed); False on an error."""
    try:
        trainer._setup()  # the package's own Trainer, driven step by step as train() would
        trainer.train_step(0)
        ok = True
    except Exception as exc:  # noqa: BLE001 - reported per plan; the others are still measured
        record["error"] = f"{type(exc).__name__}: {exc}"
        ok = False
    return all_ranks_ok(ok)


def measure(spec: dict) -> list[dict]:
    """Every plan's step times and peak memory, as rank 0 writes them (see the module docstring)."""
    from .cli import build_parser, resolve_job
    from .distributed import init_distributed, process_groups
    from .job import build_job
    from .train.faults import ENV as FAULT_ENV
    os.environ.pop(FAULT_ENV, None)  # an injected fault (a test hook) is for the training run, not for measuring plans
    job = resolve_job(build_parser().parse_args(spec["argv"]))
    init_distributed(job.train.device, job.train.timeout_s)
    parts = build_job(job)
    steps, rounds, folder = int(spec["steps"]), int(spec.get("rounds", 1)), Path(spec["folder"])
    records: list[dict] = [{"step_times_s": [], "peak_mem_bytes": 0, "groups_alive": 0} for _ in spec["plans"]]
    for round_ in range(rounds):
        for i, path in enumerate(spec["plans"]):
            record = records[i]
            if "error" in record:  # a plan that failed once is not set up again
                continue
            with alone(lambda: _trainer(parts, job, path, folder / f"{i}-{round_}", steps)) as trainer:
                if not _set_up(trainer, record):
                    record.setdefault("error", "another rank could not set this plan up")
                    continue
                record["groups_alive"] = max(record["groups_alive"], len(process_groups()))
                for step in range(1, steps):  # the first step ran in _set_up, untimed
                    seconds, peak = _timed_step(trainer, step)
                    record["step_times_s"].append(seconds)
                    record["peak_mem_bytes"] = max(record["peak_mem_bytes"], peak)
    return records


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m autopar.confirm_ranks SPEC.json (started by `autopar train --strategy auto`)",
              file=sys.stderr)
        return 2
    spec = json.loads(Path(args[0]).read_text())
    torch.set_num_threads(1)
    records = measure(spec)
    if dist.get_rank() == 0:
        Path(spec["out"]).write_text(json.dumps(records))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
