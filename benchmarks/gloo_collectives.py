"""Why ZeRO-1 all-reduces on gloo: gloo's reduce-scatter against its all-reduce of the same buffer.

    PYTHONPATH=src python benchmarks/gloo_collectives.py [--numel 3300000] [--world 2 4] [--repeats 12]
    PYTHONPATH=src python benchmarks/gloo_collectives.py --quick    # smoke test: 64 Ki elements, world 2, 4 calls

For each world size, one fp32 buffer of `--numel` elements (the size of gpt-mini's gradient bucket in
benchmarks/zero_memory.py) is reduced by `reduce_scatter_single` (each rank gets 1/n) and by `all_reduce`
(each rank gets all of it), the two interleaved call by call, one thread per rank; medians of the rank-0
times after two warm-up calls, and their ratio. zero/grads.py picks all-reduce on gloo from this.
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


def _rank(rank: int, world: int, port: int, numel: int, repeats: int) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    full, shard = torch.randn(numel - numel % world), torch.empty(numel // world)
    times: dict[str, list[float]] = {"reduce_scatter": [], "all_reduce": []}
    for _ in range(repeats):
        for name in times:
            dist.barrier()
            began = time.perf_counter()
            if name == "reduce_scatter":
                dist.reduce_scatter_single(shard, full)
            else:
                dist.all_reduce(full)
            times[name].append(time.perf_counter() - began)
    if rank == 0:
        rs, ar = (statistics.median(times[k][2:]) * 1e3 for k in ("reduce_scatter", "all_reduce"))
        print(f"world {world}: reduce_scatter {rs:7.1f} ms  all_reduce {ar:7.1f} ms  ratio rs/ar {rs / ar:.2f}",
              flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=3_300_000)
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--quick", action="store_true", help="smoke test: 64 Ki elements, world 2, 4 calls")
    args = parser.parse_args()
    if args.quick:
        args.numel, args.world, args.repeats = 65_536, [2], 4
    from autopar.launch import free_port
    print(f"gloo, fp32 buffer of {args.numel:,} elements; load average {os.getloadavg()[0]:.1f}", flush=True)
    for world in args.world:
        mp.spawn(_rank, args=(world, free_port(), args.numel, args.repeats), nprocs=world)


if __name__ == "__main__":
    main()
