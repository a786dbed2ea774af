"""The strategies, named in one place: which engine a run uses, what it refuses, how it is built.

`STRATEGIES` is an ordered list; the first entry whose `applies` holds is the run's strategy
(an asynchronous pipeline schedule, PipeDream-2BW, which refuses what it cannot combine with;
gossip, then the parameter server, then pipeline / tensor parallelism, then sparse
embeddings, then ZeRO-3, then plain data parallelism, which also runs ZeRO-1/2). `resolve()`
runs every check that needs no communication; `autopar train` calls it before starting any
process and the Trainer calls it
again on every rank, so a bad combination fails early, the same way everywhere. A new
strategy is a new entry: its predicate, its check, its engine builder and, if the
synchronous loop does not fit it, a loop of its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from .async_sgd.engine import AsyncEngine, check_async_setup
from .async_sgd.loop import train_async
from .config import ASYNC_SCHEDULES, Strategy, TrainConfig
from .errors import ConfigError, choices
from .gossip import GossipEngine, check_gossip_strategy
from .pipeline.async_engine import PipeDream2BWEngine, check_two_version_checkpoint
from .pipeline.async_stash_engine import PipeDreamStashEngine
from .pipeline.async_schedules import check_no_flush
from .pipeline.engine import PipelineEngine, check_pipeline_strategy
from .pipeline.schedules import SCHEDULES, schedule_spec
from .running_stats import check_batch_norm_subbatches, check_running_stats
from .search.auto import Example, Plan, resolve_choice
from .search.cluster import cluster_for_ranks
from .sparse.engine import SparseEmbeddingEngine, SparseOptions, check_sparse_setup
from .tensor_parallel.subpipeline import check_tp_subbatches
from .train.base import Engine, EngineContext, LoopServices, TrainResult
from .train.checkpoint import find_checkpoint
from .train.engine import DataParallelEngine
from .train.two_bw_oracle import DelayOneDataParallelEngine
from .train.fsdp_engine import FullyShardedEngine


@dataclass(frozen=True)
class Request:
    """What a strategy is checked against: the user's choices before any process group exists."""

    strategy: Strategy  # resolved: dp filled in
    config: TrainConfig
    world: int
    custom_forward: bool = False  # the Trainer got a forward_fn of its own


@dataclass(frozen=True)
class StrategyEntry:
    name: str
    applies: Callable[[Strategy, TrainConfig], bool]
    check: Callable[[Request], tuple[TrainConfig, int]]  # -> (config with micro-batches resolved, accumulation)
    build: Callable[[EngineContext], Engine]
    loop: Callable[[LoopServices], TrainResult] | None = None  # None: the Trainer's synchronous loop


@dataclass(frozen=True)
class Resolved:
    """The outcome of resolve(): the entry that runs and the settings it runs with."""

    entry: StrategyEntry
    strategy: Strategy
    config: TrainConfig
    accumulation: int  # micro-batches per replica (per worker) per step
    plan: Plan | None = None  # the plan that chose the strategy (--strategy auto, --plan), written to plan.json


def sparse_requested(strategy: Strategy, config: TrainConfig) -> bool:
    return strategy.sparse_embeddings != "dense" or config.optimizer == "sparse-adam"


# ---------------------------------------------------------------------------- checks


def _synchronous_check(request: Request) -> tuple[TrainConfig, int]:
    """Checks every synchronous strategy shares: batch split over replicas, pipeline and tp settings."""
    strategy = request.strategy
    config = request.config.with_micro_batches(strategy.dp)
    accumulation = config.accumulation_steps(strategy.dp)
    check_tp_subbatches(strategy, config.micro_batch_size)
    check_pipeline_strategy(strategy, accumulation)
    _boundary_cluster(strategy)  # a --cluster file that is missing or wrong fails here, before any rank starts
    if (strategy.pp > 1 or strategy.tp > 1) and request.custom_forward:
        raise ConfigError(f"a custom forward_fn cannot be used with pp={strategy.pp} tp={strategy.tp}: the model "
                          f"is traced as the default forward calls it (main input 'input_ids' or 'inputs', "
                          f"every other non-label field as a keyword); drop forward_fn, or use data "
                          f"parallelism only")
    if config.resume and sparse_requested(strategy, config):
        raise ConfigError(f"--resume is not supported yet with --sparse-embeddings {strategy.sparse_embeddings} / "
                          f"--optimizer {config.optimizer} (checkpoints hold per-rank table shards); start a new run")
    return config, accumulation


