"""The strategies, named in one place: which engine a run uses, what it refuses, how it is built.

`STRATEGIES` is an ordered list; the first entry whose `applies` holds is the run's strategy
(an asynchronous pipeline schedule, PipeDream-2BW or PipeDream; gossip, then the parameter server,
then pipeline / tensor parallelism, then sparse embeddings, then ZeRO-3, then plain data
parallelism, which also runs ZeRO-1/2). `resolve()` runs every check that needs no communication:
field values, then the rule table (config/rules.py: what combines with what), then the entry's own
check; `autopar train` calls it before starting any process and the Trainer calls it again on every
rank, so a bad combination fails early, the same way everywhere. A new strategy is a new entry: its
predicate, its check, its engine builder and, if the synchronous loop does not fit it, a loop of its
own; what it cannot combine with is a rule in config/rules.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from .async_sgd.engine import AsyncEngine, check_async_setup
from .async_sgd.loop import train_async
from .config import ASYNC_SCHEDULES, ReplicaOptions, SparseOptions, Strategy, TrainConfig
from .config.rules import Setup, check_rules
from .errors import ConfigError
from .gossip import GossipEngine, GossipOptions, check_gossip_strategy
from .pipeline.async_engine import PipeDream2BWEngine, check_two_version_checkpoint
from .pipeline.async_stash_engine import PipeDreamStashEngine
from .pipeline.engine import PipelineEngine
from .running_stats import batch_norm_layers, check_batch_norm_subbatches, check_running_stats
from .search.auto import Example, Plan, resolve_choice
from .search.cluster import cluster_for_ranks
from .search.device_speeds import replica_shares, stage_speeds, with_auto_shares
from .sparse.engine import SparseEmbeddingEngine
from .train.base import Engine, EngineContext, LoopServices, TrainResult
from .train.checkpoint import find_checkpoint
from .train.engine import DataParallelEngine
from .train.expert_engine import ExpertParallelEngine
from .train.two_bw_oracle import DelayOneDataParallelEngine
from .train.fsdp_engine import FullyShardedEngine


@dataclass(frozen=True)
class Request:
    """What a strategy is checked against: the user's choices before any process group exists."""

    strategy: Strategy  # resolved: dp filled in
    config: TrainConfig
    world: int
    custom_forward: bool = False  # the Trainer got a forward_fn of its own


def _whole_strategy(strategy: Strategy, config: TrainConfig) -> Strategy:
    return strategy


@dataclass(frozen=True)
class StrategyEntry:
    """One strategy: when it runs, its check, and its engine built from the context and its options."""

    name: str
    applies: Callable[[Strategy, TrainConfig], bool]
    check: Callable[[Request], tuple[TrainConfig, int]]  # -> (config with micro-batches resolved, accumulation)
    engine: Callable[[EngineContext, Any], Engine]  # (ctx, options) -> this rank's engine
    loop: Callable[[LoopServices], TrainResult] | None = None  # None: the Trainer's synchronous loop
    options: Callable[[Strategy, TrainConfig], Any] = _whole_strategy  # the part of the strategy the engine reads

    def build(self, ctx: EngineContext) -> Engine:
        return self.engine(ctx, self.options(ctx.strategy, ctx.config))


@dataclass(frozen=True)
class Resolved:
    """The outcome of resolve(): the entry that runs and the settings it runs with."""

    entry: StrategyEntry
    strategy: Strategy
    config: TrainConfig
    accumulation: int  # micro-batches per replica (per worker) per step
    plan: Plan | None = None  # the plan that chose the strategy (--strategy auto, --plan), written to plan.json


def sparse_requested(strategy: Strategy, config: TrainConfig) -> bool:
    return strategy.sparse.mode != "dense" or config.optimizer == "sparse-adam"


# ---------------------------------------------------------------------------- checks
# What combines with what is the rule table's (config/rules.py), checked before these; an entry's
# check resolves the batch split and checks what needs more than the user's choices (files).


