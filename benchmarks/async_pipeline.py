"""Asynchronous pipelines: does PipeDream-2BW's missing flush pay for its stale gradients?

One run trains gpt-mini with `autopar train` (one process per pipeline rank, gloo on CPU,
or CUDA with --device cuda) under each (schedule, pp): 1f1b (synchronous, a flush every
step) and pipedream-2bw (no flush; step t's gradient computed on W(t-1)), at pp 2 and 4,
with the same data, seed, optimizer and number of micro-batches. From each run's
metrics.jsonl it reports the median step time after warm-up (`step_time_s`), the measured
bubble the engine logs (`bubble_fraction`), the final training loss, and plots the loss
against optimizer steps and against wall time (the cumulative step time) to a PNG.

    python benchmarks/async_pipeline.py                       # gpt-mini, 300 steps (long on CPU)
    python benchmarks/async_pipeline.py --steps 20 --quick    # smoke test: gpt-tiny, pp 2
    python benchmarks/async_pipeline.py --out runs/async_pipeline --png docs/benchmarks/async_pipeline.png

Not in the comparison: PipeDream weight stashing (`pipedream`), not implemented yet.
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

SCHEDULES = ("1f1b", "pipedream-2bw")


def run_one(args: argparse.Namespace, schedule: str, pp: int, out: Path) -> list[dict]:
    command = [sys.executable, "-m", "autopar", "train", "--model", args.model, "--pp", str(pp),
               "--schedule", schedule, "--steps", str(args.steps), "--global-batch-size", str(args.global_batch),
               "--micro-batch-size", str(args.micro_batch), "--seq-len", str(args.seq_len), "--lr", str(args.lr),
               "--warmup-steps", str(args.warmup), "--eval-every", "0", "--log-every", "1", "--no-progress",
               "--device", args.device, "--nproc", str(pp), "--out", str(out), "--seed", str(args.seed)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    began = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    print(f"  {schedule} pp={pp}: {time.perf_counter() - began:.0f} s", flush=True)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def summarise(records: list[dict], skip: int) -> dict:
    timed = [r for r in records if r["step"] > skip]
    return {"step_time_s": statistics.median(r["step_time_s"] for r in timed),
            "bubble": statistics.median(r.get("bubble_fraction", float("nan")) for r in timed),
            "final_loss": records[-1]["loss"],
            "mean_loss_last_10pct": statistics.fmean(r["loss"] for r in records[-max(1, len(records) // 10):])}


def plot(results: dict, png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4))
    for (schedule, pp), records in sorted(results.items()):
        steps = [r["step"] for r in records]
        losses = [r["loss"] for r in records]
        wall, total = [], 0.0
        for r in records:
            total += r["step_time_s"]
            wall.append(total)
        style = "-" if schedule == "1f1b" else "--"
        by_step.plot(steps, losses, style, label=f"{schedule} pp={pp}")
        by_time.plot(wall, losses, style, label=f"{schedule} pp={pp}")
    by_step.set_xlabel("optimizer step")
    by_time.set_xlabel("wall time (s, sum of step times)")
    for ax in (by_step, by_time):
        ax.set_ylabel("training loss")
        ax.legend()
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    print(f"wrote {png}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt-mini")
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=300)
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
    parser.add_argument("--png", default="docs/benchmarks/async_pipeline.png")
    parser.add_argument("--quick", action="store_true", help="gpt-tiny, pp 2, short sequences")
    args = parser.parse_args()
    if args.quick:
        args.model, args.pp, args.seq_len = "gpt-tiny", [2], 64
    results = {}
    for pp in args.pp:
        for schedule in SCHEDULES:
            results[(schedule, pp)] = run_one(args, schedule, pp, Path(args.out) / f"{schedule}-pp{pp}")
    m = args.global_batch // args.micro_batch
    print(f"\n{args.model}, {args.steps} steps, {m} micro-batches of {args.micro_batch} x {args.seq_len} tokens "
          f"per step, device {args.device}, {args.threads} thread(s) per rank")
    print(f"{'schedule':>14} {'pp':>3} {'step s':>8} {'vs 1f1b':>8} {'bubble':>7} {'final loss':>11} "
          f"{'mean loss last 10%':>19}")
    for (schedule, pp), records in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        row = summarise(records, args.skip)
        base = summarise(results[("1f1b", pp)], args.skip)["step_time_s"]
        print(f"{schedule:>14} {pp:>3} {row['step_time_s']:8.3f} {row['step_time_s'] / base:8.2f} "
              f"{row['bubble']:7.2f} {row['final_loss']:11.4f} {row['mean_loss_last_10pct']:19.4f}")
    try:
        plot(results, Path(args.png))
    except ImportError:
        print("plot skipped: install matplotlib (pip install 'autopar[plot]')")


if __name__ == "__main__":
    main()
