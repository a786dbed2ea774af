"""Pipeline schedules: autopar's runtime against torch.distributed.pipelining, memory, recomputation, simulator.

One command, four parts, all on the same model, the same 2-stage partition and the same data
(pp=2: two ranks, gloo, CPU, one thread per rank):

  1. ours vs torch   our `gpipe` and `1f1b` (build_schedule + PipelineRuntime, as in
                     PipelineEngine) against torch's ScheduleGPipe / Schedule1F1B driving a
                     PipelineStage built on the very same StageModule (fresh copy per variant,
                     identical initial weights). Steps interleaved, medians; then a check that
                     losses, gradients and parameters agree to 1e-5.
  2. peak memory     every variant in a fresh run of its own: peak RSS per rank minus a
                     baseline run that only builds the stage, and the peak bytes autograd keeps
                     during a step (saved-tensor hooks).
  3. recomputation   1f1b recomputing every stage against scp with stage-aware block
                     recomputation chosen by autopar.pipeline.recompute.plan_recompute for a
                     budget equal to what 1f1b-with-full-recomputation needs.
  4. simulator       per-(stage, op) compute times measured from the runtime's recorded events
                     fed into autopar.pipeline.simulate.simulate: predicted makespan against
                     the measured step time, for gpipe, 1f1b, eager-1f1b, zb-h1, scp and
                     interleaved-1f1b (chunks=2, 4-stage partition).

    python benchmarks/pipeline_schedules.py            # default run (~1.5 min on 2 idle cores, ~3 when busy)
    python benchmarks/pipeline_schedules.py --quick    # smoke test (< 45 s)

Processes start from a forkserver that has imported torch and autopar once (a fresh process
per run, without paying the import every time); every process group has a 120 s timeout.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from autopar.launch import free_port
from autopar.errors import ConfigError
from autopar.models import build_model
from autopar.partition import partition
from autopar.pipeline.actions import Op, stage_to_rank
from autopar.pipeline.p2p import P2P
from autopar.pipeline.recompute import _memory, measure_saved_bytes, plan_recompute
from autopar.pipeline.runtime import PipelineRuntime
from autopar.pipeline.schedules import build_schedule, recomputed_stages
from autopar.pipeline.simulate import simulate
from autopar.trace import trace

PP = 2
TOLERANCE = 1e-5
TIMEOUT = timedelta(seconds=120)
CPU = torch.device("cpu")
PRELOAD = ["torch", "torch.distributed.pipelining", "autopar.models", "autopar.trace", "autopar.partition",
           "autopar.pipeline.runtime", "autopar.pipeline.simulate", "autopar.pipeline.recompute"]

# part 1: (label, implementation, schedule)
PART1 = [("ours gpipe", "ours", "gpipe"), ("torch gpipe", "torch", "gpipe"),
         ("ours 1f1b", "ours", "1f1b"), ("torch 1f1b", "torch", "1f1b")]
# part 3: (label, schedule, whole-stage recompute request, block plan?)
PART3 = [("1f1b, R on stages {0,1}", "1f1b", frozenset({0, 1}), False),
         ("scp, R {0,1}->{0} + plan", "scp", frozenset({0, 1}), True),
         ("scp, no R + plan", "scp", frozenset(), True)]
# part 4: (label, schedule, chunks, whole-stage recompute request)
PART4 = [("gpipe", "gpipe", 1, frozenset()), ("1f1b", "1f1b", 1, frozenset()),
         ("eager-1f1b", "eager-1f1b", 1, frozenset()), ("zb-h1", "zb-h1", 1, frozenset()),
         ("scp (R {0,1}->{0})", "scp", 1, frozenset({0, 1})),
         ("interleaved-1f1b c2", "interleaved-1f1b", 2, frozenset())]
# part 2: one fresh run each; "baseline" builds the stage and does nothing
MEMORY = ["baseline", "ours gpipe", "torch gpipe", "ours 1f1b", "torch 1f1b", "ours eager-1f1b", "ours zb-h1",
          "1f1b, R on stages {0,1}", "scp, R {0,1}->{0} + plan", "scp, no R + plan"]


# ----------------------------------------------------------------------------- set-up (every rank)


class Setup:
    """The model on meta, its trace, the 2-stage (and 4-stage) partition, data and loss."""

    def __init__(self, args):
        self.args = args
        self.model, self.info = build_model("gpt-mini", args.model_args, vocab_size=args.vocab, device="meta")
        self.graph = trace(self.model, (torch.zeros(args.mb, args.seq, dtype=torch.long, device="meta"),))
        self.parts = {PP: partition(self.graph, PP, method="time")}
        self.tokens = args.m * args.mb * args.seq  # loss = token sum / tokens of the whole step
        self.world = dist.group.WORLD

    def part(self, num_stages: int):
        if num_stages not in self.parts:
            self.parts[num_stages] = partition(self.graph, num_stages, method="time")
        return self.parts[num_stages]

    def stage(self, index: int, num_stages: int = PP):
        return self.part(num_stages).materialize_stage(index, self.model, "cpu", seed=0)

    def batches(self, step: int) -> list[dict]:
        """Micro-batches of step `step`: the same on every rank and for every variant."""
        a = self.args
        gen = torch.Generator().manual_seed(10_000 + step)
        ids = torch.randint(0, a.vocab, (a.m * a.mb, a.seq + 1), generator=gen)
        return [{"input_ids": ids[i * a.mb:(i + 1) * a.mb, :-1].contiguous(),
                 "labels": ids[i * a.mb:(i + 1) * a.mb, 1:].contiguous()} for i in range(a.m)]

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum") / self.tokens

    def new_group(self):
        return dist.new_group(list(range(PP)), timeout=TIMEOUT)


class _TimedPending:
    """A posted receive whose wait() is logged, so that waiting can be told apart from compute."""

    def __init__(self, inner, log: list):
        self.inner, self.log = inner, log

    def wait(self):
        start = time.perf_counter()
        result = self.inner.wait()
        self.log.append((start, time.perf_counter()))
        return result


class TimedP2P(P2P):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.waits: list[tuple[float, float]] = []

    def recv(self, **kw):
        return _TimedPending(super().recv(**kw), self.waits)


class Variant:
    """One way to run a training step on this rank, with its own weights, group and SGD."""

    def __init__(self, setup: Setup):
        self.setup = setup
        self.rank = dist.get_rank()

    def finish(self) -> None:
        """Untimed, the same for every variant: sum tied gradients across stages, SGD step, zero grads."""
        for fqn, owners in self.shared.items():
            ranks = {stage_to_rank(s, PP, self.num_stages) for s in owners}
            if ranks == set(range(PP)):
                local = [p for n, p in self.named_params() if n == fqn]
                assert len(local) == 1, f"{fqn} held twice on one rank"
                dist.all_reduce(local[0].grad, group=self.setup.world)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def grads(self) -> dict[str, torch.Tensor]:
        return {n: p.grad.detach().clone() for n, p in self.named_params() if p.grad is not None}

    def params(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.named_params()}

    def _init_common(self, stages: dict, num_stages: int) -> None:
        self.stages, self.num_stages = stages, num_stages
        self.shared = self.setup.part(num_stages).shared
        self.opt = torch.optim.SGD([p for _, p in self.named_params()], lr=self.setup.args.lr)

    def named_params(self):
        return [(n, p) for s in sorted(self.stages) for n, p in self.stages[s].named_parameters()]


class Ours(Variant):
    """build_schedule + P2P + PipelineRuntime, put together as PipelineEngine does."""

    def __init__(self, setup: Setup, schedule: str, *, chunks: int = 1, recompute=frozenset(), plan: bool = False,
                 blocks: dict | None = None, timed: bool = False):
        super().__init__(setup)
        a = setup.args
        num_stages = PP * chunks
        mine = [s for s in range(num_stages) if stage_to_rank(s, PP, num_stages) == self.rank]
        self._init_common({s: setup.stage(s, num_stages) for s in mine}, num_stages)
        self.schedule = build_schedule(schedule, pp=PP, num_microbatches=a.m, chunks=chunks, recompute=recompute,
                                       prefetch=True)
        self.recompute = recomputed_stages(self.schedule)
        self.plan = None
        if blocks is not None:  # a plan made in an earlier run (the memory runs do not measure or plan)
            self.plan = {"blocks": {s: blocks[s] for s in self.stages}}
            for s in self.stages:
                self.stages[s].recompute_blocks = blocks[s]
        elif plan:
            self.plan = plan_blocks(setup, self, num_stages)
        self.p2p = (TimedP2P if timed else P2P)(setup.new_group(), CPU, num_stages, a.m)
        self.runtime = PipelineRuntime(stages=self.stages, num_stages=num_stages, pp=PP, pp_rank=self.rank,
                                       p2p=self.p2p, loss_fn=lambda out, batch: setup.loss(out, batch["labels"]),
                                       recompute=self.recompute)

    def step(self, batches, record: bool = False):
        result = self.runtime.run(self.schedule[self.rank], batches, record=record)
        return float(result.loss), result.events


class Torch(Variant):
    """torch.distributed.pipelining: PipelineStage (manual frontend) on our StageModule + ScheduleGPipe/1F1B."""

    def __init__(self, setup: Setup, schedule: str):
        super().__init__(setup)
        self._init_common({self.rank: setup.stage(self.rank)}, PP)
        stage = PipelineStage(self.stages[self.rank], self.rank, PP, CPU, group=setup.new_group())
        cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
        # scale_grads=False: the loss is already divided by the step's token count, like ours
        self.schedule = cls(stage, setup.args.m, loss_fn=setup.loss, scale_grads=False)

    def step(self, batches, record: bool = False):
        if self.rank == 0:
            self.schedule.step(torch.cat([b["input_ids"] for b in batches]), return_outputs=False)
            return 0.0, []
        losses: list = []
        self.schedule.step(target=torch.cat([b["labels"] for b in batches]), losses=losses, return_outputs=False)
        return float(sum(l.detach() for l in losses)), []


def make_variant(setup: Setup, label: str, blocks: dict | None = None) -> Variant:
    for name, impl, schedule in PART1:
        if name == label:
            return Ours(setup, schedule) if impl == "ours" else Torch(setup, schedule)
    for name, schedule, recompute, plan in PART3:
        if name == label:
            return Ours(setup, schedule, recompute=recompute, plan=plan and blocks is None, blocks=blocks)
    if label.startswith("ours "):
        return Ours(setup, label.split(" ", 1)[1])
    raise ValueError(label)


# ----------------------------------------------------------------------------- recomputation planning


def stage_example(setup: Setup, stage, num_stages: int) -> tuple:
    nodes = {n.name: n for n in setup.graph.graph.nodes}
    if stage.spec.index == 0:
        return (torch.zeros(setup.args.mb, setup.args.seq, dtype=torch.long),)
    values = [nodes[name].meta["val"] for name in stage.spec.inputs]
    return tuple(torch.randn(v.shape, dtype=v.dtype) if v.is_floating_point() else torch.zeros(v.shape, dtype=v.dtype)
                 for v in values)


def memory_model(setup: Setup, schedule, stages: dict, num_stages: int) -> dict:
    """What PipelineEngine._plan_recompute measures for this rank's `stages` (plus their stashed inputs)."""
    timeline = simulate(schedule, pp=PP, num_stages=num_stages, num_microbatches=setup.args.m)
    saved, state, inputs = {}, {}, {}
    for s, stage in stages.items():
        example = stage_example(setup, stage, num_stages)
        saved[s] = measure_saved_bytes(stage, example)
        state[s] = 4 * sum(p.numel() * p.element_size() for p in stage.parameters())  # the planner's convention
        inputs[s] = sum(t.numel() * t.element_size() for t in example)
    in_flight = {s: max(1, timeline.peak_activations.get(s, 1)) for s in saved}
    stash = {s: timeline.stashed_inputs.get(s, 0) * inputs[s] for s in saved}
    return {"saved": saved, "state": state, "in_flight": in_flight, "stash": stash, "makespan": timeline.makespan}


