"""What layout-free dropout costs: step time of gpt-tiny with dropout 0.1, ours vs torch's own dropout.

One process, the whole model (what `autopar train` runs at dp=1): forward, backward and an
AdamW step on a batch of token windows, once with torch's dropout (its random stream) and
once inside `eager_micro_batch` (autopar/dropout: hashed masks, attention written out
because the fused kernel draws its own numbers). The two variants alternate round by round,
so drift hits both alike; the table gives the median step time and the ratio.

The traced path (pipeline / tensor-parallel stages) is timed the same way: the one-stage
graph with its dropout nodes replaced, run inside and outside a step scope (outside, the
replaced nodes fall back to torch's dropout).

    PYTHONPATH=src python benchmarks/dropout_cost.py              # CPU, ~1 min
    PYTHONPATH=src python benchmarks/dropout_cost.py --device cuda
    PYTHONPATH=src python benchmarks/dropout_cost.py --quick         # smoke test: 3 rounds of 2 x 32 tokens
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from autopar.dropout import dropout_step, eager_micro_batch, micro_batch
from autopar.models.gpt import GPT, GPTConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="smoke test: 3 rounds of 2 x 32 tokens")
    args = parser.parse_args()
    if args.quick:
        args.batch, args.seq, args.rounds = 2, 32, 3
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=4, d_model=64, max_seq_len=256, vocab_size=512, dropout=0.1)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 512, (args.batch, args.seq), device=device)
    samples = [list(range(args.batch))]

    from autopar.partition import partition
    from autopar.trace import trace
    part = partition(trace(model, (torch.zeros(ids.shape, dtype=ids.dtype, device="meta"),)), 1)
    stage = part.materialize_stage(0, model, device, seed=0)
    stage_optimizer = torch.optim.AdamW(stage.parameters(), lr=1e-4)

    def step(run, opt, scope) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        began = time.perf_counter()
        with scope():
            logits = run(ids)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - began

    @contextlib.contextmanager
    def ours_eager():
        with dropout_step(0, 0, samples), eager_micro_batch(0):
            yield

    @contextlib.contextmanager
    def ours_graph():
        with dropout_step(0, 0, samples), micro_batch(0):
            yield

    variants = {"eager, torch dropout": (model, optimizer, contextlib.nullcontext),
                "eager, layout-free": (model, optimizer, ours_eager),
                "graph, torch dropout": (stage, stage_optimizer, contextlib.nullcontext),
                "graph, layout-free": (stage, stage_optimizer, ours_graph)}
    times = {name: [] for name in variants}
    for name, (run, opt, scope) in variants.items():  # warm-up
        step(run, opt, scope)
    for r in range(args.rounds):
        names = list(variants)
        names = names[r % len(names):] + names[:r % len(names)]
        for name in names:
            times[name].append(step(*variants[name]))
    median = {name: statistics.median(t) for name, t in times.items()}
    print(f"gpt-tiny (2 layers, d_model 64), dropout 0.1, batch {args.batch} x {args.seq} tokens, {device}, "
          f"{args.threads} thread(s), median of {args.rounds} steps")
    for name, value in median.items():
        base = median[name.split(",")[0] + ", torch dropout"]
        print(f"  {name:<24} {value * 1e3:8.2f} ms   x{value / base:.2f}")


if __name__ == "__main__":
    main()
