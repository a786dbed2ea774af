"""Which device runs which mesh position: keep the heavy traffic on fast links, the light on slow ones.

On a mixed cluster (hetero_cluster.py) the same degrees can run very differently depending on where each
rank lands. Yuan et al. (NeurIPS'22, decentralized training in heterogeneous environments) split the
question the way this module does: data-parallel all-reduces move every gradient each step and tensor
parallelism all-reduces every layer, while a pipeline edge carries one activation per micro-batch, so dp
and tp groups should sit on the fastest links and the pipeline's edges take the slow ones; and a group
computes at its slowest member's pace, so slow devices should share a stage (or a replica with a smaller
batch share) rather than each holding back a different one.

A placement is `order`: mesh position k of the (pp, dp, tp) mesh (k = (p * dp + d) * tp + t, the rank
numbering of mesh.py) runs on device order[k]. It is scored with the step model's terms per device and
per link: each stage's compute at its tp group's slowest device, its tp all-reduces and its boundary
sends over the links it really uses, a 1F1B pipeline per replica ((m - 1) times its slowest stage plus
the fill), then each stage's dp all-reduce as a ring over its members. The search tries every order for
worlds up to EXHAUSTIVE_WORLD devices, and pairwise swaps from the rank order beyond that.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

from .cluster import Cluster
from .hetero_cluster import device_speed, group_all_reduce, link_between

EXHAUSTIVE_WORLD = 8  # 8! = 40320 orders, about a second of scoring


@dataclass(frozen=True)
class Workload:
    """What one step of a layout computes and moves, priced on a device of speed 1."""

    dp: int
    pp: int
    tp: int
    num_microbatches: int  # per replica, with even shares
    stage_compute_s: tuple[float, ...]  # forward + backward of one micro-batch, whole stage (tp = 1)
    boundary_bytes: tuple[float, ...]  # [p]: activations out of stage p and their gradients back, per micro-batch
    grad_bytes: tuple[float, ...]  # [p]: gradient bytes one tp rank of stage p sums over its dp group
    tp_bytes: tuple[float, ...] = ()  # [p]: tp all-reduce payload per micro-batch (forward + backward); empty: 0
    uneven_shares: bool = False  # replicas take micro-batches in proportion to their pace (--dp-shares)


@dataclass(frozen=True)
class Placement:
    order: tuple[int, ...]  # order[k]: the device at mesh position k
    step_s: float
    rank_order_step_s: float  # the same layout with rank k on device k

    def describe(self, work: Workload) -> str:
        """Stage by stage, the devices of each replica: 'stage 0: [0 1] [2 3]; stage 1: ...'."""
        parts = []
        for p in range(work.pp):
            groups = [" ".join(str(self.order[(p * work.dp + d) * work.tp + t]) for t in range(work.tp))
                      for d in range(work.dp)]
            parts.append(f"stage {p}: " + " ".join(f"[{g}]" for g in groups))
        return "; ".join(parts)


def _position(work: Workload, p: int, d: int, t: int) -> int:
    return (p * work.dp + d) * work.tp + t


def _shares(paces: list[float], total: int) -> list[int]:
    """Micro-batches per replica in proportion to 1 / pace (at least one each), summing to `total`."""
    rates = [1 / p for p in paces]
    ideal = [r / sum(rates) * total for r in rates]
    counts = [max(1, int(x)) for x in ideal]
    while sum(counts) > total:
        counts[max(range(len(counts)), key=lambda k: counts[k] - ideal[k])] -= 1
    for k in sorted(range(len(counts)), key=lambda k: counts[k] - ideal[k])[:total - sum(counts)]:
        counts[k] += 1
    return counts


def step_time(cluster: Cluster, work: Workload, order: tuple[int, ...] | list[int]) -> float:
    """Predicted seconds of one step of `work` placed by `order` (module docstring)."""
    stage_times = []  # [d][p]: one micro-batch through stage p of replica d, its send included
    for d in range(work.dp):
        row = []
        for p in range(work.pp):
            devices = [order[_position(work, p, d, t)] for t in range(work.tp)]
            speed = min(device_speed(cluster, x) for x in devices)
            t_stage = work.stage_compute_s[p] / work.tp / speed
            if work.tp > 1 and work.tp_bytes:
                t_stage += group_all_reduce(cluster, work.tp_bytes[p], devices)
            if p + 1 < work.pp:
                nbytes = work.boundary_bytes[p] / work.tp  # each tp rank sends its slice to its peer
                t_stage += max(link_between(cluster, order[_position(work, p, d, t)],
                                            order[_position(work, p + 1, d, t)]).p2p(nbytes) for t in range(work.tp))
            row.append(t_stage)
        stage_times.append(row)
    total = work.num_microbatches * work.dp
    counts = _shares([max(r) for r in stage_times], total) if work.uneven_shares else \
        [work.num_microbatches] * work.dp
    pipeline = max(sum(r) + (m - 1) * max(r) for r, m in zip(stage_times, counts))
    sync = 0.0
    if work.dp > 1:
        sync = max(group_all_reduce(cluster, work.grad_bytes[p], [order[_position(work, p, d, t)]
                                                                 for d in range(work.dp)])
                   for p in range(work.pp) for t in range(work.tp))
    return pipeline + sync


def best_placement(cluster: Cluster, work: Workload, start: tuple[int, ...] | None = None) -> Placement:
    """The order with the least predicted step time (every order up to EXHAUSTIVE_WORLD devices; pairwise
    swaps from `start`, default the rank order, beyond). Ties keep the earliest order, so a homogeneous
    cluster keeps ranks where they are."""
    world = work.dp * work.pp * work.tp
    identity = tuple(range(world))
    baseline = step_time(cluster, work, identity)
    best = tuple(start) if start is not None and world > EXHAUSTIVE_WORLD else identity
    best_s = step_time(cluster, work, best)
    if world <= EXHAUSTIVE_WORLD:
        for order in itertools.permutations(range(world)):
            s = step_time(cluster, work, order)
            if s < best_s * (1 - 1e-9):
                best, best_s = order, s
    else:
        improved = True
        while improved:
            improved = False
            for i, j in itertools.combinations(range(world), 2):
                trial = list(best)
                trial[i], trial[j] = trial[j], trial[i]
                s = step_time(cluster, work, trial)
                if s < best_s * (1 - 1e-9):
                    best, best_s, improved = tuple(trial), s, True
    return Placement(order=best, step_s=best_s, rank_order_step_s=baseline)


def workload_of(estimate, model) -> Workload:
    """The Workload of a search Estimate under a StepModel (cost.py): per-stage FLOPs at the cluster's rate,
    boundary bytes at the cuts, gradient bytes per stage (fp32, one tp rank's share)."""
    c, profile, cluster = estimate.candidate, model.profile, model.cluster
    bounds = list(estimate.bounds)
    rate = cluster.rate("bf16" if model.dtype.startswith("bf16") else "fp32")
    mbs = c.micro_batch_size
    stages = list(zip(bounds, bounds[1:]))[:c.pp] if len(bounds) == c.pp + 1 else \
        [(bounds[0], bounds[-1])] * c.pp
    compute = tuple(3 * sum(profile.flops[a:b]) * mbs / rate for a, b in stages)
    boundary = tuple(2 * profile.boundary_bytes[b - 1] * mbs if b - 1 < len(profile.boundary_bytes) else 0.0
                     for _, b in stages)  # the last stage sends nothing
    grads = tuple(4 * sum(profile.params[a:b]) / c.tp for a, b in stages)
    tp_profile = profile.tp.get(c.tp)
    tp_bytes = tuple(2 * sum(tp_profile.allreduce_bytes[a:b]) * mbs for a, b in stages) if tp_profile else ()
    return Workload(dp=c.dp, pp=c.pp, tp=c.tp, num_microbatches=c.num_microbatches, stage_compute_s=compute,
                    boundary_bytes=boundary, grad_bytes=grads, tp_bytes=tp_bytes)


def workload_from_profile(profile, cluster: Cluster, *, dp: int, pp: int, micro_batch_size: int,
                          num_microbatches: int, dtype: str = "fp32", stage_speeds=None,
                          uneven_shares: bool = False) -> Workload:
    """A Workload for degrees given by hand (tp = 1): stages cut by the PipeDream DP on FLOPs, each divided
    by its stage's speed when `stage_speeds` is given (what --partition time does on a mixed cluster)."""
    from ..partition.algorithms import min_max_time
    bounds = min_max_time(list(profile.flops), pp, speeds=stage_speeds) if pp > 1 else [0, len(profile.flops)]
    stages = list(zip(bounds, bounds[1:]))
    rate = cluster.rate(dtype)
    return Workload(dp=dp, pp=pp, tp=1, num_microbatches=num_microbatches,
                    stage_compute_s=tuple(3 * sum(profile.flops[a:b]) * micro_batch_size / rate for a, b in stages),
                    boundary_bytes=tuple(2 * profile.boundary_bytes[b - 1] * micro_batch_size
                                         if b - 1 < len(profile.boundary_bytes) else 0.0 for _, b in stages),
                    grad_bytes=tuple(4 * sum(profile.params[a:b]) for a, b in stages), uneven_shares=uneven_shares)


def placement_lines(top, model) -> list[str]:
    """What `plan --auto` prints for a mixed cluster: each top plan's best placement and its predicted gain."""
    lines = []
    for i, estimate in enumerate(top, 1):
        work = workload_of(estimate, model)
        if work.dp * work.pp * work.tp != model.cluster.num_devices or estimate.candidate.chunks != 1:
            continue
        c = estimate.candidate
        if work.dp > 1 and work.tp == 1 and c.schedule in ("1f1b", "gpipe", "eager-1f1b") and not c.zero:
            work = dataclasses.replace(work, uneven_shares=True)  # --dp-shares (rule dp-shares-data-parallel)
        placed = best_placement(model.cluster, work)
        naive = step_time(model.cluster, dataclasses.replace(work, uneven_shares=False), range(len(placed.order)))
        gain = naive / placed.step_s if placed.step_s else 1.0
        shares = ""
        if work.uneven_shares:
            speeds = [min(device_speed(model.cluster, placed.order[_position(work, p, d, t)])
                          for p in range(work.pp) for t in range(work.tp)) for d in range(work.dp)]
            shares = f"; with --dp-shares {','.join(f'{v:g}' for v in speeds)}"
        lines.append(f"placement #{i}: {placed.describe(work)} (devices by mesh position{shares}; predicted "
                     f"{placed.step_s * 1e3:.2f} ms per step vs {naive * 1e3:.2f} ms in rank order"
                     f"{' with even shares' if work.uneven_shares else ''}, {gain:.2f}x)")
    return lines
