"""When two configurations of the search execute the same, and which name the class keeps.

The search space names configurations by their fields, but several names can run the very same
step: gpipe, 1f1b and eager-1f1b at one micro-batch (each stage runs F then B), 1f1b and
eager-1f1b at two micro-batches on two stages, partition methods that cut at the same blocks,
stage-aware recomputation that recomputes nothing, and any recomputation where the model runs
whole (pp = tp = 1: the engine runs the module itself and recomputes nothing). Ranking, confirming
and explaining such twins as rivals wastes measurements and produces sentences like "0.72 ms
instead of 0.72 ms", so the search collapses them by `execution_key` before ranking.

Two configurations execute the same when they have the same degrees and micro-batching, the same
per-rank compute actions (pipeline/schedules.generate, the lists the runtime lowers and runs), the
same stage bounds, the same recomputed blocks per stage, and the same ZeRO level. The class keeps
the member closest to the defaults (`preference`): the name a user would have typed.
"""

from __future__ import annotations

from functools import lru_cache

from ..config import Strategy
from ..errors import ConfigError
from ..pipeline.schedules import SCHEDULES, generate, placement
from .cost import Candidate, Estimate


@lru_cache(maxsize=16)  # long schedules are large; a few shapes are compared at a time
def _actions(name: str, pp: int, chunks: int, num_microbatches: int, whole_stage_recompute: bool):
    """The per-rank compute actions the runtime lowers and runs (None: `name` cannot run this shape)."""
    recompute = frozenset(range(pp * chunks)) if whole_stage_recompute else frozenset()
    try:
        lists = generate(name, pp=pp, num_microbatches=num_microbatches, chunks=chunks, recompute=recompute)
    except ConfigError:
        return None
    return placement(name), tuple(tuple(lists[r]) for r in sorted(lists))


@lru_cache(maxsize=4096)
def schedule_class(schedule: str, pp: int, chunks: int, num_microbatches: int, whole_stage_recompute: bool) -> str:
    """The first schedule name (in SCHEDULES order, the default first) whose action lists equal `schedule`'s.

    Without a pipeline every schedule is the same loop ("none")."""
    if pp == 1:
        return "none"
    shape = (pp, chunks, num_microbatches, whole_stage_recompute)
    default = Strategy().pipeline.schedule
    for name in (default, *(s for s in SCHEDULES if s != default)):
        if name == schedule:
            break
        if name == "interleaved-1f1b" and chunks == 1:  # interleaving one chunk is a name no one would pick
            continue
        theirs = _actions(name, *shape)
        if theirs is not None and theirs == _actions(schedule, *shape):
            return name
    return schedule


def _cheap_key(estimate: Estimate) -> tuple:
    """Everything of the execution key but the schedule's class: degrees, micro-batching, chunks, whole-stage
    recomputation, cut, recomputed blocks, ZeRO level (recomputation counts for nothing when the model runs whole),
    batch shares (a mixed cluster's, cluster_pricing.py)."""
    c = estimate.candidate
    whole = c.recompute == "all" and not (c.pp == 1 and c.tp == 1)
    blocks = (0,) * len(estimate.recompute_blocks) if c.pp == 1 and c.tp == 1 else tuple(estimate.recompute_blocks)
    return (c.dp, c.tp, c.pp, c.micro_batch_size, c.num_microbatches, c.chunks, whole, tuple(estimate.bounds), blocks,
            c.zero, c.ep, c.sp, c.cp, c.cp_mode, c.compile, estimate.cluster_plan.get("dp_shares", "even"))


def execution_key(estimate: Estimate) -> tuple:
    """What runs: equal keys, equal executions (see the module docstring)."""
    c, cheap = estimate.candidate, _cheap_key(estimate)
    return (*cheap, schedule_class(c.schedule, c.pp, c.chunks, c.num_microbatches, cheap[6]))


def preference(c: Candidate) -> tuple:
    """Sort key for the name a class keeps: fewest fields away from the defaults, then the simplest schedule."""
    defaults = Strategy()
    away = sum((c.schedule != defaults.pipeline.schedule, c.partition != defaults.pipeline.partition, c.recompute != "none",
                c.zero != defaults.replicas.zero, c.bounds is not None, c.recompute_blocks is not None,
                c.ep != 1, c.sp, c.cp != 1, c.compile))
    order = SCHEDULES.index(c.schedule) if c.schedule in SCHEDULES else len(SCHEDULES)
    return away, order


def collapse(estimates: list[Estimate]) -> tuple[list[Estimate], int]:
    """One estimate per execution class (its preferred member's; the others are the same run under other
    names), in first-seen order of the classes; and how many were folded away.

    Schedules run the same only if the step model, simulating their actions, predicts the same time and
    memory; so action lists are compared only between candidates alike in everything else and in both
    predictions (generating them for every shape of a large search would cost more than scoring it)."""
    names: dict[tuple, set[str]] = {}
    for e in estimates:
        names.setdefault((*_cheap_key(e), e.step_time_s, e.peak_memory), set()).add(e.candidate.schedule)
    classes: dict[tuple, Estimate] = {}
    for e in estimates:
        cheap = _cheap_key(e)
        key = execution_key(e) if len(names[(*cheap, e.step_time_s, e.peak_memory)]) > 1 else \
            (*cheap, e.candidate.schedule)
        kept = classes.get(key)
        if kept is None or preference(e.candidate) < preference(kept.candidate):
            classes[key] = e
    return list(classes.values()), len(estimates) - len(classes)
