"""The default layout as a candidate, and when `--strategy auto` may run something else.

A user who adds `--strategy auto` must not get a slower run than the one they had without it. The
cost model is right only to within its error, so a pick predicted a few percent faster than the
default layout is a coin toss: auto runs something other than the default only when it is predicted
faster by more than that error (`beats_default`), and when the best distinct candidates (the default
among them) are within the error of each other, the CLI measures them for a few steps before
the run (`to_measure`; autoplan.confirm).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from collections.abc import Callable

from ..config import Strategy, TrainConfig
from ..errors import ConfigError
from .cost import Candidate, StepModel
from .equivalence import execution_key
from .plan_text import configuration, same_plan
from .search import differing, ms, percent, why

PREDICTED_TIME_ERROR = 0.10
PREDICTED_TIME_ERROR_SOURCE = (
    "median step-time error of the cost model in the strategy search's validation "
    "(benchmarks/strategy_search.py, docs/benchmarks.md: 7.2-9.9% on gpt-mini and hf:llama at 4 and 8 ranks), "
    "rounded up")
"""How far a predicted step time may be from the measured one, as a fraction: the model's own stated error."""

CONFIRM_AUTO_MAX = 3  # candidates measured when unsure (each a short run of its own)
STRATEGY_FIELDS = ("schedule", "chunks", "partition", "recompute", "zero")


def default_candidate(nproc: int, global_batch_size: int, fixed: dict[str, Any], *,
                      config: TrainConfig | None = None) -> tuple[Candidate | None, str | None]:
    """The layout the same command would run without `--strategy auto`: the Strategy and TrainConfig defaults
    for `nproc` (dp = nproc / (tp * pp), tp = pp = 1, zero 0, micro-batch size 8) with the fields the user
    fixed. Returns (candidate, None), or (None, why it could not run)."""
    defaults = Strategy()
    tp, pp, cp = fixed.get("tp", defaults.tp), fixed.get("pp", defaults.pp), fixed.get("cp", defaults.cp)
    dp = fixed.get("dp") or nproc // (tp * pp * cp)
    if dp * tp * pp * cp != nproc:
        return None, f"dp={dp} tp={tp} pp={pp} cp={cp} does not fill {nproc} processes"
    train = dataclasses.replace(config or TrainConfig(), global_batch_size=global_batch_size,
                                **{k: fixed[k] for k in ("micro_batch_size", "micro_batches") if k in fixed})
    try:
        train = train.with_micro_batches(dp)
        m = train.accumulation_steps(dp)
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

    `records` are distinct plans (their `prediction.step_time_s`), `default` the default layout's plan
    when it can run and fits. k None ("measure when unsure"): when two or more plans are within `error`
    of the fastest predicted, those (at most CONFIRM_AUTO_MAX). k > 0: the k fastest predicted. k = 0:
    none. Whatever is measured, the default layout is measured with it (in the last place when it is not
    among them; `--confirm 1` then measures the fastest predicted and the default), so the measured winner is
    never one measured slower than the default."""
    pool = list(records)
    if default is not None and not any(same_plan(default, r) for r in pool):
        pool.append(default)
    pool.sort(key=lambda r: r["prediction"]["step_time_s"])
    if k == 0 or not pool:
        return []
    if k is None:
        fastest = pool[0]["prediction"]["step_time_s"]
        if sum(within_error(fastest, r["prediction"]["step_time_s"], error) for r in pool) < 2:
            return []
        chosen = [r for r in pool if within_error(fastest, r["prediction"]["step_time_s"], error)]
        chosen = chosen[:CONFIRM_AUTO_MAX]
    else:
        chosen = pool[:k]
    if default is not None and chosen and not any(same_plan(default, r) for r in chosen):
        chosen[max(len(chosen) - 1, 1):] = [next(r for r in pool if same_plan(default, r))]
    return chosen


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
