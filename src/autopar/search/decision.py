"""The default layout as a candidate, and when `--strategy auto` may run something else.

A user who adds `--strategy auto` must not get a slower run than the one they had without it. The
cost model is right only to within its error (a fifth of the step, median, on the jobs users run), so
a prediction alone does not decide: when the pick is not the default layout, or the best distinct
candidates are within that error of each other, the CLI measures them and the default for a few
steps before the run (`to_measure`; autoplan.confirm), and a measured pick runs only when it beats
the measured default by more than the measurement's own noise (`beats_measured_default`). With
`--confirm 0` (or in Python) the prediction decides alone, and then only a pick predicted faster
than the default by more than the model's error runs instead of it (`beats_default`).
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

from collections.abc import Callable

from ..config import Strategy, TrainConfig
from ..errors import ConfigError
from .cost import Candidate, StepModel
from .equivalence import execution_key
from .plan_text import configuration, same_plan
from .search import differing, ms, percent, why

PREDICTED_TIME_ERROR = 0.20
PREDICTED_TIME_ERROR_SOURCE = (
    "median step-time error of the cost model on the jobs users run, never calibrated before "
    "(benchmarks/strategy_user_jobs.py, 16 jobs: gpt-mini, gpt-small, hf:llama, hf:gpt2 at 4 and 8 ranks; "
    "docs/benchmarks.md: 19.4% when this was set; 6.7-7.5% on the latest two runs, kept while single jobs are "
    "still up to 14% off and rows of one layout at two micro-batch sizes can rank the wrong way round)")
"""How far a predicted step time may be from the measured one, as a fraction: the model's own stated error."""

MEASUREMENT_NOISE_FLOOR = 0.05
"""The least margin a measured plan must beat the measured default by, whatever its steps' spread: a few steps
that happen to agree closely must not make a small difference decisive. Launches differ by more than their steps'
spread shows: two launches of the same default job (gpt-mini, 4 ranks) ran 156.9 and 162.3 ms a step (3.4%
apart), and a pick measured 4.3% faster than the default before its run measured 0.7% slower in the validation
benchmark's later launch. 5% is also the tolerance auto is held to against the measured best."""

CONFIRM_AUTO_MAX = 4  # plans measured when unsure, the default layout among them (all in one launch)
STRATEGY_FIELDS = ("schedule", "chunks", "partition", "recompute", "zero")


def default_candidate(nproc: int, global_batch_size: int, fixed: dict[str, Any], *,
                      config: TrainConfig | None = None) -> tuple[Candidate | None, str | None]:
    """The layout the same command would run without `--strategy auto`: the Strategy and TrainConfig defaults
    for `nproc` (dp = nproc / (tp * pp), tp = pp = 1, zero 0, the default micro-batch size for that dp where the
    user fixed no micro-batching: config.default_micro_batch_size, as the runtime resolves it) with the fields
    the user fixed. Returns (candidate, None), or (None, why it could not run)."""
    defaults = Strategy()
    tp, pp, cp = fixed.get("tp", defaults.tp), fixed.get("pp", defaults.pp), fixed.get("cp", defaults.cp)
    dp = fixed.get("dp") or nproc // (tp * pp * cp)
    if dp * tp * pp * cp != nproc:
        return None, f"dp={dp} tp={tp} pp={pp} cp={cp} does not fill {nproc} processes"
    train = dataclasses.replace(config or TrainConfig(), global_batch_size=global_batch_size,
                                **{k: fixed[k] for k in ("micro_batch_size", "micro_batches") if k in fixed})
    try:
        m = train.accumulation_steps(dp)
        train = train.with_micro_batches(dp)
    except ConfigError as exc:
        return None, str(exc)
    values = {k: fixed.get(k, defaults.flat()[k]) for k in (*STRATEGY_FIELDS, "ep", "sp", "cp", "cp_mode")}
    return Candidate(dp=dp, tp=tp, pp=pp, micro_batch_size=train.micro_batch_size, num_microbatches=m,
                     compile=bool(fixed.get("compile", False)), **values), None


def beats_default(best_s: float, default_s: float, error: float | None = None) -> bool:
    """Whether a pick predicted at `best_s` is faster than the default's `default_s` by more than the error
    (PREDICTED_TIME_ERROR unless given): the default is predicted more than that much slower."""
    return not within_error(best_s, default_s, error)


def within_error(fast_s: float, slow_s: float, error: float | None = None) -> bool:
    """Whether `slow_s` is no more than `error` (PREDICTED_TIME_ERROR unless given) slower than `fast_s`: the
    model cannot tell them apart."""
    return slow_s <= fast_s * (1 + (PREDICTED_TIME_ERROR if error is None else error))


