"""Flat gradient buckets filled by backward hooks: what the two bucketed synchronisers share.

The data-parallel all-reduce (grad_sync.py) and ZeRO's reduce-scatter (zero/grads.py) do the same
bookkeeping and differ only in the collective a full bucket starts and where its result lands:

- trainable parameters, each once, grouped in reverse registration order (about the order backward
  produces their gradients) into buckets of one dtype and device, about `cap` bytes each, the first
  one smaller so that communication starts early in backward;
- each bucket is one flat buffer; every parameter's `.grad` is a view into it, so autograd
  accumulates straight into the buffer (what DDP calls gradient_as_bucket_view);
- a post-accumulate-grad hook counts ready parameters; complete buckets are launched strictly in
  index order, so every rank issues the same collectives in the same order (gloo and NCCL require
  it) whatever order the hooks fire in;
- `no_sync()` lets micro-batches accumulate without counting.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn


def trainable_once(params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
    """The parameters that take gradients, each once (tied ones appear under several names), in order."""
    unique: dict[int, nn.Parameter] = {}
    for p in params:
        if p.requires_grad:
            unique.setdefault(id(p), p)
    return list(unique.values())


def group_by_size(params: list[nn.Parameter], cap_bytes: int,
                  first_cap_bytes: int | None = None) -> list[list[nn.Parameter]]:
    """Consecutive runs of one dtype and device, each at most `cap_bytes` (the first `first_cap_bytes`)
    unless a single parameter is larger."""
    groups: list[list[nn.Parameter]] = []
    size = 0
    for p in params:
        same_kind = groups and groups[-1][0].dtype == p.dtype and groups[-1][0].device == p.device
        cap = first_cap_bytes if len(groups) == 1 and first_cap_bytes is not None else cap_bytes
        if not same_kind or size + p.numel() * p.element_size() > cap:
            groups.append([])
            size = 0
        groups[-1].append(p)
        size += p.numel() * p.element_size()
    return groups


@dataclass(kw_only=True)
class FlatBucket:
    """Parameters flattened one after another in one buffer of `numel` elements (padding at the end)."""

    params: list[nn.Parameter]
    offsets: list[int]  # where each parameter starts in the flat bucket
    numel: int
    dtype: torch.dtype
    device: torch.device
    full: torch.Tensor | None = None  # the gradients, flat; None while released
    views: list[torch.Tensor] = field(default_factory=list)  # each parameter's gradient inside `full`
    ready: int = 0  # parameters whose gradient is complete this step
    work: dist.Work | None = field(default=None, repr=False)  # the collective in flight

    @classmethod
    def of(cls, params: list[nn.Parameter], *, multiple: int = 1, **extra) -> FlatBucket:
        """A bucket of `params`, its size padded up to a multiple of `multiple`."""
        offsets, total = [], 0
        for p in params:
            offsets.append(total)
            total += p.numel()
        numel = -(-total // multiple) * multiple
        return cls(params=params, offsets=offsets, numel=numel, dtype=params[0].dtype, device=params[0].device,
                   **extra)

    def allocate(self) -> None:
        """Create the zeroed flat buffer and the parameters' views into it, if released."""
        if self.full is None:
            self.full = torch.zeros(self.numel, dtype=self.dtype, device=self.device)
            self.views = [self.full[off:off + p.numel()].view_as(p) for p, off in zip(self.params, self.offsets)]

    @property
    def complete(self) -> bool:
        return self.ready >= len(self.params)


def attach_grad(param: nn.Parameter, view: torch.Tensor, *, accumulate: bool) -> None:
    """Point `param.grad` at its bucket view. If something replaced `.grad` (set_to_none, a caller's
    own tensor), its values go into the view first: added (`accumulate`) or copied over it."""
    if param.grad is not view:
        if param.grad is not None and param.grad.data_ptr() != view.data_ptr():
            if accumulate:
                view.add_(param.grad)
            else:
                view.copy_(param.grad)
        param.grad = view


class HookedBuckets:
    """Counts gradients as backward produces them and launches complete buckets in index order.

    Subclasses build `self.buckets` and say what a bucket's reduction is (`_launch`), whether a gradient
    counts now (`_take`), and which complete buckets may not start early (`_may_launch`)."""

    buckets: list

    def _track(self, params: list[nn.Parameter], buckets: list, *, hooks: bool = True) -> None:
        self.params, self.buckets = params, buckets
        self._slot = {id(p): (i, j) for i, b in enumerate(buckets) for j, p in enumerate(b.params)}
        self.sync = True
        self._next_launch = 0
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in params] if hooks else []

    @property
    def num_buckets(self) -> int:
        return len(self.buckets)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (earlier micro-batches of a step)."""
        previous, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = previous

    def _take(self, param: nn.Parameter, bucket, position: int) -> bool:
        """Called as `param`'s gradient is complete: whether it counts towards launching `bucket` now."""
        raise NotImplementedError

    def _launch(self, bucket) -> None:
        """Start `bucket`'s reduction (asynchronous: its `work`)."""
        raise NotImplementedError

    def _may_launch(self, bucket) -> bool:
        return bucket.complete

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        index, position = self._slot[id(param)]
        bucket = self.buckets[index]
        if not self._take(param, bucket, position):
            return
        if index < self._next_launch or bucket.complete:
            raise RuntimeError(
                "a gradient arrived for a parameter whose bucket is already being reduced: backward ran twice "
                "in one synchronised step. Wrap every micro-batch but the last in `no_sync()`, and call "
                "`finish()` once per step.")
        bucket.ready += 1
        self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            if not self._may_launch(bucket):
                return
            self._launch(bucket)
            self._next_launch += 1

    def _settle(self) -> None:
        """Before zeroing: let any reduction still in flight (an aborted step) land, and count afresh."""
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
                bucket.work = None
            bucket.ready = 0
        self._next_launch = 0

    def remove(self) -> None:
        """Detach the gradient hooks."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
