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

Step time (fp32, a wider model: --d-model 256 by default, so the optimizer step is not negligible),
every variant built in the same processes and stepped in turn, step by step, so they share the
machine's load alike; median over the steps after the first, the slowest rank each step:
  ours zero 0                  our bucketed all-reduce (DDP-style) and AdamW
  ours zero 1 / zero 2         our flat-bucket reduce-scatter, sharded AdamW, all-gather
  torch ZeroRedundancyOptimizer  over our zero-0 all-reduce (the full all-reduce it needs)
  ours zero 3                  FSDP2 fully_shard per block inside our trainer
  torch FSDP2, plain loop      fully_shard per block and root, torch AdamW, the same micro-batches
The ratios the issue asks for are printed, with the load average before and after the run.

    python benchmarks/zero_memory.py            # default (dp 2 and 4, memory and time)
    python benchmarks/zero_memory.py --quick    # smoke: gpt-tiny, dp 2, 3 steps
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


def _trainer(model_name: str, overrides: dict, world: int, zero: int, dtype: str, steps: int, data):
    import autopar
    from autopar.data import padded_vocab_size
    from autopar.models import build_model

    model, _ = build_model(model_name, overrides, vocab_size=padded_vocab_size(258), device="meta")
    config = autopar.TrainConfig(steps=steps, global_batch_size=8 * world, micro_batch_size=4, lr=1e-3,
                                 warmup_steps=1, dtype=dtype, out=tempfile.mkdtemp(), progress=False, timeout_s=600)
    trainer = autopar.Trainer(model, data, strategy=autopar.Strategy(zero=zero), config=config)
    trainer._setup()
    return trainer


def _memory(world: int, model_name: str, data) -> list[dict]:
    """Model-state bytes per level, bf16 master weights, counted just before the second optimizer step."""
    results = []
    for zero in (0, 1, 2, 3):
        trainer = _trainer(model_name, {}, world, zero, "bf16", 2, data)
        measured = {}
        step_fn = trainer.optimizer.step

        def step_and_measure(*args, _step=step_fn, **kwargs):
            measured.update(model_state_bytes(trainer))
            return _step(*args, **kwargs)

        trainer.train_step(0)
        trainer.optimizer.step = step_and_measure
        trainer.train_step(1)
        numel = sum(p.numel() for p in trainer.model.parameters())  # global (DTensor numel is global)
        peak = torch.tensor([measured.get(k, 0) for k in ("params", "master", "grads", "states")], dtype=torch.float64)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        results.append({"zero": zero, "numel": numel, "bytes": peak.tolist()})
        trainer.engine.close()
    return results


class PlainFSDP2:
    """torch's FSDP2 as its tutorial uses it: fully_shard per block and the root, torch AdamW, the same
    micro-batches as the trainer (gradient sync off for all but the last), clipping, step."""

    def __init__(self, trainer_for_data, model_name: str, overrides: dict):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from autopar.data import padded_vocab_size
        from autopar.models import build_model

        self.source = trainer_for_data
        torch.manual_seed(0)
        self.model, _ = build_model(model_name, overrides, vocab_size=padded_vocab_size(258), device="cpu")
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for child in list(self.model.modules()):
            if isinstance(child, torch.nn.ModuleList):
                for block in child:
                    fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        cfg = trainer_for_data.config
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                                           weight_decay=cfg.weight_decay)
        self.clip = cfg.grad_clip

    def train_step(self, step: int) -> None:
        batches = self.source.loader.local_batches(step, self.source.train_data)
        for i, batch in enumerate(batches):
            self.model.set_requires_gradient_sync(i == len(batches) - 1)
            logits = self.model(batch["input_ids"])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(),
                                                     ignore_index=-100) / len(batches)
            loss.backward()
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad()


