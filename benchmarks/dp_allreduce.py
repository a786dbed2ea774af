"""Data-parallel gradient synchronisation: autopar's GradientSynchronizer vs torch DDP.

Times one full training step (forward + backward of every micro-batch, gradient
synchronisation, optimizer step, zero_grad) for three variants that live side by side in
the same gloo process group and train identical model copies on identical data:

  ours   autopar.data_parallel.GradientSynchronizer (bucketed, hook-driven, overlapped)
  ddp    torch.nn.parallel.DistributedDataParallel(model), default buckets, no_sync()
         for the earlier micro-batches of a step
  plain  no bucketing, no overlap: one blocking all-reduce per parameter after backward

The variants are interleaved step by step (the order rotates every step, so drift and
position effects hit all of them equally). Before each timed step the ranks meet at a
barrier; a step's time is the slowest rank's, and the table reports the median over the
timed steps. After the timed steps the three variants' parameters must agree to 1e-5.

    python benchmarks/dp_allreduce.py                 # default run (~3 min on 2 cores)
    python benchmarks/dp_allreduce.py --quick         # smoke test (< 30 s)
    python benchmarks/dp_allreduce.py --world-sizes 2 --steps 10
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from autopar.launch import free_port
from autopar.data_parallel import GradientSynchronizer
from autopar.models import build_model, materialize

VOCAB = 320
VARIANTS = ("ours", "ddp", "plain")
TOLERANCE = 1e-5


@dataclass(frozen=True)
class Config:
    label: str
    model_args: dict
    micro_batches: int


def default_configs() -> list[Config]:
    return [
        Config("gpt-mini d128 L4", {"n_layer": 4}, 1),
        Config("gpt-mini d128 L4", {"n_layer": 4}, 2),
        Config("gpt-mini d256 L4", {"d_model": 256, "n_layer": 4}, 1),
    ]


def quick_configs() -> list[Config]:
    return [
        Config("gpt-mini d64 L1", {"n_layer": 1, "d_model": 64}, 1),
        Config("gpt-mini d64 L1", {"n_layer": 1, "d_model": 64}, 2),
    ]


# ----------------------------------------------------------------------------- variants


def new_model(model_args: dict) -> nn.Module:
    model, _ = build_model("gpt-mini", model_args, vocab_size=VOCAB, device="meta")
    return materialize(model, "cpu", seed=0)


def lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


class Ours:
    def __init__(self, model_args: dict, group, bucket_mb: float, lr: float) -> None:
        self.model = new_model(model_args)
        self.world = dist.get_world_size(group)
        self.sync = GradientSynchronizer(self.model.parameters(), group, bucket_mb=bucket_mb)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=lr)

    def step(self, micro: list[torch.Tensor]) -> None:
        scale = 1.0 / (self.world * len(micro))  # gradients are summed over ranks
        for i, ids in enumerate(micro):
            ctx = contextlib.nullcontext() if i == len(micro) - 1 else self.sync.no_sync()
            with ctx:
                (lm_loss(self.model, ids) * scale).backward()
        self.sync.finish()
        self.opt.step()
        self.sync.zero_grad()

    def params(self) -> list[torch.Tensor]:
        return [p.detach() for p in self.model.parameters()]


class DDP:
    def __init__(self, model_args: dict, group, bucket_mb: float, lr: float) -> None:
        self.ddp = DistributedDataParallel(new_model(model_args), process_group=group)
        self.opt = torch.optim.SGD(self.ddp.parameters(), lr=lr)

    def step(self, micro: list[torch.Tensor]) -> None:
        scale = 1.0 / len(micro)  # DDP averages gradients over ranks
        for i, ids in enumerate(micro):
            ctx = contextlib.nullcontext() if i == len(micro) - 1 else self.ddp.no_sync()
            with ctx:
                (lm_loss(self.ddp, ids) * scale).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def params(self) -> list[torch.Tensor]:
        return [p.detach() for p in self.ddp.module.parameters()]


class Plain:
    def __init__(self, model_args: dict, group, bucket_mb: float, lr: float) -> None:
        self.model = new_model(model_args)
        self.group = group
        self.world = dist.get_world_size(group)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=lr)

    def step(self, micro: list[torch.Tensor]) -> None:
        scale = 1.0 / (self.world * len(micro))
        for ids in micro:
            (lm_loss(self.model, ids) * scale).backward()
        for p in self.model.parameters():
            dist.all_reduce(p.grad, group=self.group)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def params(self) -> list[torch.Tensor]:
        return [p.detach() for p in self.model.parameters()]


IMPLS = {"ours": Ours, "ddp": DDP, "plain": Plain}


# ----------------------------------------------------------------------------- one rank


def make_data(steps: int, micro: int, batch: int, seq: int, rank: int, config_index: int) -> list:
    """Per step, per micro-batch token ids; different on every rank, same for every variant."""
    gen = torch.Generator().manual_seed(1000 * config_index + rank)
    return [
        [torch.randint(0, VOCAB, (batch, seq + 1), generator=gen) for _ in range(micro)]
        for _ in range(steps)
    ]


def run_config(cfg: Config, index: int, args, group) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    impls = {name: IMPLS[name](cfg.model_args, group, args.bucket_mb, args.lr) for name in VARIANTS}
    total = args.warmup + args.steps
    data = make_data(total, cfg.micro_batches, args.batch, args.seq, rank, index)
    times = {name: [] for name in VARIANTS}
    for step in range(total):
        shift = step % len(VARIANTS)  # rotate: ours,ddp,plain / ddp,plain,ours / ...
        for name in VARIANTS[shift:] + VARIANTS[:shift]:
            dist.barrier(group)
            start = time.perf_counter()
            impls[name].step(data[step])
            elapsed = time.perf_counter() - start
            if step >= args.warmup:
                times[name].append(elapsed)

    # a step takes as long as its slowest rank
    stacked = torch.tensor([times[name] for name in VARIANTS], dtype=torch.float64)
    dist.all_reduce(stacked, op=dist.ReduceOp.MAX, group=group)
    slowest = {name: stacked[i].tolist() for i, name in enumerate(VARIANTS)}

    # the three must have trained the same (on every rank), and training must have moved them
    ref = impls["ours"].params()
    init = new_model(cfg.model_args).parameters()
    moved = max((a - b).abs().max().item() for a, b in zip(ref, init))
    diffs = torch.tensor(
        [max((a - b).abs().max().item() for a, b in zip(ref, impls[name].params())) for name in ("ddp", "plain")],
        dtype=torch.float64,
    )
    dist.all_reduce(diffs, op=dist.ReduceOp.MAX, group=group)
    # and every rank must hold the same weights (the synchronisation really happened)
    flat = torch.cat([p.reshape(-1) for p in ref])
    first = flat.clone()
    dist.broadcast(first, src=0, group=group)
    spread = torch.tensor([(flat - first).abs().max().item()], dtype=torch.float64)
    dist.all_reduce(spread, op=dist.ReduceOp.MAX, group=group)

    return {
        "cfg": cfg,
        "params": sum(p.numel() for p in impls["ours"].model.parameters()),
        "buckets": impls["ours"].sync.num_buckets,
        "median_ms": {name: 1000 * statistics.median(slowest[name]) for name in VARIANTS},
        "iqr_ms": {name: 1000 * iqr(slowest[name]) for name in VARIANTS},
        # median of per-step ratios (ours and ddp ran back to back in the same step)
        "paired": statistics.median(o / d for o, d in zip(slowest["ours"], slowest["ddp"])),
        "diff_ddp": diffs[0].item(),
        "diff_plain": diffs[1].item(),
        "rank_spread": spread.item(),
        "moved": moved,
        "world": world,
    }


def iqr(values: list[float]) -> float:
    if len(values) < 4:
        return float("nan")
    q = statistics.quantiles(values, n=4)
    return q[2] - q[0]


def worker(rank: int, world: int, port: int, args, configs: list[Config]) -> None:
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    try:
        group = dist.group.WORLD
        results = [run_config(cfg, i, args, group) for i, cfg in enumerate(configs)]
        if rank == 0:
            print_report(world, args, results)
        failures = [
            r for r in results
            if not (r["diff_ddp"] <= TOLERANCE and r["diff_plain"] <= TOLERANCE and r["rank_spread"] <= TOLERANCE
                    and r["moved"] > 0)
        ]
        assert not failures, f"variants did not train the same: {[(r['cfg'].label, r['cfg'].micro_batches) for r in failures]}"
    finally:
        dist.barrier()  # no rank tears down while a peer still has gloo work in flight
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- report


def print_report(world: int, args, results: list[dict]) -> None:
    lines = [
        f"world size {world} | gloo | {torch.get_num_threads()} thread per rank | "
        f"{os.cpu_count()} CPU cores | torch {torch.__version__} | python {platform.python_version()}",
        f"batch {args.batch} x seq {args.seq} per micro-batch per rank | SGD lr {args.lr} | "
        f"warmup {args.warmup} + {args.steps} timed steps | ours bucket_mb={args.bucket_mb:g} | "
        f"DDP defaults (bucket_cap_mb=25)",
        "",
    ]
    header = (
        f"{'model':<17} {'params':>7} {'micro':>5} {'bkts':>4} | "
        f"{'ours ms':>8} {'ddp ms':>8} {'plain ms':>8} | {'ours/DDP':>8} {'ours/plain':>10}"
    )
    lines += [header, "-" * len(header)]
    for r in results:
        m = r["median_ms"]
        lines.append(
            f"{r['cfg'].label:<17} {r['params'] / 1e6:>6.2f}M {r['cfg'].micro_batches:>5} {r['buckets']:>4} | "
            f"{m['ours']:>8.1f} {m['ddp']:>8.1f} {m['plain']:>8.1f} | "
            f"{m['ours'] / m['ddp']:>8.3f} {m['ours'] / m['plain']:>10.3f}"
        )
    lines.append("")
    header = (
        f"{'model':<17} {'micro':>5} | {'IQR ms ours / ddp / plain':>26} | {'paired ours/DDP':>15} | "
        f"{'max|dparam| vs ddp':>18} {'vs plain':>8}"
    )
    lines += [header, "-" * len(header)]
    for r in results:
        q = r["iqr_ms"]
        spread = f"{q['ours']:.1f} / {q['ddp']:.1f} / {q['plain']:.1f}"
        lines.append(
            f"{r['cfg'].label:<17} {r['cfg'].micro_batches:>5} | {spread:>26} | {r['paired']:>15.3f} | "
            f"{r['diff_ddp']:>18.1e} {r['diff_plain']:>8.1e}"
        )
    lines.append("")
    ok = all(r["diff_ddp"] <= TOLERANCE and r["diff_plain"] <= TOLERANCE and r["rank_spread"] <= TOLERANCE
             and r["moved"] > 0 for r in results)
    worst = max(max(r["diff_ddp"], r["diff_plain"]) for r in results)
    spread = max(r["rank_spread"] for r in results)
    moved = min(r["moved"] for r in results)
    lines.append(
        f"equality check (tol {TOLERANCE:g}): {'PASS' if ok else 'FAIL'} -- max |param diff| vs ours "
        f"{worst:.1e}, max diff across ranks {spread:.1e}; training moved the weights (max |change| >= {moved:.1e} in every config)"
    )
    print("\n".join(lines) + "\n", flush=True)


# ----------------------------------------------------------------------------- main




def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Time autopar's GradientSynchronizer against torch DDP and a plain "
        "per-parameter all-reduce (gloo, CPU), interleaved in one run.",
    )
    parser.add_argument("--world-sizes", default="2,4", help="comma-separated world sizes (default: 2,4)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant (default: 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed warm-up steps per variant (default: 3)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per micro-batch per rank (default: 4)")
    parser.add_argument("--seq", type=int, default=64, help="tokens per sequence (default: 64)")
    parser.add_argument("--bucket-mb", type=float, default=25.0, help="GradientSynchronizer bucket size (default: 25)")
    parser.add_argument("--lr", type=float, default=0.1, help="SGD learning rate (default: 0.1)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: tiny model, few steps, world size 2 (< 30 s)")
    args = parser.parse_args(argv)
    if args.quick:
        args.world_sizes, args.steps, args.warmup, args.batch, args.seq = "2", 4, 1, 2, 32
    try:
        args.world_sizes = [int(w) for w in str(args.world_sizes).split(",") if w.strip()]
    except ValueError:
        parser.error(f"--world-sizes must be comma-separated integers, got {args.world_sizes!r}")
    if not args.world_sizes or any(w < 2 for w in args.world_sizes):
        parser.error("--world-sizes: every world size must be >= 2")
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configs = quick_configs() if args.quick else default_configs()
    print(f"$ python {' '.join(['benchmarks/dp_allreduce.py', *(sys.argv[1:] if argv is None else argv)])}")
    print(
        "step time = forward+backward of every micro-batch, gradient sync, SGD step, zero_grad; "
        "median over timed steps of the slowest rank; variants interleaved; ratio < 1: ours faster;\n"
        "paired = median over steps of ours/ddp measured back to back; bkts = our bucket count\n",
        flush=True,
    )
    start = time.perf_counter()
    for world in args.world_sizes:
        mp.spawn(worker, args=(world, free_port(), args, configs), nprocs=world, join=True)
    print(f"total wall time {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
