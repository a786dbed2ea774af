"""Cross-mesh resharding on gloo: naive vs send/recv vs scatter-gather vs broadcast (issue 17).

One run spawns sender_tp + max(receivers) CPU ranks on one gloo group. A pipeline boundary is
modelled as Megatron leaves it: the tensor replicated over the sender stage's tp ranks, wanted
replicated on every rank of the receiving stage. For each boundary size and receiver count, every
method moves the same tensor (`autopar.resharding.Resharder`); the table gives the bytes the
executor counted on the busiest sender link (one sender-receiver pair), sent by the busiest
sender rank (all its links: its NIC), and in all (the broadcast chain and the all-gather ring are
counted as those models move them), the median wall time of one transfer
(the slowest rank's, over --reps after one warm-up), and both as ratios to naive. Received
tensors are checked bitwise against the source every time.

    python benchmarks/resharding.py                    # 64 KiB .. 64 MiB, receivers 1-4, sender tp 2
    python benchmarks/resharding.py --quick            # 64 KiB .. 4 MiB, receivers 1,2,4, 2 reps
    python benchmarks/resharding.py --sender-tp 4 --sizes 1M,16M --receivers 2,4

The predicted column is the planner's cost model on a nominal link (--latency-us, --bandwidth-gbs),
a prediction, not a measurement.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta

METHODS = ("naive", "send_recv", "scatter_gather", "broadcast")


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().rstrip("B")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def label(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def cases(args):
    from autopar.resharding import Layout, plan_resharding
    from autopar.resharding.cost import LinkModel

    link = LinkModel(args.latency_us * 1e-6, args.bandwidth_gbs * 1e9)
    t = args.sender_tp
    out = []
    for size in args.sizes:
        shape = (size // 4 // 1024, 1024)  # fp32 rows of 4 KiB
        for m in args.receivers:
            src, dst = Layout(tuple(range(t))), Layout(tuple(range(t, t + m)))
            for method in METHODS:
                out.append((size, m, method, plan_resharding(shape, 4, src, dst, method, link)))
    return out


def worker(rank: int, world: int, port: int, args, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    from autopar.resharding import Resharder

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=600))
    todo = cases(args)
    resharder = Resharder([plan for *_, plan in todo], timeout_s=600)
    sources = {}
    rows = []
    for index, (size, m, method, plan) in enumerate(todo):
        if plan.shape not in sources:
            sources[plan.shape] = torch.randn(plan.shape, generator=torch.Generator().manual_seed(size))
        full = sources[plan.shape]
        local = full if rank in plan.src.ranks else None
        before = dict(resharder.link_bytes)
        times = []
        for rep in range(args.reps + 1):
            dist.barrier()
            began = time.perf_counter()
            got = resharder.start(index, local).wait()
            elapsed = torch.tensor([time.perf_counter() - began], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if rep:  # the first is a warm-up
                times.append(float(elapsed))
            if got is not None and not torch.equal(got, full):  # bitwise: bytes are moved, never computed on
                raise AssertionError(f"rank {rank} received a wrong tensor: {plan.describe()}")
        mine = {k: (v - before.get(k, 0)) // (args.reps + 1) for k, v in resharder.link_bytes.items()
                if v - before.get(k, 0)}
        counted = [None] * world
        dist.all_gather_object(counted, mine)
        if rank == 0:
            links = {k: v for part in counted for k, v in part.items()}
            assert links == plan.bytes_by_link(), (plan.describe(), links, plan.bytes_by_link())
            sender = max((v for (a, _), v in links.items() if a in plan.src.ranks), default=0)
            per_rank = max(plan.sent_by_rank().get(r, 0) for r in plan.src.ranks)
            rows.append((size, m, method, sender, per_rank, sum(links.values()), statistics.median(times),
                         plan.predicted_s))
            print(f"  done {label(size)} x{m} {method}: {statistics.median(times) * 1e3:.1f} ms", flush=True,
                  file=sys.stderr)
    resharder.close()
    dist.destroy_process_group()
    if rank == 0:
        queue.put(rows)


def report(rows, args) -> None:
    print(f"sender tp {args.sender_tp} (replicated) -> receivers replicated; fp32; median of {args.reps} reps; "
          f"load average at start {args.load[0]:.2f}, at end {os.getloadavg()[0]:.2f}")
    print(f"{'size':>8} {'recv':>4} {'method':>14} {'B/sender link':>14} {'B/sender rank':>14} {'total B':>11} "
          f"{'ms':>9} {'pred ms':>8} {'link/naive':>10} {'rank/naive':>10} {'time/naive':>10}")
    naive = {(s, m): (b, r, t) for s, m, meth, b, r, _, t, _ in rows if meth == "naive"}
    for size, m, method, sender, per_rank, total, seconds, predicted in rows:
        nb, nr, nt = naive[(size, m)]
        print(f"{label(size):>8} {m:>4} {method:>14} {sender:>14,} {per_rank:>14,} {total:>11,} {seconds * 1e3:>9.2f} "
              f"{predicted * 1e3:>8.2f} {sender / nb:>10.2f} {per_rank / nr:>10.2f} {seconds / nt:>10.2f}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="64K,1M,16M,64M", help="boundary sizes (bytes, K/M suffixes)")
    parser.add_argument("--receivers", default="1,2,3,4", help="receiving stage tp degrees")
    parser.add_argument("--sender-tp", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="64K,1M,4M; receivers 1,2,4; 2 reps")
    parser.add_argument("--latency-us", type=float, default=50.0)
    parser.add_argument("--bandwidth-gbs", type=float, default=1.0)
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.receivers, args.reps = "64K,1M,4M", "1,2,4", 2
    args.sizes = [parse_size(s) for s in args.sizes.split(",")]
    args.receivers = [int(m) for m in args.receivers.split(",")]
    if args.sender_tp < 1 or min(args.receivers) < 1 or args.reps < 1:
        parser.error(f"--sender-tp, --receivers and --reps must be >= 1, got {args.sender_tp}, {args.receivers}, "
                     f"{args.reps}")
    if any(s < 4096 or s % 4096 for s in args.sizes):
        parser.error(f"--sizes must be multiples of 4 KiB (rows of 1024 fp32), got {args.sizes}")
    args.load = os.getloadavg()

    import torch.multiprocessing as mp

    from autopar.launch import free_port

    world = args.sender_tp + max(args.receivers)
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    began = time.perf_counter()
    mp.start_processes(worker, args=(world, free_port(), args, queue), nprocs=world, start_method="spawn")
    rows = queue.get()
    report(rows, args)
    print(f"wall {time.perf_counter() - began:.0f} s, world {world} gloo ranks on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
