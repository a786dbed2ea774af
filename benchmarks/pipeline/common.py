"""What every pipeline-schedule study shares: the model and partitions, the variants (ours, built by
autopar.pipeline.build_local_pipeline as PipelineEngine builds them; torch.distributed.pipelining's),
recomputation planning with the engine's planner, interleaved timing, and number formatting.

Entry point and method: benchmarks/pipeline_schedules.py, docs/benchmarks.md.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from autopar.errors import ConfigError
from autopar.models import build_model
from autopar.partition import partition
from autopar.pipeline.actions import stage_to_rank
from autopar.pipeline.build import build_local_pipeline
from autopar.pipeline.p2p import P2P
from autopar.pipeline.recompute import plan_pipeline_recompute, stage_example_inputs, stage_memory_model
from autopar.pipeline.schedules import build_schedule, recomputed_stages
from autopar.trace import trace

PP = 2
TOLERANCE = 1e-5
TIMEOUT = timedelta(seconds=120)
CPU = torch.device("cpu")
PRELOAD = ["torch", "torch.distributed.pipelining", "autopar.models", "autopar.trace", "autopar.partition",
           "autopar.pipeline.build", "autopar.pipeline.simulate", "autopar.pipeline.recompute"]

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
        self.receive_waits: list[tuple[float, float]] = []

    def recv(self, **kw):
        return _TimedPending(super().recv(**kw), self.receive_waits)

    def exchange(self, sends, recvs):  # the path the runtime takes (batched steps): its waits count too
        return [_TimedPending(p, self.receive_waits) for p in super().exchange(sends, recvs)]


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
    """build_local_pipeline (PipelineEngine's set-up) on the shared partition, run by its PipelineRuntime."""

    def __init__(self, setup: Setup, schedule: str, *, chunks: int = 1, recompute=frozenset(), plan: bool = False,
                 blocks: dict | None = None, timed: bool = False):
        super().__init__(setup)
        a = setup.args
        num_stages = PP * chunks
        group = setup.new_group()
        self.pipe = build_local_pipeline(
            setup.model, pp=PP, pp_rank=self.rank, pp_group=group, device=CPU, seed=0,
            example_batch=setup.batches(0)[0], num_microbatches=a.m, schedule=schedule, chunks=chunks,
            recompute=recompute, partition=setup.part(num_stages),
            p2p=TimedP2P(group, CPU, num_stages, a.m) if timed else None)
        self._init_common(self.pipe.stages, num_stages)
        self.schedule, self.recompute = self.pipe.schedule, self.pipe.recompute
        self.runtime, self.p2p = self.pipe.runtime, self.pipe.runtime.p2p
        self.plan = None
        if blocks is not None:  # a plan made in an earlier run (the memory runs do not measure or plan)
            self.plan = {"blocks": {s: blocks[s] for s in self.stages}}
            for s in self.stages:
                self.stages[s].recompute_blocks = blocks[s]
        elif plan:
            self.plan = plan_blocks(setup, self)

    def step(self, batches, record: bool = False):
        result = self.runtime.run(self.pipe.actions, batches, record=record,
                                  loss_fn=lambda out, batch: self.setup.loss(out, batch["labels"]))
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


def memory_model(setup: Setup, schedule, stages: dict, recomputed: frozenset[int]):
    """The engine planner's measurements of this rank's `stages` (recompute.stage_memory_model)."""
    return stage_memory_model(stages, schedule, stage_example_inputs(setup.graph, stages, CPU), pp=PP,
                              num_microbatches=setup.args.m, recomputed=recomputed)


def full_recompute_budget(setup: Setup) -> float:
    """Predicted per-rank memory of 1f1b recomputing every stage; the budget is the largest over ranks."""
    schedule = build_schedule("1f1b", pp=PP, num_microbatches=setup.args.m, recompute=frozenset(range(PP)),
                              prefetch=True)
    model = memory_model(setup, schedule, {dist.get_rank(): setup.stage(dist.get_rank())},
                         recomputed_stages(schedule))  # whole stages recomputed: no block choice, k = 0
    mine = torch.tensor([sum(model.memory(s, 0) for s in model.saved)], dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(PP)]
    dist.all_gather(every, mine)
    return max(float(t) for t in every)


def plan_blocks(setup: Setup, variant: Ours) -> dict:
    """The engine's planner (plan_pipeline_recompute) for `variant` under full_recompute_budget; if no plan
    fits, the plan that needs the least, marked as such."""
    budget = full_recompute_budget(setup)
    stages, examples = variant.stages, stage_example_inputs(setup.graph, variant.stages, CPU)
    model = memory_model(setup, variant.schedule, stages, variant.recompute)
    plan_for = lambda b: plan_pipeline_recompute(stages, variant.schedule, examples, b, pp=PP,
                                                 num_microbatches=setup.args.m, recomputed=variant.recompute)
    fits = True
    try:
        plan = plan_for(budget)
    except ConfigError:
        fits = False
        plan = plan_for(model.least())
    for s, blocks in plan.blocks.items():
        variant.stages[s].recompute_blocks = blocks
    return {"budget": budget, "blocks": plan.blocks, "memory": plan.memory,
            "describe": plan.describe() + ("" if fits else " [NO plan fits the budget; this is the least-memory plan]"),
            "fits": fits, "in_flight": model.in_flight,
            "saved_now": {s: model.saved[s][k] for s, k in plan.blocks.items()}}


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
                variant.p2p.receive_waits = []
            dist.barrier(setup.world)
            start = time.perf_counter()
            loss, recorded = variant.step(batches, record=record)
            elapsed = time.perf_counter() - start
            variant.finish()
            losses[name].append(loss)
            if step >= warmup:
                times[name].append(elapsed)
                if record:
                    events[name].append((recorded, list(variant.p2p.receive_waits), elapsed))
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


