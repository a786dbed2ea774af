"""Sub-pipelined tensor parallelism (--tp-subbatches K): measured step time per K, and a GPU model.

Part 1 (measured). Two gloo ranks (tp=2, one thread each) train the same gpt-mini with
K = 1, 2, 4 side by side: one Trainer per K, built once, then the steps are interleaved
round by round (the K order rotates every round, so drift hits every K alike). A step's
time is the slowest rank's; the table gives the median and the ratio to K=1. The losses
of the K variants must agree to 1e-5 (they train on the same batches from the same seed).
It also times one all-reduce of a layer's activation (the thing the overlap hides).

On CPU gloo the all-reduce runs on the same two shared cores as the compute, so overlap can
hide little; splitting also shrinks every matmul. Expect K > 1 to be no faster here.

Part 2 (modelled). The stage graph's real order (segment s of copies 0..K-1, each copy's
reduce started at the end of its segment and waited on before its first use) is played on
one compute stream and one communication stream, with per-layer compute and all-reduce
times of a Megatron-style GPT layer on H100s (NVLink) and a communication-bound case. The
model charges each sub-batch its share of compute plus a fixed per-kernel overhead and each
all-reduce a fixed latency plus bytes / bandwidth.

    PYTHONPATH=src python benchmarks/tp_subpipeline.py            # ~3 min on 2 shared cores
    PYTHONPATH=src python benchmarks/tp_subpipeline.py --quick    # smoke test
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

KS = (1, 2, 4)


# ----------------------------------------------------------------------------- measured


def _rank(rank: int, world: int, port: int, args, results) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    import autopar
    from autopar.data import build_datasets, build_tokenizer, load_corpus, padded_vocab_size
    from autopar.models import build_model

    model_args = {"n_layer": args.layers, "d_model": args.d_model}
    trainers = {}
    train_data, _ = build_datasets(load_corpus("stdlib"), build_tokenizer("byte"), seq_len=args.seq_len,
                                   task="causal-lm", seed=0)
    for k in KS:
        model, _ = build_model("gpt-mini", model_args, vocab_size=padded_vocab_size(258), device="meta")
        config = autopar.TrainConfig(steps=args.steps + args.warmup, global_batch_size=args.micro,
                                     micro_batch_size=args.micro, out=tempfile.mkdtemp(), progress=False,
                                     timeout_s=120, warmup_steps=1)
        trainer = autopar.Trainer(model, train_data, strategy=autopar.Strategy(tp=2, tp_subbatches=k), config=config)
        trainer._setup()
        trainers[k] = trainer
    times = {k: [] for k in KS}
    losses = {k: [] for k in KS}
    for step in range(args.warmup + args.steps):
        order = KS[step % len(KS):] + KS[:step % len(KS)]
        for k in order:
            dist.barrier()
            began = time.perf_counter()
            loss = trainers[k].train_step(step).loss
            elapsed = torch.tensor([time.perf_counter() - began], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            losses[k].append(loss)
            if step >= args.warmup:
                times[k].append(float(elapsed))
    activation = torch.randn(args.micro, args.seq_len, args.d_model)
    reduce_times = []
    for _ in range(20):
        dist.barrier()
        began = time.perf_counter()
        dist.all_reduce(activation.clone())
        reduce_times.append(time.perf_counter() - began)
    if rank == 0:
        results.put({"times": times, "losses": losses, "reduce_s": statistics.median(reduce_times)})
    dist.destroy_process_group()


def measure(args) -> dict:
    from autopar.launch import free_port
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, args, results)) for r in range(2)]
    for p in procs:
        p.start()
    out = results.get(timeout=1800)
    for p in procs:
        p.join()
    return out


# ----------------------------------------------------------------------------- modelled


def overlap_time(*, layers: int, k: int, compute_s: float, reduce_s: float, kernel_s: float, latency_s: float) -> float:
    """Forward time of `layers` layers (two segments each: attention, MLP) in the built graph's order.

    compute_s / reduce_s: one segment's compute and all-reduce for the whole micro-batch.
    Copy j's segment costs compute_s / k + kernel_s; its reduce latency_s + (reduce_s - latency_s) / k.
    """
    compute_free = comm_free = 0.0
    done: dict[tuple[int, int], float] = {}  # (segment, copy) -> reduce end
    for s in range(2 * layers):
        for j in range(k):
            start = max(compute_free, done.get((s - 1, j), 0.0))  # wait for this copy's previous reduce
            compute_free = start + compute_s / k + kernel_s
            comm_start = max(comm_free, compute_free)
            comm_free = comm_start + latency_s + (reduce_s - latency_s) / k
            done[(s, j)] = comm_free
    return max(compute_free, comm_free)


def gpu_cases() -> list[tuple[str, dict]]:
    """Per-segment times of a GPT layer, forward, bf16, tp=8 on one H100 node (assumed, not measured)."""
    cases = []
    for label, hidden, seq, batch, bus_gbs in (("h=4096 s=2048 b=1, NVLink 370 GB/s", 4096, 2048, 1, 370),
                                               ("h=8192 s=2048 b=1, NVLink 370 GB/s", 8192, 2048, 1, 370),
                                               ("h=4096 s=2048 b=1, PCIe 25 GB/s", 4096, 2048, 1, 25)):
        tp, flops = 8, 400e12  # achieved bf16 matmul rate, ~40% of H100 peak
        tokens = batch * seq
        compute = 12 * tokens * hidden ** 2 / tp / flops  # one segment: half of 24*t*h^2/tp
        bytes_ = tokens * hidden * 2
        latency = 15e-6
        reduce = latency + 2 * (tp - 1) / tp * bytes_ / (bus_gbs * 1e9)
        cases.append((label, {"compute_s": compute, "reduce_s": reduce, "kernel_s": 10e-6, "latency_s": latency}))
    return cases


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, few steps (smoke test)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per K")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per K first")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro", type=int, default=8, help="micro-batch size (K must divide it)")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.layers, args.d_model, args.seq_len = 2, 1, 2, 64, 32

    print(f"torch {torch.__version__}, gloo, tp=2, 1 thread per rank, {os.cpu_count()} CPU cores (shared); "
          f"gpt-mini d{args.d_model} L{args.layers}, micro-batch {args.micro} x {args.seq_len} tokens")
    out = measure(args)
    base = statistics.median(out["times"][1])
    print(f"\n{'K':>3} {'median step (s)':>16} {'vs K=1':>8} {'min':>8} {'max':>8}")
    for k in KS:
        t = out["times"][k]
        print(f"{k:>3} {statistics.median(t):>16.4f} {statistics.median(t) / base:>8.3f} {min(t):>8.4f} {max(t):>8.4f}")
    worst = max(abs(a - b) / abs(a) for k in KS for a, b in zip(out["losses"][1], out["losses"][k]))
    print(f"losses of every K vs K=1: max relative difference {worst:.2e}")
    print(f"one all-reduce of a layer activation ({args.micro}x{args.seq_len}x{args.d_model} fp32): "
          f"{out['reduce_s'] * 1e3:.2f} ms (median of 20)")
    if worst > 1e-5:
        print("ERROR: the K variants did not train alike", file=sys.stderr)
        return 1

    print("\nModel (forward of 24 layers, graph order, one compute + one comm stream; assumed GPU rates):")
    print(f"{'case':<38} {'segment compute':>15} {'all-reduce':>11} " + " ".join(f"{f'K={k}':>8}" for k in KS))
    for label, rates in gpu_cases():
        base = overlap_time(layers=24, k=1, **rates)
        cells = " ".join(f"{overlap_time(layers=24, k=k, **rates) / base:>8.3f}" for k in KS)
        print(f"{label:<38} {rates['compute_s'] * 1e6:>12.0f} us {rates['reduce_s'] * 1e6:>8.0f} us {cells}")
    print("(cells: forward time relative to K=1; < 1 is a gain)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