def full_recompute_budget(setup: Setup) -> float:
    """Predicted per-rank memory of 1f1b recomputing every stage; the budget is the largest over ranks."""
    schedule = build_schedule("1f1b", pp=PP, num_microbatches=setup.args.m, recompute=frozenset(range(PP)),
                              prefetch=True)
    model = memory_model(setup, schedule, {dist.get_rank(): setup.stage(dist.get_rank())}, PP)
    plan = plan_recompute(model["saved"], in_flight=model["in_flight"], state_bytes=model["state"], budget=math.inf,
                          last_stage=PP - 1)  # no blocks: whole-stage recomputation, one micro-batch rebuilt at a time
    mine = torch.tensor([sum(plan.memory.values()) + sum(model["stash"].values())], dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(PP)]
    dist.all_gather(every, mine)
    return max(float(t) for t in every)


def plan_blocks(setup: Setup, variant: Ours, num_stages: int) -> dict:
    budget = full_recompute_budget(setup)
    model = memory_model(setup, variant.schedule, variant.stages, num_stages)
    fits = True
    try:
        plan = plan_recompute(model["saved"], in_flight=model["in_flight"], state_bytes=model["state"], budget=budget,
                              last_stage=num_stages - 1)
    except ConfigError:  # then take the plan that needs the least the planner can do, and say so
        fits = False
        least = sum(min(_memory(model["saved"][s], k, model["in_flight"][s], model["state"][s])
                        for k in range(len(model["saved"][s]))) for s in model["saved"])
        plan = plan_recompute(model["saved"], in_flight=model["in_flight"], state_bytes=model["state"], budget=least,
                              last_stage=num_stages - 1)
    for s, blocks in plan.blocks.items():
        variant.stages[s].recompute_blocks = blocks
    return {"budget": budget, "blocks": plan.blocks, "memory": plan.memory, "stash": model["stash"],
            "describe": plan.describe() + ("" if fits else " [NO plan fits the budget; this is the least-memory plan]"),
            "fits": fits, "in_flight": model["in_flight"],
            "saved_now": {s: model["saved"][s][k] for s, k in plan.blocks.items()}}


