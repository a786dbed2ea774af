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
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from autopar.search.cluster import resolve_cluster
from autopar.search.cost import Candidate, StepModel
from autopar.search.profile import profile_model


def measured(run: Path) -> list[int]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    peaks = [r["peak_mem_bytes_per_stage"] for r in records if "peak_mem_bytes_per_stage" in r]
    return [max(p[s] for p in peaks) for s in range(len(peaks[0]))]


def main() -> None:
    small_run, large_run = Path(sys.argv[1]), Path(sys.argv[2])
    profile = profile_model("gpt-tiny", seq_len=128)
    cluster = resolve_cluster("cpu-local", nproc=2).replace(memory_headroom=1.0)
    predicted = []
    for mbs in (8, 32):
        model = StepModel(profile, cluster, global_batch_size=mbs * 4)
        e = model.evaluate(Candidate(dp=1, tp=1, pp=2, micro_batch_size=mbs, num_microbatches=4, schedule="1f1b",
                                     bounds=(0, 2, 4)))
        predicted.append([m.total for m in e.memory_per_stage])
        print(f"mbs={mbs}: predicted per stage (no headroom) " +
              ", ".join(f"{m.total / 2**20:.2f} MiB ({', '.join(f'{k} {v / 2**20:.2f}' for k, v in m.to_dict().items() if k not in ('total', 'headroom'))})"
                        for m in e.memory_per_stage))
    small, large = measured(small_run), measured(large_run)
    print(f"measured peak RSS per stage: mbs=8 {[round(v / 2**20, 1) for v in small]} MiB, "
          f"mbs=32 {[round(v / 2**20, 1) for v in large]} MiB")
    for s in range(len(small)):
        want = (large[s] - small[s]) / 2**20
        got = (predicted[1][s] - predicted[0][s]) / 2**20
        print(f"stage {s}: micro-batch-dependent memory (mbs 32 minus mbs 8): predicted {got:.2f} MiB, "
              f"measured {want:.2f} MiB, error {(got - want) / want:+.0%}")


if __name__ == "__main__":
    main()
