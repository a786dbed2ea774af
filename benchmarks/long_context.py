"""Long context: the longest sequence a GPT trains at a fixed per-rank memory budget with --cp 1, 2, 4.

Four gloo CPU ranks; cp ranks split every sequence, the rest are data-parallel replicas, one sequence
per replica per step. Per-rank memory is measured, not assumed:

  states       parameters, gradients and AdamW's two moments (fp32): 16 bytes per parameter of the
               whole model at that length (counted on the meta device: no memory)
  activations  the bytes autograd keeps for backward during one training step (every tensor saved,
               counted once per storage, parameters excluded), recorded by torch's saved-tensor hooks

The whole model is not built: its 16 bytes per parameter on each of four ranks do not fit a small
shared host. The model's transformer layers are identical, so activations are measured on slices of
it with 1 and 2 layers (same width, heads, vocabulary, everything else): the difference is one
layer's, the rest is what is outside the layers (embeddings, head, loss), and the whole model's are
the 1-layer slice's plus (layers - 1) x one layer's. A 3-layer slice checks that (the error is
printed; not in --quick). Why not the process's peak RSS: on CPU it never goes down, so one process
could not try several lengths.

Activations grow linearly with the tokens a rank holds (ring attention keeps q, k, v, the output and
the row log-sum-exp; torch's CPU attention the same), so two measured lengths fix the line of states +
activations per cp (states grow too: the learned position table is as long as the sequence), a third
(longer) measured length checks it (the error is printed), and the longest length within --budget-mb
is read off the line. Then tokens/s of a few steps at --speed-length for each cp on the 2-layer slice
(not in --quick), beside cp=1. DTensor's context_parallel (torch.distributed.tensor.experimental) is
tried on the same ranks: on CPU it stops at torch's CPU attention kernel (no sharding strategy
registered for it), and the benchmark prints what it raised.

    python benchmarks/long_context.py            # gpt-small, lengths 256/512 fit, 1024 checks
    python benchmarks/long_context.py --quick    # smoke: gpt-tiny, cp 1 and 4, lengths 32/64, no checks
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

WORLD = 4


def _data(vocab: int, length: int, samples: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (samples, length + 1), generator=g)
    return [{"input_ids": row[:-1], "labels": row[1:]} for row in ids]


VOCAB = 512


def _model_args(length: int, layers: int | None = None) -> dict:
    return {"max_seq_len": length, "dropout": 0.0, **({"n_layer": layers} if layers else {})}


def _trainer(model_name: str, cp: int, length: int, steps: int, out: str, layers: int):
    import autopar
    from autopar.models.registry import build_model
    model, _ = build_model(model_name, _model_args(length, layers), vocab_size=VOCAB, device="meta")
    replicas = WORLD // cp
    config = autopar.TrainConfig(steps=steps, global_batch_size=replicas, micro_batch_size=1, lr=1e-4,
                                 warmup_steps=0, checkpoint_every=0, out=out,
                                 progress=False, timeout_s=600)
    return autopar.Trainer(model, _data(512, length, replicas * steps), strategy=autopar.Strategy(cp=cp),
                           config=config)


def whole_model(model_name: str, length: int) -> tuple[int, int]:
    """(layers, state bytes) of the whole model at `length`: 16 bytes per parameter, counted on meta."""
    from autopar.models.registry import build_model
    model, _ = build_model(model_name, _model_args(length), vocab_size=VOCAB, device="meta")
    return len(model.blocks), 16 * sum(p.numel() for p in model.parameters())


def measure_memory(model_name: str, cp: int, length: int, out: str, layers: int) -> dict:
    """The `layers`-layer slice's state bytes on this rank and saved activation bytes (the fullest rank's)
    for one step at `length` tokens per sequence."""
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor):
        if t.device.type == "cpu":  # (tracing on meta / fake tensors saves nothing real)
            try:
                storage = t.untyped_storage()
                saved.setdefault(storage.data_ptr(), storage.nbytes())
            except RuntimeError:
                pass
        return t

    trainer = _trainer(model_name, cp, length, 1, out, layers)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        trainer.train()
    params = list(trainer.model.parameters())
    for p in params:
        saved.pop(p.untyped_storage().data_ptr(), None)
    state = sum(p.numel() * p.element_size() for p in params) * 4  # weights, gradients, two AdamW moments
    trainer.close()
    most = torch.tensor([float(state), float(sum(saved.values()))], dtype=torch.float64)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)  # the fullest rank's
    return {"state": int(most[0]), "activations": int(most[1])}


def measure_speed(model_name: str, cp: int, length: int, steps: int, out: str, layers: int) -> float | None:
    """Median tokens/s of the steps after the first (rank 0 writes the metrics; None elsewhere)."""
    trainer = _trainer(model_name, cp, length, steps, out, layers)
    trainer.train()
    trainer.close()
    if dist.get_rank() != 0:
        return None
    records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["tokens_per_s"] for r in records[1:] if "tokens_per_s" in r)


def try_dtensor(length: int) -> str:
    """DTensor's context-parallel SDPA on these ranks, as its documentation uses it."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    mesh = init_device_mesh("cpu", (WORLD,))
    q = torch.randn(1, 4, length, 16)
    try:
        with context_parallel(mesh, buffers=[q], buffer_seq_dims=[2]):
            x = q.detach().requires_grad_()
            F.scaled_dot_product_attention(x, x, x, is_causal=True).sum().backward()
        return "ran"
    except Exception as exc:  # what it raises on CPU is the finding
        return f"does not run on CPU: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"


