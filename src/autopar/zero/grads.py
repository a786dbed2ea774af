"""ZeRO-1/2 gradients: reduce-scattered into each replica's shard of flat buckets, not all-reduced.

Why our own rather than torch's ZeroRedundancyOptimizer: it shards whole parameters between
replicas (each rank owns some tensors), still needs a full all-reduce of every gradient, and
sits on top of DDP's reducer; ours shards flat, padded buckets element-wise (every replica owns
1/dp of every bucket), reduce-scatters straight into that shard and is driven by the same
gradient hooks and explicit `finish()` as data_parallel/grad_sync.py (data_parallel/buckets.py holds
the bookkeeping both share), so the pipeline runtime and tensor parallelism use it unchanged.

Layout: parameters are grouped into buckets of about `bucket_mb` in reverse registration order
(about the order backward produces them), one dtype per bucket; each bucket is a flat buffer
padded to a multiple of dp, and replica r owns elements [r*S, (r+1)*S) of it. Parameters named
`deferred` (weights tied across pipeline stages, whose gradient must first be summed with the
other stage's) go in buckets of their own at the end, launched only by `finish()`.

Level 1 keeps the full gradient buffers (autograd accumulates into them across micro-batches)
and reduce-scatters once per step. Level 2 keeps only the shard's gradient between micro-batches:
with `per_micro_batch` (the data-parallel engine) every micro-batch is reduce-scattered and added
into the fp32 shard accumulator, and the full buffers are released after each reduction; the
pipeline engine reduce-scatters once per step (its schedules interleave micro-batches and split
backward into input and weight halves) and releases the full buffers after it.

Gradients are SUMMED over the group (the loss is pre-scaled, as in grad_sync.py).

On gloo, level 1's fp32 buckets are reduced by an all-reduce of the full bucket, from which each
replica copies its shard: gloo's reduce-scatter is slower than its all-reduce of the same buffer
(`benchmarks/gloo_collectives.py`, 3.3M floats, quiet 2-core machine: 15.9 against 9.2 ms at 2
ranks, 27.3 against 22.2 at 4), so the collective meant to move half the bytes loses there. Level 1 keeps the full buffer anyway, so no memory is added. Level 2 and bf16 buckets
keep the reduce-scatter (their landing buffer is part of the memory formula in
search/zero_memory.py); NCCL and other backends reduce-scatter everywhere.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..data_parallel.buckets import FlatBucket, HookedBuckets, attach_grad, group_by_size, trainable_once
from ..data_parallel.grad_sync import BUCKET_MB, FIRST_BUCKET_MB
from ..distributed import reduce_scatter_single


@dataclass(kw_only=True)
class ShardedBucket(FlatBucket):
    """A flat bucket padded to a multiple of the group size; `shard` elements per replica. Its full
    gradient (`full`, the parameters' dtype) is None while released (level 2)."""

    shard: int  # elements each replica owns
    deferred: bool  # launched only by finish(), after the engine's own pre-reduction
    shard_grad: torch.Tensor | None = None  # this replica's summed gradient, fp32
    incoming: torch.Tensor | None = None  # reduce-scatter output when it cannot land in shard_grad directly
    pending_out: torch.Tensor | None = None  # where the reduction in flight lands

    def pieces(self, rank: int) -> Iterator[tuple[nn.Parameter, int, int, int]]:
        """(param, start in the param's flat view, start in the shard, length) of what replica `rank` owns."""
        lo, hi = rank * self.shard, (rank + 1) * self.shard
        for p, off in zip(self.params, self.offsets):
            a, b = max(lo, off), min(hi, off + p.numel())
            if a < b:
                yield p, a - off, a - lo, b - a


class ShardedGradients(HookedBuckets):
    """Reduce-scatters gradients over `group` into this replica's shard of each bucket (ZeRO-1/2)."""

    def __init__(self, params: Iterable[nn.Parameter], group: dist.ProcessGroup, *, level: int,
                 deferred: Iterable[nn.Parameter] = (), per_micro_batch: bool = False, bucket_mb: float = BUCKET_MB,
                 first_bucket_mb: float = FIRST_BUCKET_MB, device: torch.device | None = None):
        """level 0: nothing sharded, gradients all-reduced into a full fp32 copy (bf16 master weights
        without ZeRO); 1: reduce-scattered once per step; 2: and only the shard's gradient is kept.

        The first bucket is small (`first_bucket_mb`, as grad_sync.py's) so that a reduction starts early
        in backward: with one 25 MiB bucket a small model's whole reduce-scatter waited for the end of
        backward (benchmarks/zero_memory.py). grad_sync.py's sizes, also where ranks time-share the cores: one
        bucket there (grad_sync.overlap_pays) doubled a ZeRO-1 test run's
        time (tests/test_zero.py, zero1-to-tp2: 13.2 s against 8.8 s)."""
        self.group, self.level = group, level
        self.dp = dist.get_world_size(group)
        # how the buckets are split: over the replicas, or (level 0) one whole copy on each
        self.world, self.rank = (self.dp, dist.get_rank(group)) if level >= 1 else (1, 0)
        self.per_micro_batch = per_micro_batch and level >= 2
        self.reduce_by_all_reduce = level == 1 and dist.get_backend(group) == "gloo"
        params = list(params)
        # where norms are summed, also on a rank holding only frozen parameters (no bucket to read it from)
        # (`device`: the run's, given by an engine whose rank may hold no parameter at all)
        self.device = device if device is not None else params[0].device if params else torch.device("cpu")
        trainable = trainable_once(params)
        late = {id(p) for p in deferred}
        cap, first_cap = int(bucket_mb * 2**20), int(min(first_bucket_mb, bucket_mb) * 2**20)
        self._track(trainable, self._make_buckets([p for p in reversed(trainable) if id(p) not in late], cap,
                                                  deferred=False, first_cap_bytes=first_cap)
                    + self._make_buckets([p for p in reversed(trainable) if id(p) in late], cap, deferred=True))
        self.zero_grad()

    def _make_buckets(self, params: list[nn.Parameter], cap_bytes: int, *, deferred: bool,
                      first_cap_bytes: int | None = None) -> list[ShardedBucket]:
        buckets = []
        for members in group_by_size(params, cap_bytes, first_cap_bytes):
            shard = -(-sum(p.numel() for p in members) // self.world)
            bucket = ShardedBucket.of(members, multiple=self.world, shard=shard, deferred=deferred)
            bucket.shard_grad = torch.zeros(bucket.shard, dtype=torch.float32, device=bucket.device)
            buckets.append(bucket)
        return buckets

    # ------------------------------------------------------------------ the full gradient buffers

    @staticmethod
    def _allocate(bucket: ShardedBucket) -> None:
        """(Re)create the full gradient buffer and point every `.grad` at its view (adding what autograd left)."""
        bucket.allocate()
        for p, view in zip(bucket.params, bucket.views):
            attach_grad(p, view, accumulate=True)

    def _release(self, bucket: ShardedBucket) -> None:
        """Level 2: drop the full gradient; only the shard's stays."""
        for p in bucket.params:
            p.grad = None
        bucket.full, bucket.views = None, []

    def zero_grad(self) -> None:
        """Zero the shard gradients (and the full buffers that are kept); use instead of optimizer.zero_grad."""
        self._settle()
        for bucket in self.buckets:
            bucket.shard_grad.zero_()
            if self.level >= 2:
                self._release(bucket)
            else:
                self._allocate(bucket)
                bucket.full.zero_()

    # ------------------------------------------------------------------ reduction

    def _take(self, param: nn.Parameter, bucket: ShardedBucket, position: int) -> bool:
        """Gradients always go into the bucket; they count (towards a launch) when synchronising, or
        on every micro-batch at level 2 per micro-batch (which ignores `no_sync()`)."""
        if bucket.full is None:
            self._allocate(bucket)  # level 2: released since the last reduction
        else:
            attach_grad(param, bucket.views[position], accumulate=True)  # something replaced .grad
        return self.sync or self.per_micro_batch

    def _launch(self, bucket: ShardedBucket) -> None:
        if bucket.full is None:
            self._allocate(bucket)
        if self.world == 1:  # level 0: all-reduce the whole bucket (nothing when dp is 1)
            bucket.work = dist.all_reduce(bucket.full, group=self.group, async_op=True) if self.dp > 1 else None
            out = bucket.full
        elif self.reduce_by_all_reduce and bucket.dtype == torch.float32:
            bucket.work = dist.all_reduce(bucket.full, group=self.group, async_op=True)
            out = bucket.full
        else:
            if bucket.dtype == torch.float32 and not self.per_micro_batch:
                out = bucket.shard_grad  # once per step, fp32: land straight in the shard
            else:
                if bucket.incoming is None:
                    bucket.incoming = torch.empty(bucket.shard, dtype=bucket.dtype, device=bucket.device)
                out = bucket.incoming
            bucket.work = reduce_scatter_single(out, bucket.full, group=self.group, async_op=True)
        bucket.pending_out = out

    def _land(self, bucket: ShardedBucket) -> None:
        """Wait for the bucket's reduction and add it into the fp32 shard gradient."""
        if bucket.work is not None:
            bucket.work.wait()
            bucket.work = None
        out = bucket.pending_out
        if out is bucket.full:  # level 0, or an all-reduce on gloo: this replica's part of the whole sum
            piece = out[self.rank * bucket.shard:(self.rank + 1) * bucket.shard]
            if self.world > 1:
                bucket.shard_grad.copy_(piece)  # what the reduce-scatter straight into the shard would leave
            else:
                bucket.shard_grad.add_(piece)
        elif out is not bucket.shard_grad:
            bucket.shard_grad.add_(out)
        bucket.pending_out = None

    def _may_launch(self, bucket: ShardedBucket) -> bool:
        return not bucket.deferred and bucket.complete

    def finish(self, before_deferred: Callable[[], None] | None = None) -> None:
        """Launch what backward left and land every bucket in its shard gradient.

        `before_deferred()` runs on the full gradients of the deferred (tied) parameters before
        their buckets are reduced: the pipeline engine sums tied weights over their stages there.
        """
        for bucket in self.buckets[self._next_launch:]:
            self._allocate(bucket)  # parameters that got no gradient reduce zeros, the same buffers everywhere
        for bucket in self.buckets[self._next_launch:]:
            if bucket.deferred and before_deferred is not None:
                before_deferred()
                before_deferred = None
            self._launch(bucket)
        for bucket in self.buckets:
            self._land(bucket)
            bucket.ready = 0
            if self.level >= 2:
                self._release(bucket)
        self._next_launch = 0

    # ------------------------------------------------------------------ what the optimizer and clipping see

    def grad_pieces(self) -> Iterator[tuple[nn.Parameter, torch.Tensor]]:
        """(parameter, this replica's part of its summed gradient), fp32 views into the shard gradients."""
        for bucket in self.buckets:
            for p, _, start, length in bucket.pieces(self.rank):
                yield p, bucket.shard_grad[start:start + length]

    def squared_norms(self, kind: Callable[[nn.Parameter], int | None], kinds: int = 1) -> torch.Tensor:
        """Squared gradient norms summed per `kind(param)` (None: not counted), fp64, over every replica."""
        squares = torch.zeros(kinds, dtype=torch.float64, device=self.device)
        for bucket in self.buckets:
            pieces = list(bucket.pieces(self.rank))
            same = {kind(p) for p, *_ in pieces}
            if len(same) == 1:  # one kind: the whole shard at once (its padding reduced zeros)
                k = same.pop()
                if k is not None:
                    squares[k] += bucket.shard_grad.double().square().sum()
                continue
            for p, _, start, length in pieces:
                k = kind(p)
                if k is not None:
                    squares[k] += bucket.shard_grad[start:start + length].double().square().sum()
        if self.world > 1:
            dist.all_reduce(squares, group=self.group)
        return squares

    def scale_gradients(self, factor: float) -> None:
        for bucket in self.buckets:
            bucket.shard_grad.mul_(factor)
