"""How long the strategy search takes for a GPT-20B-sized model on a 64-GPU preset (target: < 60 s).

The model (GPT with 44 layers, d_model 6144, 64 heads, vocabulary 50304, 2048-token sequences:
about 20B parameters) is traced ONCE on the meta device with 2 layers and its per-layer costs
scaled to 44 (search/profile.py, with_layers); every configuration is then scored from those
cached per-block costs. Prints the trace time, the number of configurations scored and the
search time, and the top plans.

    PYTHONPATH=src python benchmarks/strategy_search_speed.py [--cluster a100-80gb] [--global-batch 512]
    PYTHONPATH=src python benchmarks/strategy_search_speed.py --quick   # smoke test: 8 devices, 2 schedules
"""

from __future__ import annotations

import argparse
import os
import time

from autopar.search.cluster import resolve_cluster
from autopar.search.cost import StepModel
from autopar.search.profile import profile_model
from autopar.search.search import SearchSpace, exhaustive, require_fit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", default="a100-80gb")
    parser.add_argument("--nproc", type=int, default=64)
    parser.add_argument("--global-batch", type=int, default=512)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--schedules", default="gpipe,1f1b,interleaved-1f1b,eager-1f1b,zb-h1",
                        help="comma-separated schedules to search")
    parser.add_argument("--partitions", default="uniform,parameters,time", help="comma-separated partition methods")
    parser.add_argument("--quick", action="store_true", help="smoke test: the same model on 8 devices, global "
                        "batch 32, schedules 1f1b and zb-h1, uniform partitions")
    args = parser.parse_args()
    if args.quick:
        args.nproc, args.global_batch, args.schedules, args.partitions = 8, 32, "1f1b,zb-h1", "uniform"
    began = time.perf_counter()
    profile = profile_model("gpt-small", seq_len=args.seq_len, tp_degrees=(1, 2, 4, 8), layers=44,
                            model_args={"n_head": 64, "d_model": 6144, "max_seq_len": args.seq_len},
                            vocab_size=50304)
    traced = time.perf_counter() - began
    cluster = resolve_cluster(args.cluster, nproc=args.nproc)
    model = StepModel(profile, cluster, global_batch_size=args.global_batch, dtype="bf16")
    began = time.perf_counter()
    space = SearchSpace(nproc=args.nproc, schedules=tuple(args.schedules.split(",")),
                        partitions=tuple(args.partitions.split(",")))
    began_cpu = time.process_time()
    result = exhaustive(model, space)
    cpu = time.process_time() - began_cpu
    searched = time.perf_counter() - began
    print(f"model: {profile.num_params / 1e9:.2f}B parameters, {profile.num_blocks} blocks "
          f"(traced with 2 layers, scaled to 44) in {traced:.1f} s; tp refused: {sorted(profile.tp_refused)}")
    print(f"cluster: {cluster.name} x {cluster.num_devices} ({cluster.devices_per_node} per node)")
    print(f"search: {result.evaluated} configurations scored ({result.pruned} over memory, "
          f"{len(result.ranked)} distinct fitting) in {searched:.1f} s wall, {cpu:.1f} s CPU "
          f"({cpu / max(result.evaluated, 1) * 1e3:.2f} ms CPU each); schedules {args.schedules}; "
          f"partitions {args.partitions}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores "
          f"(wall exceeds CPU when others share them)")
    require_fit(result, model)
    for e in result.ranked[:5]:
        print(f"  {e.step_time_s:8.3f} s  {e.tokens_per_s:10.0f} tok/s  bubble {e.bubble:5.1%}  comm {e.comm_share:5.1%}"
              f"  peak {e.peak_memory / 2**30:6.1f} GiB  {e.candidate.describe()}")


if __name__ == "__main__":
    main()