# ----------------------------------------------------------------------------- timing (every rank)


def time_variants(setup: Setup, variants: dict, *, warmup: int, steps: int, record: bool = False,
                  step_offset: int = 0) -> dict:
    """Interleave the variants step by step (order rotating); returns per-variant slowest-rank times etc."""
    names = list(variants)
    times = {n: [] for n in names}
    losses = {n: [] for n in names}
    events = {n: [] for n in names}
    for step in range(warmup + steps):
        batches = setup.batches(step_offset + step)
        shift = step % len(names)
        for name in names[shift:] + names[:shift]:
            variant = variants[name]
            if isinstance(getattr(variant, "p2p", None), TimedP2P):
                variant.p2p.waits = []
            dist.barrier(setup.world)
            start = time.perf_counter()
            loss, recorded = variant.step(batches, record=record)
            elapsed = time.perf_counter() - start
            variant.finish()
            losses[name].append(loss)
            if step >= warmup:
                times[name].append(elapsed)
                if record:
                    events[name].append((recorded, list(variant.p2p.waits), elapsed))
    stacked = torch.tensor([times[n] for n in names], dtype=torch.float64)
    dist.all_reduce(stacked, op=dist.ReduceOp.MAX, group=setup.world)
    slowest = {n: stacked[i].tolist() for i, n in enumerate(names)}
    loss_t = torch.tensor([losses[n] for n in names], dtype=torch.float64)
    dist.all_reduce(loss_t, group=setup.world)  # only the last stage's rank has a non-zero loss
    return {"times": slowest, "losses": {n: loss_t[i].tolist() for i, n in enumerate(names)}, "events": events}


def max_diff(a: dict, b: dict, world) -> float:
    """Largest |a - b| over the tensors both dicts name, then over ranks."""
    keys = a.keys() & b.keys()
    assert keys == a.keys() == b.keys(), (sorted(a.keys() ^ b.keys()))[:5]
    local = max(((a[k] - b[k]).abs().max().item() for k in keys), default=0.0)
    t = torch.tensor([local], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=world)
    return float(t)


