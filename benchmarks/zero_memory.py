"""ZeRO memory and step time: measured per-rank bytes of model states beside the formulas.

For dp in {2, 4} and zero in {0, 1, 2, 3}, one gloo CPU process per rank trains a GPT with the
Trainer (bf16 parameters, fp32 master weights and AdamW state: --dtype bf16) and, just before
the last optimizer step, counts the bytes this rank holds:

  params   the module's parameters (bf16; ZeRO-3: this rank's fp32 shards, FSDP2 keeps them)
  master   fp32 master weights (ShardedOptimizer; ZeRO-3: the shards above are the masters)
  grads    gradient buffers: full bf16 buckets, the bf16 reduce-scatter landing buffer, fp32 shards
  states   AdamW's exp_avg and exp_avg_sq (fp32)

and prints the sum per parameter (bytes / Ψ) beside two formulas:
  paper       ZeRO paper, mixed precision, K = 12: 16 | 4 + 12/d | 2 + 14/d | 16/d
  deepspeed   DeepSpeed's estimator, which also counts the fp32 gradient: 16+2 | 4 + 16/d | 2 + 18/d | 18/d
              (ZeRO-3 without its 4x largest-layer term; no 1.5 CPU buffer factor).
Ours at level 0 keeps a replicated fp32 master and fp32 gradient too (4 + 16 = 20).

Step time (fp32, median of the timed steps, the slowest rank): our ZeRO-1 against torch's
ZeroRedundancyOptimizer over the same model with our plain all-reduce, and our ZeRO-3 (which is
plain FSDP2 fully_shard per block) against zero 0.

    python benchmarks/zero_memory.py            # default (gpt-mini, ~5 min on 2 loaded cores)
    python benchmarks/zero_memory.py --quick    # smoke
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

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

PAPER = {0: lambda d: 16, 1: lambda d: 4 + 12 / d, 2: lambda d: 2 + 14 / d, 3: lambda d: 16 / d}
DEEPSPEED = {0: lambda d: 18, 1: lambda d: 4 + 16 / d, 2: lambda d: 2 + 18 / d, 3: lambda d: 18 / d}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else _local(t).numel() * _local(t).element_size()


def model_state_bytes(trainer) -> dict[str, int]:
    """What this rank holds now: parameters, master weights, gradient buffers, optimizer state."""
    from autopar.zero import ShardedGradients

    engine, optimizer = trainer.engine, trainer.optimizer
    params = sum(_bytes(p) for p in trainer.model.parameters())
    master = optimizer.master_bytes() if hasattr(optimizer, "master_bytes") else 0
    sync = getattr(engine, "sync", None)
    if isinstance(sync, ShardedGradients):
        grads = sum(_bytes(b.full) + _bytes(b.shard_grad) + _bytes(b.incoming) for b in sync.buckets)
    else:
        grads = sum(_bytes(p.grad) for p in trainer.model.parameters())
    inner = getattr(optimizer, "inner", optimizer)
    states = sum(_bytes(v) for s in inner.state.values() for v in s.values()
                 if isinstance(v, torch.Tensor) and v.dim() > 0)
    return {"params": params, "master": master, "grads": grads, "states": states}


def _run(rank: int, world: int, port: int, jobs: list, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    import autopar
    from autopar.data import build_datasets, build_tokenizer, load_corpus, padded_vocab_size
    from autopar.models import build_model

    data = build_datasets(load_corpus("stdlib"), build_tokenizer("byte"), seq_len=128, task="causal-lm", seed=0)[0]
    results = []
    for name, model_name, zero, dtype, steps, torch_zero in jobs:
        model, _ = build_model(model_name, {}, vocab_size=padded_vocab_size(258), device="meta")
        config = autopar.TrainConfig(steps=steps, global_batch_size=8 * world, micro_batch_size=4, lr=1e-3,
                                     warmup_steps=1, dtype=dtype, out=tempfile.mkdtemp(), progress=False,
                                     timeout_s=600)
        trainer = autopar.Trainer(model, data, strategy=autopar.Strategy(zero=zero), config=config)
        trainer._setup()
        if torch_zero:  # torch's ZeroRedundancyOptimizer over the same parameters, our plain all-reduce
            from torch.distributed.optim import ZeroRedundancyOptimizer
            trainer.optimizer = ZeroRedundancyOptimizer(
                list(trainer.model.parameters()), optimizer_class=torch.optim.AdamW, lr=config.lr,
                betas=(config.beta1, config.beta2), weight_decay=config.weight_decay)
            from autopar.train.optim import build_scheduler
            trainer.scheduler = build_scheduler(trainer.optimizer, config)
        measured = {}
        step_fn = trainer.optimizer.step

        def step_and_measure(*args, _step=step_fn, **kwargs):
            measured.update(model_state_bytes(trainer))
            return _step(*args, **kwargs)

        times = []
        for step in range(steps):
            if step == steps - 1 and not torch_zero:
                trainer.optimizer.step = step_and_measure
            dist.barrier()
            began = time.perf_counter()
            trainer.train_step(step)
            elapsed = torch.tensor(time.perf_counter() - began)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times.append(float(elapsed))
        numel = sum(p.numel() for p in trainer.model.parameters())  # global (DTensor numel is global)
        peak = torch.tensor([measured.get(k, 0) for k in ("params", "master", "grads", "states")], dtype=torch.float64)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        results.append({"name": name, "zero": zero, "dtype": dtype, "numel": numel, "bytes": peak.tolist(),
                        "step_s": statistics.median(times[1:]) if len(times) > 1 else times[0]})
        trainer.engine.close()
    if rank == 0:
        out.put(results)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--model", default="gpt-mini")
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    steps = 2 if args.quick else args.steps
    from autopar.launch import free_port

    rows = []
    for world in (2, 4):
        jobs = [(f"zero {z} bf16", args.model, z, "bf16", 2, False) for z in (0, 1, 2, 3)]
        jobs += [("ours zero 1 fp32", args.model, 1, "fp32", steps, False),
                 ("torch ZeroRedundancyOptimizer fp32", args.model, 0, "fp32", steps, True),
                 ("ours zero 0 fp32", args.model, 0, "fp32", steps, False),
                 ("ours zero 3 = FSDP2 fp32", args.model, 3, "fp32", steps, False)]
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=_run, args=(r, world, port, jobs, out)) for r in range(world)]
        for p in procs:
            p.start()
        results = out.get(timeout=3600)
        for p in procs:
            p.join()
        rows.append((world, results))

    print(f"model {args.model}; torch {torch.__version__}; {os.cpu_count()} cores; gloo CPU")
    print("\nper-rank model-state bytes per parameter (max over ranks, just before the last optimizer step)")
    print(f"{'dp':>3} {'zero':>4} {'params':>7} {'master':>7} {'grads':>7} {'states':>7} {'total':>7} "
          f"{'paper':>7} {'deepspeed':>9} {'vs ds':>6}")
    for world, results in rows:
        for r in results:
            if r["dtype"] != "bf16":
                continue
            per = [b / r["numel"] for b in r["bytes"]]
            total = sum(per)
            ds = DEEPSPEED[r["zero"]](world)
            print(f"{world:>3} {r['zero']:>4} {per[0]:7.2f} {per[1]:7.2f} {per[2]:7.2f} {per[3]:7.2f} {total:7.2f} "
                  f"{PAPER[r['zero']](world):7.2f} {ds:9.2f} {total / ds - 1:+6.1%}")
    print("\nstep time (fp32, median, slowest rank)")
    for world, results in rows:
        for r in results:
            if r["dtype"] == "fp32":
                print(f"dp {world}  {r['name']:<36} {r['step_s'] * 1e3:8.1f} ms")


if __name__ == "__main__":
    main()
