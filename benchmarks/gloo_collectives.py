"""What gloo's ZeRO collectives cost beside its all-reduce of the same buffer, against the ring rule.

    PYTHONPATH=src python benchmarks/gloo_collectives.py [--numel 200000 3300000] [--world 2 4] [--repeats 12]
    PYTHONPATH=src python benchmarks/gloo_collectives.py --quick    # smoke test: 64 Ki elements, world 2, 4 calls

For each world size and buffer of `--numel` fp32 elements (200 K: a gpt-mini block, one FSDP2 unit; 3.3 M:
gpt-mini's gradient bucket in benchmarks/zero_memory.py), the buffer is reduced by `all_reduce` (each rank gets
all of it), reduce-scattered by `reduce_scatter_single` (each rank gets 1/n) and re-assembled by
`all_gather_single` from 1/n shards: the calls zero/grads.py, zero/optimizer.py and FSDP2 make. The three are
interleaved call by call, one thread per rank; medians of the rank-0 times after two warm-up calls. The ring
rule (search/cluster.py's fallback) says reduce-scatter / all-reduce = all-gather / all-reduce = 0.5; a
calibrated cluster measures each instead (calibrate_ranks.py). zero/grads.py's all-reduce on gloo comes from
the reduce-scatter column.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, world: int, port: int, sizes: list[int], repeats: int) -> None:
    from autopar.distributed import all_gather_single, reduce_scatter_single
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    for numel in sizes:
        full, shard = torch.randn(numel - numel % world), torch.empty(numel // world)
        calls = {"all_reduce": lambda: dist.all_reduce(full),
                 "reduce_scatter": lambda: reduce_scatter_single(shard, full),
                 "all_gather": lambda: all_gather_single(full, shard)}
        times: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(repeats + 2):
            for name, call in calls.items():
                dist.barrier()
                began = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - began)
        if rank == 0:
            ar, rs, ag = (statistics.median(times[k][2:]) * 1e3 for k in calls)
            print(f"world {world} numel {numel:>9,}: all_reduce {ar:7.2f} ms  reduce_scatter {rs:7.2f} ms  "
                  f"all_gather {ag:7.2f} ms  rs/ar {rs / ar:.2f}  ag/ar {ag / ar:.2f}  (ring rule: 0.50)", flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, nargs="+", default=[200_000, 3_300_000])
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--quick", action="store_true", help="smoke test: 64 Ki elements, world 2, 4 calls")
    args = parser.parse_args()
    if args.quick:
        args.numel, args.world, args.repeats = [65_536], [2], 4
    from autopar.launch import free_port
    print(f"gloo, fp32 buffers of {args.numel} elements; load average {os.getloadavg()[0]:.1f}", flush=True)
    for world in args.world:
        mp.spawn(_rank, args=(world, free_port(), args.numel, args.repeats), nprocs=world)


if __name__ == "__main__":
    main()
