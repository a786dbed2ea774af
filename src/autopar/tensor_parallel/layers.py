"""Tensor-parallel building blocks: column/row-parallel linear, vocab-parallel embedding and loss.

Why our own rather than DTensor's ColwiseParallel/RowwiseParallel: these layers must run
inside pipeline stages built from an exported graph, where we rewrite the graph's linear
and view nodes directly on plain tensors; DTensor would have to flow through the stage
graph and across stage boundaries. The two conjugate operators carry the communication:

- `copy_to_tp` (Megatron's f): identity forward, all-reduce of the gradient backward;
- `reduce_from_tp` (g): all-reduce forward, identity backward.

With sequence parallelism (`--sp`) the regions between a row layer and the next column
layer hold 1/tp of the sequence; their operators become (Megatron's g-bar and f-bar):

- `reduce_scatter_seq`: the row layer's sum, each rank keeping its slice of the sequence
  (backward: all-gather of the gradient);
- `gather_seq`: the whole sequence for a column layer (backward: reduce-scatter, the ranks'
  partial gradients summed) or for a replicated operation (backward: this rank's slice).

A column-parallel linear holds rows [r*o/t, (r+1)*o/t) of the weight (a slice of the
outputs); a row-parallel linear holds the matching input columns and sums partial
results. Vocab-parallel cross-entropy computes the loss from vocabulary-sharded logits
with three small all-reduces (max, sum of exps, target logit) and never gathers the full
logits.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError


def _shard(size: int, group: dist.ProcessGroup, what: str) -> tuple[int, int]:
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if size % world:
        raise ConfigError(f"tp={world} does not divide {what}={size}; use a tp that divides {size}")
    part = size // world
    return rank * part, part


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_tp(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _ReduceFromTP.apply(x, group)


def _seq_slices(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """[tp, ...]: x's sequence dimension cut into tp contiguous slices, stacked first (for *_tensor collectives)."""
    tp = dist.get_world_size(group)
    if x.shape[dim] % tp:
        raise ValueError(f"sequence of {x.shape[dim]} positions does not split over tp={tp}")
    return torch.stack(x.chunk(tp, dim=dim)).contiguous()


