"""One rank's share of a pipeline, built from an unmodified model: the set-up PipelineEngine and the
benchmarks share.

trace -> partition -> this rank's stages (materialised, tensor-parallel, sub-pipelined) ->
schedule -> runtime -> recomputation plan. What is left to an engine is what a training run
adds around it: gradient synchronisation over data-parallel replicas, the sums of tied
weights across pipeline ranks, the loss of a tensor-parallel head.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from ..errors import ConfigError
from ..timing import WaitTally
from ..train.engine import broadcast_state, on_every_rank
from ..train.fields import first_stage_inputs, traced_call
from ..train.loss import Batch
from .actions import Action, Op, Schedule, stage_to_rank
from .p2p import P2P
from .recompute import RecomputePlan, plan_pipeline_recompute, stage_example_inputs
from .runtime import PipelineRuntime
from .schedules import build_schedule, placement, recomputed_stages

if TYPE_CHECKING:
    from ..context_parallel import ContextParallel
    from ..experts import ShardedExperts
    from ..partition.plan import Partition
    from ..tensor_parallel.apply import TensorParallel
    from ..trace.graph import ModelGraph



@dataclass
class LocalPipeline:
    """What one pipeline rank runs: its stages of the partitioned model, its actions, the runtime."""

    graph: ModelGraph  # the traced model
    partition: Partition
    stages: dict[int, nn.Module]  # stage index -> StageModule, this rank's only
    pp: int
    pp_rank: int
    num_stages: int
    placement: str
    schedule: Schedule  # every rank's actions
    actions: list[Action]  # this rank's training step
    eval_actions: list[Action]  # the same order without backward work (dropping work only removes waits)
    runtime: PipelineRuntime
    recompute: frozenset[int]  # stages whose forward keeps only its inputs (the schedule's R)
    tensor_parallel: TensorParallel | None = None  # when tp > 1
    experts: ShardedExperts | None = None  # when ep > 1: this rank's rows of every expert layer, and the dispatches
    recompute_plan: RecomputePlan | None = None  # with a memory budget: this rank's stages
    recompute_report: RecomputePlan | None = None  # ... and every pipeline rank's, for the run's report

    def first_stage_inputs(self, batch: Batch) -> tuple:
        """Stage 0's inputs from a micro-batch, checked against the traced shapes (an error, never a hang)."""
        return _first_stage_inputs(self.graph, batch)


def check_stage_count(graph: ModelGraph, pp: int, chunks: int) -> None:
    """pp x chunks stages need as many blocks to cut between, each stage one with parameters (ranks, and
    `autopar train` before it launches)."""
    from ..partition.plan import check_units
    num_stages = pp * chunks
    if graph.layers_path is None:  # no stack: partition() says so
        return
    asked = f"pp={pp} x chunks={chunks} = {num_stages} stages" if chunks > 1 else f"pp={pp} stages"
    check_units(graph, num_stages, asked)
    if num_stages > len(graph.blocks):
        raise ConfigError(f"pp={pp} x chunks={chunks} = {num_stages} stages, but the model has "
                          f"only {len(graph.blocks)} blocks to cut between (embedding part, "
                          f"{len(graph.blocks) - 2} layers, head part); use at most {len(graph.blocks)} stages")


def recompute_request(name: str, num_stages: int) -> frozenset[int]:
    """Stages a --recompute choice asks to recompute whole (the schedule may drop some)."""
    return {"none": frozenset(), "all": frozenset(range(num_stages)),
            "all-but-last": frozenset(range(num_stages - 1))}[name]