def _check_pipedream(request: Request) -> tuple[TrainConfig, int]:
    """PipeDream-2BW: the no-flush lists and two weight versions cover plain 1F1B stages over
    data-parallel replicas; everything else is refused here, before any process starts."""
    strategy, config = request.strategy, request.config
    name = strategy.schedule
    refusals = [
        (strategy.dp_mode != "allreduce", f"--dp-mode {strategy.dp_mode}: the replicas of a 2BW pipeline "
         f"sum each step's gradient synchronously (a parameter server or gossip would add a second, "
         f"different staleness); use --dp-mode allreduce"),
        (strategy.chunks > 1, f"--chunks {strategy.chunks} (interleaving): the no-flush lists are 1F1B with "
         f"one stage per rank; use --chunks 1"),
        (strategy.tp > 1, f"--tp {strategy.tp}: tensor-parallel stages with two weight versions are not "
         f"supported yet (the older version would need saving as slices); use --tp 1"),
        (strategy.recompute != "none" or strategy.memory_budget_mb is not None,
         "recomputation (--recompute / --memory-budget-mb, SCP's ingredient): not supported with the no-flush "
         "lists yet; use --recompute none"),
        (sparse_requested(strategy, config), "sparse embeddings / sparse-adam: their deferred rows assume "
         "synchronous steps; use dense embeddings"),
        (name == "pipedream-2bw" and strategy.pp == 1 and bool(config.resume), "--resume with pp=1: the whole-model "
         "2BW rule keeps its older version outside the checkpoint; resume a pipelined (pp > 1) run"),
    ]
    for refused, why in refusals:
        if refused:
            raise ConfigError(f"schedule {name!r} cannot be combined with {why}")
    if name == "pipedream":
        resolved = config.with_micro_batches(strategy.dp)
        per_replica = resolved.accumulation_steps(strategy.dp)
        if per_replica != 1:
            raise ConfigError(f"schedule 'pipedream' updates after every micro-batch (the paper's semantics: one "
                              f"optimizer step is one micro-batch per replica), but global batch "
                              f"{config.global_batch_size} gives {per_replica} micro-batches of "
                              f"{resolved.micro_batch_size} per replica (dp={strategy.dp}); set --global-batch-size "
                              f"to micro-batch size x dp = {resolved.micro_batch_size * strategy.dp}")
        # the rest as for a 1F1B pipeline (one micro-batch per call is enough for the no-flush lists)
        return _synchronous_check(dataclasses.replace(request, strategy=dataclasses.replace(strategy, schedule="1f1b")))
    if strategy.pp > 1:
        check_no_flush(strategy.pp, config.with_micro_batches(strategy.dp).accumulation_steps(strategy.dp))
        if config.resume:
            check_two_version_checkpoint(find_checkpoint(config.resume))
    return _synchronous_check(request)


def _check_gossip(request: Request) -> tuple[TrainConfig, int]:
    resolved = _synchronous_check(request)
    check_gossip_strategy(request.strategy)
    return resolved


def _check_async(request: Request) -> tuple[TrainConfig, int]:
    return check_async_setup(request.strategy, request.config, request.world)


def _check_sparse(request: Request) -> tuple[TrainConfig, int]:
    resolved = _synchronous_check(request)
    check_sparse_setup(SparseOptions.of(request.strategy), request.config, request.config.device)
    return resolved


# ---------------------------------------------------------------------------- builders


