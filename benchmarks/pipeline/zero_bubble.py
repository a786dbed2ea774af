"""Study 5: zero-bubble schedules at pp 2 and 4 against torch.distributed.pipelining's, and the I/W split.

  5a. split       one process, the second stage of a 2-stage gpt-mini: a fused backward (B) against
                  I then W (pipeline/split_backward.py, with a plan cache as the runtime keeps), medians;
                  and the bytes I keeps for W (the gradients at weight-reading nodes; the graph's saved
                  activations come on top in both).
  5b. schedules   pp ranks (gloo, CPU, one thread each) on the same partitions (pp stages for
                  1-chunk schedules, 2pp for 2-chunk ones) and the same data: our 1f1b, zb-h1, zbv
                  (build_local_pipeline) against torch's Schedule1F1B, ScheduleInterleavedZeroBubble
                  and ScheduleZBVZeroBubble driving PipelineStages built on the very same StageModules.
                  Steps interleaved across variants, medians of the slowest rank's step time.
                  Bubble = 1 - (process CPU time / wall time) per rank, averaged: the same meter for
                  ours and torch's (when ranks outnumber cores, waiting for a core counts as bubble too).
                  Beside it, our simulator's makespan with unit chunk costs (F = I = W).

Weights are not updated (gradients zeroed between steps): step time does not depend on them.
"""

from __future__ import annotations

import copy
import os
import statistics
import tempfile
import time
import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleInterleavedZeroBubble,
                                          ScheduleZBVZeroBubble)

from autopar.launch import free_port
from autopar.pipeline.actions import Op, stage_to_rank
from autopar.pipeline.build import build_local_pipeline
from autopar.pipeline.schedules import generate, placement
from autopar.pipeline.simulate import simulate
from autopar.pipeline.split_backward import backward_input, backward_weight
from autopar.pipeline.split_plan import SplitPlanCache

from pipeline.common import TIMEOUT, Setup

# (label, implementation, schedule, chunks)
VARIANTS = [("ours 1f1b", "ours", "1f1b", 1), ("ours zb-h1", "ours", "zb-h1", 1), ("ours zbv", "ours", "zbv", 2),
            ("torch 1F1B", "torch", "1f1b", 1), ("torch InterleavedZB", "torch", "interleaved-zb", 2),
            ("torch ZBV", "torch", "zbv", 2)]


# ----------------------------------------------------------------------------- 5a: the split, one process


def split_timing(args, repeats: int = 15) -> dict:
    torch.set_num_threads(1)
    setup = Setup.__new__(Setup)  # no process group needed: only the model, its trace and partition
    _local_setup(setup, args)
    first, stage = setup.stage(0, 2), setup.stage(1, 2)
    batch = setup.batches(0)[0]
    with torch.no_grad():
        acts = tuple(first(batch["input_ids"]))
    params = [p for p in stage.parameters() if p.requires_grad]

    def forward():
        xs = tuple(a.detach().requires_grad_(a.is_floating_point()) for a in acts)
        return xs, setup.loss(stage(*xs), batch["labels"])

    def fused():
        xs, loss = forward()
        begin = time.perf_counter()
        loss.backward()
        return time.perf_counter() - begin, 0

    plans = SplitPlanCache()  # as the runtime keeps it: the boundary walk is analysed once per graph shape

    def split():
        xs, loss = forward()
        begin = time.perf_counter()
        _, work = backward_input([loss], [None], [x for x in xs if x.requires_grad], params, plans)
        middle, held = time.perf_counter(), work.held_bytes
        backward_weight(work)
        return (middle - begin, time.perf_counter() - middle), held

    def two_pass():  # what zb-h1 did before: autograd.grad to the inputs, then a second backward to the weights
        xs, loss = forward()
        begin = time.perf_counter()
        torch.autograd.grad([loss], [x for x in xs if x.requires_grad], retain_graph=True)
        middle = time.perf_counter()
        torch.autograd.backward([loss], inputs=params)
        return (middle - begin, time.perf_counter() - middle), 0

    runs = {"B": [], "I, W": [], "I, W (two passes)": []}
    held = 0
    for i in range(repeats + 2):
        for name, fn in (("B", fused), ("I, W", split), ("I, W (two passes)", two_pass)):
            for p in params:
                p.grad = None
            t, h = fn()
            held = max(held, h)
            if i >= 2:
                runs[name].append(t)
    out = {"B": statistics.median(runs["B"]), "held_bytes": held, "plan_hits": plans.hits,
           "plan_misses": plans.misses}
    for name in ("I, W", "I, W (two passes)"):
        out[name] = [statistics.median(t[0] for t in runs[name]), statistics.median(t[1] for t in runs[name])]
    out["activation_bytes"] = sum(a.numel() * a.element_size() for a in acts if a.is_floating_point())
    return out


