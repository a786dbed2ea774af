"""The step model on a mixed cluster: every candidate priced at its own devices' speeds, shares and cut.

StepModel (cost.py) prices every device alike. On a cluster whose [[devices]] speeds differ
(hetero_cluster.py) that ranks layouts wrongly: a data-parallel replica on half-speed devices takes twice
as long unless it gets a smaller batch share, and a pipeline stage on them twice as long unless the cut
gives it less work. ClusterStepModel prices what the runtime would run with ranks in rank order (the
launcher keeps rank k on device k):

- replica d's stage p computes at the slowest speed among its tp ranks, the ranks (p * dp + d) * tp + t
  of the (pp, dp, tp) mesh;
- the replicas take the batch shares `--dp-shares auto` gives (each replica's slowest device's speed,
  split in whole micro-batches by data/shares.py) where rule `dp-shares-data-parallel` allows shares
  (dp > 1, tp = 1, one chunk, no ZeRO, a 1f1b, gpipe or eager-1f1b schedule), else even ones;
- `--partition time` cuts with each stage's compute divided by its slowest device's speed (what
  device_speeds.stage_speeds makes the runtime do);
- each replica's pipeline is simulated with its own micro-batch count, stage speeds and the [[links]]
  its boundary sends really cross; the step waits for the slowest replica, then the gradient sum and the
  update as the homogeneous model prices them, plus what the [[links]] add to each stage's dp ring.

Layouts beyond that (chunks, ep, sp, cp, compile) run every rank in lock-step: their compute is priced
at the slowest device's pace. A cluster without speeds other than 1 keeps StepModel's numbers exactly.
"""

from __future__ import annotations

import copy
import dataclasses
import os

from ..data.shares import split_samples
from ..errors import ConfigError
from ..partition import algorithms
from . import dimensions
from .calibration_cache import CLUSTER_ENV
from .candidate import Candidate, Estimate
from .cluster import Cluster, resolve_cluster
from .cost import StepModel
from .hetero_cluster import device_memory_gb, device_speed, group_all_reduce, group_speed, link_between
from .timeline import StageCosts

SHARE_SCHEDULES = ("1f1b", "gpipe", "eager-1f1b")  # rule dp-shares-data-parallel's schedules


def has_speeds(cluster: Cluster) -> bool:
    """Whether the cluster states device speeds that differ from 1 (then the search prices per device)."""
    return any(d.speed != 1.0 for d in cluster.devices)


def step_model(profile, cluster: Cluster, **kwargs) -> StepModel:
    """The search's step model for `cluster`: per-device pricing where it has speeds, else StepModel itself."""
    return (ClusterStepModel if has_speeds(cluster) else StepModel)(profile, cluster, **kwargs)


def even_shares(model: StepModel) -> StepModel:
    """`model` pricing even shares: the default layout, what runs without --strategy auto (no --dp-shares)."""
    if not isinstance(model, ClusterStepModel) or not model.uneven_shares:
        return model
    even = copy.copy(model)  # the caches hold nothing that depends on the shares
    even.uneven_shares = False
    return even


def plan_cluster(record: dict, cluster: str | None, source: str) -> str | None:
    """The cluster file a run of `record` must read (its --cluster, else $AUTOPAR_CLUSTER, as the search did): a
    plan whose cut was balanced on stage speeds runs that cut only where the run reads them
    (device_speeds.stage_speeds). Without either, refused rather than run an even cut the plan did not price."""
    mixed, strategy = record.get("cluster_plan") or {}, record.get("strategy", {})
    if cluster or strategy.get("pp", 1) < 2 or strategy.get("partition", "time") != "time" or \
            len(set(mixed.get("stage_speeds", ()))) < 2:
        return cluster
    spec = os.environ.get(CLUSTER_ENV)
    if spec and resolve_cluster(spec).name == record.get("cluster"):
        return spec
    raise ConfigError(f"{source} cuts its pipeline on the stage speeds {mixed['stage_speeds']} of cluster "
                      f"{record.get('cluster', '?')!r}, but this run has no --cluster; pass the cluster file the plan "
                      f"was made for (--cluster FILE), so the runtime cuts as the plan priced")