def _all_gather_seq(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _reduce_scatter_seq(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    slices = _seq_slices(x, dim, group)
    out = torch.empty_like(slices[0])
    dist.reduce_scatter_tensor(out, slices.flatten(0, 1), group=group)  # rank r receives the sum of slice r
    return out


class _ReduceScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter_seq(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_seq(grad, ctx.dim, ctx.group), None, None


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, partial):
        ctx.dim, ctx.group, ctx.partial, ctx.part = dim, group, partial, x.shape[dim]
        return _all_gather_seq(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.partial:  # each rank's gradient is its share of the whole one: summed, then sliced
            return _reduce_scatter_seq(grad, ctx.dim, ctx.group), None, None, None
        rank = dist.get_rank(ctx.group)  # a replicated consumer: every rank already holds the whole gradient
        return grad.narrow(ctx.dim, rank * ctx.part, ctx.part).contiguous(), None, None, None


def reduce_scatter_seq(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum over the tp ranks, each keeping slice `rank` of dimension `dim` (the sequence)."""
    return _ReduceScatterSeq.apply(x, dim, group)


def gather_seq(x: torch.Tensor, dim: int, group: dist.ProcessGroup, *, partial: bool) -> torch.Tensor:
    """The whole sequence from every rank's slice. `partial`: the consumer is split over tp (a column layer),
    so the ranks' gradients are summed; otherwise it is replicated and each rank keeps its slice of one."""
    return _GatherSeq.apply(x, dim, group, partial)


class _SavedSlice:
    """What a column layer keeps of its gathered input for backward: this rank's slice (gathered again there)."""

    def __init__(self, local: torch.Tensor, shape: torch.Size, dim: int, group: dist.ProcessGroup):
        self.local, self.shape, self.dim, self.group = local, shape, dim, group


def linear_keeping_slice(x_full: torch.Tensor, x_local: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """F.linear(x_full, ...) that saves x_local, not x_full, for its weight gradient (all-gathered again in
    backward, as Megatron's sequence-parallel column layer does): the whole sequence is never kept."""
    storage = x_full.untyped_storage().data_ptr()

    def pack(t: torch.Tensor):
        if t.untyped_storage().data_ptr() == storage and t.storage_offset() == 0 and t.is_contiguous() \
                and t.numel() == x_full.numel():
            return _SavedSlice(x_local.detach(), t.shape, dim, group)
        return t

    def unpack(saved):
        if isinstance(saved, _SavedSlice):
            return _all_gather_seq(saved.local, saved.dim, saved.group).view(saved.shape)
        return saved

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        return F.linear(x_full, weight, bias)


class ColumnParallelLinear(nn.Module):
    """y_local = x @ W[rows of this rank].T (+ b[same rows]); the output stays sharded on its last dim."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: dist.ProcessGroup):
        super().__init__()
        self.group = group
        start, part = _shard(weight.shape[0], group, "out_features")
        self.weight = nn.Parameter(weight.detach()[start:start + part].clone(), requires_grad=weight.requires_grad)
        self.bias = (nn.Parameter(bias.detach()[start:start + part].clone(), requires_grad=bias.requires_grad)
                     if bias is not None else None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: dist.ProcessGroup) -> ColumnParallelLinear:
        return cls(linear.weight, linear.bias, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_tp(x, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x_local @ W[:, columns of this rank].T, then + b (added once)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: dist.ProcessGroup):
        super().__init__()
        self.group = group
        start, part = _shard(weight.shape[1], group, "in_features")
        self.weight = nn.Parameter(weight.detach()[:, start:start + part].clone(), requires_grad=weight.requires_grad)
        self.bias = nn.Parameter(bias.detach().clone(), requires_grad=bias.requires_grad) if bias is not None else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: dist.ProcessGroup) -> RowParallelLinear:
        return cls(linear.weight, linear.bias, group)

    def forward(self, x_local: torch.Tensor) -> torch.Tensor:
        out = reduce_from_tp(F.linear(x_local, self.weight), self.group)
        return out + self.bias if self.bias is not None else out


class VocabParallelEmbedding(nn.Module):
    """Each rank holds a contiguous slice of the vocabulary; lookups outside it give zeros, then sum."""

    def __init__(self, weight: torch.Tensor, group: dist.ProcessGroup):
        super().__init__()
        self.group = group
        self.start, part = _shard(weight.shape[0], group, "vocab_size")
        self.end = self.start + part
        self.weight = nn.Parameter(weight.detach()[self.start:self.end].clone(), requires_grad=weight.requires_grad)

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, group: dist.ProcessGroup) -> VocabParallelEmbedding:
        return cls(embedding.weight, group)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.end)
        local = (ids - self.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, start, group, ignore_index):
        logits = logits.float()
        local_max = logits.max(dim=-1).values
        dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - local_max.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)
        part = logits.shape[-1]
        valid = targets != ignore_index
        local_t = targets - start
        mine = valid & (local_t >= 0) & (local_t < part)
        index = local_t.clamp(0, part - 1).unsqueeze(-1)
        target_logit = shifted.gather(-1, index).squeeze(-1) * mine
        dist.all_reduce(target_logit, group=group)
        loss = (sum_exp.log() - target_logit) * valid
        softmax = exp / sum_exp.unsqueeze(-1)
        ctx.save_for_backward(softmax, index, mine, valid)
        return loss

    @staticmethod
    def backward(ctx, grad):
        softmax, index, mine, valid = ctx.saved_tensors
        g = softmax.clone()
        g.scatter_add_(-1, index, -mine.unsqueeze(-1).to(g.dtype))
        g = g * (grad * valid).unsqueeze(-1)
        return g, None, None, None, None


def vocab_parallel_cross_entropy(logits_local: torch.Tensor, targets: torch.Tensor, *, vocab_start: int,
                                 group: dist.ProcessGroup, ignore_index: int = -100) -> torch.Tensor:
    """Per-token cross-entropy from logits sharded on the vocabulary (0 where targets == ignore_index)."""
    return _VocabParallelCrossEntropy.apply(logits_local, targets, vocab_start, group, ignore_index)