def _local_setup(setup: Setup, args) -> None:
    """Setup's fields without a process group (5a runs in the launching process)."""
    from autopar.models import build_model
    from autopar.partition import partition
    from autopar.trace import trace
    setup.args = args
    setup.model, setup.info = build_model("gpt-mini", args.model_args, vocab_size=args.vocab, device="meta")
    setup.graph = trace(setup.model, (torch.zeros(args.mb, args.seq, dtype=torch.long, device="meta"),))
    setup.parts = {2: partition(setup.graph, 2, method="time")}
    setup.tokens = args.m * args.mb * args.seq


# ----------------------------------------------------------------------------- 5b: schedules, pp ranks


class _Run:
    """One variant on this rank: its own stage copies (same initial weights), group and step."""

    def __init__(self, setup: Setup, pp: int, impl: str, schedule: str, chunks: int):
        self.setup, self.pp, self.rank = setup, pp, dist.get_rank()
        a, num_stages = setup.args, pp * chunks
        group = dist.new_group(list(range(pp)), timeout=TIMEOUT)
        loss = lambda out, labels: setup.loss(out, labels)
        if impl == "ours":
            self.pipe = build_local_pipeline(setup.model, pp=pp, pp_rank=self.rank, pp_group=group, device="cpu",
                                             seed=0, example_batch=setup.batches(0)[0], num_microbatches=a.m,
                                             schedule=schedule, chunks=chunks, partition=setup.part(num_stages))
            self.stages = list(self.pipe.stages.values())
            self.last = num_stages - 1 in self.pipe.stages
        else:
            style = "v" if schedule == "zbv" else "loop"
            mine = [s for s in range(num_stages) if stage_to_rank(s, pp, num_stages, style) == self.rank]
            self.stages = [setup.stage(s, num_stages) for s in mine]
            pipes = [PipelineStage(m, s, num_stages, torch.device("cpu"), group=group) for m, s in zip(self.stages, mine)]
            cls = {"1f1b": Schedule1F1B, "interleaved-zb": ScheduleInterleavedZeroBubble,
                   "zbv": ScheduleZBVZeroBubble}[schedule]
            self.torch = cls(pipes if chunks > 1 else pipes[0], a.m, loss_fn=loss, scale_grads=False)
            self.first, self.last = 0 in mine, num_stages - 1 in mine
        self.impl = impl

    def step(self, batches) -> float:
        if self.impl == "ours":
            loss = self.pipe.runtime.run(self.pipe.actions, batches,
                                         loss_fn=lambda out, b: self.setup.loss(out, b["labels"])).loss
            result = float(loss)
        else:
            kw: dict = {}
            if self.last:
                losses: list = []
                kw = {"target": torch.cat([b["labels"] for b in batches]), "losses": losses}
            args = (torch.cat([b["input_ids"] for b in batches]),) if self.first else ()
            self.torch.step(*args, return_outputs=False, **kw)
            result = float(sum(l.detach() for l in losses)) if self.last else 0.0
        for stage in self.stages:
            for p in stage.parameters():
                p.grad = None
        return result


def _worker(rank: int, port: int, pp: int, args, out: str) -> None:
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=pp, timeout=TIMEOUT)
    try:
        setup = Setup(args)
        runs = {label: _Run(setup, pp, impl, schedule, chunks) for label, impl, schedule, chunks in VARIANTS}
        wall = {label: [] for label in runs}
        cpu = {label: [] for label in runs}
        first_loss = {}
        for step in range(args.warmup + args.steps5):
            batches = setup.batches(step)
            for label, run in runs.items():
                dist.barrier()
                c0, t0 = time.process_time(), time.perf_counter()
                loss = run.step(batches)
                t, c = time.perf_counter() - t0, time.process_time() - c0
                slowest = torch.tensor([t])
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                if step == 0:
                    got = torch.tensor([loss])
                    dist.all_reduce(got)  # only the last stage's rank adds a loss
                    first_loss[label] = float(got)
                if step >= args.warmup:
                    wall[label].append(float(slowest))
                    cpu[label].append(1 - c / float(slowest))
        idle = {label: torch.tensor([statistics.median(v)]) for label, v in cpu.items()}
        for v in idle.values():
            dist.all_reduce(v)
        if rank == 0:
            result = {label: {"step": statistics.median(wall[label]), "bubble": float(idle[label]) / pp,
                              "loss0": first_loss[label]} for label in runs}
            Path(out, f"pp{pp}.json").write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def predicted(pp: int, m: int) -> dict:
    """Simulated makespan with unit chunk costs (a 1-chunk stage costs 2), against our 1f1b."""
    unit = {Op.FORWARD: 1, Op.BACKWARD_INPUT: 1, Op.BACKWARD_WEIGHT: 1, Op.BACKWARD: 2}
    out = {}
    for name, chunks in (("1f1b", 1), ("zb-h1", 1), ("zbv", 2)):
        scale = 2 // chunks
        t = simulate(generate(name, pp=pp, num_microbatches=m, chunks=chunks), pp=pp, num_stages=pp * chunks,
                     num_microbatches=m, style=placement(name), cost=lambda a: unit[a.op] * scale)
        out[name] = {"makespan": t.makespan, "bubble": sum(t.bubble.values()) / pp}
    return out