def _build_gossip(ctx: EngineContext) -> Engine:
    """D-PSGD: replicas mix with neighbours (gossip/engine.py)."""
    return GossipEngine(ctx.model, ctx.mesh, device=ctx.device, seed=ctx.seed, forward_fn=ctx.forward_fn,
                        autocast=ctx.autocast, timeout_s=ctx.timeout_s,
                        topology=check_gossip_strategy(ctx.strategy), order=ctx.strategy.gossip_order)


def _build_async(ctx: EngineContext) -> Engine:
    """Parameter server (async_sgd/engine.py): servers serve, workers run ahead."""
    return AsyncEngine(ctx.model, ctx.mesh, device=ctx.device, seed=ctx.seed, forward_fn=ctx.forward_fn,
                       autocast=ctx.autocast, timeout_s=ctx.timeout_s, weight_decay=ctx.config.weight_decay,
                       servers=ctx.strategy.servers, staleness=ctx.strategy.staleness)


def _build_pipeline(ctx: EngineContext) -> Engine:
    """Traced stages run by a schedule (pipeline/engine.py); tensor parallelism too (one stage when pp=1)."""
    return PipelineEngine(ctx.model, ctx.mesh, device=ctx.device, seed=ctx.seed, example_batch=ctx.example_batch(),
                          num_microbatches=ctx.accumulation, autocast=ctx.autocast, timeout_s=ctx.timeout_s,
                          strategy=ctx.strategy, param_dtype=ctx.param_dtype, boundary_link=_boundary_cluster(ctx.strategy))


def _boundary_cluster(strategy: Strategy):
    """The cluster --boundary auto prices its choice on (--cluster; cpu-local, this host, by default)."""
    if strategy.boundary != "auto":
        return None
    ranks = sum(strategy.stage_tps) if strategy.stage_tps is not None else strategy.tp * strategy.pp
    return cluster_for_ranks(strategy.cluster, strategy.dp * ranks)


def _build_pipedream(ctx: EngineContext) -> Engine:
    """PipeDream-2BW: no-flush 1F1B on two weight versions (pipeline/async_engine.py); with pp=1, the
    same update rule on whole models (train/two_bw_oracle.py). PipeDream (weight stashing,
    pipeline/async_stash_engine.py); with pp=1 its rule is synchronous SGD (no stage lags)."""
    cfg = ctx.config
    if ctx.strategy.schedule == "pipedream":
        if ctx.strategy.pp == 1:
            return _build_data_parallel(ctx)
        return PipeDreamStashEngine(ctx.model, ctx.mesh, device=ctx.device, seed=ctx.seed,
                                    example_batch=ctx.example_batch(), autocast=ctx.autocast, timeout_s=ctx.timeout_s,
                                    strategy=ctx.strategy, steps=cfg.steps, eval_every=cfg.eval_every,
                                    checkpoint_every=cfg.checkpoint_every, vertical_sync=ctx.strategy.vertical_sync,
                                    tied_delay=ctx.strategy.tied_delay,
                                    batches_for_step=ctx.batches_for_step, samples_for_step=ctx.samples_for_step)
    if ctx.strategy.pp == 1:
        return DelayOneDataParallelEngine(ctx.model, ctx.mesh, device=ctx.device, seed=ctx.seed,
                                          forward_fn=ctx.forward_fn, autocast=ctx.autocast)
    return PipeDream2BWEngine(ctx.model, ctx.mesh, device=ctx.device, seed=ctx.seed,
                              example_batch=ctx.example_batch(), num_microbatches=ctx.accumulation,
                              autocast=ctx.autocast, timeout_s=ctx.timeout_s, strategy=ctx.strategy,
                              steps=cfg.steps, eval_every=cfg.eval_every, checkpoint_every=cfg.checkpoint_every,
                              batches_for_step=ctx.batches_for_step, samples_for_step=ctx.samples_for_step)


