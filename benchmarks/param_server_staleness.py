"""Parameter server: what the staleness bound S buys when one worker straggles, and what it costs.

W workers and one server (async_sgd.train_with_parameter_server) train the same MLP
classifier on the same synthetic data (labels from a random teacher), plain SGD, for a
fixed number of steps, at several bounds S. Workers straggle at random: before a push each
sleeps `--straggle-ms` with probability `--straggle-p`, else 0-`--jitter-ms` (seeded per
worker and step, the same in every run). Under S = 0 every step waits for that step's
slowest worker; a larger S lets the others run ahead, at the price of staler gradients. Reported per S (median over
`--repeats` runs, the bounds interleaved so that machine drift hits all equally):
wall-clock, its ratio to S = 0, the final model's loss on all the data, the mean and
largest staleness of the pushes, and the share of pulls the bound held back.

    python benchmarks/param_server_staleness.py            # default (~1 min on 2 cores)
    python benchmarks/param_server_staleness.py --quick    # smoke test
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from autopar.async_sgd import train_with_parameter_server
from autopar.launch import free_port


def make_task(samples: int, dim: int, classes: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, dim, generator=gen)
    teacher = torch.randn(dim, classes, generator=gen)
    y = (x @ teacher + 0.5 * torch.randn(samples, classes, generator=gen)).argmax(1)
    return x, y


def make_model(dim: int, hidden: int, classes: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, classes))


def worker(rank: int, world: int, port: int, args: argparse.Namespace, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    x, y = make_task(args.samples, args.dim, args.classes, args.seed)
    per_worker = args.batch // args.workers

    def batch_fn(step: int, w: int, workers: int):
        start = (step * args.batch + w * per_worker) % args.samples
        return x[start:start + per_worker], y[start:start + per_worker]

    def loss_fn(model: nn.Module, batch) -> torch.Tensor:
        return F.cross_entropy(model(batch[0]), batch[1])

    def straggle(step: int, w: int) -> None:
        rng = random.Random(args.seed * 100_003 + step * 101 + w)
        slow = rng.random() < args.straggle_p
        time.sleep(args.straggle_ms / 1000 if slow else rng.uniform(0, args.jitter_ms) / 1000)

    rows = []
    for repeat in range(args.repeats):
        order = args.staleness if repeat % 2 == 0 else list(reversed(args.staleness))
        for bound in order:
            model = make_model(args.dim, args.hidden, args.classes, args.seed)
            result = train_with_parameter_server(model, loss_fn, batch_fn, steps=args.steps, lr=args.lr,
                                                 staleness=bound, servers=1, before_push=straggle, timeout_s=120)
            with torch.no_grad():
                final = float(F.cross_entropy(model(x), y))
            stale = result.staleness_per_push()
            rows.append({"S": bound, "wall_s": result.wall_s, "final_loss": final,
                         "stale_mean": sum(stale) / len(stale), "stale_max": max(stale),
                         "waited": sum(p.waited for p in result.pulls) / len(result.pulls)})
    if rank == 0:
        results.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def report(rows: list[dict], args: argparse.Namespace) -> str:
    by_bound = {s: [r for r in rows if r["S"] == s] for s in args.staleness}
    base = statistics.median(r["wall_s"] for r in by_bound[args.staleness[0]])
    lines = [f"{args.workers} workers + 1 server, {args.steps} steps of {args.batch} samples, MLP {args.dim}-"
             f"{args.hidden}-{args.classes}, SGD lr {args.lr}; each worker sleeps {args.straggle_ms:g} ms with "
             f"probability {args.straggle_p:g} per step, else 0-{args.jitter_ms:g} ms; median of {args.repeats}",
             "", "| S | wall s | vs S=" + str(args.staleness[0]) + " | final loss | staleness mean | max | pulls held |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for s, group in by_bound.items():
        med = lambda key: statistics.median(r[key] for r in group)
        lines.append(f"| {s} | {med('wall_s'):.2f} | {med('wall_s') / base:.2f} | {med('final_loss'):.4f} | "
                     f"{med('stale_mean'):.2f} | {max(r['stale_max'] for r in group)} | {med('waited'):.0%} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2, 4, 16])
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--batch", type=int, default=48, help="global batch (split over the workers)")
    p.add_argument("--samples", type=int, default=1536)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--classes", type=int, default=8)
    p.add_argument("--lr", type=float, default=0.2)
    p.add_argument("--straggle-ms", type=float, default=40.0)
    p.add_argument("--straggle-p", type=float, default=0.3)
    p.add_argument("--jitter-ms", type=float, default=4.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="2 bounds, 2 workers, 20 steps, 1 repeat")
    args = p.parse_args(argv)
    if args.quick:
        args.staleness, args.steps, args.repeats, args.workers = [0, 4], 20, 1, 2
    world = args.workers + 1
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    began = time.perf_counter()
    mp.start_processes(worker, args=(world, free_port(), args, results), nprocs=world, join=False,
                       start_method="spawn").join()
    rows = results.get(timeout=10)
    print(report(rows, args))
    print(f"\n({time.perf_counter() - began:.0f} s; python {sys.version.split()[0]}, torch {torch.__version__})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