def part1(setup: Setup) -> dict:
    a = setup.args
    variants = {label: make_variant(setup, label) for label, _, _ in PART1}
    initial = variants["ours 1f1b"].params()
    run = time_variants(setup, variants, warmup=a.warmup, steps=a.steps)
    # identical training: parameters after the same SGD steps, then the raw gradients of one more step
    ref = variants["ours 1f1b"]
    param_diff = {n: max_diff(ref.params(), v.params(), setup.world) for n, v in variants.items()}
    moved = max_diff(ref.params(), initial, setup.world)
    check_batches = setup.batches(99_999)
    grads, check_loss = {}, {}
    for name, v in variants.items():
        dist.barrier(setup.world)
        loss, _ = v.step(check_batches)
        grads[name] = v.grads()
        t = torch.tensor([loss], dtype=torch.float64)
        dist.all_reduce(t, group=setup.world)
        check_loss[name] = float(t)
        v.opt.zero_grad(set_to_none=True)
    grad_diff = {n: max_diff(grads["ours 1f1b"], g, setup.world) for n, g in grads.items()}
    pairs = {"gpipe": ("ours gpipe", "torch gpipe"), "1f1b": ("ours 1f1b", "torch 1f1b")}
    paired_diff = {k: max_diff(grads[o], grads[t], setup.world) for k, (o, t) in pairs.items()}
    loss_rel = max(abs(l - check_loss["ours 1f1b"]) / abs(check_loss["ours 1f1b"]) for l in check_loss.values())
    reference = run["losses"]["ours 1f1b"]
    step_loss_rel = max(abs(x - y) / abs(y) for n in variants for x, y in zip(run["losses"][n], reference))
    return {"times": run["times"], "param_diff": param_diff, "grad_diff": grad_diff, "paired_grad_diff": paired_diff,
            "loss_rel": max(loss_rel, step_loss_rel), "moved": moved, "check_loss": check_loss}


def part3(setup: Setup) -> dict:
    a = setup.args
    variants = {label: make_variant(setup, label) for label, _, _, _ in PART3}
    plans = {n: v.plan for n, v in variants.items() if v.plan is not None}
    recompute = {n: sorted(v.recompute) for n, v in variants.items()}
    # predicted memory of the reference (whole-stage recomputation everywhere): planner formula + stashed inputs
    ref = variants[PART3[0][0]]
    model = memory_model(setup, ref.schedule, ref.stages, PP)
    ref_plan = plan_recompute(model["saved"], in_flight=model["in_flight"], state_bytes=model["state"],
                              budget=math.inf, last_stage=PP - 1)
    predicted = {PART3[0][0]: {"memory": ref_plan.memory, "stash": model["stash"], "in_flight": model["in_flight"],
                               "saved_now": {s: model["saved"][s][0] for s in model["saved"]}}}
    makespans = {}
    for n, v in variants.items():
        makespans[n] = simulate(v.schedule, pp=PP, num_stages=PP, num_microbatches=a.m).makespan
    run = time_variants(setup, variants, warmup=a.warmup, steps=a.steps3, step_offset=1000)
    ref_params = ref.params()
    param_diff = {n: max_diff(ref_params, v.params(), setup.world) for n, v in variants.items()}
    loss_rel = max(abs(x - y) / abs(y) for n in variants for x, y in zip(run["losses"][n], run["losses"][PART3[0][0]]))
    gathered = [None] * PP
    dist.all_gather_object(gathered, {"plans": plans, "predicted": predicted})
    return {"times": run["times"], "ranks": gathered, "recompute": recompute, "makespan_unit": makespans,
            "param_diff": param_diff, "loss_rel": loss_rel}


def one_way_transfer(setup: Setup, shape: tuple, repeats: int) -> float:
    """Median one-way time of one boundary tensor over gloo (ping-pong / 2)."""
    group = setup.new_group()
    x = torch.zeros(shape)
    times = []
    for i in range(repeats + 3):
        dist.barrier(group)
        start = time.perf_counter()
        if dist.get_rank() == 0:
            dist.send(x, 1, group=group)
            dist.recv(x, 1, group=group)
        else:
            dist.recv(x, 0, group=group)
            dist.send(x, 0, group=group)
        if i >= 3:
            times.append((time.perf_counter() - start) / 2)
    t = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.broadcast(t, src=0, group=setup.world)
    return float(t)


def compute_durations(events: list, waits: list) -> list[tuple[int, Op, float]]:
    """(stage, op, seconds) per compute event, minus the receive waits that happened inside it."""
    out = []
    for start, end, action in events:
        waited = sum(max(0.0, min(end, we) - max(start, ws)) for ws, we in waits)
        out.append((action.stage, action.op, end - start - waited))
    return out


def simulated_idle(timeline) -> list[float]:
    """Per rank: time between its first action's start (0) and its last compute's end not spent computing."""
    idle = []
    for r in range(PP):
        mine = [(start, end) for rank, start, end, action in timeline.compute_events() if rank == r]
        idle.append(max(end for _, end in mine) - sum(end - start for start, end in mine))
    return idle


