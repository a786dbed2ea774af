"""Whether one chosen configuration fits in memory, and the nearest ones that do: the strategy search's
memory model (cost.StepModel, memory.py) applied to a strategy set by hand, before any rank starts.

Two figures per pipeline rank, both of live tensor bytes (without the allocator headroom):

    high   the search's own prediction: model state + activations as traced (every op's output)
    low    model state + LOW_ACTIVATION_SHARE x the rest: autograd keeps about half of what the trace
           counts (0.5-0.6 on the GPT blocks measured by measure_profile.py), while the model state
           (parameters, gradients, optimizer: zero_memory.py) and, where it is the peak, the update's
           temporaries (update_memory.py) are counted exactly

A run is refused only when even `low` is more than (1 + MODEL_ERROR) x the memory, so an error of the
model lets a run start rather than stops it. A suggested change must fit by the search's own rule
(high x headroom <= memory): what is suggested is what `--strategy auto` would also accept.

Not covered (estimated by nothing here, so never refused): stages of different tp degrees, gossip,
the parameter server, sparse embeddings, the asynchronous pipelines and the zbv and scp schedules
(`not_covered` names them).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ..config import ASYNC_SCHEDULES, Strategy, TrainConfig
from .cluster import Cluster
from .cost import Candidate, Estimate, StepModel
from .device_memory import size
from .memory import OPTIMIZER_STATE_BYTES, StageMemory
from .profile import ModelProfile
from .zero_memory import zero_model_state_bytes
from .search import divisors, schedule_valid, zero_valid

GIB = 2**30
MODEL_ERROR = 0.25
"""Refuse only above (1 + this) x the memory: the worst per-rank over-prediction the strategy search's validation
measured is +24.8% (docs/benchmarks/strategy_search.md)."""
LOW_ACTIVATION_SHARE = 0.5
"""The least share of the traced activation bytes autograd keeps (the traced sum counts every op's output)."""
STATE_PIECES = ("params", "grads", "optimizer", "update")  # counted exactly (the update's: update_memory.py)
PIECE_NAMES = {"params": "parameters", "grads": "gradients", "optimizer": "optimizer", "activations": "activations",
               "stashed_inputs": "stashed inputs", "transient": "transient", "buffers": "buffers",
               "weight_pending": "weight gradients pending", "update": "update (clipping, gathered parameters)"}
MOST_PROCESSES = 64  # times the process count the search for "more processes" goes up to


def not_covered(strategy: Strategy, config: TrainConfig) -> str | None:
    """What in this strategy the memory model does not estimate (it is then not gated), or None."""
    if strategy.stage_tp is not None and len(set(strategy.stage_tps)) > 1:
        return f"--stage-tp {strategy.stage_tp} (stages of different tp degrees)"
    if strategy.replicas.mode == "gossip":
        return "gossip data parallelism (--dp-mode gossip)"
    if strategy.replicas.mode == "async":
        return "the parameter server (--dp-mode async)"
    if strategy.pipeline.schedule in ASYNC_SCHEDULES:
        return f"the asynchronous pipeline --schedule {strategy.pipeline.schedule} (several weight versions)"
    if strategy.pp > 1 and strategy.pipeline.schedule in ("zbv", "scp"):
        return f"--schedule {strategy.pipeline.schedule}"
    if strategy.sparse.mode != "dense" or config.optimizer not in OPTIMIZER_STATE_BYTES:
        return f"sparse embeddings (--sparse-embeddings {strategy.sparse.mode}, --optimizer {config.optimizer})"
    if strategy.cp > 1:  # its traced activations are the whole sequence's; a rank keeps 1/cp of them
        return f"context parallelism (--cp {strategy.cp})"
    return None


def candidate_of(strategy: Strategy, config: TrainConfig, accumulation: int) -> Candidate:
    """The search's Candidate for a resolved strategy (dp filled in) and its resolved micro-batching.

    Recomputation is a pipeline feature (the data-parallel engine runs the model whole), so without pp or tp
    it is none; all-but-last is estimated as all (its last stage differs), the lower figure, so it is not refused
    for the difference."""
    pipelined = strategy.pp > 1 or strategy.tp > 1
    recompute = "none"
    if pipelined and strategy.pipeline.memory_budget_mb is not None:
        recompute = "stage-aware"
    elif pipelined and strategy.pipeline.recompute != "none":
        recompute = "all"
    return Candidate(dp=strategy.dp, tp=strategy.tp, pp=strategy.pp, micro_batch_size=config.micro_batch_size,
                     num_microbatches=accumulation, schedule=strategy.pipeline.schedule if strategy.pp > 1 else "1f1b",
                     chunks=strategy.pipeline.chunks if strategy.pp > 1 else 1, recompute=recompute,
                     partition=strategy.pipeline.partition, zero=strategy.replicas.zero)


@dataclass(frozen=True)
class Setting:
    """One configuration to estimate: the candidate, the processes, precision, batch and the memory per rank."""

    candidate: Candidate
    world: int
    dtype: str
    global_batch_size: int
    memory: float  # bytes one rank may use
    hosts: int = 1  # hosts like this one the processes spread over
    stage_budget_mb: float | None = None  # --memory-budget-mb: the stage-aware recomputation's budget


@dataclass(frozen=True)
class RankFigures:
    """Predicted bytes of one pipeline rank (the sum of its stages), without headroom: the model's total and, to
    show where it goes, its pieces (StageMemory's fields, whatever they are)."""

    rank: int
    stages: tuple[int, ...]
    pieces: dict[str, float]
    total: float

    @property
    def state(self) -> float:
        return sum(self.pieces.get(k, 0.0) for k in STATE_PIECES)

    @property
    def high(self) -> float:
        return self.total

    @property
    def low(self) -> float:
        return self.state + LOW_ACTIVATION_SHARE * max(0.0, self.high - self.state)


@dataclass
class Fit:
    """The memory model's verdict on one Setting."""

    setting: Setting
    estimate: Estimate
    ranks: list[RankFigures]
    headroom: float

    @property
    def high(self) -> float:
        return max(r.high for r in self.ranks)

    @property
    def low(self) -> float:
        return max(r.low for r in self.ranks)

    @property
    def fits(self) -> bool:
        """Fits by the search's rule: the prediction with its headroom within the memory."""
        return self.high * self.headroom <= self.setting.memory

    @property
    def refused(self) -> bool:
        """Over the memory even at the low figure and beyond the model's error."""
        return self.low > self.setting.memory * (1 + MODEL_ERROR)


class MemoryFit:
    """Estimates Settings of one traced model; the StepModels (which cache per-block costs) are shared.

    Their times only rank the suggestions, so the cores' time-sharing (a second simulation per candidate) is
    left out of them (cores_per_node=0)."""

    def __init__(self, profile: ModelProfile, cluster: Cluster, *, optimizer: str, ranks_per_host: int):
        self.profile, self.cluster, self.optimizer = profile, cluster, optimizer
        self.ranks_per_host = max(1, ranks_per_host)
        self._models: dict = {}

    def step_model(self, s: Setting) -> StepModel:
        key = (s.dtype, s.global_batch_size, s.stage_budget_mb, s.world)
        if key not in self._models:
            per_node = min(s.world, self.ranks_per_host)
            cluster = self.cluster.replace(num_devices=s.world, devices_per_node=per_node, cores_per_node=0,
                                           memory_per_device_gb=(s.stage_budget_mb / 1024 if s.stage_budget_mb
                                                                 else s.memory / GIB))
            self._models[key] = StepModel(self.profile, cluster, global_batch_size=s.global_batch_size,
                                          dtype=s.dtype, optimizer=self.optimizer)
        return self._models[key]

    def may_fit(self, s: Setting) -> bool:
        """False when the model state alone, split as evenly as the degrees allow, is over the memory: most of
        the configurations near a model far too big are ruled out without simulating their schedules."""
        c = s.candidate
        even_share = self.profile.num_params / (c.tp * c.pp)  # no rank holds less (norms stay whole under tp)
        states = zero_model_state_bytes(int(even_share), zero=c.zero, dp=c.dp, bf16=s.dtype == "bf16",
                                        optimizer_bytes=float(OPTIMIZER_STATE_BYTES[self.optimizer]))
        return states.total * self.cluster.memory_headroom <= s.memory

    def assess(self, s: Setting) -> Fit:
        model = self.step_model(s)
        estimate = model.evaluate(s.candidate)
        c = s.candidate
        names = [f.name for f in dataclasses.fields(StageMemory) if f.name != "headroom"]
        ranks = []
        for r in range(c.pp):
            stages = tuple(i for i in range(c.pp * c.chunks) if i % c.pp == r)
            mine = [estimate.memory_per_stage[i] for i in stages]
            pieces = {k: sum(getattr(m, k) for m in mine) for k in names}
            ranks.append(RankFigures(rank=r, stages=stages, pieces=pieces,
                                     total=sum(m.total / m.headroom for m in mine)))
        return Fit(setting=s, estimate=estimate, ranks=ranks, headroom=model.cluster.memory_headroom)

    # ------------------------------------------------------------------ the configurations nearby

    def layouts(self, base: Setting, world: int, *, memory: float, hosts: int = 1, dtype: str | None = None,
                global_batch_size: int | None = None, micro_batch_sizes: Callable[[int], list[int]] | None = None,
                ) -> Iterator[Setting]:
        """Every dp x tp x pp of `world` processes with micro-batches no larger than the base's, recomputation
        (where a pipeline runs it) and each zero level the runtime has for it."""
        b = base.candidate
        dtype = dtype or base.dtype
        batch = global_batch_size or base.global_batch_size
        per_host = world // hosts
        for tp in self.profile.tp:
            if world % tp or tp > per_host:
                continue
            for pp in divisors(world // tp):
                dp = world // (tp * pp)
                if batch % dp:
                    continue
                sizes = micro_batch_sizes(batch // dp) if micro_batch_sizes else \
                    [m for m in divisors(batch // dp) if m <= b.micro_batch_size]
                schedule, chunks = (b.schedule, b.chunks) if pp == b.pp else ("1f1b", 1)
                pipelined = pp > 1 or tp > 1
                recomputes = {"none", "all"} if pipelined else {"none"}
                if pipelined and b.recompute == "stage-aware":
                    recomputes.add("stage-aware")
                for mbs in sizes:
                    m = batch // (dp * mbs)
                    if pp > 1 and not schedule_valid(schedule, pp, chunks, m, self.profile.num_blocks):
                        continue
                    for recompute in sorted(recomputes):
                        for zero in (0, 1, 2, 3):
                            if not zero_valid(zero, dp, tp, pp, self.optimizer, schedule, chunks):
                                continue
                            c = dataclasses.replace(b, dp=dp, tp=tp, pp=pp, micro_batch_size=mbs, num_microbatches=m,
                                                    schedule=schedule, chunks=chunks, recompute=recompute, zero=zero,
                                                    bounds=None, recompute_blocks=None)
                            yield dataclasses.replace(base, candidate=c, world=world, dtype=dtype,
                                                      global_batch_size=batch, memory=memory, hosts=hosts)

    def process_counts(self, base: Setting, *, shared_host: bool, devices_per_host: int | None = None,
                       ) -> Iterator[tuple[int, float, int]]:
        """(processes, memory per rank, hosts) to try, nearest first. On a CPU host the ranks share its memory:
        fewer processes each get more of it, more processes need more hosts like this one. A GPU rank has its
        device's memory whatever the count; past `devices_per_host` they need more hosts."""
        n, tried = base.world, []
        whole = base.memory * n
        for k in range(1, int(math.log2(MOST_PROCESSES)) + 1):
            if shared_host and n % 2**k == 0:
                tried.append((k - 0.5, n // 2**k, whole / (n // 2**k), 1))  # fewer: a half-step nearer than more
            more = n * 2**k
            if shared_host:
                hosts = 2**k
            elif devices_per_host and more > devices_per_host:
                if more % devices_per_host:
                    continue
                hosts = more // devices_per_host
            else:
                hosts = 1
            tried.append((k, more, base.memory, hosts))
        for _, world, memory, hosts in sorted(tried):
            yield world, memory, hosts


def changes(base: Setting, s: Setting, *, dp_given: bool, micro_batches_given: bool) -> list[str]:
    """The flags that turn `base` into `s`, as a user would type them (or, across hosts, a torchrun line)."""
    b, c = base.candidate, s.candidate
    out = []
    if s.world != base.world:
        out.append(f"--nproc {s.world}" if s.hosts == 1 else
                   f"{s.world} processes on {s.hosts} hosts like this one (torchrun --nnodes {s.hosts} "
                   f"--nproc-per-node {s.world // s.hosts})")
    for name in ("tp", "pp"):
        if getattr(c, name) != getattr(b, name):
            out.append(f"--{name} {getattr(c, name)}")
    if dp_given and c.dp != b.dp:
        out.append(f"--dp {c.dp}")
    if micro_batches_given and c.num_microbatches != b.num_microbatches:
        out.append(f"--micro-batches {c.num_microbatches}")
    elif not micro_batches_given and c.micro_batch_size != b.micro_batch_size:
        out.append(f"--micro-batch-size {c.micro_batch_size}")
    if c.pp > 1 and (c.schedule, c.chunks) != (b.schedule, b.chunks):
        out.append(f"--schedule {c.schedule}" + (f" --chunks {c.chunks}" if c.chunks != b.chunks else ""))
    if c.recompute != b.recompute:
        out.append("--recompute all" if c.recompute == "all" else f"--recompute {c.recompute}")
    if c.zero != b.zero:
        out.append(f"--zero {c.zero}")
    if s.dtype != base.dtype:
        out.append(f"--dtype {s.dtype}")
    if s.global_batch_size != base.global_batch_size:
        out.append(f"--global-batch-size {s.global_batch_size}")
    return out


def rank_lines(fit: Fit) -> list[str]:
    """One line per pipeline rank: the prediction, its pieces, and the low figure."""
    lines = []
    c = fit.setting.candidate
    for r in fit.ranks:
        where = "each rank" if c.pp == 1 else (f"pipeline rank {r.rank} (stage{'s' if len(r.stages) > 1 else ''} "
                                               f"{', '.join(map(str, r.stages))})")
        pieces = " + ".join(f"{PIECE_NAMES.get(k, k.replace('_', ' '))} {size(v)}" for k, v in r.pieces.items()
                            if v > 0)
        lines.append(f"  {where}: {size(r.high)} ({pieces or 'nothing'}; at least {size(r.low)})")
    return lines