def _synchronous_check(request: Request) -> tuple[TrainConfig, int]:
    """The batch split over the replicas; a --cluster file for --boundary auto is read here."""
    strategy = request.strategy
    config = request.config.with_micro_batches(strategy.dp)
    shares = replica_shares(strategy, config)
    accumulation = request.config.accumulation_steps(strategy.dp) if shares is None else \
        max(shares) // config.micro_batch_size  # the busiest replica's micro-batches
    _boundary_cluster(strategy)  # a --cluster file that is missing or wrong fails here, before any rank starts
    return config, accumulation


def _check_pipedream(request: Request) -> tuple[TrainConfig, int]:
    """PipeDream-2BW resumes only a checkpoint holding its older weight version (read from the file)."""
    strategy, config = request.strategy, request.config
    if strategy.pipeline.schedule == "pipedream-2bw" and strategy.pp > 1 and config.resume:
        check_two_version_checkpoint(find_checkpoint(config.resume))
    return _synchronous_check(request)


def _check_gossip(request: Request) -> tuple[TrainConfig, int]:
    resolved = _synchronous_check(request)
    check_gossip_strategy(request.strategy)  # the topology (a file, or a graph that must fit dp)
    return resolved


def _check_async(request: Request) -> tuple[TrainConfig, int]:
    return check_async_setup(request.strategy, request.config, request.world)


# ---------------------------------------------------------------------------- builders
# Each takes the context (what every engine is built from; ctx.common() the arguments all take) and
# its entry's options (the part of the strategy that engine reads).


def _build_gossip(ctx: EngineContext, options: GossipOptions) -> Engine:
    """D-PSGD: replicas mix with neighbours (gossip/engine.py)."""
    return GossipEngine(**ctx.common(), forward_fn=ctx.forward_fn, timeout_s=ctx.timeout_s, options=options)


def _build_async(ctx: EngineContext, options: ReplicaOptions) -> Engine:
    """Parameter server (async_sgd/engine.py): servers serve, workers run ahead."""
    return AsyncEngine(**ctx.common(), forward_fn=ctx.forward_fn, timeout_s=ctx.timeout_s,
                       weight_decay=ctx.config.weight_decay, servers=options.servers, staleness=options.staleness)


def _build_pipeline(ctx: EngineContext, options: Strategy) -> Engine:
    """Traced stages run by a schedule (pipeline/engine.py); tensor parallelism too (one stage when pp=1), and --ep
    with either (experts sharded within each stage's dp group)."""
    return PipelineEngine(**ctx.common(), example_batch=ctx.example_batch(), num_microbatches=ctx.accumulation,
                          timeout_s=ctx.timeout_s, strategy=options, param_dtype=ctx.param_dtype,
                          boundary_link=_boundary_cluster(options),
                          stage_speeds=stage_speeds(options))


def _boundary_cluster(strategy: Strategy):
    """The cluster --boundary auto prices its choice on (--cluster; cpu-local, this host, by default)."""
    if strategy.pipeline.boundary != "auto":
        return None
    ranks = sum(strategy.stage_tps) if strategy.stage_tps is not None else strategy.tp * strategy.pp
    return cluster_for_ranks(strategy.planning.cluster, strategy.dp * ranks)


def _build_pipedream(ctx: EngineContext, options: Strategy) -> Engine:
    """PipeDream-2BW: no-flush 1F1B on two weight versions (pipeline/async_engine.py); with pp=1, the
    same update rule on whole models (train/two_bw_oracle.py). PipeDream (weight stashing,
    pipeline/async_stash_engine.py); with pp=1 its rule is synchronous SGD (no stage lags)."""
    if options.pp == 1:
        if options.pipeline.schedule == "pipedream":
            return _build_data_parallel(ctx, options.replicas)
        return DelayOneDataParallelEngine(**ctx.common(), forward_fn=ctx.forward_fn)
    cfg = ctx.config
    no_flush = dict(example_batch=ctx.example_batch(), timeout_s=ctx.timeout_s, strategy=options, steps=cfg.steps,
                    eval_every=cfg.eval_every, checkpoint_every=cfg.checkpoint_every,
                    batches_for_step=ctx.batches_for_step, samples_for_step=ctx.samples_for_step)
    if options.pipeline.schedule == "pipedream":
        return PipeDreamStashEngine(**ctx.common(), **no_flush, vertical_sync=options.pipeline.vertical_sync,
                                    tied_delay=options.pipeline.tied_delay)
    return PipeDream2BWEngine(**ctx.common(), **no_flush, num_microbatches=ctx.accumulation)


