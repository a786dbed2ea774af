"""`autopar reproduce embrace`: dense all-reduce vs sparse all-gather vs EmbRace on a word LM.

EmbRace (Li et al., ICPP'22) claims up to 2.41x over the best baseline on GPU clusters by
sharding sparse embedding tables (AlltoAll lookups) instead of all-reducing them densely
or all-gathering their sparse gradients. This study runs, in one go, at each world size:

  dense       today's data parallelism: every gradient, the whole table included, in
              the bucketed all-reduce (train/engine.py DataParallelEngine)
  allgather   sparse tables replicated, their (ids, rows) gradients all-gathered
  embrace     sparse tables sharded column-wise, AlltoAll lookups, local updates
  embrace+2D  the same with 2D communication scheduling (rows the next step reads first)

on the word-level LSTM LM (untied input embedding) and the embedded corpus with the word
tokenizer, SGD, no clipping (2D scheduling needs it off; all variants alike). All
variants live in the same gloo job, train copies of the same model on the same batches,
and are interleaved step by step with a rotating order; a step's time is the slowest
rank's, the table shows the median over the timed steps. Bytes are what one rank receives
per step: measured payload for the sparse exchanges, the ring all-reduce model
2(N-1)/N x elements for all-reduced parameters. After timing, every variant's parameters
must equal the dense run's (1e-4): a speedup that changed the training would not count.

    autopar reproduce embrace                       # default: ~1 min on 2 idle CPU cores, ~3 busy
    autopar reproduce embrace --worlds 2 --steps 4  # quicker
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import time
from datetime import datetime, timedelta
from pathlib import Path

import torch

VARIANTS = ("dense", "allgather", "embrace", "embrace+2D")
TOLERANCE = 1e-4


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="autopar reproduce embrace", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4], help="data-parallel world sizes")
    parser.add_argument("--steps", type=int, default=16, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--vocab-size", type=int, default=32768, help="word vocabulary (table rows)")
    parser.add_argument("--d-embed", type=int, default=128, help="embedding width (the classic untied LM: = hidden)")
    parser.add_argument("--d-hidden", type=int, default=128, help="LSTM width")
    parser.add_argument("--seq-len", type=int, default=32, help="tokens per sequence")
    parser.add_argument("--batch-per-rank", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--lr", type=float, default=0.5, help="SGD learning rate")
    parser.add_argument("--out", default=None, help="output folder (default runs/reproduce-embrace-<time>)")
    args = parser.parse_args(argv)
    for name in ("steps", "vocab_size", "d_embed", "d_hidden", "seq_len", "batch_per_rank"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    if any(w < 2 for w in args.worlds):
        parser.error("--worlds: every world size must be >= 2 (communication needs peers)")
    return args


# ----------------------------------------------------------------------------- one rank


def _rank_main(rank: int, world: int, port: int, args: argparse.Namespace, train_tokens: torch.Tensor,
               vocab: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    try:
        record = _run_variants(rank, world, args, train_tokens, vocab)
        if rank == 0:
            results.put(record)
    except BaseException as exc:  # report, so the parent does not wait forever
        results.put({"error": f"rank {rank}: {type(exc).__name__}: {exc}"})
        raise
    finally:
        dist.destroy_process_group()


def _run_variants(rank: int, world: int, args: argparse.Namespace, train_tokens: torch.Tensor, vocab: int) -> dict:
    import torch.distributed as dist
    import torch.nn.functional as F

    from ..config import Strategy, TrainConfig
    from ..data import CausalLMWindows, GlobalBatchSampler
    from ..mesh import ProcessMesh
    from ..models import build_model
    from ..sparse import SparseEmbeddingEngine
    from ..train.engine import DataParallelEngine
    from ..train.optim import build_optimizer

    data = CausalLMWindows(train_tokens, args.seq_len)
    total_steps = args.warmup + args.steps
    config = TrainConfig(steps=total_steps, optimizer="sgd", lr=args.lr, weight_decay=0.0, grad_clip=0.0,
                         global_batch_size=args.batch_per_rank * world, micro_batch_size=args.batch_per_rank,
                         timeout_s=120)
    sampler = GlobalBatchSampler(len(data), config.global_batch_size, seed=0)

    def batches(step: int) -> list[dict]:
        indices = sampler.local_micro_batches(step, dp_rank=rank, dp_size=world, micro_batch_size=args.batch_per_rank)
        return [{k: torch.stack([data[i][k] for i in mb]) for k in ("input_ids", "labels")} for mb in indices]

    forward = lambda m, b: m(b["input_ids"])  # noqa: E731
    engines, optimizers = {}, {}
    for variant in VARIANTS:
        model, _ = build_model("word-lstm", {"d_embed": args.d_embed, "d_hidden": args.d_hidden}, vocab_size=vocab,
                               device="meta")
        mode = variant.split("+")[0]
        strategy = Strategy(dp=world, sparse_embeddings=mode, sparse_schedule=variant.endswith("2D"))
        mesh = ProcessMesh.build(strategy.resolved(world), timeout_s=120)
        if mode == "dense":
            engines[variant] = DataParallelEngine(model, mesh, device=torch.device("cpu"), seed=0, forward_fn=forward,
                                                  autocast=contextlib.nullcontext)
            optimizers[variant] = build_optimizer(engines[variant].module, config)
        else:
            engines[variant] = SparseEmbeddingEngine(model, mesh, device=torch.device("cpu"), seed=0,
                                                     forward_fn=forward, autocast=contextlib.nullcontext,
                                                     config=config, batches_for_step=batches,
                                                     options=strategy.sparse)
            optimizers[variant] = engines[variant].build_optimizer(config)
    tokens = config.global_batch_size * args.seq_len
    times = {v: [] for v in VARIANTS}
    sent = {v: [] for v in VARIANTS}
    dense_elements = sum(p.numel() for p in engines["dense"].module.parameters())
    table_elements = sum(t.num_rows * t.dim for t in engines["embrace"].tables if t.sparse)
    table_bytes = {v: [] for v in VARIANTS}
    for step in range(total_steps):
        local = batches(step)
        order = VARIANTS[step % len(VARIANTS):] + VARIANTS[:step % len(VARIANTS)]
        for variant in order:
            engine, optimizer = engines[variant], optimizers[variant]
            loss_fn = lambda out, b: F.cross_entropy(out.reshape(-1, vocab), b["labels"].reshape(-1),  # noqa: E731
                                                     reduction="sum") / tokens
            dist.barrier()
            began = time.perf_counter()
            engine.forward_backward(local, loss_fn)
            engine.clip_gradients(float("inf"))
            optimizer.step()
            engine.zero_grad()
            elapsed = torch.tensor([time.perf_counter() - began], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if step >= args.warmup:
                times[variant].append(float(elapsed))
                if variant == "dense":
                    sent[variant].append(round(2 * (world - 1) / world * dense_elements) * 4)
                    table_bytes[variant].append(round(2 * (world - 1) / world * table_elements) * 4)
                else:
                    ledger = engine.ledger.bytes
                    mine = torch.tensor([float(engine.ledger.total_bytes()),
                                         float(engine.ledger.total_bytes() - ledger.get("allreduce", 0))],
                                        dtype=torch.float64)
                    dist.all_reduce(mine)
                    sent[variant].append(float(mine[0]) / world)
                    table_bytes[variant].append(float(mine[1]) / world)
    # the speedups must not change the training: every variant ends where dense does
    reference = {k: v.detach().clone() for k, v in engines["dense"].module.state_dict().items()}
    differences = {}
    for variant in VARIANTS[1:]:
        full = engines[variant].full_state_dict()
        differences[variant] = max(float((full[k] - reference[k]).abs().max()) for k in reference)
    tables = engines["embrace"].tables
    for engine in engines.values():
        engine.close()
    return {"world": world, "median_step_s": {v: statistics.median(t) for v, t in times.items()},
            "step_times_s": times, "bytes_per_step": {v: statistics.median(b) for v, b in sent.items()},
            "table_bytes_per_step": {v: statistics.median(b) for v, b in table_bytes.items()},
            "max_param_difference_vs_dense": differences, "dense_params": dense_elements,
            "tables": [{"name": t.param_name, "rows": t.num_rows, "dim": t.dim, "rows_touched": t.rows_touched,
                        "sparse": t.sparse} for t in tables]}


# ----------------------------------------------------------------------------- driver


def _run_world(world: int, args: argparse.Namespace, train_tokens: torch.Tensor, vocab: int) -> dict:
    import torch.multiprocessing as mp

    from ..launch import free_port
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, args, train_tokens, vocab, results), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    record = results.get()
    for p in procs:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
    if "error" in record:
        raise RuntimeError(f"the study failed at world size {world}: {record['error']}")
    return record


def table(records: list[dict]) -> str:
    lines = ["world variant      table KB  total MB  median step ms  vs dense  vs allgather  max |param - dense|",
             "-" * 96]
    for r in records:
        dense_t, gather_t = r["median_step_s"]["dense"], r["median_step_s"]["allgather"]
        for v in VARIANTS:
            t = r["median_step_s"][v]
            diff = r["max_param_difference_vs_dense"].get(v)
            lines.append(f"{r['world']:>5} {v:<12} {r['table_bytes_per_step'][v] / 1e3:>8.1f} "
                         f"{r['bytes_per_step'][v] / 1e6:>9.3f} {t * 1e3:>15.1f} "
                         f"{dense_t / t:>8.2f}x {gather_t / t:>12.2f}x  {'-' if diff is None else f'{diff:.1e}'}")
    return "\n".join(lines)


def plot(records: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(VARIANTS)
    for i, v in enumerate(VARIANTS):
        xs = [k + i * width for k in range(len(records))]
        axes[0].bar(xs, [r["median_step_s"][v] * 1e3 for r in records], width, label=v)
        axes[1].bar(xs, [r["table_bytes_per_step"][v] / 1e3 for r in records], width, label=v)
    axes[1].set_yscale("log")
    labels = ("median step time (ms, slowest rank)", "embedding-table KB received per rank per step")
    for ax, label in zip(axes, labels):
        ax.set_xticks([k + 0.4 - width / 2 for k in range(len(records))], [f"{r['world']} ranks" for r in records])
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    fig.suptitle("EmbRace on CPU gloo: word-lstm, dense vs sparse all-gather vs sharded AlltoAll")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    from ..data import build_tokenizer, load_corpus
    out = Path(args.out or f"runs/reproduce-embrace-{datetime.now():%Y%m%d-%H%M%S}")
    out.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    corpus = load_corpus("stdlib")
    tokenizer = build_tokenizer("word", corpus=corpus, vocab_size=args.vocab_size)
    train_tokens = tokenizer.encode(corpus.train)
    records = [_run_world(world, args, train_tokens, tokenizer.vocab_size) for world in args.worlds]
    header = (f"EmbRace study | word-lstm d_embed {args.d_embed} d_hidden {args.d_hidden} vocab {tokenizer.vocab_size} "
              f"({tokenizer.words_in_use} words in use) | {args.batch_per_rank} x {args.seq_len} tokens per rank per "
              f"step | SGD, no clipping | {args.warmup} warm-up + {args.steps} timed steps, interleaved | gloo, 1 "
              f"thread per rank, {os.cpu_count()} CPU cores | torch {torch.__version__} | python "
              f"{platform.python_version()}")
    tables = "; ".join(f"{t['name']} {t['rows']}x{t['dim']} ({t['rows_touched']} rows touched in step 1, "
                       f"{'sparse' if t['sparse'] else 'dense'})" for t in records[0]["tables"])
    legend = ("per rank per step: table KB = what the sparse tables cost (dense: their share of the all-reduce, "
              "ring model; others: measured ids + rows/lookups + gradients); total MB adds the dense all-reduce "
              "(ring model 2(N-1)/N x elements x 4 B); step time = slowest rank, median; ratios > 1: faster")
    text = f"{header}\ntables: {tables}\n{legend}\n\n{table(records)}"
    print(text, flush=True)
    bad = {(r["world"], v): d for r in records for v, d in r["max_param_difference_vs_dense"].items() if d > TOLERANCE}
    (out / "embrace.json").write_text(json.dumps({"args": vars(args), "records": records, "table": text,
                                                  "wall_s": time.perf_counter() - began}, indent=2) + "\n")
    plot(records, out / "embrace.png")
    print(f"\nwrote {out / 'embrace.json'} and {out / 'embrace.png'} ({time.perf_counter() - began:.0f} s)")
    if bad:
        print(f"FAILED: parameters differ from the dense run by more than {TOLERANCE}: {bad}")
        return 1
    return 0