def to_measure(records: list[dict], default: dict | None, k: int | None, error: float | None = None) -> list[dict]:
    """The plans to run for a few steps before training, fastest predicted first; [] to trust the prediction.

    `records` are distinct plans (their `prediction.step_time_s`), the pick first; `default` the default
    layout's plan when it can run and fits. k None ("measure when unsure"): the plans within `error` of the
    fastest predicted (at most CONFIRM_AUTO_MAX) whenever there are two or more, or the pick is not the
    default layout (a model a fifth off cannot promise it beats the default: the pick and the default are
    measured then); nothing when the default is the fastest predicted by more than the error, or there is no
    default and one plan stands out. k > 0: the k fastest predicted. k = 0: none. Whatever is measured, the
    default layout is measured with it (in the last place when it is not among them; `--confirm 1` then
    measures the fastest predicted and the default), so the measured winner is never one measured slower
    than the default."""
    pool = list(records)
    if default is not None and not any(same_plan(default, r) for r in pool):
        pool.append(default)
    pool.sort(key=lambda r: r["prediction"]["step_time_s"])
    if k == 0 or not pool:
        return []
    if k is None:
        fastest = pool[0]["prediction"]["step_time_s"]
        chosen = [r for r in pool if within_error(fastest, r["prediction"]["step_time_s"], error)]
        picks_other = default is not None and records and not same_plan(default, records[0])
        if len(chosen) < 2 and not picks_other:
            return []
        chosen = varied(chosen)[:CONFIRM_AUTO_MAX]
        if default is not None and not any(same_plan(default, r) for r in chosen):
            chosen = [*chosen[:CONFIRM_AUTO_MAX - 1], next(r for r in pool if same_plan(default, r))]
        return chosen
    else:
        chosen = pool[:k]
    if default is not None and chosen and not any(same_plan(default, r) for r in chosen):
        chosen[max(len(chosen) - 1, 1):] = [next(r for r in pool if same_plan(default, r))]
    return chosen


def kept_plans(ranked: list, runnable, top: int) -> tuple[list[tuple], list[str]]:
    """The plans a search keeps, as (estimate, record) fastest first, and the runtime's refusals on the way:
    the `top` fastest the runtime accepts (`runnable(estimate)` -> (record, None) or (None, why)), then the
    fastest of each other layout within the model's error until `top` layouts are kept, so that measuring when
    unsure (to_measure) chooses among layouts, not among the zero levels and schedules of the fastest one."""
    chosen, refusals, layouts = [], [], set()
    for estimate in ranked:
        c = estimate.candidate
        if c.pp == 1 and c.tp == 1 and c.recompute != "none":
            continue  # plain data parallelism runs the model whole and recomputes nothing: not what was scored
        if len(chosen) >= top:
            if len(layouts) >= top or not within_error(chosen[0][0].step_time_s, estimate.step_time_s):
                break
            if layout_of(c) in layouts:
                continue
        record, refused = runnable(estimate)
        if record is None:
            refusals.append(refused)
            continue
        chosen.append((estimate, record))
        layouts.add(layout_of(c))
    return chosen, refusals


def layout_of(c) -> tuple:
    """A candidate's layout, as `varied` groups plans: its degrees and micro-batch size (its zero level, schedule,
    cut and recomputation are variants of it)."""
    return (c.dp, c.tp, c.pp, c.cp, c.ep, c.micro_batch_size)


def varied(records: list[dict]) -> list[dict]:
    """`records` (fastest predicted first) reordered so that each layout's fastest comes before any second plan of
    a layout already there (layout: the degrees and the micro-batch size; zero levels and schedules of one layout
    are its variants): a few measurements then span the layouts the model is unsure between, not the variants
    of one. Kept in predicted order within each of the two groups."""
    seen, first, rest = set(), [], []
    for r in records:
        s, t = r["strategy"], r["train"]
        layout = (s.get("dp"), s.get("tp", 1), s.get("pp", 1), s.get("cp", 1), s.get("ep", 1),
                  t.get("micro_batch_size"))
        (rest if layout in seen else first).append(r)
        seen.add(layout)
    return first + rest


def measurement_noise(step_times_s: list[float]) -> float:
    """How far a plan's measured time (the median of its timed steps) may be off, as a fraction of it: half
    the range of those steps (0 for one step)."""
    if len(step_times_s) < 2:
        return 0.0
    return (max(step_times_s) - min(step_times_s)) / 2 / statistics.median(step_times_s)