def _build_sparse(ctx: EngineContext) -> Engine:
    """EmbRace and its baselines (sparse/engine.py)."""
    return SparseEmbeddingEngine(ctx.model, ctx.mesh, device=ctx.device, seed=ctx.seed, forward_fn=ctx.forward_fn,
                                 autocast=ctx.autocast, config=ctx.config, log=ctx.log,
                                 batches_for_step=ctx.batches_for_step, options=SparseOptions.of(ctx.strategy))


def _build_fully_sharded(ctx: EngineContext) -> Engine:
    """ZeRO-3: parameters sharded too, gathered per block by FSDP2 (train/fsdp_engine.py)."""
    return FullyShardedEngine(ctx.model, ctx.mesh, device=ctx.device, seed=ctx.seed, forward_fn=ctx.forward_fn,
                              autocast=ctx.autocast, param_dtype=ctx.param_dtype)


def _build_data_parallel(ctx: EngineContext) -> Engine:
    return DataParallelEngine(ctx.model, ctx.mesh, device=ctx.device, seed=ctx.seed, forward_fn=ctx.forward_fn,
                              autocast=ctx.autocast, zero=ctx.strategy.zero, param_dtype=ctx.param_dtype)


STRATEGIES: tuple[StrategyEntry, ...] = (
    StrategyEntry("pipedream-2bw", lambda s, c: s.schedule in ASYNC_SCHEDULES, _check_pipedream, _build_pipedream),
    StrategyEntry("gossip", lambda s, c: s.dp_mode == "gossip", _check_gossip, _build_gossip),
    StrategyEntry("parameter-server", lambda s, c: s.dp_mode == "async", _check_async, _build_async,
                  loop=train_async),
    StrategyEntry("pipeline", lambda s, c: s.pp > 1 or s.tp > 1, _synchronous_check, _build_pipeline),
    StrategyEntry("sparse-embeddings", sparse_requested, _check_sparse, _build_sparse),
    StrategyEntry("zero-3", lambda s, c: s.zero == 3, _synchronous_check, _build_fully_sharded),
    StrategyEntry("data-parallel", lambda s, c: True, _synchronous_check, _build_data_parallel),
)


ZERO_OPTIMIZERS = ("adamw", "adam", "adagrad")  # element-wise per-parameter state: worth sharding


def check_memory_options(strategy: Strategy, config: TrainConfig) -> None:
    """--zero and --dtype bf16 (master weights) work with synchronous all-reduce data parallelism only."""
    zero = strategy.zero
    other_mode = ("--dp-mode gossip" if strategy.dp_mode == "gossip" else "--dp-mode async (the parameter server)"
                  if strategy.dp_mode == "async" else f"--sparse-embeddings {strategy.sparse_embeddings} / "
                  f"--optimizer {config.optimizer}" if sparse_requested(strategy, config) else None)
    if config.dtype == "bf16" and other_mode is not None:
        raise ConfigError(f"--dtype bf16 (bf16 parameters, fp32 master weights) is not supported with {other_mode}; "
                          f"use --dtype bf16-autocast there, or the default all-reduce data parallelism")
    if strategy.schedule in ASYNC_SCHEDULES and (zero or config.dtype == "bf16"):
        raise ConfigError(f"--schedule {strategy.schedule} keeps several whole weight versions per stage; it does not "
                          f"combine with --zero {zero} / --dtype {config.dtype} yet; use --zero 0 and --dtype fp32 "
                          f"or bf16-autocast, or a flushing schedule such as 1f1b")
    if zero == 0:
        return
    if other_mode is not None:
        raise ConfigError(f"--zero {zero} shards optimizer state over synchronous all-reduce replicas; it does not "
                          f"combine with {other_mode}; use --zero 0, or drop that mode")
    if strategy.dp == 1:
        raise ConfigError(f"--zero {zero} shards over data-parallel replicas, but dp=1 (tp={strategy.tp} "
                          f"pp={strategy.pp}): there is nothing to shard over; use --zero 0, or more processes for dp")
    if config.optimizer not in ZERO_OPTIMIZERS:
        raise ConfigError(f"--zero {zero} shards per-parameter optimizer state, and --optimizer {config.optimizer} "
                          f"has none (plain SGD without momentum): sharding saves nothing; use --zero 0, or an "
                          f"optimizer with state: {', '.join(ZERO_OPTIMIZERS)}")
    if zero == 3 and (strategy.pp > 1 or strategy.tp > 1):  # FSDP2 per stage (zero/fully_sharded.py)
        refusals = [
            (strategy.chunks > 1, f"--chunks {strategy.chunks}: one FSDP2 unit per stage, and a rank's stages "
             f"may share a tied weight; use --chunks 1"),
            (not schedule_spec(strategy.schedule).zero3_stages, f"--schedule {strategy.schedule}: its "
             f"weight-gradient pass (W) runs after FSDP2 has resharded the stage at the end of the input-gradient "
             f"pass (I) (tried: the ranks hang); use one of "
             f"{choices(s for s in SCHEDULES if schedule_spec(s).zero3_stages)}"),
        ]
        for refused, why in refusals:
            if refused:
                raise ConfigError(f"--zero 3 with pp={strategy.pp} tp={strategy.tp} cannot be combined with {why}; "
                                  f"or use --zero 2 (optimizer state and gradients sharded)")


