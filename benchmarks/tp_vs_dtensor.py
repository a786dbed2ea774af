"""Tensor parallelism: autopar's graph-rewritten stage against torch DTensor's parallelize_module.

One run, the same tp gloo ranks, the same transformer stack (autopar's own GPT blocks from
src/autopar/models/gpt.py in an nn.ModuleList; no embedding or head, the input is hidden
states [B, T, D]) built from one seed, parallelised two ways:

  ours     autopar.trace.trace -> partition(graph, 1) -> materialise stage 0 ->
           plan_tensor_parallel(graph, tp) -> TensorParallel(plan, group).parallelize(stage),
           exactly what PipelineEngine does for pp=1, tp>1 (the plan is found in the graph)
  dtensor  torch.distributed.tensor.parallel.parallelize_module on a DeviceMesh of the same
           ranks: ColwiseParallel on q/k/v_proj and fc_in, RowwiseParallel on out_proj and
           fc_out (a hand-written plan; the attention's view(b, t, -1, head_dim) makes the
           local head count work)

First both are checked against the unsharded stack (fp32): outputs, the gradient of the
input and every (gathered) parameter gradient must agree to a relative 1e-5, or the run
fails (a gradient's scale is at least 1e-2 of the model's largest gradient: k_proj.bias has
an exactly-zero true gradient, so its own magnitude is rounding noise). Then forward+backward
steps are timed interleaved (ours, dtensor, dtensor, ours, ...: the order alternates every
step) after warm-up; a step's time is the slowest rank's, the
table reports medians and ours/DTensor. Memory per rank: parameter bytes, the bytes autograd
saves for backward in one step (saved-tensor hooks, each storage once, weights excluded),
and on CUDA the peak allocated during a step above what was resident before it. The
all-reduces one step issues are counted with the profiler (the reason the times differ).

    python benchmarks/tp_vs_dtensor.py                      # tp 2 and 4 (~1 min on 2 busy cores)
    python benchmarks/tp_vs_dtensor.py --tp 2 --steps 5     # tp 2 only, fewer steps
    python benchmarks/tp_vs_dtensor.py --quick              # smoke test: tp 2, one narrow block, 3 steps
    python benchmarks/tp_vs_dtensor.py --device cuda        # ranks share the visible GPUs (gloo)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from autopar.launch import free_port
from autopar.models import materialize
from autopar.models.gpt import Block, GPTConfig
from autopar.partition import partition
from autopar.tensor_parallel import TensorParallel, plan_tensor_parallel
from autopar.trace import trace

VARIANTS = ("ours", "dtensor")
TOLERANCE = 1e-5  # relative to the largest magnitude of the reference value
GRAD_FLOOR = 1e-2  # gradient errors are relative to max(own max |grad|, GRAD_FLOOR * model's max |grad|)
TIMEOUT = timedelta(seconds=120)
SEED = 0


class BlockStack(nn.Module):
    """GPT blocks only: hidden states in, hidden states out (what one pipeline stage of layers holds)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def dtensor_plan(n_layer: int) -> dict:
    plan = {}
    for i in range(n_layer):
        for name in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.fc_in"):
            plan[f"blocks.{i}.{name}"] = ColwiseParallel()
        for name in ("attn.out_proj", "mlp.fc_out"):
            plan[f"blocks.{i}.{name}"] = RowwiseParallel()
    return plan


# ----------------------------------------------------------------------------- the two variants