def measured_margin(*step_times_s: list[float]) -> float:
    """The margin by which one measured plan must beat another: the larger noise of the two (their steps'
    half-range, measurement_noise), at least MEASUREMENT_NOISE_FLOOR."""
    return max(MEASUREMENT_NOISE_FLOOR, *(measurement_noise(t) for t in step_times_s))


def beats_measured_default(best_s: float, default_s: float, margin: float) -> bool:
    """Whether a plan measured at `best_s` beats the default layout measured at `default_s` by more than
    `margin` (measured_margin): else the default runs."""
    return best_s * (1 + margin) < default_s


def default_layout(step: StepModel, nproc: int, global_batch_size: int, fixed: dict, train: TrainConfig,
                    runnable: Callable) -> dict:
    """The default layout's entry of plan.json: its plan and prediction (scored even when over the memory, and
    said so), or why it cannot run."""
    candidate, reason = default_candidate(nproc, global_batch_size, fixed, config=train)
    if candidate is None:
        return {"runnable": False, "reason": reason}
    try:
        estimate = step.evaluate(candidate)
    except ConfigError as exc:
        return {"runnable": False, "reason": str(exc), "layout": candidate.describe()}
    record, refused = runnable(estimate)
    if record is None:
        return {"runnable": False, "reason": refused, "layout": candidate.describe()}
    entry = {key: record[key] for key in ("strategy", "train", "prediction")}
    return {**entry, "runnable": True, "fits": estimate.fits, "estimate": estimate}


def decide(chosen: list, default: dict, step: StepModel) -> dict:
    """The plan to run: the search's best when it beats the default layout by more than the model's error (or the
    default cannot run or fit), else the default; with the decision and the default's prediction recorded."""
    estimate = default.get("estimate")
    if estimate is not None:  # the default's own names for the class it falls in (e.g. its cut at pp = 1)
        chosen = [(e, {**r, "strategy": default["strategy"], "train": default["train"]}
                   if execution_key(e) == execution_key(estimate) else r) for e, r in chosen]
    best, record = chosen[0]
    others = list(chosen[1:])
    error = PREDICTED_TIME_ERROR
    decision = {"model_error": error, "model_error_source": PREDICTED_TIME_ERROR_SOURCE,
                "searched_best": configuration(record), "searched_best_step_time_s": best.step_time_s}
    same = estimate is not None and execution_key(estimate) == execution_key(best)
    if estimate is not None:
        decision["default_step_time_s"] = estimate.step_time_s
        others = [(e, r) for e, r in others if execution_key(e) != execution_key(estimate)]
    if estimate is None:
        runs, text = "search", f"the default layout cannot run here ({default['reason']})."
    elif same:
        runs, text = "search", "the search's best is the default layout."
    elif not estimate.fits:
        need = estimate.peak_memory / 2**20
        runs, text = "search", (f"the default layout ({configuration(default)}) is predicted not to fit: "
                                f"{need:.4g} MiB per rank, the device has {step.cluster.memory_bytes / 2**20:.4g} MiB.")
    else:
        slower = estimate.step_time_s / best.step_time_s - 1
        pair = differing(estimate.step_time_s, best.step_time_s, ms) or (ms(best.step_time_s),) * 2
        if beats_default(best.step_time_s, estimate.step_time_s, error):
            runs, text = "search", (f"the default layout, {configuration(default)}, is predicted {percent(slower)} "
                                    f"slower ({pair[0]} against {pair[1]}), more than the model's "
                                    f"{error:.0%} error.")
        else:
            runs = "default"
            text = (f"the default layout runs: it is predicted only {percent(slower)} slower ({pair[0]} against "
                    f"{pair[1]}) than the search's best, {configuration(record)}, within the model's "
                    f"{error:.0%} error.")
    decision.update(runs=runs, text=text)
    if runs == "default":
        run = {**record, **{key: default[key] for key in ("strategy", "train", "prediction")}}
        alternatives = [record, *(r for _, r in others)]
        sentence = text
    else:
        run, alternatives = record, [r for _, r in others]
        runner_up = others[0][0] if others else (estimate if estimate is not None and not same and estimate.fits
                                                  else None)
        sentence = why(best, runner_up) + ("" if same else " " + text[0].upper() + text[1:])
    keep = ("strategy", "train", "prediction")
    return {**run, "why": sentence, "alternatives": [{key: r[key] for key in keep} for r in alternatives],
            "default_layout": {k: v for k, v in default.items() if k != "estimate"}, "decision": decision}