def part4(setup: Setup) -> dict:
    a = setup.args
    variants = {label: Ours(setup, schedule, chunks=chunks, recompute=recompute, timed=True)
                for label, schedule, chunks, recompute in PART4}
    boundary = setup.part(PP).boundaries[0][0].shape
    transfer = one_way_transfer(setup, tuple(boundary), 20)
    run = time_variants(setup, variants, warmup=a.warmup4, steps=a.steps4, record=True, step_offset=2000)
    mine, waits_total, other = {}, {}, {}
    for name, per_step in run["events"].items():
        durations = defaultdict(list)
        waited, rest = [], []
        for events, waits, elapsed in per_step:
            computed = compute_durations(events, waits)
            for s, op, d in computed:
                durations[(s, op.value)].append(d)
            waited.append(sum(we - ws for ws, we in waits))
            rest.append(elapsed - waited[-1] - sum(d for _, _, d in computed))
        mine[name] = dict(durations)
        waits_total[name] = statistics.median(waited)
        other[name] = statistics.median(rest)
    gathered = [None] * PP
    dist.all_gather_object(gathered, {"durations": mine, "waits": waits_total, "other": other})
    result = {"times": run["times"], "transfer": transfer, "rows": {}}
    for label, schedule, chunks, recompute in PART4:
        v = variants[label]
        pooled = {key: values for part in gathered for key, values in part["durations"][label].items()}
        medians = {key: statistics.median(values) for key, values in pooled.items()}
        means = {key: statistics.fmean(values) for key, values in pooled.items()}

        def predict(table: dict, transfer_s: float = 0.0):
            return simulate(v.schedule, pp=PP, num_stages=v.num_stages, num_microbatches=a.m,
                            cost=lambda action: table[(action.stage, action.op.value)],
                            comm_cost=lambda action: transfer_s)

        by_median, by_mean, by_mean_comm = predict(medians), predict(means), predict(means, transfer)
        result["rows"][label] = {
            "medians": {f"{s}{op}": m for (s, op), m in sorted(medians.items())},
            "pred_median": by_median.makespan, "pred_mean": by_mean.makespan, "pred_mean_comm": by_mean_comm.makespan,
            "sim_idle": simulated_idle(by_mean_comm),
            "waits": [p["waits"][label] for p in gathered], "other": [p["other"][label] for p in gathered],
            "measured": statistics.median(run["times"][label]), "num_stages": v.num_stages}
    losses = run["losses"]
    ref = losses[PART4[1][0]]
    result["loss_rel"] = max(abs(x - y) / abs(y) for n in losses for x, y in zip(losses[n], ref))
    return result


# ----------------------------------------------------------------------------- saved-tensor counter (part 2)


class SavedBytes:
    """Live bytes of the storages autograd's saved-tensor hooks hold (weights excluded), and their peak.

    A saved tensor is wrapped in a handle; autograd drops the handle when it frees the graph
    node, which releases the count. Storages saved several times are counted once.
    """

    def __init__(self, weights):
        self.exclude = {w.untyped_storage().data_ptr() for w in weights}
        self.live: dict[int, list[int]] = {}
        self.now = self.peak = 0

    def pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self.exclude or storage.nbytes() == 0:
            return t
        entry = self.live.get(ptr)
        if entry is None:
            self.live[ptr] = [1, storage.nbytes()]
            self.now += storage.nbytes()
            self.peak = max(self.peak, self.now)
        else:
            entry[0] += 1
        return _Saved(self, ptr, t)

    @staticmethod
    def unpack(value):
        return value.tensor if isinstance(value, _Saved) else value

    def release(self, ptr: int) -> None:
        entry = self.live[ptr]
        entry[0] -= 1
        if entry[0] == 0:
            self.now -= entry[1]
            del self.live[ptr]

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


class _Saved:
    __slots__ = ("owner", "ptr", "tensor")

    def __init__(self, owner: SavedBytes, ptr: int, tensor: torch.Tensor):
        self.owner, self.ptr, self.tensor = owner, ptr, tensor

    def __del__(self):
        self.owner.release(self.ptr)


def memory_run(setup: Setup, label: str, blocks: dict | None) -> dict:
    a = setup.args
    if label == "baseline":  # the same stage, the same data and a group; no step
        stage = setup.stage(dist.get_rank())
        setup.new_group()
        setup.batches(0)
        dist.barrier(setup.world)
        del stage
        return {"rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "saved": 0, "blocks": None}
    variant = make_variant(setup, label, blocks)
    for step in range(a.mem_steps):
        dist.barrier(setup.world)
        variant.step(setup.batches(step))
        variant.finish()
    weights = [p for _, p in variant.named_params()] + [b for s in variant.stages.values() for b in s.buffers()]
    counter = SavedBytes(weights)
    dist.barrier(setup.world)
    with counter.hooks():
        variant.step(setup.batches(a.mem_steps))
    variant.finish()
    leftover = counter.now
    dist.barrier(setup.world)
    plan = getattr(variant, "plan", None)
    return {"rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "saved": counter.peak,
            "leftover": leftover, "blocks": plan["blocks"] if plan else None}


# ----------------------------------------------------------------------------- processes


def worker(rank: int, port: int, args, job: str, out_dir: str, blocks: dict | None = None) -> None:
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=PP, timeout=TIMEOUT)
    try:
        setup = Setup(args)
        if job == "main":
            result = {"params": sum(setup.graph.param_numel.values()),
                      "partition": setup.part(PP).table(), "partition4": setup.part(2 * PP).table()}
            for name, fn in (("part1", part1), ("part3", part3), ("part4", part4)):
                if name in args.parts:
                    begin = time.perf_counter()
                    result[name] = fn(setup)
                    result[name]["wall"] = time.perf_counter() - begin
                    if rank == 0:
                        print(f"  [{name} done in {result[name]['wall']:.0f} s]", file=sys.stderr, flush=True)
            if rank == 0:
                Path(out_dir, "main.json").write_text(json.dumps(result, default=str))
        else:
            result = memory_run(setup, job, blocks)
            gathered = [None] * PP
            dist.all_gather_object(gathered, result)
            if rank == 0:
                Path(out_dir, "memory.json").write_text(json.dumps(gathered, default=str))
        dist.barrier()  # no rank tears down while its peer still has gloo work in flight
    finally:
        dist.destroy_process_group()




def launch(args, job: str, blocks: dict | None = None) -> dict | list:
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(worker, args=(free_port(), args, job, out, blocks), nprocs=PP, join=True,
                           start_method="forkserver")
        name = "main.json" if job == "main" else "memory.json"
        return json.loads(Path(out, name).read_text())


