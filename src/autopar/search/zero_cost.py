"""The data-parallel communication a step exposes under each ZeRO level, as the runtime does it.

    zero 0   bucketed all-reduce of the gradients, overlapped with the last backward
             (only what outlasts it, or the last bucket, shows)                 data_parallel/grad_sync.py
    zero 1   reduce-scatter of the gradients into each replica's shard, overlapped the same way, then
             the all-gather of the updated parameters after the optimizer step (not overlapped: the
             next forward needs them); on gloo the fp32 gradients are all-reduced instead (gloo's
             reduce-scatter is the slower of the two there), so priced as zero 0's all-reduce
             + the all-gather                                                    zero/grads.py, optimizer.py
    zero 2   a reduce-scatter (on every backend), then the all-gather; the data-parallel engine
             (pp = 1) also reduce-scatters every earlier micro-batch, one whole reduce-scatter each,
             counted as exposed (conservative: on CPU the collective competes with the compute it
             would overlap)
    zero 3   FSDP2 per unit (train/fsdp_engine.py; a block under dp alone, the stage with pp or tp):
             every micro-batch all-gathers each unit's parameters in forward and again in backward,
             prefetching the next unit's during the current one's compute (only what outlasts it shows,
             plus the first unit's), and the last micro-batch's backward reduce-scatters each unit's
             gradients, one call per unit, overlapped like zero 1's

Each collective is priced by the cluster's own figure for it (cluster.py): on a calibrated cluster the
measured wall time of that very call per group size (gloo's reduce-scatter costs 0.9-2x its all-reduce of the
same buffer and its all-gather 0.5-1.5x, not the ring's 0.5: benchmarks/gloo_collectives.py), else ring
volumes: all-reduce 2(n-1)/n, reduce-scatter and all-gather (n-1)/n of the bytes, so that zero 1/2 move what
zero 0 moves and zero 3 half again as much (the ZeRO paper's 1.5x). On a CPU cluster (`hide_gathers=False`:
a calibrated one, with cores_per_node, or the cpu-local preset; ranks time-share cores, and gloo's copies take
the cycles the compute would use) nothing hides the gathers: benchmarks/zero_memory.py measures FSDP2 well
behind plain all-reduce there (docs/benchmarks.md).

Beside the communication, zero 1/2 step only their shard (the optimizer's time / dp) and then copy
the all-gathered buckets into the parameters (`copy_bytes_per_param`, memory-bandwidth bound).
"""

from __future__ import annotations

from collections.abc import Sequence

from .cluster import Cluster
from .memory import BUCKET_BYTES


def data_parallel_exposed_s(cluster: Cluster, *, zero: int, dp: int, span: int, param_elements: float,
                            element_bytes: float, overlap_s: float, num_microbatches: int = 1,
                            per_micro_batch: bool = False, block_params: Sequence[float] = (),
                            block_forward_s: Sequence[float] = (), block_backward_s: Sequence[float] = (),
                            hide_gathers: bool = True) -> float:
    """Seconds of data-parallel communication left on the step's critical path for one rank.

    `element_bytes` is what a gradient and a parameter weigh on the wire (4 fp32, 2 under bf16 master
    weights); `overlap_s` the last backward the gradient reduction can hide behind; `per_micro_batch`
    says ZeRO-2 reduces every micro-batch (the data-parallel engine). The unit lists (zero 3) are this rank's
    FSDP2 units' parameter counts and forward / backward seconds of one micro-batch, in forward order; without
    them, one unit of all the parameters.
    """
    nbytes = param_elements * element_bytes
    if dp <= 1 or nbytes <= 0:
        return 0.0
    units = [p * element_bytes for p in block_params] if zero == 3 and block_params else [nbytes]
    reduce = cluster.all_reduce if zero == 0 or (zero == 1 and zero1_all_reduces(cluster, element_bytes)) else \
        cluster.reduce_scatter
    whole = sum(reduce(u, dp, span=span) for u in units)  # one call per bucket (~ the whole) or per FSDP2 unit
    last = reduce(min(BUCKET_BYTES, units[0]), dp, span=span)  # FSDP2's last: the root unit, first in forward
    reduction = max(last, whole - overlap_s)
    if zero == 0:
        return reduction
    if zero in (1, 2):
        earlier = (num_microbatches - 1) * whole if zero == 2 and per_micro_batch else 0.0
        return reduction + earlier + cluster.all_gather(nbytes, dp, span=span)
    if zero == 3:
        gathers = [cluster.all_gather(u, dp, span=span) for u in units]
        if not hide_gathers or not block_params:
            return reduction + num_microbatches * 2 * sum(gathers)
        forward = gathers[0] + sum(max(0.0, g - f) for g, f in zip(gathers[1:], block_forward_s))
        backward_order, times = gathers[::-1], list(block_backward_s)[::-1]
        backward = backward_order[0] + sum(max(0.0, g - b) for g, b in zip(backward_order[1:], times))
        return reduction + num_microbatches * (forward + backward)
    raise ValueError(f"zero level must be 0, 1, 2 or 3, got {zero!r}")