def build_local_pipeline(model: nn.Module, *, pp: int, pp_rank: int, pp_group, device: torch.device, seed: int,
                         example_batch: Batch, num_microbatches: int, schedule: str = "1f1b", chunks: int = 1,
                         partition_method: str = "time", recompute: str | frozenset[int] = "none",
                         memory_budget_bytes: float | None = None, tp: int = 1, tp_group=None, tp_subbatches: int = 1,
                         sp: bool = False,
                         autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                         partition=None, p2p: P2P | None = None,
                         stage_tp: tuple[int, ...] | None = None,
                         context_parallel: ContextParallel | None = None,
                         ep: int = 1, ep_group=None, ep_rank: int = 0,
                         stage_speeds: tuple[float, ...] | None = None) -> LocalPipeline:
    """This rank's pipeline of `model` (on meta, or built for real on every rank: then rank 0's weights win).

    Collective over the world (errors one rank finds are raised on all) and over `pp_group`.
    `partition`: one made earlier of this same model and stage count, reused instead of tracing
    again (a benchmark building many pipelines). `p2p`: a transport to use instead of a fresh
    P2P on `pp_group`. `stage_tp`: each stage's own tp degree (--stage-tp); `tp` and `tp_group` are then
    this rank's stage's, and `p2p` must be given (pipeline/hetero_boundary.py). With `memory_budget_bytes`, every stage's recomputed blocks are chosen to
    fit it (pipeline/recompute.py) and every rank agrees that they fit. `sp`: sequence parallelism within
    tp (tensor_parallel/sequence.py). `context_parallel`: the model is traced on this rank's share of the
    sequence and its attention and positions rewritten (context_parallel/). `ep` > 1: every expert layer's
    experts sharded over `ep_group` (this rank is `ep_rank` in it), its dispatch spliced into the stage graphs.
    """
    from ..partition import partition as make_partition
    from ..trace import trace

    num_stages = pp * chunks
    if partition is None:
        built_for_real = not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
        if built_for_real:  # every rank starts from rank 0's weights, as the whole-model engines do
            broadcast_state(model, dist.group.WORLD, src=0, device=device)
        # trace where the model lives: a real model's tensors and a meta input cannot meet in one op
        traced_on = (next((t.device for t in [*model.parameters(), *model.buffers()]), torch.device("cpu"))
                     if built_for_real else torch.device("meta"))
        model.train()  # the training graph (dropout nodes on), as whole-model engines run it
        if context_parallel is not None:  # what the masks mean, read on a short probe; then trace the shard
            from ..context_parallel import declared_window
            on_every_rank(lambda: context_parallel.probe(
                lambda batch: trace(model, *_traced_call(model, batch, traced_on), device=device), example_batch,
                device, declared_window(model)))
            example_batch = context_parallel.shard(example_batch)
        graph = trace(model, *_traced_call(model, example_batch, traced_on), device=device)
        if context_parallel is not None:
            on_every_rank(lambda: context_parallel.rewrite(graph))
        check_stage_count(graph, pp, chunks)
        partition = make_partition(graph, num_stages, method=partition_method, stage_speeds=stage_speeds)
    elif partition.num_stages != num_stages:
        raise ValueError(f"the given partition has {partition.num_stages} stages, not pp x chunks = {num_stages}")
    graph = partition.graph
    style = placement(schedule)  # 'loop' (stage s on rank s mod pp), or 'v' for zbv (rank r: stages r, 2pp-1-r)
    mine = [s for s in range(num_stages) if stage_to_rank(s, pp, num_stages, style) == pp_rank]
    stages = on_every_rank(lambda: {s: partition.materialize_stage(s, model, device, seed=seed)
                                    for s in mine})  # an uninitialised weight is found by its stage's rank
    tensor_parallel = None
    if stage_tp is not None:  # every rank plans every degree: a degree that does not fit fails on all ranks
        from ..tensor_parallel import plan_tensor_parallel
        plans = {t: plan_tensor_parallel(graph, t) for t in sorted(set(stage_tp)) if t > 1}
        if tp > 1:
            from ..tensor_parallel import TensorParallel
            tensor_parallel = TensorParallel(plans[tp], tp_group)
            for stage in stages.values():
                tensor_parallel.parallelize(stage)
    elif tp > 1:
        from ..tensor_parallel import TensorParallel, plan_tensor_parallel
        tensor_parallel = TensorParallel(plan_tensor_parallel(graph, tp, sequence=sp), tp_group)
        for stage in stages.values():
            tensor_parallel.parallelize(stage)
        if tp_subbatches > 1:  # Merak's sub-pipelined TP (tensor_parallel/subpipeline.py)
            from ..tensor_parallel.subpipeline import sub_pipeline_stages
            sub_pipeline_stages(stages, model, partition, tp_subbatches, tp_group, device)
    experts = None
    if ep > 1:  # after tensor parallelism, which leaves the experts whole
        from ..experts import find_experts
        from ..experts.splice import splice_expert_dispatch
        plan = find_experts(graph, model)
        if not plan.layers:
            raise ConfigError(f"--ep {ep} needs mixture-of-experts layers to shard, and none was recognised in "
                              f"{type(model).__name__}:\n{plan.table()}\nuse --ep 1")
        experts = on_every_rank(lambda: splice_expert_dispatch(stages, graph, model, plan, ep_group, ep=ep,
                                                               ep_rank=ep_rank))
    requested = recompute_request(recompute, num_stages) if isinstance(recompute, str) else frozenset(recompute)
    steps = build_schedule(schedule, pp=pp, num_microbatches=num_microbatches, chunks=chunks,
                           recompute=requested, batched=True)  # NCCL-safe groups (comm_steps.py)
    recomputed = recomputed_stages(steps)  # the schedule may drop some (scp: never the last)
    actions = steps[pp_rank]
    first_input = lambda batch: _first_stage_inputs(graph, batch)
    waits = WaitTally(device)  # the time this rank waits for its peers (the runtime's and the transfers')
    runtime = PipelineRuntime(stages=stages, num_stages=num_stages, pp=pp, pp_rank=pp_rank,
                              p2p=p2p if p2p is not None else P2P(pp_group, device, num_stages, num_microbatches,
                                                                  waits=waits),
                              recompute=recomputed, autocast=autocast, placement=style, first_input=first_input,
                              waits=waits)
    pipe = LocalPipeline(
        graph=graph, partition=partition, stages=stages, pp=pp, pp_rank=pp_rank, num_stages=num_stages,
        placement=style, schedule=steps, actions=actions,
        eval_actions=[a for a in actions if a.op in (Op.FORWARD, Op.SEND_ACT, Op.RECV_ACT)],
        runtime=runtime, recompute=recomputed, tensor_parallel=tensor_parallel, experts=experts)
    if memory_budget_bytes is not None:
        pipe.recompute_plan, pipe.recompute_report = _agreed_recompute_plan(
            pipe, memory_budget_bytes, num_microbatches, device, pp_group)
    return pipe