# ----------------------------------------------------------------------------- report


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def iqr(values: list[float]) -> float:
    if len(values) < 4:
        return float("nan")
    q = statistics.quantiles(values, n=4)
    return q[2] - q[0]


def report_header(args, main: dict) -> str:
    a = args
    size = ", ".join(f"{k}={v}" for k, v in a.model_args.items())
    return "\n".join([
        f"torch {torch.__version__} | python {platform.python_version()} | {os.cpu_count()} CPU cores | gloo | "
        f"1 thread per rank | pp={PP} (2 ranks) | no GPU | load average (1 min) at start {a.load[0]:.1f}, "
        f"at end {os.getloadavg()[0]:.1f}",
        f"model gpt-mini ({size}, vocab {a.vocab}): {main['params'] / 1e6:.2f}M parameters | "
        f"micro-batch {a.mb} x {a.seq} tokens | m={a.m} micro-batches per step | SGD lr {a.lr} | "
        f"loss = token-summed cross-entropy / tokens of the whole step",
        f"timing: warm-up {a.warmup} + {a.steps} timed steps (part 1), {a.warmup} + {a.steps3} (part 3), "
        f"{a.warmup4} + {a.steps4} (part 4); variants interleaved step by step, order rotating; a step = "
        "forward+backward of all m micro-batches with their transfers (tied-gradient sum, SGD step and "
        "zero_grad follow, untimed); its time is the slower rank's; medians",
        "",
        main["partition"],
        "",
    ])


def report_part1(r: dict) -> str:
    t = r["times"]
    med = {n: statistics.median(v) for n, v in t.items()}
    lines = ["== 1. ours vs torch.distributed.pipelining (same StageModules, same partition, same data) ==",
             "torch side: PipelineStage(submodule=stage, stage_index=rank, num_stages=2, device=cpu, group=...) + "
             "ScheduleGPipe / Schedule1F1B(n_microbatches=m, loss_fn, scale_grads=False), step(whole batch, "
             "return_outputs=False)",
             "ours: build_schedule(name, pp=2, num_microbatches=m, prefetch=True) + P2P + PipelineRuntime "
             "(recompute off)", ""]
    header = (f"{'schedule':<8} | {'ours ms':>8} {'torch ms':>8} | {'IQR ours':>8} {'IQR torch':>9} | "
              f"{'ours/torch':>10} {'paired':>7}")
    lines += [header, "-" * len(header)]
    for sched in ("gpipe", "1f1b"):
        o, tt = t[f"ours {sched}"], t[f"torch {sched}"]
        paired = statistics.median(x / y for x, y in zip(o, tt))
        lines.append(f"{sched:<8} | {ms(med[f'ours {sched}']):>8} {ms(med[f'torch {sched}']):>8} | "
                     f"{ms(iqr(o)):>8} {ms(iqr(tt)):>9} | {med[f'ours {sched}'] / med[f'torch {sched}']:>10.3f} "
                     f"{paired:>7.3f}")
    lines.append(f"ours 1f1b / ours gpipe = {med['ours 1f1b'] / med['ours gpipe']:.3f}; "
                 f"torch 1f1b / torch gpipe = {med['torch 1f1b'] / med['torch gpipe']:.3f}")
    ok = (max(r["param_diff"].values()) <= TOLERANCE and max(r["grad_diff"].values()) <= TOLERANCE
          and r["loss_rel"] <= TOLERANCE and r["moved"] > 0)
    lines += ["",
              f"equality check (tol {TOLERANCE:g}): {'PASS' if ok else 'FAIL'} -- "
              f"gradients of one more step, ours vs torch: gpipe {r['paired_grad_diff']['gpipe']:.1e}, "
              f"1f1b {r['paired_grad_diff']['1f1b']:.1e}; all four vs ours 1f1b: max |dgrad| "
              f"{max(r['grad_diff'].values()):.1e}, max |dparam| after the same SGD steps "
              f"{max(r['param_diff'].values()):.1e}; max relative loss difference {r['loss_rel']:.1e}; "
              f"training moved the weights by up to {r['moved']:.1e}", ""]
    r["ok"] = ok
    return "\n".join(lines)


def report_part2(mem: dict, args) -> str:
    base = mem["baseline"]
    lines = ["== 2. peak memory per rank (each variant in a fresh pair of processes) ==",
             f"RSS - base = ru_maxrss of the run (after {args.mem_steps} + 1 steps) minus ru_maxrss of a run that only "
             "builds the same stage; includes allocator caching, gloo buffers and code pages touched by the first "
             "step.",
             "saved peak = most bytes autograd's saved tensors held at once during one step (saved-tensor hooks, "
             "unique storages, weights excluded): activations only; stashed stage inputs and receive buffers are "
             "not saved tensors, nor are the tensors a checkpointed block rebuilds inside backward.",
             f"baseline ru_maxrss: rank 0 {mib(base[0]['rss'])} MiB, rank 1 {mib(base[1]['rss'])} MiB", ""]
    header = (f"{'variant':<26} | {'RSS-base r0':>11} {'RSS-base r1':>11} | {'saved peak r0':>13} "
              f"{'saved peak r1':>13} | blocks recomputed")
    lines += [header + "", "-" * len(header)]
    for label in MEMORY[1:]:
        if label not in mem:
            continue
        r = mem[label]
        blocks = "-"
        if r[0]["blocks"] is not None:
            blocks = ", ".join(f"stage {s}: {k}" for rr in r for s, k in sorted((rr["blocks"] or {}).items()))
        lines.append(f"{label:<26} | {mib(r[0]['rss'] - base[0]['rss']):>11} {mib(r[1]['rss'] - base[1]['rss']):>11} "
                     f"| {mib(r[0]['saved']):>13} {mib(r[1]['saved']):>13} | {blocks}")
    leftover = max(rr.get("leftover", 0) for label in MEMORY[1:] if label in mem for rr in mem[label])
    lines += ["(MiB; saved bytes still held after the step: "
              f"{leftover} B, i.e. every graph was freed)", ""]
    return "\n".join(lines)