def zero1_all_reduces(cluster: Cluster, element_bytes: float) -> bool:
    """Whether ZeRO-1 reduces its gradients by an all-reduce rather than a reduce-scatter: fp32 buckets on gloo
    (zero/grads.py `reduce_by_all_reduce`)."""
    return cluster.gloo and element_bytes == 4


def copy_bytes_per_param(zero: int, element_bytes: float) -> float:
    """Bytes per parameter ZeRO-1/2 move after the step: the gathered bucket read, the parameter written."""
    return 2 * element_bytes if zero in (1, 2) else 0.0


def data_parallel_cpu_s(cluster: Cluster, *, zero: int, dp: int, nbytes: float, num_microbatches: int = 1,
                        per_micro_batch: bool = False, unit_bytes: Sequence[float] = (),
                        element_bytes: float = 4.0) -> float:
    """CPU seconds, summed over one dp group, of the data-parallel collectives of one step (time-sharing ranks),
    as the runtime runs them on gloo, each at its calibrated CPU (Cluster.all_reduce_cpu, reduce_scatter_cpu,
    all_gather_cpu: gloo's reduce-scatter costs several all-reduces' CPU, benchmarks/gloo_collectives.py):
    zero 0 one all-reduce; zero 1 an all-reduce of the whole gradients too (zero/grads.py, for that reason; a
    reduce-scatter with bf16 buckets, `element_bytes` 2), then the all-gather of the updated parameters
    (zero/optimizer.py); zero 2 a reduce-scatter, per micro-batch under the data-parallel engine and once with a
    pipeline, then the all-gather; zero 3 a reduce-scatter and every micro-batch's two all-gathers of the
    parameters.

    `unit_bytes` (zero 3): the bytes of each FSDP2 unit this rank holds (a block under dp alone, the whole stage
    with pp or tp). FSDP2 runs its collectives per unit, so each pays the collective's fixed cost. Without it,
    one unit of `nbytes`."""
    if dp <= 1 or nbytes <= 0:
        return 0.0
    if zero == 0:
        return cluster.all_reduce_cpu(nbytes, dp)
    gather = cluster.all_gather_cpu(nbytes, dp)
    if zero == 1:
        return (cluster.all_reduce_cpu if element_bytes == 4 else cluster.reduce_scatter_cpu)(nbytes, dp) + gather
    if zero == 2:
        return (num_microbatches if per_micro_batch else 1) * cluster.reduce_scatter_cpu(nbytes, dp) + gather
    units = list(unit_bytes) or [nbytes]
    return sum(cluster.reduce_scatter_cpu(u, dp) + 2 * num_microbatches * cluster.all_gather_cpu(u, dp)
               for u in units)
