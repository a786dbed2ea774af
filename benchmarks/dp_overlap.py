"""Gradient reduction overlapped with the backward, or in one bucket after it, where ranks time-share the cores.

The trainer's data-parallel step built twice in one launch of forked gloo ranks (one thread each, LOCAL_WORLD_SIZE
set as the launcher sets it): as the synchronizer chooses (data_parallel/grad_sync.py `overlap_pays`: one bucket
when the ranks' threads outnumber the cores) and forced to overlap (a small first bucket, 25 MiB buckets after it);
for gpt-mini at 8 sequences a rank also the calibration's plain-torch reference step of the same shape (one
all-reduce after the backward, search/reference_step.py). The variants run in interleaved rounds of 3 steps from
a common start (the slowest rank's time); the table gives each one's median step and the ratios.

    PYTHONPATH=src python benchmarks/dp_overlap.py                          # 4 ranks, gpt-mini, 8 a rank, 10 rounds
    PYTHONPATH=src python benchmarks/dp_overlap.py --model gpt-small --micro-batch 2 --rounds 6
    PYTHONPATH=src python benchmarks/dp_overlap.py --quick                  # smoke: 2 ranks, gpt-tiny, 2 rounds
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

STEPS = 3  # timed steps per round and variant


def _trainer(args, data, vocab: int, world: int, out: str):
    import autopar
    from autopar.models import build_model
    model, _ = build_model(args.model, {}, vocab_size=vocab, device="meta")
    config = autopar.TrainConfig(steps=10_000, global_batch_size=args.micro_batch * world,
                                 micro_batch_size=args.micro_batch, progress=False, out=out, warmup_steps=1)
    trainer = autopar.Trainer(model, data, strategy=autopar.Strategy(dp=world), config=config)
    trainer._setup()
    trainer.train_step(0)
    trainer.train_step(1)
    return trainer


def _timed(trainer, step: int) -> float:
    """STEPS steps from a common start: the slowest rank's seconds per step."""
    dist.barrier()
    span = torch.tensor([-time.monotonic(), 0.0], dtype=torch.float64)
    for i in range(STEPS):
        trainer.train_step(step + i)
    span[1] = time.monotonic()
    dist.all_reduce(span, op=dist.ReduceOp.MAX)  # the first start, the last end
    return float(span[0] + span[1]) / STEPS


def _rank(rank: int, world: int, port: int, args, scratch: str, results) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    from autopar.data import build_datasets, build_tokenizer, load_corpus, padded_vocab_size
    from autopar.data_parallel import grad_sync
    from autopar.search import reference_step
    tokenizer = build_tokenizer("byte")
    data, _ = build_datasets(load_corpus("stdlib"), tokenizer, seq_len=args.seq_len, task="causal-lm", seed=0)
    vocab = padded_vocab_size(tokenizer.vocab_size)
    chosen = "overlapped" if grad_sync.overlap_pays(torch.device("cpu")) else "one bucket"
    trainers = {f"as chosen ({chosen})": _trainer(args, data, vocab, world, f"{scratch}/chosen{rank}")}
    policy = grad_sync.overlap_pays
    grad_sync.overlap_pays = lambda device: True  # the other way: overlapped whatever the cores
    try:
        trainers["overlapped"] = _trainer(args, data, vocab, world, f"{scratch}/overlapped{rank}")
    finally:
        grad_sync.overlap_pays = policy
    buckets = {name: t.engine.sync.num_buckets if hasattr(getattr(t.engine, "sync", None), "num_buckets") else None
               for name, t in trainers.items()}
    reference = (args.model == "gpt-mini" and args.micro_batch == reference_step.MICRO_BATCH
                 and args.seq_len == reference_step.SEQ_LEN)
    times: dict[str, list[float]] = {name: [] for name in [*trainers, *(["plain torch"] if reference else [])]}
    step = 2
    for _ in range(args.rounds):
        for name, trainer in trainers.items():
            times[name].append(_timed(trainer, step))
            step += STEPS
        if reference:
            times["plain torch"].append(reference_step.step_rounds(rounds=1, steps=STEPS, warmup=1)[0]["wall_s"])
    if rank == 0:
        results.put({"times": times, "buckets": buckets, "cores": len(os.sched_getaffinity(0))
                     if hasattr(os, "sched_getaffinity") else os.cpu_count()})
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--model", default="gpt-mini")
    parser.add_argument("--micro-batch", type=int, default=8, help="sequences per rank (one micro-batch)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 ranks, gpt-tiny, 2 x 32 tokens, 2 rounds")
    args = parser.parse_args()
    if args.quick:
        args.world, args.model, args.micro_batch, args.seq_len, args.rounds = 2, "gpt-tiny", 2, 32, 2
    from autopar.launch import free_port
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as scratch:
        port = free_port()
        procs = [ctx.Process(target=_rank, args=(r, args.world, port, args, scratch, results))
                 for r in range(args.world)]
        for p in procs:
            p.start()
        found = results.get(timeout=1800)
        for p in procs:
            p.join()
    medians = {name: statistics.median(t) for name, t in found["times"].items()}
    print(f"{args.world} ranks of one thread on {found['cores']} cores, {args.model}, {args.micro_batch} x "
          f"{args.seq_len} tokens a rank, {args.rounds} interleaved rounds of {STEPS} steps (median step)")
    for name, t in found["times"].items():
        print(f"  {name:28s} {medians[name] * 1e3:8.1f} ms   buckets {found['buckets'].get(name, '-')}   "
              f"rounds {' '.join(f'{x * 1e3:.0f}' for x in t)}")
    chosen = next(n for n in medians if n.startswith("as chosen"))
    print(f"  as chosen / overlapped: {medians[chosen] / medians['overlapped']:.3f}")
    if "plain torch" in medians:
        print(f"  as chosen / plain torch: {medians[chosen] / medians['plain torch']:.3f}; "
              f"overlapped / plain torch: {medians['overlapped'] / medians['plain torch']:.3f}")


if __name__ == "__main__":
    main()
