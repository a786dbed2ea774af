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
  where no core would idle during the backward (a CPU host whose ranks' threads outnumber
  its cores), one bucket instead, reduced as the backward ends (`overlap_pays`);
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

import os
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from .buckets import FlatBucket, HookedBuckets, attach_grad, group_by_size, trainable_once


BUCKET_MB, FIRST_BUCKET_MB = 25.0, 1.0  # where overlapping pays: a small first bucket starts communication early


def overlap_pays(device: torch.device) -> bool:
    """Whether reducing a bucket while the backward still runs can hide the reduction.

    Not on a CPU host whose ranks' threads outnumber its cores (LOCAL_WORLD_SIZE x torch's threads > the cores
    this process may run on): there no core idles during the backward, so a reduction started early only competes
    with the ranks' compute (gloo runs it on a thread of its own, scheduled against them). One reduction as the
    backward ends measured no slower there, and faster where there are many buckets (benchmarks/dp_overlap.py, 4
    ranks on 2 cores, medians of interleaved steps): gpt-small, 16 buckets when overlapped, 3.00 s against 3.07 s
    (0.980); gpt-mini, 2 buckets, 156.5 against 157.1 ms (0.996, within the noise)."""
    if device.type != "cpu":
        return True
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    local = os.environ.get("LOCAL_WORLD_SIZE", "1")  # the ranks on this host, as torchrun and autopar's launcher say
    return (int(local) if local.isdigit() else 1) * torch.get_num_threads() <= cores


class GradientSynchronizer(HookedBuckets):
    """Sums gradients over `group` in buckets, overlapping communication with backward where that pays."""

    def __init__(self, params: Iterable[nn.Parameter], group: dist.ProcessGroup, *, bucket_mb: float | None = None,
                 first_bucket_mb: float | None = None):
        """`bucket_mb` / `first_bucket_mb` unset: BUCKET_MB / FIRST_BUCKET_MB where overlap_pays, else one
        bucket of everything (reduced when the backward's last gradient arrives)."""
        self.group = group
        self.world = dist.get_world_size(group)
        params = trainable_once(params)
        if bucket_mb is None and first_bucket_mb is None and params and not overlap_pays(params[0].device):
            cap = first_cap = sum(p.numel() * p.element_size() for p in params)
        else:
            bucket_mb = BUCKET_MB if bucket_mb is None else bucket_mb
            first_bucket_mb = FIRST_BUCKET_MB if first_bucket_mb is None else first_bucket_mb
            cap, first_cap = int(bucket_mb * 2**20), int(min(first_bucket_mb, bucket_mb) * 2**20)
        groups = group_by_size(list(reversed(params)), cap, first_cap)
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
