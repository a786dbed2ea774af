"""One rank of `autopar calibrate`'s link measurement: gloo point-to-point and all-reduce per group size.

Started on N local ranks by the project's launcher (launch.py). Times each operation at a
small and a large size and fits latency plus bandwidth (alpha-beta) to the two points:
point-to-point t = a + S / B; ring all-reduce over n ranks t = 2(n-1) a + 2(n-1)/n S / B; and the
node's aggregate: every rank sends S to the next at once, t = a + N S / B_node (what all ranks of
this host move together; on one host it is near one pair's rate, not N times it).
Rank 0 writes the fits as JSON to the path given as the only argument.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

SMALL, LARGE = 1024, 4 * 2**20  # bytes
REPEATS = 8


def _time(fn, group=None) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(REPEATS):
        dist.barrier(group=group)
        began = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - began)
    return statistics.median(samples)


def _fit(t_small: float, t_large: float, steps: float, volume: float) -> dict:
    """alpha, beta from t = steps * alpha + volume * S / beta at S = SMALL and LARGE."""
    per_byte = max((t_large - t_small) / ((LARGE - SMALL) * volume), 1e-15)
    latency = max((t_small - volume * SMALL * per_byte) / steps, 0.0)
    return {"latency_s": latency, "bandwidth_bytes_per_s": 1.0 / per_byte}


def main() -> None:
    out = sys.argv[1]
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    result: dict = {"allreduce": {}}
    times = {}
    for size in (SMALL, LARGE):
        buf = torch.zeros(size // 4)

        def ping() -> None:
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            elif rank == 1:
                dist.recv(buf, 0)
                dist.send(buf, 0)

        times[size] = _time(ping) / 2  # one way
    result["p2p"] = _fit(times[SMALL], times[LARGE], 1, 1)
    for size in (SMALL, LARGE):
        outgoing, incoming = torch.zeros(size // 4), torch.zeros(size // 4)

        def shift() -> None:  # every rank at once: to the next, from the previous
            works = [dist.isend(outgoing, (rank + 1) % world), dist.irecv(incoming, (rank - 1) % world)]
            for work in works:
                work.wait()

        times[size] = _time(shift)
    result["aggregate"] = _fit(times[SMALL], times[LARGE], 1, world)
    for n in range(2, world + 1):
        group = dist.new_group(list(range(n)))
        times = {}
        for size in (SMALL, LARGE):
            buf = torch.zeros(size // 4)
            if rank < n:
                times[size] = _time(lambda: dist.all_reduce(buf, group=group), group)
            dist.barrier()
        if rank == 0:
            result["allreduce"][str(n)] = _fit(times[SMALL], times[LARGE], 2 * (n - 1), 2 * (n - 1) / n)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
