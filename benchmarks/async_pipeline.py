"""Asynchronous pipelines: does the missing flush of PipeDream-2BW and PipeDream pay for their stale weights?

One run trains gpt-mini with `autopar train` (one process per pipeline rank, gloo on CPU,
or CUDA with --device cuda) under each (schedule, pp): 1f1b (synchronous, a flush every
step), pipedream-2bw (no flush; step t's gradient computed on W(t-1)) and pipedream (weight
stashing: no flush, one update per micro-batch, stage s delayed pp-1-s updates), at pp 2 and
4, with the same data, seed and optimizer. 1f1b and 2bw take m = global/micro micro-batches
per step; pipedream takes one per step (its semantics), so it runs m times as many steps over
the same samples (`--steps` counts 1f1b's steps; pipedream's warm-up is m times longer too).
From each run's metrics.jsonl it reports the median step time after warm-up (`step_time_s`),
the time per micro-batch, two measured steady-state fractions (below: `idle`, the bubble, and
`1-compute/wall`) beside the simulator's prediction of the bubble for the same lists (unit costs
F=1, B=2, no transfer time), the final training loss,
and plots the loss against optimizer steps, against samples seen and against
wall time (the cumulative step time) to a PNG; pipedream's per-micro-batch losses are averaged
over m steps (the samples of one 1f1b step) so the curves compare like with like.

    python benchmarks/async_pipeline.py                       # gpt-mini, 300 steps (long on CPU)
    python benchmarks/async_pipeline.py --steps 20 --quick    # smoke test: gpt-tiny, pp 2
    python benchmarks/async_pipeline.py --out runs/async_pipeline --png runs/async_pipeline.png
    python benchmarks/async_pipeline.py --steps 24 --no-plot    # the bubble table only
    python benchmarks/async_pipeline.py --pp 2 --steps 16 --count-subnormals --no-plot   # denormals? (untimed)
    python benchmarks/async_pipeline.py --steps 16 --tied0 --no-plot   # also pipedream --tied-delay 0

gpt models tie the embedding and the output head across the first and last stage. pipedream
applies that weight's summed gradient pp - 1 steps late by default (pipeline/async_schedules.py,
`tied_steps_due`); `--tied0` adds `pipedream-tied0`, the same schedule with `--tied-delay 0` (the
two stages meet every micro-batch to sum it), to show what the delay removes.

Both fractions are taken per pipeline rank over the steady steps (the first --skip 1f1b-steps'
worth of warm-up and the last step, a drain, left out), as a sum over those steps of a time over
the sum of the rank's step wall times (the trainer's timer around each step), then averaged over
ranks (`steady_fraction`). From the per-step metrics (each averaged over replicas):

- `idle` (the pipeline bubble, the literature's: the time a device sits waiting for its pipeline
  peers; what the simulator predicts): `blocked_s_per_stage` / `step_s_per_stage`. Blocked is the
  wall time the rank spent inside waits for other pipeline ranks, timed around each wait by the
  runtime and engines (`timing.WaitTally`, kind "pipeline"): receives of activations and gradients,
  sends completing, a channel's first metadata, the all-reduce of a weight tied across stages,
  2BW's wait for step t's all-reduce before its deferred update, and on 1f1b the step's closing
  collectives (the norm over pp, the loss and flags, the peak memory): the flush's end. Transfer
  time is inside these waits (the simulator's transfers are free). Not included: data-parallel
  waits (`dp_wait_s_per_stage`, kept apart: the gradient sync, the target count); and, outside the
  step's timer, the no-flush schedules' posting of their all-reduce and PipeDream's reading of a
  step's report pp steps later.
- `1-compute/wall`: 1 - `busy_s_per_stage` / `step_s_per_stage`, busy being the forwards' and
  backwards' compute events. This is idle plus everything else the step does on the rank: the
  optimizer update (pipedream: one per micro-batch, its rule), loading batches, norms and clipping,
  posting transfers, the data-parallel copies and the trainer's bookkeeping. It was this benchmark's
  "bubble" until 2026-11-26.

With more ranks than cores (pp 4 on two cores) a rank's wait is time another rank computes, so
both fractions there are a property of the machine as much as of the schedule.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

SCHEDULES = ("1f1b", "pipedream-2bw", "pipedream", "pipedream-tied0")
# name -> (--schedule, extra flags): pipedream-tied0 sums a tied weight's gradient every step (--tied-delay 0,
# the owners meet each micro-batch), where pipedream's default delays it by pp - 1 steps
VARIANTS = {"pipedream-tied0": ("pipedream", ["--tied-delay", "0"])}


def per_step(args: argparse.Namespace, schedule: str) -> int:
    """Micro-batches per optimizer step: pipedream updates after every one."""
    return 1 if VARIANTS.get(schedule, (schedule,))[0] == "pipedream" else args.global_batch // args.micro_batch


def run_one(args: argparse.Namespace, schedule: str, pp: int, out: Path) -> list[dict]:
    stretch = args.global_batch // args.micro_batch // per_step(args, schedule)
    command = [sys.executable, "-m", "autopar", "train", "--model", args.model,
               *[flag for item in args.model_arg for flag in ("--model-arg", item)], "--pp", str(pp),
               "--schedule", VARIANTS.get(schedule, (schedule, []))[0], *VARIANTS.get(schedule, (schedule, []))[1],
               "--steps", str(args.steps * stretch),
               "--global-batch-size", str(args.micro_batch * per_step(args, schedule)),
               "--micro-batch-size", str(args.micro_batch), "--seq-len", str(args.seq_len), "--lr", str(args.lr),
               "--warmup-steps", str(args.warmup * stretch), "--eval-every", "0", "--checkpoint-every", "0",
               "--log-every", "1", "--no-progress",
               "--device", args.device, "--nproc", str(pp), "--out", str(out), "--seed", str(args.seed)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    startup = []  # lines every rank process runs first (a sitecustomize)
    if args.flush_denormal:
        startup += ["import torch", "torch.set_flush_denormal(True)"]
    if args.count_subnormals:
        startup += [f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})",
                    "import subnormal_census"]
        env["SUBNORMAL_CENSUS_DIR"] = str((out / "subnormals").resolve())
    if startup:
        folder = Path(args.out) / "rank_startup"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "sitecustomize.py").write_text("\n".join(startup) + "\n")
        env["PYTHONPATH"] = os.pathsep.join([str(folder.resolve())] + [p for p in [env.get("PYTHONPATH")] if p])
    began = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    print(f"  {schedule} pp={pp}: {time.perf_counter() - began:.0f} s", flush=True)
    if args.count_subnormals:
        print(f"    subnormals: {census(out / 'subnormals')}", flush=True)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def census(folder: Path) -> str:
    """The subnormal census of one run (benchmarks/subnormal_census.py), summed over ranks and steps."""
    totals, steps = {}, 0
    for path in sorted(folder.glob("rank*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            steps = max(steps, record.pop("step"))
            for key, value in record.items():
                totals[key] = totals.get(key, 0) + value
    ranks = len(list(folder.glob("rank*.jsonl")))
    found = ", ".join(f"{k} {v}" for k, v in sorted(totals.items(), key=lambda kv: -kv[1])) or "none"
    return f"{found} (over {ranks} ranks, {steps} optimizer steps)"


def summarise(records: list[dict], skip: int, microbatches: int) -> dict:
    """Medians over the steps after `skip` (warm-up) and before the last (the drain)."""
    timed = [r for r in records if skip < r["step"] < len(records)]
    step = statistics.median(r["step_time_s"] for r in timed)
    idle = steady_fraction(records, skip, "blocked_s_per_stage")
    last = records[-max(1, len(records) // 10):]
    return {"step_time_s": step, "per_microbatch_s": step / microbatches,
            "wall_s": sum(r["step_time_s"] for r in records),
            "idle": statistics.fmean(idle), "idle_per_stage": idle,
            "non_compute": statistics.fmean(steady_fraction(records, skip, "busy_s_per_stage", complement=True)),
            "mean_loss_last_10pct": statistics.fmean(r["loss"] for r in last)}


def steady_fraction(records: list[dict], skip: int, key: str, complement: bool = False) -> list[float]:
    """Per stage, over the steady steps: sum of `key` seconds / sum of step seconds (1 minus it with
    `complement`). idle: key "blocked_s_per_stage"; 1-compute/wall: "busy_s_per_stage", complement."""
    steady = [r for r in records if skip < r["step"] < len(records)]
    stages = len(steady[0][key])
    share = [sum(r[key][s] for r in steady) / sum(r["step_s_per_stage"][s] for r in steady) for s in range(stages)]
    return [1 - v for v in share] if complement else share


def predicted_bubble(schedule: str, pp: int, m: int, tied: bool) -> float:
    """The simulator's bubble for the same lists, unit costs (F=1, B=2, transfers free), mean over ranks.

    1f1b: one flushing step. pipedream-2bw: its steady state (no meeting between steps). pipedream: its
    steady state (a tied weight's gradient arrives pp - 1 steps late: no meeting); pipedream-tied0, with a
    weight tied across stages (`tied`: gpt's embedding and head, where the last stage's next forward needs
    stage 0's gradient of the same micro-batch) modelled as the ranks meeting each step.
    """
    from autopar.pipeline.async_schedules import (segment_lists, stash_lists, steady_state_bubble,
                                                  step_time_with_meeting, whole_run)
    from autopar.pipeline.schedules import build_schedule
    from autopar.pipeline.simulate import simulate

    if schedule == "1f1b":
        return statistics.fmean(simulate(build_schedule("1f1b", pp=pp, num_microbatches=m), pp=pp, num_stages=pp,
                                         num_microbatches=m).bubble.values())
    if schedule == "pipedream-2bw":
        lists = segment_lists(pp=pp, m=m, steps=range(6), flush_after={5})
        timeline = simulate(whole_run(lists), pp=pp, num_stages=pp, num_microbatches=6 * m)
        return statistics.fmean(steady_state_bubble(timeline, lists).values())
    lists = stash_lists(pp=pp, steps=range(3 * pp), flush_after={3 * pp - 1})
    if tied and schedule == "pipedream-tied0":
        return 1 - 3 / step_time_with_meeting(pp=pp, m=1, lists=lists[pp])
    timeline = simulate(whole_run(lists), pp=pp, num_stages=pp, num_microbatches=3 * pp)
    steady = {t: lists[t] for t in range(2 * pp + 1)}  # the warm-up (skip pp) and the drain left out
    return statistics.fmean(steady_state_bubble(timeline, steady, skip=pp).values())


def averaged(records: list[dict], m: int) -> list[tuple[int, float, float]]:
    """(samples-step index, mean loss, cumulative wall time) per group of m steps (one 1f1b step's samples)."""
    out, wall = [], 0.0
    for i in range(0, len(records) - m + 1, m):
        group = records[i:i + m]
        wall += sum(r["step_time_s"] for r in group)
        out.append((i // m + 1, statistics.fmean(r["loss"] for r in group), wall))
    return out


def plot(results: dict, png: Path, args: argparse.Namespace) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (by_step, by_samples, by_time) = plt.subplots(1, 3, figsize=(16, 4.5))
    styles = {"1f1b": "-", "pipedream-2bw": "--", "pipedream": ":", "pipedream-tied0": "-."}
    for (schedule, pp), records in sorted(results.items()):
        m = args.global_batch // args.micro_batch // per_step(args, schedule)  # steps per 1f1b step's samples
        points = averaged(records, m)
        label = f"{schedule} pp={pp}"
        by_step.plot([r["step"] for r in records], [r["loss"] for r in records], styles[schedule], label=label,
                     alpha=0.8)
        by_samples.plot([i * args.global_batch for i, _, _ in points], [loss for _, loss, _ in points],
                        styles[schedule], label=label)
        by_time.plot([w for _, _, w in points], [loss for _, loss, _ in points], styles[schedule], label=label)
    by_step.set_xlabel("optimizer step (pipedream: one micro-batch each)")
    by_step.set_xscale("log")
    by_samples.set_xlabel(f"samples seen (pipedream averaged over {args.global_batch // args.micro_batch} steps)")
    by_time.set_xlabel("wall time (s, sum of step times)")
    for ax in (by_step, by_samples, by_time):
        ax.set_ylabel("training loss")
        ax.legend()
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    print(f"wrote {png}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt-mini")
    parser.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="passed to autopar train (repeatable)")
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--tied", choices=("auto", "yes", "no"), default="auto",
                        help="does the model tie a weight across stages (auto: gpt models do); for the prediction")
    parser.add_argument("--steps", type=int, default=None, help="1f1b's steps (default 300; --quick: 6)")
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--skip", type=int, default=3, help="steps left out of the step-time median")
    parser.add_argument("--out", default="runs/async_pipeline")
    parser.add_argument("--png", default="runs/async_pipeline.png")
    parser.add_argument("--quick", action="store_true", help="gpt-tiny, pp 2, short sequences")
    parser.add_argument("--no-plot", action="store_true", help="the table only")
    parser.add_argument("--flush-denormal", action="store_true",
                        help="ranks flush denormal floats to zero (torch.set_flush_denormal); an A/B knob: "
                             "--count-subnormals found no denormals in these runs (docs/benchmarks.md)")
    parser.add_argument("--count-subnormals", action="store_true",
                        help="count the subnormal floats each rank computes with (benchmarks/subnormal_census.py) "
                             "and print the totals per run; slows every run several times: its times mean nothing")
    parser.add_argument("--tied0", action="store_true", help="also run pipedream with --tied-delay 0 (a tied "
                        "weight's gradient summed every step: its first and last stages meet each micro-batch)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each (schedule, pp), interleaved; the "
                        "table gives the median over them (a loaded machine drifts between runs)")
    args = parser.parse_args()
    if args.quick:
        args.model, args.pp, args.seq_len, args.global_batch = "gpt-tiny", [2], 64, 8
        args.png = str(Path(args.out) / "async_pipeline_quick.png")  # never over a figure the docs show
    if args.steps is None:
        args.steps = 6 if args.quick else 300
    print(f"load average at the start {os.getloadavg()[0]:.1f}", flush=True)
    results, repeats = {}, {}
    for rep in range(args.repeats):
        for pp in args.pp:
            for schedule in SCHEDULES:
                if schedule == "pipedream-tied0" and not args.tied0:
                    continue
                out = Path(args.out) / (f"{schedule}-pp{pp}" + (f"-r{rep}" if args.repeats > 1 else ""))
                repeats.setdefault((schedule, pp), []).append(run_one(args, schedule, pp, out))
    results = {key: runs[0] for key, runs in repeats.items()}  # the losses are the same in every repeat
    m = args.global_batch // args.micro_batch
    print(f"\n{args.model}, {args.steps * args.global_batch} samples: {args.steps} steps of {m} micro-batches of "
          f"{args.micro_batch} x {args.seq_len} tokens (pipedream: {args.steps * m} steps of one), device "
          f"{args.device}, {args.threads} thread(s) per rank, load average at the end {os.getloadavg()[0]:.1f}")
    print(f"{'schedule':>14} {'pp':>3} {'steps':>6} {'step s':>8} {'per mb s':>9} {'vs 1f1b':>8} {'idle':>6} "
          f"{'1-compute/wall':>14} {'predicted':>9} {'wall s':>8} {'mean loss last 10%':>19}")
    tied = args.model.startswith("gpt") if args.tied == "auto" else args.tied == "yes"
    for (schedule, pp), runs in sorted(repeats.items(), key=lambda kv: (kv[0][1], SCHEDULES.index(kv[0][0]))):
        skip = args.skip * m // per_step(args, schedule)
        rows = [summarise(records, skip, per_step(args, schedule)) for records in runs]
        row = {key: statistics.median(r[key] for r in rows) for key in rows[0] if key != "idle_per_stage"}
        by_stage = [statistics.median(r["idle_per_stage"][s] for r in rows) for s in range(pp)]
        base = statistics.median(summarise(records, args.skip, m)["per_microbatch_s"]
                                 for records in repeats[("1f1b", pp)])
        print(f"{schedule:>14} {pp:>3} {len(runs[0]):6d} {row['step_time_s']:8.3f} {row['per_microbatch_s']:9.4f} "
              f"{row['per_microbatch_s'] / base:8.2f} {row['idle']:6.2f} {row['non_compute']:14.2f} "
              f"{predicted_bubble(schedule, pp, m, tied):9.2f} {row['wall_s']:8.1f} "
              f"{row['mean_loss_last_10pct']:19.4f}   idle by stage " + " ".join(f"{v:.2f}" for v in by_stage) +
              (" | repeats: idle " + " ".join(f"{r['idle']:.2f}" for r in rows) + ", 1-compute/wall " +
               " ".join(f"{r['non_compute']:.2f}" for r in rows) if len(rows) > 1 else ""))
    if args.no_plot:
        return
    try:
        plot(results, Path(args.png), args)
    except ImportError:
        print("plot skipped: install matplotlib (pip install 'autopar[plot]')")


if __name__ == "__main__":
    main()