def _build_sparse(ctx: EngineContext, options: SparseOptions) -> Engine:
    """EmbRace and its baselines (sparse/engine.py)."""
    return SparseEmbeddingEngine(**ctx.common(), forward_fn=ctx.forward_fn, config=ctx.config, log=ctx.log,
                                 batches_for_step=ctx.batches_for_step, options=options)


def _build_fully_sharded(ctx: EngineContext, options: ReplicaOptions) -> Engine:
    """ZeRO-3: parameters sharded too, gathered per block by FSDP2 (train/fsdp_engine.py)."""
    return FullyShardedEngine(**ctx.common(), forward_fn=ctx.forward_fn, param_dtype=ctx.param_dtype,
                              batchnorm=options.batchnorm)


def _build_data_parallel(ctx: EngineContext, options: ReplicaOptions) -> Engine:
    return DataParallelEngine(**ctx.common(), forward_fn=ctx.forward_fn, zero=options.zero,
                              param_dtype=ctx.param_dtype, batchnorm=options.batchnorm)


def _build_expert_parallel(ctx: EngineContext, options: Strategy) -> Engine:
    """--ep: data parallelism whose expert layers are sharded over ep ranks (train/expert_engine.py)."""
    return ExpertParallelEngine(**ctx.common(), forward_fn=ctx.forward_fn, example_batch=ctx.example_batch(),
                                ep=options.ep, batchnorm=options.replicas.batchnorm)


def _sparse_options(strategy: Strategy, config: TrainConfig) -> SparseOptions:
    return strategy.sparse


def _replica_options(strategy: Strategy, config: TrainConfig) -> ReplicaOptions:
    return strategy.replicas


def _gossip_options(strategy: Strategy, config: TrainConfig) -> GossipOptions:
    return GossipOptions.of(strategy)


STRATEGIES: tuple[StrategyEntry, ...] = (
    StrategyEntry("pipedream-2bw", lambda s, c: s.pipeline.schedule in ASYNC_SCHEDULES, _check_pipedream, _build_pipedream),
    StrategyEntry("gossip", lambda s, c: s.replicas.mode == "gossip", _check_gossip, _build_gossip,
                  options=_gossip_options),
    StrategyEntry("parameter-server", lambda s, c: s.replicas.mode == "async", _check_async, _build_async,
                  loop=train_async, options=_replica_options),
    StrategyEntry("pipeline", lambda s, c: s.pp > 1 or s.tp > 1 or s.cp > 1, _synchronous_check, _build_pipeline),
    StrategyEntry("sparse-embeddings", sparse_requested, _synchronous_check, _build_sparse, options=_sparse_options),
    StrategyEntry("zero-3", lambda s, c: s.replicas.zero == 3, _synchronous_check, _build_fully_sharded,
                  options=_replica_options),
    StrategyEntry("expert-parallel", lambda s, c: s.ep > 1, _synchronous_check, _build_expert_parallel),
    StrategyEntry("data-parallel", lambda s, c: True, _synchronous_check, _build_data_parallel,
                  options=_replica_options),
)


