"""Choosing the strategy before training: `autopar train --strategy auto | --plan FILE [--confirm K]`, `plan_auto`.

The CLI resolves the choice in its own process, before any rank starts (strategies.resolve
runs the search, or reads and checks the plan), prints the banner line, writes plan.json into
the run folder and starts the ranks on that plan, so they do not search again. When unsure (the
pick is not the default layout, or plans are within the model's error of each other: decision.to_measure),
or with `--confirm K`, it first runs those plans for a few steps (all in one launch, in rounds, one plan alive
at a time: confirm_ranks.py) and keeps the fastest measured, unless that beats the measured default
layout by no more than the measurement's noise; every measurement goes into plan.json.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

from torch import nn
from torch.utils.data import Dataset

from .config import JobConfig, Strategy, TrainConfig
from .elastic_plan import CHOSEN_BY_SEARCH, read_previous_plan
from .errors import ConfigError
from .search.auto import Plan, milliseconds
from .search.decision import (MEASUREMENT_NOISE_FLOOR, PREDICTED_TIME_ERROR, beats_measured_default,
                              measured_margin, measurement_noise, to_measure)
from .search.plan_text import configuration, same_plan
from .strategies import resolve
from .train.fields import example_call

CONFIRM_STEPS = 3  # steps per plan per round at least, the first untimed; the median of the timed ones is its
CONFIRM_ROUNDS = 2  # time, their spread its noise; each round sets every plan up in turn, steps it, releases it
CONFIRM_TIMED_S = 0.6  # short steps get more: about this many predicted seconds of timed steps per plan and round
CONFIRM_MAX_STEPS = 10  # (four timed 65 ms steps put a default layout 7% slow, and a pick 3% slower than it won)


def confirm_steps(records: list[dict]) -> int:
    """Steps per plan and round: CONFIRM_STEPS, or more (up to CONFIRM_MAX_STEPS) so that the median predicted
    plan times about CONFIRM_TIMED_S of steps after the untimed first: a few short steps measure scheduling noise
    as much as the plan."""
    predicted = sorted(r["prediction"]["step_time_s"] for r in records)
    typical = predicted[len(predicted) // 2] if predicted else 0.0
    timed = math.ceil(CONFIRM_TIMED_S / typical) if typical > 0 else CONFIRM_STEPS - 1
    return max(CONFIRM_STEPS, min(CONFIRM_MAX_STEPS, timed + 1))


def plan_auto(model: nn.Module, train_data: Dataset, nproc: int, *, strategy: Strategy | None = None,
              config: TrainConfig | None = None) -> Plan:
    """The search's Plan for training `model` on `train_data` with `nproc` processes (no process starts).

    `strategy` (default `Strategy.auto()`) carries the cluster, the memory and any fixed degrees;
    `config` the global batch size and dtype. Pass the Plan to the Trainer as its strategy.
    """
    strategy = strategy or Strategy.auto()
    if strategy.planning.mode != "auto" and not strategy.planning.plan:
        strategy = dataclasses.replace(strategy, search="auto")
    resolved = resolve(strategy, config or TrainConfig(), nproc, model=model,
                       example=lambda: example_call(model, train_data))
    return resolved.plan


def choose_before_launch(job: JobConfig, argv: list[str]) -> tuple[JobConfig, list[str]]:
    """Resolve --strategy auto / --plan here; returns the job and the ranks' argv, both naming the run's plan.json."""
    from .job import build_job
    out = Path(job.train.out or f"runs/{datetime.now():%Y%m%d-%H%M%S}")
    parts = build_job(job)
    nproc = job.launch.nproc
    resolved = resolve(job.strategy, job.train, nproc, model=parts.model, model_name=parts.name,
                       example=lambda: example_call(parts.model, parts.train_data))
    plan = resolved.plan
    print(plan.describe(), flush=True)
    if not job.strategy.planning.plan:
        plan = confirm_when_unsure(plan, job.strategy.planning.confirm, argv, nproc)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "plan.json"
    if not job.strategy.planning.plan:  # a resume with another --nproc may search again (elastic_plan.replan_on_resume)
        plan.record["chosen_by"] = CHOSEN_BY_SEARCH
        previous = read_previous_plan(path) if job.train.resume else None
        if previous is not None and previous.nproc != nproc:  # the run's plan for its earlier process count
            plan.record["earlier_plans"] = [{k: v for k, v in previous.record.items() if k != "earlier_plans"},
                                            *previous.record.get("earlier_plans", [])]
            plan.record["replanned"] = {"from_nproc": previous.nproc, "to_nproc": nproc, "how": "searched again"}
            print(f"autopar: resumed with {nproc} processes instead of {previous.nproc}: re-planned", flush=True)
    plan.save(path)
    job = dataclasses.replace(job, strategy=dataclasses.replace(job.strategy, plan=str(path)),
                              train=dataclasses.replace(job.train, out=str(out)))
    return job, [*argv, "--plan", str(path), "--out", str(out)]


def confirm_when_unsure(plan: Plan, k: int | None, argv: list[str], nproc: int) -> Plan:
    """What `autopar train --strategy auto` runs, given the search's Plan: the Plan itself, or, when
    plans_to_measure says so, the winner of measuring those plans (confirm), saying first what is measured
    and why. `argv` is the train command (`train --model ...`) the measuring ranks build the job from;
    benchmarks/strategy_user_jobs.py calls this too, so what it validates is what users get."""
    measure = plans_to_measure(plan, k)
    if not measure:
        return plan
    print(why_measure(plan, measure, k), flush=True)
    plan = confirm(plan, measure, argv, nproc)
    print(plan.describe(), flush=True)
    return plan


def why_measure(plan: Plan, measure: list[dict], k: int | None) -> str:
    """The line said before measuring: which plans, and why they are measured rather than trusted."""
    steps = f"for {CONFIRM_ROUNDS} rounds of {confirm_steps(measure)} steps each, one plan at a time, in one launch"
    if k is not None:
        return f"auto: --confirm {k}: measuring the {len(measure)} fastest predicted plans (the default layout " \
               f"among them) {steps}"
    default = plan.record.get("default_layout") or {}
    others = sum(not same_plan(r, plan.record) and not same_plan(r, default) for r in measure)
    error = f"{PREDICTED_TIME_ERROR:.0%}"
    if default.get("runnable") and not same_plan(default, plan.record):
        text = (f"auto: the pick, {plan.configuration()}, is not the default layout, and the model's step times are "
                f"{error} off (median): measuring it"
                + (f", {others} more within that error" if others else "") + " and the default layout")
    else:
        text = f"auto: {len(measure)} plans are within the model's {error} error of each other: measuring them"
    return f"{text} {steps} (--confirm 0: trust the prediction)"


def plans_to_measure(plan: Plan, k: int | None) -> list[dict]:
    """The plans `confirm` runs: `--confirm K` the K fastest predicted (the default layout among them); unset,
    the pick and the default when they differ, and the plans within the model's error of each other
    (decision.to_measure)."""
    record = plan.record
    default = record.get("default_layout") or {}
    usable = default if default.get("runnable") and default.get("fits", True) else None
    return to_measure([record, *record.get("alternatives", [])], usable, k)


def confirm(plan: Plan, records: list[dict], argv: list[str], nproc: int) -> Plan:
    """Run each of `records` (plans) for CONFIRM_ROUNDS x confirm_steps steps and return the fastest measured,
    all recorded.

    One launch for all of them (confirm_ranks.py): the ranks start once and, round after round, set each plan up
    in turn, step it and release it, so no other plan's trainer is alive while one is timed."""
    from .launch import launch
    k = len(records)
    shared = {key: plan.record[key] for key in ("nproc", "num_params", "model", "seq_len", "cluster")
              if key in plan.record}
    began = time.perf_counter()
    folder = Path(tempfile.mkdtemp(prefix="autopar-confirm-"))
    results = []
    try:
        paths = []
        for i, record in enumerate(records):
            candidate = Plan({**shared, **{key: record[key] for key in ("strategy", "train", "prediction")}})
            paths.append(str(folder / f"plan-{i}.json"))
            candidate.save(paths[-1])
            predicted = milliseconds(record["prediction"]["step_time_s"])
            print(f"confirm {i + 1}/{len(records)}: {candidate.configuration()}, predicted {predicted} ms/step",
                  flush=True)
        steps = confirm_steps(records)
        spec = {"argv": list(argv), "plans": paths, "steps": steps, "rounds": CONFIRM_ROUNDS,
                "folder": str(folder / "runs"), "out": str(folder / "measured.json")}
        (folder / "spec.json").write_text(json.dumps(spec))
        print(f"confirm: running the {len(records)} plans in {CONFIRM_ROUNDS} rounds of {steps} steps each "
              f"(the first untimed), one plan alive at a time, in one launch", flush=True)
        code = launch([sys.executable, "-m", "autopar.confirm_ranks", str(folder / "spec.json")], nproc)
        measured = json.loads((folder / "measured.json").read_text()) if code == 0 else [{}] * len(records)
        for i, (record, got) in enumerate(zip(records, measured)):
            entry = {"predicted_rank": i + 1, "strategy": record["strategy"], "train": record["train"],
                     "predicted_step_time_s": record["prediction"]["step_time_s"], "exit_code": code,
                     "default_layout": same_plan(record, plan.record.get("default_layout") or {})}
            if got.get("error"):
                entry["error"] = got["error"]
            elif got.get("step_times_s"):  # each round's first step (allocations, cold caches) ran untimed
                entry.update(measured_step_time_s=statistics.median(got["step_times_s"]),
                             step_times_s=got["step_times_s"], peak_mem_bytes=got["peak_mem_bytes"],
                             noise=measurement_noise(got["step_times_s"]))
            results.append(entry)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    ran = [r for r in results if "measured_step_time_s" in r]
    if not ran:
        why = [r.get("error") or f"exit code {r['exit_code']}" for r in results]
        raise ConfigError(f"--confirm {k}: none of the top {len(records)} plans ran ({'; '.join(why)}); run the plan "
                          f"alone to see why, or drop --confirm")
    best, margin = measured_winner(ran)
    winner = records[best["predicted_rank"] - 1]
    keep = ("strategy", "train", "prediction")
    pool = [plan.record, *plan.record.get("alternatives", [])]
    chosen = {**plan.record, **{key: winner[key] for key in keep},
              "alternatives": [{key: r[key] for key in keep if key in r} for r in pool
                               if not same_plan(r, winner)],
              "confirm": results, "confirm_s": time.perf_counter() - began}
    fastest = min(ran, key=lambda r: r["measured_step_time_s"])
    text = f"{len(ran)} plans ran {CONFIRM_ROUNDS} x {confirm_steps(records)} steps each; "
    if fastest is best:
        text += f"kept the fastest, {winner_text(winner, best)}"
        if margin is not None and not best["default_layout"]:
            text += f", faster than the default layout by more than the measurement's {margin:.0%} noise"
    else:
        faster = 1 - fastest["measured_step_time_s"] / best["measured_step_time_s"]
        text += (f"kept the default layout, {winner_text(winner, best)}: the fastest, {configuration(fastest)}, "
                 f"was {faster:.1%} faster, within the measurement's {margin:.0%} noise (the larger half-range of "
                 f"the two plans' timed steps, at least {MEASUREMENT_NOISE_FLOOR:.0%})")
    chosen["decision"] = {**plan.record.get("decision", {}), "runs": "measured", "text": text,
                          "kept_default": fastest is not best, "measured_margin": margin}
    chosen["why"] = f"Predicted: {plan.record.get('why', '')} Measured: {chosen['decision']['text']}."
    return Plan(chosen, source="the confirmed search")


def measured_winner(ran: list[dict]) -> tuple[dict, float | None]:
    """The measured plan that runs, and the margin it was judged by (None when the default was not measured):
    the fastest, unless the default layout was measured too and the fastest beats it by no more than the
    measurement's noise (decision.beats_measured_default), then the default."""
    fastest = min(ran, key=lambda r: r["measured_step_time_s"])
    default = next((r for r in ran if r["default_layout"]), None)
    if default is None:
        return fastest, None
    margin = measured_margin(fastest["step_times_s"], default["step_times_s"])
    if fastest is default or beats_measured_default(fastest["measured_step_time_s"],
                                                     default["measured_step_time_s"], margin):
        return fastest, margin
    return default, margin


def winner_text(winner: dict, measured: dict) -> str:
    return (f"{configuration(winner)} ({milliseconds(measured['measured_step_time_s'])} ms/step measured, "
            f"{milliseconds(winner['prediction']['step_time_s'])} predicted)")