def resolve(strategy: Strategy, config: TrainConfig, world: int, *, custom_forward: bool = False,
            model: nn.Module | None = None, example: Example | None = None, plan: Plan | None = None,
            model_name: str | None = None) -> Resolved:
    """Every check that needs no communication, in one place; the same error on every rank and in the CLI.

    `--strategy auto` and `--plan` become a concrete strategy here first (search/auto.py): the
    search needs `model` and `example` (the traced call of one sample); a plan is checked against them.
    """
    config.validate()
    searched = strategy.search == "auto" and not strategy.plan
    # field errors first, as for any strategy (the search picks the degrees left open, so not their product)
    (dataclasses.replace(strategy, dp=None, tp=1, pp=1) if searched else strategy).resolved(world)

    def accept(candidate: Strategy, candidate_config: TrainConfig) -> None:
        resolved = candidate.resolved(world)
        entry, _, _ = _entry_and_check(resolved, candidate_config, world, custom_forward)
        if model is not None:  # e.g. no --tp-subbatches for a model with BatchNorm
            _check_running_stats(model, entry, resolved, world)

    strategy, config, plan = resolve_choice(strategy, config, world, model=model, example=example, plan=plan,
                                            model_name=model_name, accept=accept)
    strategy = strategy.resolved(world)
    entry, config, accumulation = _entry_and_check(strategy, config, world, custom_forward)
    if model is not None:
        _check_running_stats(model, entry, strategy, world)
    return Resolved(entry=entry, strategy=strategy, config=config, accumulation=accumulation, plan=plan)


REPLAYING_ENTRIES = ("pipeline", "zero-3", "data-parallel")  # their engines keep BatchNorm statistics exactly


def _check_running_stats(model: nn.Module, entry: StrategyEntry, strategy: Strategy, world: int) -> None:
    """Layers with running statistics the chosen strategy cannot keep as one process does: refused here."""
    layout = f"strategy {entry.name} (dp={strategy.dp} tp={strategy.stage_tp or strategy.tp} pp={strategy.pp})"
    check_running_stats(model, layout=layout, replays=entry.name in REPLAYING_ENTRIES, processes=world)
    check_batch_norm_subbatches(model, strategy.tp_subbatches)


def _entry_and_check(strategy: Strategy, config: TrainConfig, world: int,
                     custom_forward: bool) -> tuple[StrategyEntry, TrainConfig, int]:
    check_memory_options(strategy, config)
    entry = next(e for e in STRATEGIES if e.applies(strategy, config))
    config, accumulation = entry.check(Request(strategy, config, world, custom_forward))
    return entry, config, accumulation