def resolve(strategy: Strategy, config: TrainConfig, world: int, *, custom_forward: bool = False,
            custom_loss: bool = False,
            pretrained: bool = False, model: nn.Module | None = None, example: Example | None = None,
            plan: Plan | None = None, model_name: str | None = None,
            strategies: Sequence[StrategyEntry] | None = None) -> Resolved:
    """Every check that needs no communication, in one place; the same error on every rank and in the CLI.

    Field values first (Strategy.resolved), then the rule table (config/rules.py: what combines with
    what), then the chosen entry's own check. `--strategy auto` and `--plan` become a concrete strategy
    here first (search/auto.py): the search needs `model` and `example` (the traced call of one sample);
    a plan is checked against them. `strategies`: the entries to choose from (default STRATEGIES; tests
    put an oracle engine in front).
    """
    config.validate()
    searched = strategy.planning.mode == "auto" and not strategy.planning.plan
    # field errors first, as for any strategy (the search picks the degrees left open, so not their product)
    (dataclasses.replace(strategy, dp=None, tp=1, pp=1) if searched else strategy).resolved(world)
    check_rules(Setup(strategy, config, world, custom_forward, pretrained, custom_loss),
                phase="search")  # what it may search
    choices = dict(world=world, custom_forward=custom_forward, pretrained=pretrained, custom_loss=custom_loss,
                   strategies=strategies)

    def accept(candidate: Strategy, candidate_config: TrainConfig) -> None:
        resolved = candidate.resolved(world)
        entry, _, _ = _entry_and_check(resolved, candidate_config, **choices)
        if model is not None:  # e.g. no --tp-subbatches for a model with BatchNorm
            _check_running_stats(model, entry, resolved, world)

    strategy, config, plan = resolve_choice(strategy, config, world, model=model, example=example, plan=plan,
                                            model_name=model_name, accept=accept)
    strategy = with_auto_shares(strategy.resolved(world), world)
    entry, config, accumulation = _entry_and_check(strategy, config, **choices)
    if model is not None:
        _check_running_stats(model, entry, strategy, world)
    return Resolved(entry=entry, strategy=strategy, config=config, accumulation=accumulation, plan=plan)


def pick_entry(strategy: Strategy, config: TrainConfig,
               strategies: Sequence[StrategyEntry] | None = None) -> StrategyEntry:
    """The first entry of `strategies` (default STRATEGIES) that applies."""
    for entry in STRATEGIES if strategies is None else strategies:
        if entry.applies(strategy, config):
            return entry
    names = ", ".join(e.name for e in strategies or ())
    raise ConfigError(f"no strategy entry applies to dp={strategy.dp} tp={strategy.tp} pp={strategy.pp} "
                      f"dp_mode={strategy.replicas.mode}; the entries given were: {names or 'none'}")


REPLAYING_ENTRIES = ("pipeline", "zero-3", "expert-parallel", "data-parallel")  # their engines keep BatchNorm statistics exactly


def _check_running_stats(model: nn.Module, entry: StrategyEntry, strategy: Strategy, world: int) -> None:
    """Layers with running statistics the chosen strategy cannot keep as one process does: refused here."""
    layout = f"strategy {entry.name} (dp={strategy.dp} tp={strategy.stage_tp or strategy.tp} pp={strategy.pp})"
    check_running_stats(model, layout=layout, replays=entry.name in REPLAYING_ENTRIES, processes=world)
    if strategy.replicas.shares != "even" and batch_norm_layers(model):
        raise ConfigError(f"--dp-shares {strategy.replicas.shares} with a model whose layers keep running statistics "
                          f"(BatchNorm): their replay over replicas assumes equal micro-batch counts; use "
                          f"--dp-shares even")
    check_batch_norm_subbatches(model, strategy.pipeline.tp_subbatches)


def _entry_and_check(strategy: Strategy, config: TrainConfig, *, world: int, custom_forward: bool,
                     pretrained: bool, custom_loss: bool, strategies: Sequence[StrategyEntry] | None,
                     ) -> tuple[StrategyEntry, TrainConfig, int]:
    check_rules(Setup(strategy, config, world, custom_forward, pretrained, custom_loss))
    entry = pick_entry(strategy, config, strategies)
    config, accumulation = entry.check(Request(strategy, config, world, custom_forward))
    return entry, config, accumulation