def _worker(rank: int, port: int, args: argparse.Namespace, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    results: dict = {"memory": {}, "speed": {}, "layer_check": {}}
    with tempfile.TemporaryDirectory() as scratch:
        for cp in args.cps:
            for layers in (1, 2):
                for length in args.lengths:
                    out = os.path.join(scratch, f"m{cp}-{layers}-{length}")
                    results["memory"][(cp, layers, length)] = measure_memory(args.model, cp, length, out, layers)
            if args.check_layers:  # one more layer, at the longer fit length: is the model linear in layers?
                out = os.path.join(scratch, f"c{cp}")
                results["layer_check"][cp] = measure_memory(args.model, cp, args.fit_lengths[1], out, 3)
            if args.speed_length:
                out = os.path.join(scratch, f"s{cp}")
                results["speed"][cp] = measure_speed(args.model, cp, args.speed_length, args.steps, out, 2)
    results["dtensor"] = try_dtensor(args.speed_length or args.fit_lengths[1])
    if rank == 0:
        queue.put(results)
    dist.barrier()
    dist.destroy_process_group()


def activations(results: dict, cp: int, length: int, layers: int) -> float:
    """Saved activation bytes of a `layers`-layer model: the 1-layer slice's plus (layers - 1) x one layer's."""
    one, two = (results["memory"][(cp, n, length)]["activations"] for n in (1, 2))
    return one + (layers - 1) * (two - one)


def fitted(args: argparse.Namespace, results: dict, cp: int) -> tuple[int, str]:
    """(longest length within the budget on the line through the fit lengths, the line's error at the check length)."""
    total = lambda n: args.states[n] + activations(results, cp, n, args.layers)  # noqa: E731
    (n0, a0), (n1, a1) = [(n, total(n)) for n in args.fit_lengths]  # (states grow too: the position table)
    slope = (a1 - a0) / (n1 - n0)
    base = a0 - slope * n0
    budget = args.budget_mb * 2**20
    step = 2 * cp
    longest = int((budget - base) / slope) // step * step if budget > base else 0
    error = "-"
    if args.check_length:
        check = total(args.check_length)
        error = f"{(base + slope * args.check_length - check) / check:+.1%}"
    return longest, error


def layer_error(args: argparse.Namespace, results: dict, cp: int) -> str:
    measured = results["layer_check"].get(cp)
    if measured is None:
        return "-"
    predicted = activations(results, cp, args.fit_lengths[1], 3)
    return f"{(predicted - measured['activations']) / measured['activations']:+.1%}"


def report(args: argparse.Namespace, results: dict) -> list[str]:
    lines = [f"{args.model} ({args.layers} layers), {WORLD} gloo CPU ranks, one sequence per replica; budget "
             f"{args.budget_mb:g} MiB per rank (states + saved activations); activations from 1- and 2-layer slices",
             f"cp | states MiB at {args.lengths[0]} | activations MiB at " + " / ".join(map(str, args.lengths))
             + f" | 3-layer slice's error at {args.fit_lengths[1]} | line's error at {args.check_length or '-'} | "
             + "longest length | x cp=1"
             + (f" | tokens/s at {args.speed_length} (2-layer slice) | x cp=1" if args.speed_length else "")]
    longest: dict[int, int] = {}
    for cp in args.cps:
        longest[cp], error = fitted(args, results, cp)
        acts = " / ".join(f"{activations(results, cp, n, args.layers) / 2**20:.1f}" for n in args.lengths)
        line = (f"{cp} | {args.states[args.lengths[0]] / 2**20:.1f} | {acts} | {layer_error(args, results, cp)} | "
                f"{error} | {longest[cp]} | {longest[cp] / max(longest[args.cps[0]], 1):.2f}")
        if args.speed_length:
            speed = results["speed"][cp]
            line += f" | {speed:.0f} | {speed / results['speed'][args.cps[0]]:.2f}"
        lines.append(line)
    lines.append(f"DTensor context_parallel (torch {torch.__version__}): {results['dtensor']}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: gpt-tiny, short lengths")
    parser.add_argument("--model", default=None)
    parser.add_argument("--budget-mb", type=float, default=None)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    if args.quick:
        args.model, args.fit_lengths, args.check_length = args.model or "gpt-tiny", [32, 64], None
        args.budget_mb = args.budget_mb or 24.0
        args.speed_length, args.check_layers = None, False
    else:
        args.model, args.fit_lengths, args.check_length = args.model or "gpt-small", [256, 512], 1024
        args.budget_mb = args.budget_mb or 4096.0
        args.speed_length, args.check_layers = 1024, True
    args.cps = [1, 4] if args.quick else [1, 2, 4]  # (the smoke run within its 20 s)
    args.lengths = [*args.fit_lengths, *([args.check_length] if args.check_length else [])]
    states = {n: whole_model(args.model, n) for n in args.lengths}
    args.layers = states[args.lengths[0]][0]
    args.states = {n: state for n, (_, state) in states.items()}
    from autopar.launch import free_port
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_worker, args=(free_port(), args, queue), nprocs=WORLD)
    print("\n".join(report(args, queue.get())), flush=True)


if __name__ == "__main__":
    main()
