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
- parameters are grouped into buckets of about `bucket_mb`, in reverse registration
  order (roughly the order backward produces their gradients); the first bucket is kept
  small (`first_bucket_mb`) so that communication starts early in backward;
- each parameter's `.grad` is a view into its bucket's flat buffer, so autograd
  accumulates straight into the buffer and nothing is copied before or after the
  all-reduce (what DDP calls gradient_as_bucket_view);
- a post-accumulate-grad hook counts ready parameters; when a bucket is complete its
  asynchronous all-reduce starts while backward continues. Buckets are launched strictly
  in index order, so every rank issues the same collectives in the same order (gloo and
  NCCL require it) whatever order hooks fire in;
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
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    buffer: torch.Tensor
    views: list[torch.Tensor]
    ready: int = 0
    work: dist.Work | None = field(default=None, repr=False)


class GradientSynchronizer:
    """Sums gradients over `group` in buckets, overlapping communication with backward."""

    def __init__(self, params: Iterable[nn.Parameter], group: dist.ProcessGroup, *, bucket_mb: float = 25.0,
                 first_bucket_mb: float = 1.0):
        self.group = group
        self.world = dist.get_world_size(group)
        unique: dict[int, nn.Parameter] = {}
        for p in params:
            if p.requires_grad:
                unique.setdefault(id(p), p)
        self.params = list(unique.values())
        self.sync = True
        self._next_launch = 0
        self._buckets = self._make_buckets(list(reversed(self.params)), int(bucket_mb * 2**20),
                                           int(min(first_bucket_mb, bucket_mb) * 2**20))
        self._slot = {id(p): (i, j) for i, b in enumerate(self._buckets) for j, p in enumerate(b.params)}
        self._hooks = []
        if self.world > 1:
            self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self.params]
        self.zero_grad()

    @staticmethod
    def _make_buckets(params: list[nn.Parameter], cap_bytes: int, first_cap_bytes: int) -> list[_Bucket]:
        groups: list[list[nn.Parameter]] = []
        size = 0
        for p in params:
            same_kind = groups and groups[-1][0].dtype == p.dtype and groups[-1][0].device == p.device
            cap = first_cap_bytes if len(groups) == 1 else cap_bytes
            if not same_kind or size + p.numel() * p.element_size() > cap:
                groups.append([])
                size = 0
            groups[-1].append(p)
            size += p.numel() * p.element_size()
        buckets = []
        for members in groups:
            buffer = torch.zeros(sum(p.numel() for p in members), dtype=members[0].dtype, device=members[0].device)
            views, offset = [], 0
            for p in members:
                views.append(buffer[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
            buckets.append(_Bucket(params=members, buffer=buffer, views=views))
        return buckets

    @property
    def num_buckets(self) -> int:
        return len(self._buckets)

    def zero_grad(self) -> None:
        """Zero every gradient and (re)attach it to its bucket view; use instead of optimizer.zero_grad."""
        for bucket in self._buckets:
            if bucket.work is not None:  # an aborted step: let the reduction land before zeroing
                bucket.work.wait()
            bucket.buffer.zero_()
            bucket.ready = 0
            bucket.work = None
            for p, view in zip(bucket.params, bucket.views):
                p.grad = view
        self._next_launch = 0

    @contextmanager
    def no_sync(self):
        """Accumulate gradients locally (earlier micro-batches of a step)."""
        previous, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = previous

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if not self.sync:
            return
        index, position = self._slot[id(param)]
        bucket = self._buckets[index]
        if index < self._next_launch or bucket.ready >= len(bucket.params):
            raise RuntimeError(
                "a gradient arrived for a parameter whose bucket is already being reduced: backward ran twice "
                "in one synchronised step. Wrap every micro-batch but the last in `no_sync()`, and call "
                "`finish()` once per step.")
        self._reattach(param, bucket.views[position])
        bucket.ready += 1
        self._launch_ready()

    @staticmethod
    def _reattach(param: nn.Parameter, view: torch.Tensor) -> None:
        """If something replaced `.grad` (e.g. set_to_none), copy it back into the bucket view."""
        if param.grad is not view:
            if param.grad is not None and param.grad.data_ptr() != view.data_ptr():
                view.copy_(param.grad)
            param.grad = view

    def _launch_ready(self) -> None:
        while self._next_launch < len(self._buckets):
            bucket = self._buckets[self._next_launch]
            if bucket.ready < len(bucket.params):
                return
            bucket.work = dist.all_reduce(bucket.buffer, group=self.group, async_op=True)
            self._next_launch += 1

    def finish(self) -> None:
        """Launch what backward left and wait for every bucket: gradients are then summed."""
        if self.world == 1:
            return
        for bucket in self._buckets[self._next_launch:]:  # not yet in flight
            for p, view in zip(bucket.params, bucket.views):
                self._reattach(p, view)
            bucket.ready = len(bucket.params)
        self._launch_ready()
        for bucket in self._buckets:
            if bucket.work is not None:
                bucket.work.wait()
                bucket.work = None
            bucket.ready = 0
        self._next_launch = 0  # ready for the next step, even if the caller skips zero_grad()

    def remove(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
