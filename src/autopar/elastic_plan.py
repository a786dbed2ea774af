"""`--strategy auto` under torchrun: one plan for every rank, made again when the world changes size.

Under torchrun the ranks are already running, so the search cannot happen once before they
start (autoplan.py). Searching on every rank would not do either: the search measures this
machine, and ranks measuring at the same time could pick different plans. So rank 0 decides
and broadcasts the plan; every rank then trains on that one plan.

What rank 0 decides from the run folder's plan.json (written by the previous start of the run):
- a plan for this world size and this model, which the run's settings accept: kept (a restart
  with as many ranks resumes on the plan it had);
- a plan for another world size (an elastic restart with fewer or more ranks): searched again
  for the new world, unless the run already used a plan for this size earlier; the new plan.json
  keeps the older plans under "earlier_plans" and notes the change under "replanned"; the
  checkpoint resumes under the new plan (checkpoints load into any layout);
- no plan (or one for another model): searched.
A plan the user fixed with `--plan FILE` is never replaced: a plan for another world is refused.

The same holds for a run resumed by hand: `autopar train --resume RUN_DIR --nproc N` on a run whose plan
`--strategy auto` chose for another process count searches again for N (replan_on_resume), unless a layout
is given beside it; the checkpoint then resumes under the new plan. The fields the user fixed beside
`--strategy auto` on the run's first command (plan.json's search.fixed, e.g. `--tp 2`) stay fixed; dp is the rest.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from .config import JobConfig, Strategy, TrainConfig
from .errors import AutoparError, ConfigError, DistributedError
from .search.auto import Plan

PLAN_FILE = "plan.json"
CHOSEN_BY_SEARCH = "--strategy auto"  # plan.json's "chosen_by" when the run's own search chose it (not --plan FILE)
LAYOUT_FIELDS = ("dp", "tp", "pp", "stage_tp", "plan", "search")  # flags that fix the layout of a resumed run


def replan_on_resume(job: JobConfig, run: Path, given: dict) -> JobConfig:
    """`job` (read back from `run`'s config.toml, which holds the layout its plan chose) made a `--strategy auto`
    job again when the run's search chose that plan for another process count than this start's: the fields the
    plan set go back to their defaults (but those given now), so the search plans them for the new count. With a
    plan given now (`--plan`, as the CLI hands the ranks the new plan.json), the run's old layout yields to it the
    same way. As is otherwise (no such plan, the same count, or a layout given in `given`, the command line's)."""
    fixed = given.get("strategy", {})
    if fixed.get("plan"):
        chosen = read_previous_plan(Path(fixed["plan"]))
        return _without_plan_fields(job, chosen, given) if chosen is not None else job
    previous = read_previous_plan(run / PLAN_FILE)
    if previous is None or previous.record.get("chosen_by") != CHOSEN_BY_SEARCH or \
            previous.nproc == job.launch.nproc or any(key in fixed for key in LAYOUT_FIELDS):
        return job
    job = _without_plan_fields(job, previous, _with_user_fixed(given, previous))
    return dataclasses.replace(job, strategy=dataclasses.replace(job.strategy, search="auto", plan=None))


def _with_user_fixed(given: dict, plan: Plan) -> dict:
    """`given` (the command line's fields) with what the user fixed beside `--strategy auto` on the run's first
    command (plan.json's search.fixed: `--tp 2 --strategy auto` keeps tp=2, the search re-plans the rest), but
    dp: it is the rest of the new process count once tp and pp are set."""
    fixed = (plan.record.get("search") or {}).get("fixed") or {}
    train_keys = {f.name for f in dataclasses.fields(TrainConfig)}
    kept = {"strategy": {k: v for k, v in fixed.items() if k not in train_keys and k != "dp"},
            "train": {k: v for k, v in fixed.items() if k in train_keys}}
    return {**given, **{table: {**kept[table], **given.get(table, {})} for table in kept}}


def _without_plan_fields(job: JobConfig, plan: Plan, given: dict) -> JobConfig:
    """`job` with the fields `plan` sets back at their defaults, but those `given` on the command line."""
    fixed, strategy_defaults, train_defaults = given.get("strategy", {}), Strategy().flat(), TrainConfig()
    strategy = dataclasses.replace(job.strategy, **{
        key: strategy_defaults[key] for key in plan.record["strategy"] if key not in fixed})
    train = dataclasses.replace(job.train, **{
        key: getattr(train_defaults, key) for key in plan.record["train"]
        if key not in given.get("train", {}) and key != "global_batch_size"})  # the batch is the run's, not planned
    return dataclasses.replace(job, strategy=strategy, train=train)


def searches_on_the_ranks(job: JobConfig) -> bool:
    """True for `--strategy auto` without a fixed `--plan`: the ranks must agree on a plan of their own."""
    return job.strategy.planning.mode == "auto" and not job.strategy.planning.plan


def agree_on_plan(job: JobConfig) -> Plan:
    """Rank 0 chooses the plan (kept, re-planned or searched) and every rank returns that same plan.

    Joins the job's process group (the Trainer uses it as it finds it). An error on rank 0 is
    raised on every rank, with rank 0's message.
    """
    from .distributed import init_distributed
    init_distributed(job.train.device, job.train.timeout_s)
    shared: list = [None, None]
    failure: Exception | None = None
    if dist.get_rank() == 0:
        try:
            plan, note = choose_on_rank_zero(job, dist.get_world_size())
            if note:
                print(f"autopar: {note}", flush=True)
            shared = [plan.record, plan.source]
        except Exception as exc:  # told to the other ranks first, so they do not wait for a plan that never comes
            failure, shared = exc, [None, (type(exc).__name__, str(exc))]
    dist.broadcast_object_list(shared, src=0)
    if failure is not None:
        raise failure
    record, source = shared
    if record is None:
        kind, message = source
        raise _error_kind(kind)(message)
    return Plan(record, source=source)


def _error_kind(name: str) -> Callable[[str], AutoparError]:
    """Rank 0's error as the other ranks raise it: the same kind for autopar's errors, else a failed rank."""
    from . import errors
    kind = getattr(errors, name, None)
    if isinstance(kind, type) and issubclass(kind, AutoparError):
        return kind
    return lambda message: DistributedError(f"rank 0 failed while choosing the plan: {name}: {message}")


def choose_on_rank_zero(job: JobConfig, world: int) -> tuple[Plan, str | None]:
    """The plan for `world` processes from the run folder's plan.json and a search; with the line to print."""
    from .job import build_job
    from .strategies import resolve
    from .train.fields import example_call
    parts = build_job(job)
    num_params = sum(p.numel() for p in parts.model.parameters())
    path = Path(job.train.out) / PLAN_FILE if job.train.out else None
    previous = read_previous_plan(path)

    def search() -> Plan:
        return resolve(job.strategy, job.train, world, model=parts.model, model_name=parts.name,
                       example=lambda: example_call(parts.model, parts.train_data)).plan

    return plan_for_world(world, job.strategy, job.train, previous, num_params, search)


def read_previous_plan(path: Path | None) -> Plan | None:
    """The run folder's plan.json, or None where there is none (a damaged one is set aside: searched again)."""
    if path is None or not path.is_file():
        return None
    try:
        return Plan.load(path)
    except ConfigError:
        return None


def plan_for_world(world: int, strategy: Strategy, config: TrainConfig, previous: Plan | None, num_params: int,
                   search: Callable[[], Plan]) -> tuple[Plan, str | None]:
    """Keep `previous` where it was made for `world` and this model; else re-plan (an earlier plan of the run
    for `world`, or `search()`), noting the change. Returns the plan and the line saying what happened."""
    if previous is None or previous.record.get("num_params") not in (None, num_params):
        plan = search()
        return plan, None
    if previous.nproc == world and _accepted(previous, strategy, config):
        return previous, f"the run's plan is for {world} processes, as this start: keeps {previous.configuration()}"
    if previous.nproc == world:  # the run's settings changed since (e.g. the global batch): plan them afresh
        return search(), None
    earlier = [Plan(r, source=previous.source) for r in previous.record.get("earlier_plans", [])]
    reused = next((p for p in earlier if p.nproc == world and _accepted(p, strategy, config)), None)
    plan = Plan(_without_history(reused.record), source=previous.source) if reused is not None else search()
    history = [_without_history(previous.record),
               *(r for r in previous.record.get("earlier_plans", []) if reused is None or r is not reused.record)]
    plan.record["earlier_plans"] = history
    plan.record["replanned"] = {"from_nproc": previous.nproc, "to_nproc": world,
                                "how": "an earlier plan of this run for this size" if reused else "searched again"}
    note = f"world changed from {previous.nproc} to {world}: re-planned: {plan.configuration()}"
    if reused is not None:
        note += f" (the plan this run used before with {world} processes)"
    return plan, note


def _accepted(plan: Plan, strategy: Strategy, config: TrainConfig) -> bool:
    """Whether the run's own settings combine with `plan` (nothing the user set contradicts it)."""
    try:
        plan.apply(strategy, config)
    except ConfigError:
        return False
    return True


def _without_history(record: dict) -> dict:
    return {k: v for k, v in record.items() if k not in ("earlier_plans", "replanned")}

