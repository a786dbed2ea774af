"""Predicted vs measured peak memory per pipeline stage, for gpt-tiny at pp=2.

On CPU the trainer's peak is the process's peak resident set (metrics.py), which includes the
Python, torch and gloo runtime (hundreds of MiB) that the memory model does not predict. So
two runs that differ only in micro-batch size (same micro-batch count) are compared: the
difference of their measured peaks is the memory that depends on the micro-batch
(activations, stashed inputs, transient, buffers), which is what the model must get right.

    PYTHONPATH=src python -m autopar train --model gpt-tiny --pp 2 --nproc 2 --steps 3 --micro-batch-size 8 \
        --global-batch-size 32 --seq-len 128 --out /tmp/memrun_8 --no-progress --eval-batches 1
    (the same with 32 and 128 into /tmp/memrun_32), then
    PYTHONPATH=src python benchmarks/strategy_memory_check.py /tmp/memrun_8 /tmp/memrun_32
    PYTHONPATH=src python benchmarks/strategy_memory_check.py --quick   # smoke test: makes both runs, 2 x 32 tokens
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from autopar.search.cluster import resolve_cluster
from autopar.search.cost import Candidate, StepModel
from autopar.search.profile import profile_model


def measured(run: Path) -> list[int]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    peaks = [r["peak_mem_bytes_per_stage"] for r in records if "peak_mem_bytes_per_stage" in r]
    return [max(p[s] for p in peaks) for s in range(len(peaks[0]))]


def train(out: Path, mbs: int, seq_len: int, steps: int) -> Path:
    """The documented run (gpt-tiny, pp 2, 4 micro-batches of `mbs`) into `out`."""
    subprocess.run([sys.executable, "-m", "autopar", "train", "--model", "gpt-tiny", "--pp", "2", "--nproc", "2",
                    "--steps", str(steps), "--micro-batch-size", str(mbs), "--global-batch-size", str(4 * mbs),
                    "--seq-len", str(seq_len), "--out", str(out), "--no-progress", "--eval-batches", "1"],
                   check=True, capture_output=True, text=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("small_run", nargs="?", help="the run at micro-batch size 8 (seq 128)")
    parser.add_argument("large_run", nargs="?", help="the run at micro-batch size 32 (seq 128)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: make the two runs here (micro-batch sizes 2 and 8, 32 tokens, 2 steps)")
    args = parser.parse_args()
    seq_len, sizes = (32, (2, 8)) if args.quick else (128, (8, 32))
    if args.quick:
        work = Path(tempfile.mkdtemp(prefix="strategy_memory_check-"))
        small_run, large_run = (train(work / f"mbs{mbs}", mbs, seq_len, steps=2) for mbs in sizes)
    elif args.small_run and args.large_run:
        small_run, large_run = Path(args.small_run), Path(args.large_run)
    else:
        parser.error("give the two run folders (see the commands above), or --quick")
    profile = profile_model("gpt-tiny", seq_len=seq_len)
    cluster = resolve_cluster("cpu-local", nproc=2).replace(memory_headroom=1.0)
    predicted = []
    for mbs in sizes:
        model = StepModel(profile, cluster, global_batch_size=mbs * 4)
        e = model.evaluate(Candidate(dp=1, tp=1, pp=2, micro_batch_size=mbs, num_microbatches=4, schedule="1f1b",
                                     bounds=(0, 2, 4)))
        predicted.append([m.total for m in e.memory_per_stage])
        print(f"mbs={mbs}: predicted per stage (no headroom) " +
              ", ".join(f"{m.total / 2**20:.2f} MiB ({', '.join(f'{k} {v / 2**20:.2f}' for k, v in m.to_dict().items() if k not in ('total', 'headroom'))})"
                        for m in e.memory_per_stage))
    small, large = measured(small_run), measured(large_run)
    print(f"measured peak RSS per stage: mbs={sizes[0]} {[round(v / 2**20, 1) for v in small]} MiB, "
          f"mbs={sizes[1]} {[round(v / 2**20, 1) for v in large]} MiB")
    for s in range(len(small)):
        want = (large[s] - small[s]) / 2**20
        got = (predicted[1][s] - predicted[0][s]) / 2**20
        error = f"{(got - want) / want:+.0%}" if want else "undefined (nothing measured grew)"
        print(f"stage {s}: micro-batch-dependent memory (mbs {sizes[1]} minus mbs {sizes[0]}): predicted "
              f"{got:.2f} MiB, measured {want:.2f} MiB, error {error}")


if __name__ == "__main__":
    main()