def shares_allowed(c: Candidate) -> bool:
    """Uneven batch shares run with this layout (rule dp-shares-data-parallel, the search's part of it)."""
    return c.dp > 1 and c.tp == 1 and c.chunks == 1 and c.zero == 0 and dimensions.is_plain(c) and \
        c.schedule in SHARE_SCHEDULES


def mesh_rank(c: Candidate, p: int, d: int, t: int) -> int:
    return (p * c.dp + d) * c.tp + t


class ClusterStepModel(StepModel):
    """StepModel whose estimates price each replica and stage at its devices' speeds (module docstring).

    Each estimate's `cluster_plan` says what the runtime must run to match the price: the batch shares
    (`dp_shares` weights and samples per replica), each stage's speed, the cut, and the device of each rank."""

    uneven_shares = True  # False: price even shares everywhere (what runs with --dp-shares even)

    def evaluate(self, c: Candidate) -> Estimate:
        if c.world != self.cluster.num_devices:
            return super().evaluate(c)
        if not dimensions.is_plain(c) or c.chunks != 1:
            return self._lock_step(super().evaluate(c))
        return self._per_device(c)

    def _lock_step(self, est: Estimate) -> Estimate:
        """Every rank waits for the slowest device each step: its compute stretched by 1 / slowest speed."""
        slow = min(device_speed(self.cluster, k) for k in range(self.cluster.num_devices))
        busy = est.parts.get("busy_s", est.parts.get("pipeline_s", 0.0))
        step = est.step_time_s + busy * (1 / slow - 1)
        plan = {"dp_shares": "even", "placement": list(range(self.cluster.num_devices)),
                "slowest_speed": slow}
        return dataclasses.replace(est, step_time_s=step, tokens_per_s=self._tokens() / step,
                                   parts={**est.parts, "cluster_step_s": step}, cluster_plan=plan)

    def _tokens(self) -> int:
        return self.global_batch_size * self.profile.seq_len

    def speeds(self, c: Candidate) -> list[list[float]]:
        """[d][p]: the pace of replica d's stage p, its slowest tp rank's device."""
        return [[group_speed(self.cluster, [mesh_rank(c, p, d, t) for t in range(c.tp)]) for p in range(c.pp)]
                for d in range(c.dp)]

    def cut(self, c: Candidate, stage_speeds: list[float]) -> tuple[int, ...]:
        """The speed-balanced time cut (partition/algorithms.py's DP with each stage's speed), else the usual."""
        if c.bounds is not None or c.pp == 1 or c.partition != "time":
            return c.bounds if c.bounds is not None else self.bounds(c.partition, c.tp, c.micro_batch_size, c.pp)
        forward, backward, _ = self.block_times(c.tp, c.micro_batch_size)
        link = self.cluster.intra_node
        transfer = [2 * link.p2p(b * c.micro_batch_size * self.boundary_scale) for b in self.profile.boundary_bytes]
        return tuple(algorithms.min_max_time([f + b for f, b in zip(forward, backward)], c.pp,
                                             transfer=[*transfer, 0.0], speeds=stage_speeds))

    def replica_microbatches(self, c: Candidate, replica_speeds: list[float]) -> tuple[list[int], str]:
        """Micro-batches per replica and the --dp-shares value that gives them (auto's weights, or even)."""
        if not self.uneven_shares or not shares_allowed(c) or len(set(replica_speeds)) == 1:
            return [c.num_microbatches] * c.dp, "even"
        samples = split_samples(tuple(replica_speeds), self.global_batch_size, c.micro_batch_size)
        return [s // c.micro_batch_size for s in samples], ",".join(f"{w:g}" for w in replica_speeds)

    def _per_device(self, c: Candidate) -> Estimate:
        cl = self.cluster
        speeds = self.speeds(c)
        stage_speeds = [min(speeds[d][p] for d in range(c.dp)) for p in range(c.pp)]
        replica_speeds = [min(row) for row in speeds]
        bounds = self.cut(c, stage_speeds)
        counts, shares = self.replica_microbatches(c, replica_speeds)
        spans = [(bounds[p], bounds[p + 1]) for p in range(c.pp)]
        # memory and the homogeneous tail (gradient sum, update) on the cut, with the largest replica's count
        base = super().evaluate(dataclasses.replace(c, bounds=tuple(bounds), num_microbatches=max(counts)))
        tail = max(0.0, base.parts["timeline_step_s"] - base.parts["pipeline_s"])
        recompute = frozenset(range(c.pp)) if c.recompute == "all" else frozenset()
        pipelines = []
        for d in range(c.dp):
            mine = dataclasses.replace(c, bounds=tuple(bounds), num_microbatches=counts[d])
            costs = self.replica_costs(mine, spans, base.recompute_blocks, d, speeds[d])
            pipelines.append(self.timeline(mine, recompute, costs).makespan)
        tail += self.slower_gradient_rings(c, spans)
        step = max(max(pipelines) + tail, base.parts.get("time_shared_s", 0.0))
        per_device = [base.memory_per_rank[k // (c.dp * c.tp)] for k in range(cl.num_devices)]
        fits = all(m <= cl.memory_bytes * device_memory_gb(cl, k) / cl.memory_per_device_gb
                   for k, m in enumerate(per_device))
        plan = {"dp_shares": shares, "microbatches_per_replica": counts, "replica_speeds": replica_speeds,
                "stage_speeds": stage_speeds, "stage_bounds": list(bounds),
                "placement": list(range(cl.num_devices))}
        return dataclasses.replace(base, candidate=c, step_time_s=step, tokens_per_s=self._tokens() / step,
                                   fits=fits, bounds=tuple(bounds), cluster_plan=plan,
                                   parts={**base.parts, "pipeline_s": max(pipelines), "cluster_step_s": step})

    def slower_gradient_rings(self, c: Candidate, spans: list[tuple[int, int]]) -> float:
        """Seconds the [[links]] add to the gradient sum: each stage's dp ring over the links its members really
        use, less the node links' ring the step model priced (0 without [[links]] or replicas)."""
        if not self.cluster.links or c.dp == 1:
            return 0.0
        params = self.profile.at_tp(c.tp).params
        extra = 0.0
        for p, (a, b) in enumerate(spans):
            nbytes = sum(params[a:b]) * self.param_bytes
            span = (c.dp - 1) * c.tp + 1  # ranks (p * dp + d) * tp + t: dp members tp apart
            homogeneous = self.cluster.all_reduce(nbytes, c.dp, span=span)
            extra = max(extra, *(group_all_reduce(self.cluster, nbytes, [mesh_rank(c, p, d, t) for d in range(c.dp)])
                                 - homogeneous for t in range(c.tp)))
        return extra

    def replica_costs(self, c: Candidate, spans: list[tuple[int, int]], blocks: tuple[int, ...], d: int,
                      speeds: list[float]) -> StageCosts:
        """Replica d's stage costs: compute at its stages' speeds, sends over the links its ranks really use."""
        costs = self.stage_costs(c, spans, blocks)

        def slower(values: tuple[float, ...]) -> tuple[float, ...]:
            return tuple(v / s for v, s in zip(values, speeds)) if values else values
        send = []
        for p, (_, b) in enumerate(spans):
            if b >= self.profile.num_blocks or p + 1 >= c.pp:
                send.append(0.0)
                continue
            nbytes = self.profile.boundary_bytes[b - 1] * c.micro_batch_size * self.boundary_scale
            send.append(max(link_between(self.cluster, mesh_rank(c, p, d, t), mesh_rank(c, p + 1, d, t)).p2p(nbytes)
                            for t in range(c.tp)))
        return StageCosts(slower(costs.forward), slower(costs.backward), slower(costs.recompute), tuple(send),
                          (0.0, *send[:-1]), slower(costs.backward_input), slower(costs.backward_weight))
