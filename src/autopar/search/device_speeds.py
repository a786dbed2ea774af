"""What a mixed cluster's device speeds mean for a run: replica shares and pipeline stage rates.

`--dp-shares auto` becomes one weight per replica, its device's speed (the arithmetic, whole micro-batches
by largest remainder, is data/shares.py's); `--partition time` on a cluster with [[devices]] speeds cuts
stages in proportion to the rate of the devices each stage runs on. Both read the --cluster file once,
before ranks start (every rank reads the same file, so every rank cuts alike).
"""

from __future__ import annotations

import dataclasses

from ..config import Strategy, TrainConfig
from ..data.shares import AUTO, EVEN, parse_weights, split_samples
from ..errors import ConfigError
from .cluster import resolve_cluster
from .hetero_cluster import group_speed, is_heterogeneous


def with_auto_shares(strategy: Strategy, world: int) -> Strategy:
    """`strategy` (resolved) with --dp-shares auto replaced by the replicas' device speeds, e.g. "1,1,0.5,0.5"."""
    if strategy.replicas.shares != AUTO:
        return strategy
    if not strategy.planning.cluster:
        raise ConfigError("--dp-shares auto takes each replica's speed from the cluster file's [[devices]] "
                          "tables, but no --cluster was given; give --cluster FILE (docs/features/"
                          "heterogeneous.md) or explicit weights, e.g. --dp-shares 2,1")
    cluster = resolve_cluster(strategy.planning.cluster)
    if not cluster.devices:
        raise ConfigError(f"--dp-shares auto: cluster {cluster.name!r} lists no [[devices]] speeds, so every "
                          f"replica is equally fast; add [[devices]] tables or use --dp-shares even")
    if cluster.num_devices != world:
        raise ConfigError(f"--dp-shares auto: cluster {cluster.name!r} describes {cluster.num_devices} devices "
                          f"but the job has {world} processes; describe the devices the job runs on")
    dp, tp = strategy.dp, strategy.tp  # replica d: ranks (p * dp + d) * tp + t of the (pp, dp, tp) mesh
    weights = [group_speed(cluster, [(p * dp + d) * tp + t for p in range(strategy.pp) for t in range(tp)])
               for d in range(dp)]
    text = ",".join(f"{w:g}" for w in weights)
    return dataclasses.replace(strategy, replicas=dataclasses.replace(strategy.replicas, shares=text))


def replica_shares(strategy: Strategy, config: TrainConfig) -> tuple[int, ...] | None:
    """Samples per replica of each global batch (None: equal); --dp-shares auto must be resolved first."""
    if strategy.replicas.shares == EVEN:
        return None
    if strategy.replicas.shares == AUTO:
        raise ConfigError("--dp-shares auto is resolved from the cluster before training (with_auto_shares)")
    weights = parse_weights(strategy.replicas.shares, strategy.dp)
    return split_samples(weights, config.global_batch_size, config.micro_batch_size)


def stage_speeds(strategy: Strategy) -> tuple[float, ...] | None:
    """Each pipeline stage's relative rate, the slowest of the ranks that run it in the (pp, dp, tp) mesh
    (`strategy` resolved);
    None when the --cluster file gives no speeds, or the layout is not one stage per rank group (--chunks,
    --stage-tp, --cp), or the partition does not balance time."""
    if not strategy.planning.cluster or strategy.pp < 2 or strategy.pipeline.partition != "time" or \
            strategy.pipeline.chunks != 1 or strategy.stage_tp is not None or strategy.cp != 1:
        return None
    cluster = resolve_cluster(strategy.planning.cluster)
    if not cluster.devices:
        return None
    world = strategy.dp * strategy.tp * strategy.pp
    if cluster.num_devices != world:
        raise ConfigError(f"cluster {cluster.name!r} describes {cluster.num_devices} devices but the job has "
                          f"{world} processes; describe the devices the job runs on")
    per_stage = world // strategy.pp  # the mesh is pp-outermost: stage p holds ranks p*per_stage..
    return tuple(group_speed(cluster, range(p * per_stage, (p + 1) * per_stage)) for p in range(strategy.pp))


__all__ = ["with_auto_shares", "replica_shares", "stage_speeds", "is_heterogeneous"]