def report_part3(r: dict, args, memory: dict) -> str:
    t = r["times"]
    med = {n: statistics.median(v) for n, v in t.items()}
    ref = PART3[0][0]
    plans, predicted = {}, dict(r["ranks"][0]["predicted"])
    for rank_part in r["ranks"]:
        for n, p in rank_part["plans"].items():
            plans.setdefault(n, []).append(p)
        for n, p in rank_part["predicted"].items():
            for key in p:
                predicted[n][key] = {**predicted[n][key], **p[key]}
    budget = next(iter(plans.values()))[0]["budget"]
    lines = ["== 3. scp + stage-aware recomputation vs 1f1b + full recomputation, same memory budget ==",
             "predicted memory = planner's model (recompute.plan_recompute): 4 x parameter bytes + in-flight "
             "micro-batches x saved bytes per micro-batch (measure_saved_bytes) + largest recomputed block, plus "
             "stashed stage inputs (simulator's stashed_inputs x input bytes)",
             f"budget = predicted per-rank memory of 1f1b with every stage recomputed, largest rank: {mib(budget)} MiB",
             ""]
    for n, per_rank in plans.items():
        for p in per_rank:
            lines.append(f"plan for '{n}': {p['describe']}")
    lines.append("")
    header = (f"{'variant':<26} {'R on':>6} | {'pred r0':>7} {'pred r1':>7} | {'act pred':>11} {'act meas':>11} | "
              f"{'in-flight':>9} | {'sim unit':>8} | {'median ms':>9} {'IQR':>6} | {'vs ref':>6}")
    lines += [header, "-" * len(header)]
    for label, _, _, _ in PART3:
        if label in plans:
            predicted_memory = {int(s): v for p in plans[label] for s, v in p["memory"].items()}
            stash = {int(s): v for p in plans[label] for s, v in p["stash"].items()}
            flight = {int(s): v for p in plans[label] for s, v in p["in_flight"].items()}
            saved_now = {int(s): v for p in plans[label] for s, v in p["saved_now"].items()}
        else:
            predicted_memory = {int(s): v for s, v in predicted[label]["memory"].items()}
            stash = {int(s): v for s, v in predicted[label]["stash"].items()}
            flight = {int(s): v for s, v in predicted[label]["in_flight"].items()}
            saved_now = {int(s): v for s, v in predicted[label]["saved_now"].items()}
        act_pred = "/".join(mib(flight[s] * saved_now[s]) for s in range(PP))
        act_meas = "/".join(mib(memory[label][s]["saved"]) for s in range(PP)) if label in memory else "-"
        pred = [predicted_memory[s] + stash[s] for s in range(PP)]
        rc = "{" + ",".join(str(s) for s in r["recompute"][label]) + "}"
        lines.append(f"{label:<26} {rc:>6} | {mib(pred[0]):>7} {mib(pred[1]):>7} | {act_pred:>11} {act_meas:>11} | "
                     f"{'/'.join(str(flight[s]) for s in range(PP)):>9} | {r['makespan_unit'][label]:>8g} | "
                     f"{ms(med[label]):>9} {ms(iqr(t[label])):>6} | {med[label] / med[ref]:>6.3f}")
    ok = max(r["param_diff"].values()) <= TOLERANCE and r["loss_rel"] <= TOLERANCE
    lines += ["(MiB. R on = stages whose forwards keep only inputs and rerun before backward; pred = predicted memory "
              "per rank as above; act pred = its activation term, in-flight x saved bytes per micro-batch; act meas = "
              "part 2's saved peak; in-flight = simulator's peak live micro-batches per stage; sim unit = simulated "
              "makespan with F=1, B=2, R=1, which does not see block recomputation inside B)",
              f"equality check (tol {TOLERANCE:g}): {'PASS' if ok else 'FAIL'} -- max |dparam| vs '{ref}' "
              f"{max(r['param_diff'].values()):.1e}, max relative loss difference {r['loss_rel']:.1e}", ""]
    r["ok"] = ok
    return "\n".join(lines)