class Variant:
    """A tensor-parallel module plus how to read its (whole) gradients and its local weights."""

    def __init__(self, name: str, module: nn.Module, gather_grad, local_of):
        self.name, self.module, self.gather_grad, self.local_of = name, module, gather_grad, local_of

    def named_params(self) -> list[tuple[str, torch.Tensor]]:
        return list(self.module.named_parameters())

    def local_weights(self) -> list[torch.Tensor]:
        return [self.local_of(p) for p in self.module.parameters()] + list(self.module.buffers())

    def param_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.local_weights())

    def zero_grad(self) -> None:
        for p in self.module.parameters():
            p.grad = None

    def step(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out = self.module(x)
        (out * w).sum().backward()
        return out


def build_ours(meta_model: nn.Module, example: torch.Tensor, tp: int, group, device: torch.device) -> Variant:
    graph = trace(meta_model, (torch.zeros(example.shape, dtype=example.dtype, device="meta"),))
    part = partition(graph, 1)
    stage = part.materialize_stage(0, meta_model, device, seed=SEED)
    plan = plan_tensor_parallel(graph, tp)
    roles = [d.role for d in plan.decisions]
    n_layer = len(meta_model.blocks)
    if roles.count("column") != 4 * n_layer or roles.count("row") != 2 * n_layer:
        raise RuntimeError(f"autopar's plan did not split every block's 4 column + 2 row linears "
                           f"(columns {roles.count('column')}, rows {roles.count('row')}):\n{plan.table()}")
    parallel = TensorParallel(plan, group)
    parallel.parallelize(stage)
    return Variant("ours", stage, lambda fqn, g: parallel.gather(fqn, g), lambda p: p)


def build_dtensor(meta_model: nn.Module, tp: int, device: torch.device) -> Variant:
    model = materialize(copy.deepcopy(meta_model), device, seed=SEED)
    mesh = init_device_mesh(device.type, (tp,))
    parallelize_module(model, mesh, dtensor_plan(len(model.blocks)))

    def whole(fqn: str, g: torch.Tensor) -> torch.Tensor:
        return g.full_tensor() if isinstance(g, DTensor) else g

    return Variant("dtensor", model, whole, lambda p: p.to_local() if isinstance(p, DTensor) else p)


# ----------------------------------------------------------------------------- checks and measurements


def rel_err(got: torch.Tensor, ref: torch.Tensor, floor: float = 0.0) -> float:
    """max |got - ref| / max |ref|, the denominator at least `floor`."""
    scale = max(ref.detach().abs().max().item(), floor, 1e-30)
    return (got.detach() - ref.detach()).abs().max().item() / scale


def check_against_reference(variant: Variant, reference: nn.Module, ref_out: torch.Tensor, ref_dx: torch.Tensor,
                            x: torch.Tensor, w: torch.Tensor) -> dict:
    """Largest relative error of the output, the input gradient and each gathered parameter gradient."""
    variant.zero_grad()
    xin = x.clone().requires_grad_(True)
    out = variant.step(xin, w)
    errors = {"output": rel_err(out, ref_out), "input grad": rel_err(xin.grad, ref_dx)}
    ref_grads = dict(reference.named_parameters())
    # k_proj.bias has an exactly-zero true gradient (softmax ignores a constant per query), so its
    # computed values are rounding noise; gradients are judged relative to at least 1e-2 of the largest
    # gradient in the model rather than relative to their own (possibly ~0) magnitude
    floor = GRAD_FLOOR * max(p.grad.abs().max().item() for p in ref_grads.values())
    seen = set()
    for fqn, p in variant.named_params():
        if p.grad is None:
            raise RuntimeError(f"{variant.name}: parameter {fqn} got no gradient")
        whole = variant.gather_grad(fqn, p.grad)  # collective for sharded ones: same order on every rank
        errors[fqn] = rel_err(whole, ref_grads[fqn].grad, floor)
        seen.add(fqn)
    missing = set(ref_grads) - seen
    if missing:
        raise RuntimeError(f"{variant.name}: parameters missing from the parallel module: {sorted(missing)}")
    variant.zero_grad()
    return errors


def saved_bytes(variant: Variant, x: torch.Tensor, w: torch.Tensor) -> int:
    """Bytes autograd keeps for backward in one forward (each storage once, weights not counted)."""
    weights = {t.untyped_storage().data_ptr() for t in variant.local_weights()}
    seen: set[int] = set()
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        local = t._local_tensor if isinstance(t, DTensor) else t  # DTensor saves wrappers around local shards
        storage = local.untyped_storage()
        key = storage.data_ptr()
        if key not in weights and key not in seen and storage.nbytes():
            seen.add(key)
            total += storage.nbytes()
        return t

    variant.zero_grad()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = variant.module(x)
    (out * w).sum().backward()
    variant.zero_grad()
    return total


def collectives_per_step(variant: Variant, x: torch.Tensor, w: torch.Tensor) -> dict[str, int]:
    """How many all-reduces / all-gathers one forward+backward issues (profiler events at the c10d layer)."""
    from torch.profiler import profile
    variant.zero_grad()
    with profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        variant.step(x, w)
    variant.zero_grad()
    counts = {"all_reduce": 0, "all_gather": 0}
    for event in prof.events():
        if event.name == "c10d::allreduce_":
            counts["all_reduce"] += 1
        elif event.name in ("c10d::allgather_", "c10d::_allgather_base_"):
            counts["all_gather"] += 1
    return counts


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_variants(variants: dict[str, Variant], x, w, args, group, device) -> dict:
    times = {name: [] for name in VARIANTS}
    peaks = {name: 0 for name in VARIANTS}
    for step in range(args.warmup + args.steps):
        order = VARIANTS if step % 2 == 0 else VARIANTS[::-1]
        for name in order:
            variant = variants[name]
            variant.zero_grad()
            sync(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
                resident = torch.cuda.memory_allocated(device)
            dist.barrier(group)
            start = time.perf_counter()
            variant.step(x, w)
            sync(device)
            elapsed = time.perf_counter() - start
            if device.type == "cuda":
                peaks[name] = max(peaks[name], torch.cuda.max_memory_allocated(device) - resident)
            if step >= args.warmup:
                times[name].append(elapsed)
    stacked = torch.tensor([times[name] for name in VARIANTS], dtype=torch.float64)
    dist.all_reduce(stacked, op=dist.ReduceOp.MAX, group=group)  # a step lasts as long as its slowest rank
    return {"times": {name: stacked[i].tolist() for i, name in enumerate(VARIANTS)}, "cuda_peak": peaks}


def run_tp(args, group, device: torch.device) -> dict:
    tp = dist.get_world_size(group)
    cfg = GPTConfig(n_layer=args.layers, d_model=args.d_model, n_head=args.heads, max_seq_len=args.seq,
                    dropout=0.0)
    with torch.device("meta"):
        meta_model = BlockStack(cfg)
    gen = torch.Generator().manual_seed(1234)  # the same input on every rank: tp replicates activations
    x = torch.randn(args.batch, args.seq, args.d_model, generator=gen).to(device)
    w = torch.randn(args.batch, args.seq, args.d_model, generator=gen).to(device)

    reference = materialize(copy.deepcopy(meta_model), device, seed=SEED)
    xin = x.clone().requires_grad_(True)
    ref_out = reference(xin)
    (ref_out * w).sum().backward()
    ref_bytes = sum(p.numel() * p.element_size() for p in reference.parameters())

    begin = time.perf_counter()
    variants = {"ours": build_ours(meta_model, x, tp, group, device)}
    build_ours_s = time.perf_counter() - begin
    begin = time.perf_counter()
    variants["dtensor"] = build_dtensor(meta_model, tp, device)
    build_dtensor_s = time.perf_counter() - begin

    errors = {name: check_against_reference(variants[name], reference, ref_out, xin.grad, x, w) for name in VARIANTS}
    worst = torch.tensor([max(errors[name].values()) for name in VARIANTS], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)
    worst_where = {name: max(errors[name], key=errors[name].get) for name in VARIANTS}
    if worst.max().item() > TOLERANCE:
        for name in VARIANTS:
            print(f"rank {dist.get_rank()} {name}: " + ", ".join(f"{k} {v:.1e}" for k, v in errors[name].items()),
                  flush=True)
        raise AssertionError(f"tp={tp}: not equal to the unsharded stack (relative tol {TOLERANCE:g}): "
                             + ", ".join(f"{n} max {worst[i].item():.2e} at {worst_where[n]}"
                                         for i, n in enumerate(VARIANTS)))
    del reference, ref_out, xin

    saved = {name: saved_bytes(variants[name], x, w) for name in VARIANTS}
    collectives = {name: collectives_per_step(variants[name], x, w) for name in VARIANTS}
    timing = time_variants(variants, x, w, args, group, device)
    t = timing["times"]
    return {
        "tp": tp,
        "median_ms": {n: 1000 * statistics.median(t[n]) for n in VARIANTS},
        "paired_ratio": statistics.median(o / d for o, d in zip(t["ours"], t["dtensor"])),
        "param_bytes": {n: variants[n].param_bytes() for n in VARIANTS},
        "unsharded_param_bytes": ref_bytes,
        "saved_bytes": saved,
        "collectives_per_step": collectives,
        "cuda_peak_bytes": timing["cuda_peak"] if device.type == "cuda" else None,
        "max_rel_err": {n: worst[i].item() for i, n in enumerate(VARIANTS)},
        "build_s": {"ours": build_ours_s, "dtensor": build_dtensor_s},
    }


def worker(rank: int, world: int, port: int, args, out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    if args.device == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=TIMEOUT)
    try:
        result = run_tp(args, dist.group.WORLD, device)
        if rank == 0:
            Path(out_dir, f"tp{world}.json").write_text(json.dumps(result))
        dist.barrier()  # no rank tears down while a peer still has gloo work in flight
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- report


def mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def report(args, results: list[dict]) -> str:
    cuda = args.device == "cuda"
    lines = [
        f"GPT blocks x{args.layers}, d_model {args.d_model}, {args.heads} heads, d_ff {4 * args.d_model} | "
        f"input [{args.batch}, {args.seq}, {args.d_model}] fp32 | {args.device} | gloo, "
        f"1 thread per rank | {os.cpu_count()} CPU cores, load {args.load[0]:.1f} | torch {torch.__version__} | "
        f"python {platform.python_version()}",
        f"step = forward + backward of sum(out * w); {args.warmup} warm-up + {args.steps} timed steps per variant, "
        f"interleaved; median of the slowest rank; paired = median of per-step ours/dtensor;\n"
        f"all-reduces = c10d all-reduces in one step (profiler); saved act = bytes autograd keeps for backward",
        "",
    ]
    header = (f"{'tp':>2} | {'ours ms':>8} {'DTensor ms':>10} {'ours/DT':>7} {'paired':>6} | "
              f"{'params MiB/rank ours/DT (whole)':>31} | {'saved act MiB ours/DT':>21} | {'all-reduces ours/DT':>19}"
              + (f" | {'CUDA step peak MiB ours/DT':>26}" if cuda else "") + f" | {'max rel err ours/DT':>19}")
    lines += [header, "-" * len(header)]
    for r in results:
        m, p, s, e = r["median_ms"], r["param_bytes"], r["saved_bytes"], r["max_rel_err"]
        reduces = {n: r["collectives_per_step"][n]["all_reduce"] for n in VARIANTS}
        row = (f"{r['tp']:>2} | {m['ours']:>8.1f} {m['dtensor']:>10.1f} {m['ours'] / m['dtensor']:>7.3f} "
               f"{r['paired_ratio']:>6.3f} | "
               f"{mib(p['ours']) + ' / ' + mib(p['dtensor']) + ' (' + mib(r['unsharded_param_bytes']) + ')':>31} | "
               f"{mib(s['ours']) + ' / ' + mib(s['dtensor']):>21} | "
               f"{'%d / %d' % (reduces['ours'], reduces['dtensor']):>19}")
        if cuda:
            c = r["cuda_peak_bytes"]
            row += f" | {mib(c['ours']) + ' / ' + mib(c['dtensor']):>26}"
        row += f" | {'%.1e / %.1e' % (e['ours'], e['dtensor']):>19}"
        lines.append(row)
    lines += ["", f"equality vs the unsharded stack (outputs, input grad, gathered param grads; relative tol "
                  f"{TOLERANCE:g}): PASS for every tp",
              "setup time (s, rank 0) ours trace+partition+materialise+plan+rewrite / DTensor parallelize_module: "
              + ", ".join(f"tp{r['tp']} {r['build_s']['ours']:.1f} / {r['build_s']['dtensor']:.2f}" for r in results)]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="autopar tensor parallelism (graph-planned, rewritten stage) vs torch DTensor "
                    "parallelize_module on the same GPT blocks: equality check, step time, memory.")
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4], help="tp sizes to run (default: 2 4)")
    parser.add_argument("--layers", type=int, default=2, help="GPT blocks in the stack (default 2)")
    parser.add_argument("--d-model", type=int, default=256, help="hidden width (default 256)")
    parser.add_argument("--heads", type=int, default=8, help="attention heads; tp must divide it (default 8)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence (default 128)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed warm-up steps per variant (default 3)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the ranks compute (default cpu)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: tp 2, 1 block of width 64 (4 heads), 2 x 16 tokens, 1 warm-up + 3 steps")
    args = parser.parse_args(argv)
    if args.quick:
        args.tp, args.layers, args.d_model, args.heads, args.batch, args.seq = [2], 1, 64, 4, 2, 16
        args.steps, args.warmup = 3, 1
    if any(t < 2 for t in args.tp):
        parser.error(f"--tp: every size must be >= 2, got {args.tp}")
    bad = [t for t in args.tp if args.heads % t or (4 * args.d_model) % t]
    if bad:
        parser.error(f"--tp {bad} must divide --heads {args.heads} (and d_ff {4 * args.d_model}); "
                     f"pick tp among the divisors of {args.heads}")
    if args.d_model % args.heads:
        parser.error(f"--heads {args.heads} must divide --d-model {args.d_model}")
    if min(args.layers, args.batch, args.seq, args.steps) < 1 or args.warmup < 0:
        parser.error("--layers/--batch/--seq/--steps must be >= 1 and --warmup >= 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible to torch here; use --device cpu")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.load = os.getloadavg()
    print(f"$ python {' '.join(['benchmarks/tp_vs_dtensor.py', *(sys.argv[1:] if argv is None else argv)])}",
          flush=True)
    begin = time.perf_counter()
    results = []
    with tempfile.TemporaryDirectory() as out:
        for tp in args.tp:
            mp.spawn(worker, args=(tp, free_port(), args, out), nprocs=tp, join=True)
            results.append(json.loads(Path(out, f"tp{tp}.json").read_text()))
            print(f"  [tp={tp} done]", file=sys.stderr, flush=True)
    print(report(args, results))
    print(json.dumps({"benchmark": "tp_vs_dtensor", "args": {k: v for k, v in vars(args).items() if k != "load"},
                      "results": results}))
    print(f"total wall time {time.perf_counter() - begin:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
