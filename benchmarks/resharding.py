"""Cross-mesh resharding on gloo: naive vs send/recv vs scatter-gather vs broadcast.

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
    python benchmarks/resharding.py --quick            # smoke test: 64 KiB and 1 MiB, receivers 1,2, 2 reps
    python benchmarks/resharding.py --sender-tp 4 --sizes 1M,16M --receivers 2,4

The predicted column is the planner's cost model on a nominal link (--latency-us, --bandwidth-gbs),
a prediction, not a measurement.

    python benchmarks/resharding.py --end-to-end       # a --stage-tp 1,2 gpt-mini pipeline: direct vs planned

--end-to-end trains the same pipeline twice side by side in one run (every rank holds both trainers,
steps alternate between them, the first --warmup steps untimed): boundaries `direct` (whole tensor
per receiver) against `--boundary scatter_gather` (or --e2e-boundary); the step time is the slowest
rank's; the table gives medians, their ratio and both runs' losses (which must agree). Equal degrees
(--stage-tp 2,2) are the uniform tp=2 pipeline, where scatter-gather is Megatron's trick.

    python benchmarks/resharding.py --emulate-links                 # each rank its own 1 Gbit/s link
    python benchmarks/resharding.py --emulate-links --intra-gbit 10 # and 10 Gbit/s inside each stage
    python benchmarks/resharding.py --end-to-end --stage-tp 2,2 --emulate-links --link-gbit 0.25 --intra-gbit 10

--emulate-links (root, iproute2) puts every rank in its own network namespace behind a veth shaped
by tc to --link-gbit each way (benchmarks/emulated_links.py): each rank gets a link of its own, as
between hosts, on this one host. --intra-gbit gives ranks of one stage (senders; receivers) a faster
link among themselves, as NVLink inside a node. The namespaces are removed at the end, on an error,
and on SIGTERM.
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
    if args.links is not None:
        args.links.enter(rank)  # its own namespace and link; MASTER_ADDR becomes rank 0's address
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
    print(args.links.describe() if args.links is not None else
          f"shared host: {args.sender_tp + max(args.receivers)} ranks on loopback, one memory bus, "
          f"{os.cpu_count()} cores")
    print(f"{'size':>8} {'recv':>4} {'method':>14} {'B/sender link':>14} {'B/sender rank':>14} {'total B':>11} "
          f"{'ms':>9} {'pred ms':>8} {'link/naive':>10} {'rank/naive':>10} {'time/naive':>10}")
    naive = {(s, m): (b, r, t) for s, m, meth, b, r, _, t, _ in rows if meth == "naive"}
    for size, m, method, sender, per_rank, total, seconds, predicted in rows:
        nb, nr, nt = naive[(size, m)]
        print(f"{label(size):>8} {m:>4} {method:>14} {sender:>14,} {per_rank:>14,} {total:>11,} {seconds * 1e3:>9.2f} "
              f"{predicted * 1e3:>8.2f} {sender / nb:>10.2f} {per_rank / nr:>10.2f} {seconds / nt:>10.2f}")


def e2e_worker(rank: int, world: int, port: int, args, queue) -> None:
    """Both trainers on this rank; alternate their steps; rank 0 reports the slowest rank's times."""
    import tempfile

    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    if args.links is not None:
        args.links.enter(rank)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
    import autopar
    from autopar.data import build_datasets, build_tokenizer, load_corpus, padded_vocab_size
    from autopar.models import build_model
    train_data, _ = build_datasets(load_corpus("stdlib"), build_tokenizer("byte"), seq_len=args.seq_len,
                                   task="causal-lm", seed=0)
    boundaries = ("direct", args.e2e_boundary)
    trainers = {}
    for boundary in boundaries:
        model, _ = build_model("gpt-mini", {"n_layer": args.layers, "d_model": args.d_model},
                               vocab_size=padded_vocab_size(258), device="meta")
        config = autopar.TrainConfig(steps=args.steps + args.warmup, global_batch_size=args.micro * args.microbatches,
                                     micro_batch_size=args.micro, out=tempfile.mkdtemp(), progress=False,
                                     timeout_s=300, warmup_steps=1)
        strategy = autopar.Strategy(stage_tp=args.stage_tp, schedule=args.schedule, boundary=boundary)
        trainers[boundary] = autopar.Trainer(model, train_data, strategy=strategy, config=config)
        trainers[boundary]._setup()
    times = {b: [] for b in boundaries}
    losses = {b: [] for b in boundaries}
    for step in range(args.warmup + args.steps):
        for boundary in (boundaries if step % 2 == 0 else boundaries[::-1]):
            dist.barrier()
            began = time.perf_counter()
            loss = trainers[boundary].train_step(step).loss
            elapsed = torch.tensor([time.perf_counter() - began], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            losses[boundary].append(loss)
            if step >= args.warmup:
                times[boundary].append(float(elapsed))
    if rank == 0:
        queue.put({"times": times, "losses": losses})
    dist.destroy_process_group()


def end_to_end(args) -> None:
    degrees = [int(t) for t in args.stage_tp.split(",")]
    world = sum(degrees)
    print(f"end to end: gpt-mini d{args.d_model} L{args.layers}, --stage-tp {args.stage_tp} ({world} gloo ranks, "
          f"1 thread each, {os.cpu_count()} cores), --schedule {args.schedule}, {args.microbatches} micro-batches of "
          f"{args.micro} x {args.seq_len}; {args.warmup} warm-up + {args.steps} timed steps each; load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    starts = [sum(degrees[:s]) for s in range(len(degrees))]
    groups = [list(range(a, a + t)) for a, t in zip(starts, degrees)]  # one stage, one "node"
    with _links(args, world, groups) as links:
        args.links = links
        if links is not None:
            print(links.describe())
        began = time.perf_counter()
        out = run_ranks(e2e_worker, world, args)
    direct = statistics.median(out["times"]["direct"])
    print(f"{'boundary':>16} {'median step (s)':>16} {'vs direct':>10} {'min':>8} {'max':>8}  losses (rank 0)")
    for boundary, t in out["times"].items():
        print(f"{boundary:>16} {statistics.median(t):>16.4f} {statistics.median(t) / direct:>10.3f} {min(t):>8.4f} "
              f"{max(t):>8.4f}  {', '.join(f'{x:.6f}' for x in out['losses'][boundary])}")
    print(f"wall {time.perf_counter() - began:.0f} s, load average after {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


def run_ranks(fn, world: int, args):
    """Spawn `world` ranks of fn(rank, world, port, args, queue) and return what rank 0 queued; if this
    process is stopped (an error, Ctrl-C, SIGTERM under --emulate-links), the ranks are stopped too, so
    the namespaces they sit in can go."""
    import torch.multiprocessing as mp

    from autopar.launch import free_port
    queue = mp.get_context("spawn").SimpleQueue()
    ranks = mp.start_processes(fn, args=(world, free_port(), args, queue), nprocs=world, start_method="spawn",
                               join=False)
    try:
        while not ranks.join():
            pass
    except BaseException:
        for process in ranks.processes:
            if process.is_alive():
                process.terminate()
        for process in ranks.processes:
            process.join(10)
        raise
    return queue.get()


def _links(args, world: int, groups: list[list[int]]):
    """The emulated links as a context (set up, torn down), or a context holding None without --emulate-links."""
    import contextlib

    if not args.emulate_links:
        return contextlib.nullcontext(None)
    from emulated_links import EmulatedLinks
    return EmulatedLinks(world, args.link_gbit, intra_gbit=args.intra_gbit, groups=groups)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="64K,1M,16M,64M", help="boundary sizes (bytes, K/M suffixes)")
    parser.add_argument("--receivers", default="1,2,3,4", help="receiving stage tp degrees")
    parser.add_argument("--sender-tp", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="smoke test: 64K,1M; receivers 1,2; 2 reps")
    parser.add_argument("--latency-us", type=float, default=50.0)
    parser.add_argument("--bandwidth-gbs", type=float, default=None,
                        help="the prediction's link (GB/s); default 1, or --link-gbit / 8 with --emulate-links")
    emulate = parser.add_argument_group("emulated links (root; benchmarks/emulated_links.py)")
    emulate.add_argument("--emulate-links", action="store_true", help="every rank in its own network namespace "
                         "behind a tc-shaped veth: a link of its own per rank, as between hosts")
    emulate.add_argument("--link-gbit", type=float, default=1.0, help="each rank's link, each way (Gbit/s)")
    emulate.add_argument("--intra-gbit", type=float, default=None, help="a faster link between ranks of one "
                         "stage (senders; receivers), as NVLink inside a node (Gbit/s); default: none")
    e2e = parser.add_argument_group("end to end (--end-to-end)")
    e2e.add_argument("--end-to-end", action="store_true", help="time a --stage-tp pipeline: direct vs planned")
    e2e.add_argument("--stage-tp", default="1,2")
    e2e.add_argument("--e2e-boundary", default="scatter_gather", help="the planned --boundary to compare")
    e2e.add_argument("--schedule", default="1f1b")
    e2e.add_argument("--layers", type=int, default=2)
    e2e.add_argument("--d-model", type=int, default=256)
    e2e.add_argument("--seq-len", type=int, default=128)
    e2e.add_argument("--micro", type=int, default=4, help="micro-batch size")
    e2e.add_argument("--microbatches", type=int, default=4)
    e2e.add_argument("--steps", type=int, default=6)
    e2e.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args(argv)
    args.links = None
    if args.bandwidth_gbs is None:
        args.bandwidth_gbs = args.link_gbit / 8 if args.emulate_links else 1.0
    if args.emulate_links:
        from emulated_links import EmulatedLinks, EmulatedLinksError
        try:
            EmulatedLinks.check()
        except EmulatedLinksError as exc:
            parser.error(str(exc))
        if not args.link_gbit > 0 or (args.intra_gbit is not None and not args.intra_gbit > 0):
            parser.error(f"--link-gbit and --intra-gbit must be > 0, got {args.link_gbit} and {args.intra_gbit}")
    if args.end_to_end:
        return end_to_end(args)
    if args.quick:
        args.sizes, args.receivers, args.reps = "64K,1M", "1,2", 2
    args.sizes = [parse_size(s) for s in args.sizes.split(",")]
    args.receivers = [int(m) for m in args.receivers.split(",")]
    if args.sender_tp < 1 or min(args.receivers) < 1 or args.reps < 1:
        parser.error(f"--sender-tp, --receivers and --reps must be >= 1, got {args.sender_tp}, {args.receivers}, "
                     f"{args.reps}")
    if any(s < 4096 or s % 4096 for s in args.sizes):
        parser.error(f"--sizes must be multiples of 4 KiB (rows of 1024 fp32), got {args.sizes}")
    args.load = os.getloadavg()
    world = args.sender_tp + max(args.receivers)
    groups = [list(range(args.sender_tp)), list(range(args.sender_tp, world))]
    with _links(args, world, groups) as links:
        args.links = links
        began = time.perf_counter()
        rows = run_ranks(worker, world, args)
    report(rows, args)
    print(f"wall {time.perf_counter() - began:.0f} s, world {world} gloo ranks on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