def part5(args) -> dict:
    """2pp stages need 2pp blocks: the model gets at least 2pp-2 layers (the others parts' size when enough)."""
    args = copy.copy(args)
    args.model_args = {**args.model_args, "n_layer": max(args.model_args["n_layer"], 2 * max(args.pp5) - 2)}
    result = {"split": split_timing(args), "pp": {}, "n_layer": args.model_args["n_layer"]}
    for pp in args.pp5:
        with tempfile.TemporaryDirectory() as out:
            mp.start_processes(_worker, args=(free_port(), pp, args, out), nprocs=pp, join=True,
                               start_method="forkserver")
            result["pp"][pp] = json.loads(Path(out, f"pp{pp}.json").read_text())
        result["pp"][pp]["predicted"] = predicted(pp, args.m)
    return result


def report_part5(result: dict, args) -> str:
    s = result["split"]
    i, w = s["I, W"]
    i2, w2 = s["I, W (two passes)"]
    lines = ["== 5. zero bubble: the I/W split, and zero-bubble schedules against torch's ==",
             f"gpt-mini with n_layer={result['n_layer']} (2pp stages need 2pp blocks)",
             "5a. one stage (second of 2), one process, medians of 15:",
             f"  B (fused backward)            {s['B'] * 1e3:8.2f} ms",
             f"  I + W (split_backward)        {(i + w) * 1e3:8.2f} ms  (I {i * 1e3:.2f} + W {w * 1e3:.2f})  "
             f"ratio to B {(i + w) / s['B']:.3f}  (plan cache: {s['plan_misses']} miss, {s['plan_hits']} hits)",
             f"  I + W (two passes, before)    {(i2 + w2) * 1e3:8.2f} ms  (I {i2 * 1e3:.2f} + W {w2 * 1e3:.2f})  "
             f"ratio to B {(i2 + w2) / s['B']:.3f}",
             f"  held between I and W: {s['held_bytes'] / 2**20:.2f} MiB of gradients at weight-reading nodes "
             f"(stage input activations {s['activation_bytes'] / 2**20:.2f} MiB; "
             "the retained graph is the same as B's)"]
    for pp, rows in result["pp"].items():
        base = rows["ours 1f1b"]["step"]
        lines.append(f"5b. pp={pp}, m={args.m}, {args.steps5} timed steps (medians of the slowest rank), "
                     f"{pp} ranks on {os.cpu_count()} cores:")
        lines.append(f"  {'variant':22s} {'step ms':>9s} {'/ ours 1f1b':>11s} {'bubble':>7s} {'step-0 loss':>12s}")
        for label, _, _, _ in VARIANTS:
            r = rows[label]
            lines.append(f"  {label:22s} {r['step'] * 1e3:9.1f} {r['step'] / base:11.3f} {r['bubble']:7.3f} "
                         f"{r['loss0']:12.6f}")
        pairs = [("ours 1f1b", "torch 1F1B"), ("ours zb-h1", "torch InterleavedZB"), ("ours zbv", "torch ZBV")]
        lines.append("  ours / torch: " + ", ".join(f"{a.split()[1]} / {b.split()[1]} "
                                                     f"{rows[a]['step'] / rows[b]['step']:.3f}" for a, b in pairs))
        p = rows["predicted"]
        lines.append("  simulator (unit chunk costs): " + ", ".join(
            f"{k} {v['makespan']} ({v['makespan'] / p['1f1b']['makespan']:.3f}, bubble {v['bubble']:.3f})"
            for k, v in p.items()))
    return "\n".join(lines)
