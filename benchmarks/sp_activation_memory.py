"""Sequence parallelism (--sp): activation bytes per rank, measured, beside the formula one process / tp.

For each tp, gloo CPU ranks train a GPT (dropout 0.1, fp32) for one step of one micro-batch with
the Trainer, and count the bytes of every tensor autograd saves for backward during that step
(deduplicated by storage; parameters left out): the activation memory of one micro-batch, the
vocabulary-parallel loss's included. Column layers under --sp keep only their rank's slice of the
gathered input (all-gathered again in backward); those slices are counted too. Three layouts:

  one process   tp = 1 (the whole-model engine)
  tp            tensor parallelism alone: norms, dropout and residuals hold the whole sequence
  tp + sp       those regions on 1/tp of the sequence

Formula (Megatron's sequence parallelism: every activation of a transformer layer is split over tp,
either by heads/features or by positions): bytes(tp + sp) = bytes(one process) / tp. What stays
whole is small (position ids, rotary tables); a backward also holds, for one layer at a time, the
whole input it gathers again, which the count of saved tensors does not show.

    python benchmarks/sp_activation_memory.py            # gpt-mini, seq 512, micro-batch 4, tp 2 and 4
    python benchmarks/sp_activation_memory.py --quick    # smoke: gpt-tiny, seq 64, micro-batch 2, tp 2 + sp
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))


def saved_activation_bytes(trainer) -> int:
    """Bytes autograd keeps for backward during one train step (storages counted once, parameters left out)."""
    from autopar.tensor_parallel import layers

    params = {p.untyped_storage().data_ptr() for p in trainer.model.parameters()}
    seen: dict[int, int] = {}

    def count(t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()

    def pack(t):
        count(t)
        return t

    original = layers._SavedSlice.__init__

    def slice_counted(self, local, *args, **kwargs):  # saved inside the column layer's own hooks
        count(local)
        original(self, local, *args, **kwargs)

    layers._SavedSlice.__init__ = slice_counted
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            trainer.train_step(0)
    finally:
        layers._SavedSlice.__init__ = original
    return sum(seen.values())


def _measure(args, tp: int, sp: bool, data) -> int:
    import autopar
    from autopar.data import padded_vocab_size
    from autopar.models import build_model

    model, _ = build_model(args.model, {"dropout": 0.1, "max_seq_len": max(256, args.seq_len)},
                           vocab_size=padded_vocab_size(258), device="meta")
    config = autopar.TrainConfig(steps=1, global_batch_size=args.micro_batch, micro_batch_size=args.micro_batch,
                                 lr=1e-3, warmup_steps=1, out=tempfile.mkdtemp(), progress=False, timeout_s=600)
    trainer = autopar.Trainer(model, data, strategy=autopar.Strategy(tp=tp, sp=sp), config=config)
    trainer._setup()
    measured = torch.tensor([saved_activation_bytes(trainer)], dtype=torch.float64)
    dist.all_reduce(measured, op=dist.ReduceOp.MAX)
    trainer.engine.close()
    return int(measured.item())


def _run(rank: int, world: int, port: int, args, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=1200))
    from autopar.data import build_datasets, build_tokenizer, load_corpus

    data = build_datasets(load_corpus("stdlib"), build_tokenizer("byte"), seq_len=args.seq_len, task="causal-lm",
                          seed=0)[0]
    rows = {(1, False): _measure(args, 1, False, data)} if world == 1 else \
        {(world, sp): _measure(args, world, sp, data) for sp in ((True,) if args.quick else (False, True))}
    if rank == 0:
        out.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke: gpt-tiny, seq 64, micro-batch 2, tp 2 with sp only")
    parser.add_argument("--model", default="gpt-mini")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    if args.quick:
        args.model, args.seq_len, args.micro_batch, args.tp = "gpt-tiny", 64, 2, [2]
    from autopar.launch import free_port

    rows: dict = {}
    for world in [1, *args.tp]:  # (one process in a process of its own too: the same imports and threads)
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=_run, args=(r, world, port, args, out)) for r in range(world)]
        for p in procs:
            p.start()
        rows.update(out.get(timeout=3600))
        for p in procs:
            p.join()
    one = rows[(1, False)]
    print(f"{args.model}, dropout 0.1, fp32, seq {args.seq_len}, micro-batch {args.micro_batch}; torch "
          f"{torch.__version__}; gloo CPU. Activation bytes saved for backward per rank (max over ranks), one step")
    print(f"{'layout':<12} {'tp':>3} {'MiB':>9} {'/ one':>7} {'formula MiB':>12} {'vs formula':>10}")
    print(f"{'one process':<12} {1:>3} {one / 2**20:9.2f} {1:7.3f} {one / 2**20:12.2f} {0:+10.1%}")
    for tp in args.tp:
        for sp in (False, True):
            if (tp, sp) not in rows:
                continue
            got = rows[(tp, sp)]
            name = "tp + sp" if sp else "tp"
            formula = f"{one / tp / 2**20:12.2f} {got / (one / tp) - 1:+10.1%}" if sp else f"{'':>12} {'':>10}"
            print(f"{name:<12} {tp:>3} {got / 2**20:9.2f} {got / one:7.3f} {formula}")


if __name__ == "__main__":
    main()