def _first_stage_inputs(graph: ModelGraph, batch: Batch) -> tuple:
    return first_stage_inputs(batch, graph.input_keys, [tuple(v.shape) for v in graph.example_inputs])


def _traced_call(model: nn.Module, example_batch: Batch, device: torch.device) -> tuple[tuple, dict]:
    """Trace on every non-label batch field (train/fields.py), with a model's key/value cache off."""
    from ..models.hf import turn_off_kv_cache
    if turn_off_kv_cache(model) and dist.get_rank() == 0:
        print(f"{type(model).__name__}: set config.use_cache=False for training (a key/value cache "
              f"cannot be traced and is not used when training)", flush=True)
    return traced_call(example_batch, device)


def _agreed_recompute_plan(pipe: LocalPipeline, budget: float, num_microbatches: int, device: torch.device,
                           pp_group) -> tuple[RecomputePlan, RecomputePlan]:
    """This rank's plan, applied to its stages, once every rank found one that fits; and every pp rank's plan."""
    error = plan = None
    try:
        plan = plan_pipeline_recompute(pipe.stages, pipe.schedule, stage_example_inputs(pipe.graph, pipe.stages, device),
                                       budget, pp=pipe.pp, num_microbatches=num_microbatches,
                                       recomputed=pipe.recompute)
    except ConfigError as exc:
        error = exc
    failed = torch.tensor(0 if error is None else 1, device=device)
    dist.all_reduce(failed)
    if error is not None:
        raise error
    if int(failed):
        raise ConfigError(f"another pipeline rank cannot fit --memory-budget-mb {budget / 2**20:g}; "
                          f"see its message")
    for s, blocks in plan.blocks.items():
        pipe.stages[s].recompute_blocks = blocks
    parts = [None] * pipe.pp
    dist.all_gather_object(parts, (plan.blocks, plan.memory), group=pp_group)
    whole = RecomputePlan(blocks={s: k for part_blocks, _ in parts for s, k in part_blocks.items()},
                          memory={s: m for _, part_memory in parts for s, m in part_memory.items()}, budget=plan.budget)
    return plan, whole
