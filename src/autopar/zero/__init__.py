"""ZeRO: optimizer state, gradients (and parameters) sharded over data-parallel replicas."""

from .grads import ShardedBucket, ShardedGradients
from .optimizer import ShardedOptimizer

__all__ = ["ShardedBucket", "ShardedGradients", "ShardedOptimizer"]


def gradient_sync(params, group, *, zero: int, master_weights: bool, deferred=(), per_micro_batch: bool = False,
                  device=None):
    """The gradient path of a replica: plain bucketed all-reduce, or ZeRO's shards (fp32 masters under bf16)."""
    if zero == 0 and not master_weights:
        from ..data_parallel import GradientSynchronizer
        return GradientSynchronizer(params, group)
    return ShardedGradients(params, group, level=zero, deferred=deferred, per_micro_batch=per_micro_batch,
                            device=device)


def to_compute_dtype(params, dtype) -> None:
    """Parameters stored in the compute dtype (bf16) in place; the fp32 masters live in ShardedOptimizer."""
    for p in params:
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