def _timing(world: int, model_name: str, overrides: dict, steps: int, data) -> dict[str, list[float]]:
    """fp32 step times of every variant, interleaved step by step so they share the machine's load alike."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from autopar.train.optim import build_scheduler

    variants = {
        "ours zero 0 (bucketed all-reduce)": _trainer(model_name, overrides, world, 0, "fp32", steps, data),
        "ours zero 1": _trainer(model_name, overrides, world, 1, "fp32", steps, data),
        "torch ZeroRedundancyOptimizer": _trainer(model_name, overrides, world, 0, "fp32", steps, data),
        "ours zero 2": _trainer(model_name, overrides, world, 2, "fp32", steps, data),
        "ours zero 3 (FSDP2 per block)": _trainer(model_name, overrides, world, 3, "fp32", steps, data),
    }
    # torch's ZeroRedundancyOptimizer over the same parameters, after our plain bucketed all-reduce (DDP-style)
    zro = variants["torch ZeroRedundancyOptimizer"]
    zro.optimizer = ZeroRedundancyOptimizer(list(zro.model.parameters()), optimizer_class=torch.optim.AdamW,
                                            lr=zro.config.lr, betas=(zro.config.beta1, zro.config.beta2),
                                            weight_decay=zro.config.weight_decay)
    zro.scheduler = build_scheduler(zro.optimizer, zro.config)
    variants["torch FSDP2 fully_shard, plain loop"] = PlainFSDP2(variants["ours zero 0 (bucketed all-reduce)"],
                                                                 model_name, overrides)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for step in range(steps):
        for name, runner in variants.items():
            dist.barrier()
            began = time.perf_counter()
            runner.train_step(step)
            elapsed = torch.tensor(time.perf_counter() - began)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank decides the step
            times[name].append(float(elapsed))
    for runner in variants.values():
        if hasattr(runner, "engine"):
            runner.engine.close()
    return times


def _run(rank: int, world: int, port: int, args, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=1200))
    from autopar.data import build_datasets, build_tokenizer, load_corpus

    data = build_datasets(load_corpus("stdlib"), build_tokenizer("byte"), seq_len=128, task="causal-lm", seed=0)[0]
    memory = [] if args.skip_memory else _memory(world, args.model, data)
    times = {} if args.skip_time else _timing(world, args.model, _overrides(args), args.steps, data)
    if rank == 0:
        out.put((memory, times))
    dist.barrier()
    dist.destroy_process_group()


def _overrides(args) -> dict:
    return {} if args.d_model is None else {"d_model": args.d_model}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="smoke: gpt-tiny at its own width, 3 timed steps, dp 2 only")
    parser.add_argument("--model", default="gpt-mini")
    parser.add_argument("--d-model", type=int, default=256,
                        help="width of the timing model (gpt-mini's 128 makes the optimizer step negligible)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per variant (the first is dropped)")
    parser.add_argument("--dp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--skip-time", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.dp, args.model, args.d_model = 3, [2], "gpt-tiny", None
    from autopar.launch import free_port

    load_before = os.getloadavg()
    rows = []
    for world in args.dp:
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=_run, args=(r, world, port, args, out)) for r in range(world)]
        for p in procs:
            p.start()
        memory, times = out.get(timeout=3600)
        for p in procs:
            p.join()
        rows.append((world, memory, times))
    load_after = os.getloadavg()

    print(f"model {args.model}; torch {torch.__version__}; {os.cpu_count()} cores; gloo CPU; "
          f"load average (1/5/15 min) before {'/'.join(f'{x:.1f}' for x in load_before)}, "
          f"after {'/'.join(f'{x:.1f}' for x in load_after)}")
    if not args.skip_memory:
        print("\nper-rank model-state bytes per parameter (bf16, max over ranks, just before the last optimizer step)")
        print(f"{'dp':>3} {'zero':>4} {'params':>7} {'master':>7} {'grads':>7} {'states':>7} {'total':>7} "
              f"{'paper':>7} {'deepspeed':>9} {'vs ds':>6} {'search':>7}")
        from autopar.search.zero_memory import zero_model_state_bytes
        for world, memory, _ in rows:
            for r in memory:
                per = [b / r["numel"] for b in r["bytes"]]
                total = sum(per)
                ds = DEEPSPEED[r["zero"]](world)
                model = zero_model_state_bytes(r["numel"], zero=r["zero"], dp=world, optimizer_bytes=8,
                                               bf16=True).total / r["numel"]
                print(f"{world:>3} {r['zero']:>4} {per[0]:7.2f} {per[1]:7.2f} {per[2]:7.2f} {per[3]:7.2f} "
                      f"{total:7.2f} {PAPER[r['zero']](world):7.2f} {ds:9.2f} {total / ds - 1:+6.1%} {model:7.2f}")
    if not args.skip_time:
        width = f"d_model {args.d_model}" if args.d_model else "default width"
        print(f"\nstep time (fp32, {args.model} {width}, seq 128, 2 micro-batches of 4 per replica; median of "
              f"{args.steps - 1} steps after the first, slowest rank; variants interleaved step by step)")
        for world, _, times in rows:
            med = {name: statistics.median(t[1:] or t) for name, t in times.items()}
            for name, m in med.items():
                spread = f"[{min(times[name][1:] or times[name]) * 1e3:.0f}-{max(times[name][1:] or times[name]) * 1e3:.0f}]"
                print(f"dp {world}  {name:<38} {m * 1e3:8.1f} ms  {spread}")
            print(f"dp {world}  ratio ours zero 1 / torch ZeroRedundancyOptimizer: "
                  f"{med['ours zero 1'] / med['torch ZeroRedundancyOptimizer']:.3f}  (target <= 1.1)")
            print(f"dp {world}  ratio ours zero 3 / plain FSDP2: "
                  f"{med['ours zero 3 (FSDP2 per block)'] / med['torch FSDP2 fully_shard, plain loop']:.3f}")
            print(f"dp {world}  ratio ours zero 1 / ours zero 0: "
                  f"{med['ours zero 1'] / med['ours zero 0 (bucketed all-reduce)']:.3f}")


if __name__ == "__main__":
    main()
