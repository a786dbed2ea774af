"""Heterogeneity-aware plans against the best homogeneous plan, measured on an emulated mixed cluster.

    python benchmarks/heterogeneous.py            # 4 ranks: two at half speed (cgroup cpu quotas), the link
                                                  # between two pairs of ranks 10x slower (tc, namespaces)
    python benchmarks/heterogeneous.py --quick    # a smoke run: tiny model, 2 timed steps, no emulation

The cluster: devices 0 and 1 form one "node", 2 and 3 another; devices 1 and 3 run at half the CPU quota
of 0 and 2 (benchmarks/cpu_quota.py), and the link between the nodes is --slow-factor times slower than
the links inside them (benchmarks/emulated_links.py). The same cluster is written as a cluster file
(search/hetero_cluster.py), which the aware plans read; its rate is this host's one-thread matmul rate
(search/calibrate.py) times a full-speed device's quota.

Homogeneous plans are what a planner that sees equal devices runs: dp=4 and pp=2 x dp=2 with even
batch shares, cuts balanced on work, ranks in order. The aware plans are the same degrees with
`--dp-shares auto` (replicas, whole models or pipelines, take micro-batches in proportion to their
slowest device's speed), pipeline cuts
balanced on each stage's device speed and the placement (search/placement.py) that keeps gradient sums
on the fast links; the aware plan reported is the one the placement model predicts fastest, chosen
before measuring. Plans with the same placement run in one set of ranks, step by step in alternating
order (interleaved); plans with another placement run in their own set. Every rank's time of a step is
the slowest rank's. The last line: `aware / homogeneous = X` (the aware plan's median step time over
the best measured homogeneous plan's).

An emulation on one host: the ranks share its cores; on a loaded machine the quotas are upper bounds,
not rates, and the figure is noise. Needs root for the emulation (--no-emulate runs without it).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

SPEEDS = (1.0, 0.5, 1.0, 0.5)  # devices 1 and 3 at half speed
NODES = ([0, 1], [2, 3])


@dataclass
class PlanRun:
    name: str
    aware: bool
    strategy: dict
    order: tuple[int, ...]  # order[rank]: the device the rank runs on
    predicted_s: float = 0.0


def cluster_toml(order: tuple[int, ...], args) -> str:
    """The emulated cluster as a cluster file, its devices listed in rank order for `order`."""
    intra = args.intra_gbit * 1e9 / 8
    slow = intra / args.slow_factor
    node = {d: k for k, members in enumerate(NODES) for d in members}
    ranks_of = [[r for r, d in enumerate(order) if node[d] == k] for k in range(len(NODES))]
    lines = ['name = "emulated-mixed-4"', 'source = "benchmarks/heterogeneous.py: cpu quotas and tc-shaped links"',
             "num_devices = 4", "devices_per_node = 4", "memory_per_device_gb = 4", "compute_efficiency = 1.0",
             "memory_bandwidth_bytes_per_s = 5e9", f"flops_per_s = {{fp32 = {args.flops:g}}}",
             f"intra_node = {{latency_s = 1e-4, bandwidth_bytes_per_s = {intra:g}}}",
             f"inter_node = {{latency_s = 1e-4, bandwidth_bytes_per_s = {slow:g}}}"]
    for rank in range(4):
        lines += ["[[devices]]", f"speed = {SPEEDS[order[rank]]:g}"]
    lines += ["[[links]]", f"a = {ranks_of[0]}", f"b = {ranks_of[1]}", "latency_s = 1e-4",
              f"bandwidth_bytes_per_s = {slow:g}"]
    return "\n".join(lines) + "\n"


def plans(args, folder: Path) -> list[PlanRun]:
    """The homogeneous plans, and the aware ones with their placement and predicted step time."""
    from autopar.search.cluster import load_cluster
    from autopar.search.placement import best_placement, step_time, workload_from_profile
    from autopar.search.profile import profile_model

    import torch

    from autopar.search.calibrate import matmul_rate
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    args.flops = matmul_rate() * min(1.0, args.cores) if args.emulate else matmul_rate()  # a full-speed device
    torch.set_num_threads(threads)
    identity = (0, 1, 2, 3)
    device_file = folder / "devices.toml"
    device_file.write_text(cluster_toml(identity, args))
    cluster = load_cluster(device_file)
    profile = profile_model(args.model, seq_len=args.seq_len, model_args=args.model_args)
    layouts = [(4, 1)] if args.quick else [(4, 1), (2, 2)]
    out = []
    for dp, pp in layouts:  # what a planner that sees equal devices runs, priced on the devices as they are
        work = workload_from_profile(profile, cluster, dp=dp, pp=pp, micro_batch_size=args.micro,
                                     num_microbatches=args.global_batch // (dp * args.micro))
        out.append(PlanRun(f"homogeneous dp={dp} pp={pp}", False, {"dp": dp, "pp": pp}, identity,
                           step_time(cluster, work, identity)))
    for dp, pp in layouts:
        micro = args.global_batch // (dp * args.micro)
        work = workload_from_profile(profile, cluster, dp=dp, pp=pp, micro_batch_size=args.micro,
                                     num_microbatches=micro, uneven_shares=True)
        placed = best_placement(cluster, work)
        file = folder / f"aware-dp{dp}-pp{pp}.toml"
        file.write_text(cluster_toml(placed.order, args))
        strategy = {"dp": dp, "pp": pp, "cluster": str(file), "dp_shares": "auto"}
        if pp > 1:  # the cut on each stage's speed, as train does; predicted with it
            placed_cluster = load_cluster(file)
            speeds = [min(SPEEDS[placed.order[(p * dp + d)]] for d in range(dp)) for p in range(pp)]
            work = workload_from_profile(profile, placed_cluster, dp=dp, pp=pp, micro_batch_size=args.micro,
                                         num_microbatches=micro, stage_speeds=speeds, uneven_shares=True)
            predicted = step_time(placed_cluster, work, identity)
        else:
            predicted = placed.step_s
        out.append(PlanRun(f"aware dp={dp} pp={pp}", True, strategy, placed.order, predicted))
    return out


def worker(rank: int, world: int, port: int, args, queue, runs: list[PlanRun]) -> None:
    """This rank's trainers (one per plan, all with the same placement), stepped in alternating order."""
    order = runs[0].order
    if args.quotas is not None:
        args.quotas.enter(order[rank])  # this rank's device: its CPU quota ...
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    if args.links is not None:  # ... and its link
        args.links.enter(order[rank])
        os.environ["MASTER_ADDR"] = args.links.address(order[0])
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
    import autopar
    from autopar.data import build_datasets, build_tokenizer, load_corpus, padded_vocab_size
    from autopar.models import build_model
    train_data, _ = build_datasets(load_corpus("stdlib"), build_tokenizer("byte"), seq_len=args.seq_len,
                                   task="causal-lm", seed=0)
    trainers = {}
    for run in runs:
        model, _ = build_model(args.model, args.model_args, vocab_size=padded_vocab_size(258), device="meta")
        config = autopar.TrainConfig(steps=args.warmup + args.steps, global_batch_size=args.global_batch,
                                     micro_batch_size=args.micro, out=tempfile.mkdtemp(), progress=False,
                                     timeout_s=300, warmup_steps=1)
        trainers[run.name] = autopar.Trainer(model, train_data, strategy=autopar.Strategy(**run.strategy),
                                             config=config)
        trainers[run.name]._setup()
    times = {run.name: [] for run in runs}
    losses = {run.name: [] for run in runs}
    names = [run.name for run in runs]
    for step in range(args.warmup + args.steps):
        for name in (names if step % 2 == 0 else names[::-1]):
            dist.barrier()
            began = time.perf_counter()
            loss = trainers[name].train_step(step).loss
            elapsed = torch.tensor([time.perf_counter() - began], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            losses[name].append(loss)
            if step >= args.warmup:
                times[name].append(float(elapsed))
    for trainer in trainers.values():
        trainer.close()
    if rank == 0:
        queue.put({"times": times, "losses": losses})
    dist.destroy_process_group()


def run_ranks(runs: list[PlanRun], args) -> dict:
    """4 ranks for `runs` (one placement), spawned and stopped with this process as resharding.py does."""
    import functools

    from resharding import run_ranks as spawn_ranks
    return spawn_ranks(functools.partial(worker, runs=runs), 4, args)


def measure(args, candidates: list[PlanRun]) -> dict[str, list[float]]:
    """Every plan's step times: plans sharing a placement interleaved in one set of ranks, the sets one
    after another, `--rounds` times in alternating order."""
    by_order: dict[tuple[int, ...], list[PlanRun]] = {}
    for run in candidates:
        by_order.setdefault(run.order, []).append(run)
    sets = list(by_order.values())
    times: dict[str, list[float]] = {run.name: [] for run in candidates}
    for round_ in range(args.rounds):
        for runs in (sets if round_ % 2 == 0 else sets[::-1]):
            got = run_ranks(runs, args)
            for name, values in got["times"].items():
                times[name] += values
    return times


def emulation(args):
    """The cpu quotas and the links as one context (both torn down on exit, error or SIGTERM)."""
    import contextlib

    from cpu_quota import CpuQuotas
    from emulated_links import EmulatedLinks
    stack = contextlib.ExitStack()
    if not args.emulate:
        args.quotas = args.links = None
        return stack
    args.quotas = stack.enter_context(CpuQuotas({d: args.cores * s for d, s in enumerate(SPEEDS)}))
    args.links = stack.enter_context(EmulatedLinks(4, args.intra_gbit / args.slow_factor, intra_gbit=args.intra_gbit,
                                                   groups=[list(n) for n in NODES]))
    return stack


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny model, one round of 2 timed steps, "
                        "dp=4 plans only, no emulation")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per plan per round")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2, help="sets of ranks per placement, in alternating order")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--global-batch", type=int, default=24)
    parser.add_argument("--micro", type=int, default=2)
    parser.add_argument("--cores", type=float, default=0.5, help="CPU quota of a full-speed device (cores); the "
                        "half-speed ones get half")
    parser.add_argument("--intra-gbit", type=float, default=10.0, help="links inside a node (Gbit/s each way)")
    parser.add_argument("--slow-factor", type=float, default=10.0, help="how much slower the link between the "
                        "nodes is")
    parser.add_argument("--no-emulate", dest="emulate", action="store_false",
                        help="no quotas or shaped links (no root needed; every device equal in fact)")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.rounds, args.emulate = 2, 1, 1, False
        args.layers, args.d_model, args.seq_len, args.global_batch, args.micro = 2, 32, 16, 12, 1
    args.model = "gpt-mini"
    args.model_args = {"n_layer": args.layers, "d_model": args.d_model}
    if args.emulate:
        from cpu_quota import CpuQuotaError, CpuQuotas
        from emulated_links import EmulatedLinks, EmulatedLinksError
        try:
            CpuQuotas.check()
            EmulatedLinks.check()
        except (CpuQuotaError, EmulatedLinksError) as exc:
            sys.exit(f"heterogeneous.py: {exc}; or run with --no-emulate")
    began = time.perf_counter()
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"heterogeneous: {args.model} L{args.layers} d{args.d_model}, seq {args.seq_len}, global batch "
          f"{args.global_batch} in micro-batches of {args.micro}; 4 gloo ranks, 1 thread each, {os.cpu_count()} "
          f"cores; {args.warmup} warm-up + {args.steps} timed steps x {args.rounds} round(s); load average {load}")
    with tempfile.TemporaryDirectory() as folder, emulation(args):
        if args.emulate:
            print(args.quotas.describe())
            print(args.links.describe())
        candidates = plans(args, Path(folder))
        for run in candidates:
            print(f"  {run.name:24} {run.strategy} devices by rank {list(run.order)}; predicted "
                  f"{run.predicted_s * 1e3:.1f} ms")
        times = measure(args, candidates)
    print(f"{'plan':>24} {'median step (s)':>16} {'min':>8} {'max':>8}")
    for run in candidates:
        t = times[run.name]
        print(f"{run.name:>24} {statistics.median(t):>16.4f} {min(t):>8.4f} {max(t):>8.4f}")
    homogeneous = min(statistics.median(times[r.name]) for r in candidates if not r.aware)
    aware = min((r for r in candidates if r.aware), key=lambda r: r.predicted_s)  # chosen before measuring
    print(f"aware plan (predicted fastest): {aware.name}; wall {time.perf_counter() - began:.0f} s, load average "
          f"after {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(f"aware / homogeneous = {statistics.median(times[aware.name]) / homogeneous:.3f}")


if __name__ == "__main__":
    main()