def report_part4(r: dict, args, main: dict) -> str:
    lines = ["== 4. simulated vs measured (our schedules) ==",
             "cost of each compute action = median over timed steps and micro-batches of its recorded duration "
             "(PipelineRuntime.run(record=True)) minus the time it spent waiting for a receive inside it; "
             f"transfer = measured one-way gloo time of one boundary tensor: {r['transfer'] * 1e6:.0f} us",
             "interleaved-1f1b runs 4 stages (2 chunks per rank) on this partition:", main["partition4"], ""]
    header = (f"{'schedule':<20} | {'measured':>8} | {'pred':>6} {'ratio':>5} | {'mean':>6} {'ratio':>5} | "
              f"{'+comm':>6} {'ratio':>5} | {'idle r0/r1 meas':>15} {'sim':>11} | {'other r0/r1':>11}")
    lines += [header, "-" * len(header)]
    for label, _, _, _ in PART4:
        row = r["rows"][label]
        meas = row["measured"]
        idle = " / ".join(ms(w) for w in row["waits"])
        sim_idle = " / ".join(ms(w) for w in row["sim_idle"])
        lines.append(f"{label:<20} | {ms(meas):>8} | {ms(row['pred_median']):>6} {row['pred_median'] / meas:>5.2f} | "
                     f"{ms(row['pred_mean']):>6} {row['pred_mean'] / meas:>5.2f} | {ms(row['pred_mean_comm']):>6} "
                     f"{row['pred_mean_comm'] / meas:>5.2f} | {idle:>15} {sim_idle:>11} | "
                     f"{' / '.join(ms(o) for o in row['other']):>11}")
    lines += ["(ms. measured = median step time, slower rank; pred = simulate(schedule, cost=per-(stage, op) medians), "
              "transfers free; ratio = pred/measured; mean = the same with per-(stage, op) means; +comm = means and "
              "every transfer taking the measured one-way time; idle meas = median per step of the time a rank "
              "spent blocked in receive waits; idle sim = the +comm simulation's time per rank not computing before "
              "its last compute ends; other = median "
              "per step of the rank's step time minus its compute minus its receive waits: posting sends and "
              "receives, waiting for sends at the end, Python between actions, and time the OS gave to others)",
              "", "measured per-action compute medians (ms), stage+op:"]
    for label, _, _, _ in PART4:
        medians = r["rows"][label]["medians"]
        lines.append(f"  {label:<20} " + " ".join(f"{k}={v * 1e3:.1f}" for k, v in medians.items()))
    ok = r["loss_rel"] <= TOLERANCE
    lines += [f"all six schedules trained identically: {'PASS' if ok else 'FAIL'} -- max relative difference of "
              f"per-step losses vs 1f1b {r['loss_rel']:.1e} (tol {TOLERANCE:g})", ""]
    r["ok"] = ok
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Pipeline schedules on CPU/gloo with pp=2: autopar's runtime vs torch.distributed.pipelining "
                    "(time and gradients), peak memory per rank, scp + stage-aware recomputation vs 1f1b + full "
                    "recomputation, and simulated vs measured step times. Prints tables with ratios.")
    parser.add_argument("--quick", action="store_true", help="smoke test: tiny model, few steps (< 45 s)")
    parser.add_argument("--layers", type=int, default=4, help="gpt-mini n_layer (default 4)")
    parser.add_argument("--d-model", type=int, default=None, help="gpt-mini d_model (default: gpt-mini's 128)")
    parser.add_argument("--mb", type=int, default=4, help="sequences per micro-batch (default 4)")
    parser.add_argument("--seq", type=int, default=64, help="tokens per sequence (default 64)")
    parser.add_argument("--m", type=int, default=8, help="micro-batches per step (default 8)")
    parser.add_argument("--steps", type=int, default=40, help="timed steps per variant in part 1 (default 40)")
    parser.add_argument("--steps3", type=int, default=20, help="timed steps per variant in part 3 (default 20)")
    parser.add_argument("--steps4", type=int, default=15, help="timed steps per schedule in part 4 (default 15)")
    parser.add_argument("--warmup", type=int, default=3, help="warm-up steps in parts 1 and 3 (default 3)")
    parser.add_argument("--parts", default="1,2,3,4", help="which parts to run (default 1,2,3,4)")
    parser.add_argument("--lr", type=float, default=0.1, help="SGD learning rate (default 0.1)")
    args = parser.parse_args(argv)
    args.vocab, args.warmup4, args.mem_steps = 320, 2, 2
    if args.quick:
        args.layers, args.d_model, args.mb, args.seq, args.m = 2, 64, 2, 32, 4
        args.steps, args.steps3, args.steps4, args.warmup, args.warmup4, args.mem_steps = 4, 3, 3, 1, 1, 1
    args.model_args = {"n_layer": args.layers, **({"d_model": args.d_model} if args.d_model else {})}
    args.parts = {f"part{p.strip()}" for p in args.parts.split(",") if p.strip()}
    if args.m < PP or args.m % PP:
        parser.error(f"--m must be a positive multiple of {PP} (interleaved-1f1b runs micro-batches in groups of pp)")
    if min(args.steps, args.steps3, args.steps4) < 1 or args.warmup < 0:
        parser.error("--steps/--steps3/--steps4 must be >= 1 and --warmup >= 0")
    return args


def planned_blocks(main_result: dict, label: str) -> dict | None:
    """The block plan part 3 chose for `label` (stage -> blocks), so that memory runs need not plan."""
    if "part3" not in main_result:
        return None
    blocks = {}
    for rank_part in main_result["part3"]["ranks"]:
        for s, k in rank_part["plans"].get(label, {}).get("blocks", {}).items():
            blocks[int(s)] = k
    return blocks or None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.load = os.getloadavg()
    print(f"$ python {' '.join(['benchmarks/pipeline_schedules.py', *(sys.argv[1:] if argv is None else argv)])}")
    begin = time.perf_counter()
    multiprocessing.set_forkserver_preload(PRELOAD)
    main_result = launch(args, "main")
    memory = {}
    if "part2" in args.parts:
        labels = MEMORY if not args.quick else ["baseline", "ours 1f1b", "torch 1f1b", "scp, no R + plan"]
        for label in labels:
            memory[label] = launch(args, label, planned_blocks(main_result, label))
            print(f"  [memory run '{label}' done]", file=sys.stderr, flush=True)
    print(report_header(args, main_result))
    ok = True
    if "part1" in main_result:
        print(report_part1(main_result["part1"]))
        ok &= main_result["part1"]["ok"]
    if memory:
        print(report_part2(memory, args))
    if "part3" in main_result:
        print(report_part3(main_result["part3"], args, memory))
        ok &= main_result["part3"]["ok"]
    if "part4" in main_result:
        print(report_part4(main_result["part4"], args, main_result))
        ok &= main_result["part4"]["ok"]
    print(f"total wall time {time.perf_counter() - begin:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
