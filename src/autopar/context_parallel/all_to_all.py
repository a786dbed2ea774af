"""All-to-all attention (DeepSpeed-Ulysses): swap the sequence split for a head split, attend, swap back.

Before attention each rank holds all heads of its tokens; one all-to-all gives it 1/cp of the heads
over every token, attention runs as in one process (torch's own kernel, causal or with the padding
mask), and a second all-to-all brings each token's heads home. Two all-to-alls of the activations per
attention, whatever cp is; the head count must be divisible by cp.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .layout import shard_positions


def heads_per_rank(heads: int, tp: int) -> int:
    """The heads of one attention a tp rank holds: tensor parallelism splits them where tp divides them (its
    own planner refuses the rest, so the whole count is what this rank would swap)."""
    return heads // tp if heads % tp == 0 else heads


def swaps_heads(heads: int, tp: int, cp: int) -> bool:
    """Whether all-to-all attention can run an attention of `heads` query heads at tp x cp: each rank's swap
    hands every cp rank an equal share of its tp rank's heads. The rewrite refuses what this refuses, and the
    strategy search lists only what it allows (keys and values are repeated to the query heads first, so
    their head count does not matter)."""
    return heads_per_rank(heads, tp) % cp == 0


class _SequenceToHeads(torch.autograd.Function):
    """(B, H, T/cp, D) sequence-split -> (B, H/cp, T, D) head-split, tokens in rank order; backward the inverse."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _swap(x, group, split_dim=1, join_dim=2)

    @staticmethod
    def backward(ctx, grad):
        return _swap(grad, ctx.group, split_dim=2, join_dim=1), None


class _HeadsToSequence(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _swap(x, group, split_dim=2, join_dim=1)

    @staticmethod
    def backward(ctx, grad):
        return _swap(grad, ctx.group, split_dim=1, join_dim=2), None


def _swap(x: torch.Tensor, group: dist.ProcessGroup, *, split_dim: int, join_dim: int) -> torch.Tensor:
    cp = dist.get_world_size(group)
    sent = [part.contiguous() for part in x.chunk(cp, dim=split_dim)]
    received = [torch.empty_like(sent[0]) for _ in range(cp)]
    dist.all_to_all(received, sent, group=group)
    return torch.cat(received, dim=join_dim)


def all_to_all_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: torch.Tensor | None, *,
                         causal: bool, scale: float, group: dist.ProcessGroup,
                         window: int | None = None) -> torch.Tensor:
    """Attention of this rank's tokens (B, H, T/cp, D), exact; heads must be divisible by cp. Each rank sees
    the whole sequence of its heads, so a causal sliding `window` masks as in one process."""
    cp = dist.get_world_size(group)
    local = q.shape[2]
    order = torch.cat([shard_positions(local * cp, r, cp, device=q.device) for r in range(cp)])
    natural = torch.argsort(order)  # tokens arrive in rank order; attention wants sequence order
    q, k, v = (_SequenceToHeads.apply(t, group).index_select(2, natural) for t in (q, k, v))
    n = q.shape[2]
    index = torch.arange(n, device=q.device)
    back = index[:, None] - index[None, :]  # how far back each key lies
    positional = None  # which keys each query may see by position (None: torch's is_causal, or all)
    if window is not None:  # causal, keys fewer than `window` positions back
        positional = (back >= 0) & (back < window)
    elif causal and key_valid is not None:
        positional = back >= 0
    mask = positional
    if key_valid is not None:
        gathered = [torch.empty_like(key_valid) for _ in range(cp)]
        dist.all_gather(gathered, key_valid.contiguous(), group=group)
        valid = torch.cat(gathered, dim=1).index_select(1, natural)[:, None, None, :]
        mask = valid if positional is None else valid & positional
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None, scale=scale)
    return _HeadsToSequence.apply(out.index_select(2, order), group)  # back to rank order: order inverts natural

