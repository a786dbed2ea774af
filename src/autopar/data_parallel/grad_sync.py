"""Gradient synchronisation across data-parallel replicas: bucketed, overlapped with backward.

Why our own instead of wrapping torch's DistributedDataParallel: DDP ties the gradient
reduction to *its* forward (it prepares the reducer in `DDP.forward`), which does not fit
the pipeline runtime to come, where one stage runs many forwards and backwards per step
in an order the schedule decides and sync must happen once, after the last micro-batch
backward; nor the sparse-embedding and decentralised modes, which must take some
parameters out of the dense all-reduce. Here the reduction is driven only by gradient
hooks and an explicit `finish()`, so any runtime can use it. `benchmarks/dp_allreduce.py`
measures it against DDP on the same model in one run (docs/benchmarks.md).

How it works:
- parameters go into flat buckets of about `bucket_mb` (the first `first_bucket_mb`, so
  that communication starts early in backward), each `.grad` a view into its bucket,
  counted by gradient hooks and launched in index order: buckets.py, shared with ZeRO;
- when a bucket is complete its asynchronous all-reduce starts while backward continues
  (nothing is copied before or after it: autograd accumulated into the bucket);
- while `sync` is off (accumulating micro-batches) hooks only let gradients accumulate:
  one all-reduce per optimizer step;
- `finish()` launches any bucket left (parameters that got no gradient keep a zero
  gradient, so every rank still reduces the same buffers) and waits for all.

Gradients are SUMMED: the trainer scales each rank's loss so that the sum over replicas
is the global-batch mean (see train/loss.py), which also keeps token-weighted losses exact
when replicas hold different numbers of target tokens.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch.distributed as dist
from torch import nn

from .buckets import FlatBucket, HookedBuckets, attach_grad, group_by_size, trainable_once


class GradientSynchronizer(HookedBuckets):
    """Sums gradients over `group` in buckets, overlapping communication with backward."""

    def __init__(self, params: Iterable[nn.Parameter], group: dist.ProcessGroup, *, bucket_mb: float = 25.0,
                 first_bucket_mb: float = 1.0):
        self.group = group
        self.world = dist.get_world_size(group)
        params = trainable_once(params)
        groups = group_by_size(list(reversed(params)), int(bucket_mb * 2**20),
                               int(min(first_bucket_mb, bucket_mb) * 2**20))
        buckets = [FlatBucket.of(members) for members in groups]
        for bucket in buckets:
            bucket.allocate()
        self._track(params, buckets, hooks=self.world > 1)
        self.zero_grad()

    def zero_grad(self) -> None:
        """Zero every gradient and (re)attach it to its bucket view; use instead of optimizer.zero_grad."""
        self._settle()
        for bucket in self.buckets:
            bucket.full.zero_()
            for p, view in zip(bucket.params, bucket.views):
                p.grad = view

    def _take(self, param: nn.Parameter, bucket: FlatBucket, position: int) -> bool:
        if not self.sync:
            return False
        attach_grad(param, bucket.views[position], accumulate=False)
        return True

    def _launch(self, bucket: FlatBucket) -> None:
        bucket.work = dist.all_reduce(bucket.full, group=self.group, async_op=True)

    def finish(self) -> None:
        """Launch what backward left and wait for every bucket: gradients are then summed."""
        if self.world == 1:
            return
        for bucket in self.buckets[self._next_launch:]:  # not yet in flight
            for p, view in zip(bucket.params, bucket.views):
                attach_grad(p, view, accumulate=False)
            bucket.ready = len(bucket.params)
        self._launch_ready()
        self._settle()  # ready for the next step, even if the caller skips zero_grad()
