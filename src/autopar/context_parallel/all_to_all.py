"""All-to-all attention (DeepSpeed-Ulysses): swap the sequence split for a head split, attend, swap back.

Before attention each rank holds all heads of its tokens; one all-to-all gives it 1/cp of the heads
over every token (queries, keys and values stacked in one collective), attention runs as in one process
(torch's own kernel, causal or with the padding mask), and a second all-to-all brings each token's heads
home. Two all-to-alls of the activations per attention each way, whatever cp is (what the strategy search
prices); each tp rank's heads must be divisible by cp.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

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
    """(S, B, H, T/cp, D) sequence-split -> (S, B, H/cp, T, D) head-split in sequence order; backward the inverse.
    S tensors stacked (queries, keys and values) travel in one collective. The reorder from rank order to
    sequence order is part of the swap, so its backward is the inverse reorder (a copy), not index_select's
    scatter-add into zeros."""

    @staticmethod
    def forward(ctx, x, swap, cp, natural, order):
        ctx.swap, ctx.cp, ctx.order = swap, cp, order
        return _to_heads(x, swap, cp).index_select(3, natural)

    @staticmethod
    def backward(ctx, grad):
        return _to_sequence(grad.index_select(3, ctx.order), ctx.swap, ctx.cp), None, None, None, None


class _HeadsToSequence(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, swap, cp, natural, order):
        ctx.swap, ctx.cp, ctx.natural = swap, cp, natural
        return _to_sequence(x.index_select(3, order), swap, cp)

    @staticmethod
    def backward(ctx, grad):
        return _to_heads(grad, ctx.swap, ctx.cp).index_select(3, ctx.natural), None, None, None, None


def _exchange(send: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """One all_to_all_single of `send` (cp, ...): part r goes to cp rank r, part r of the result came from it.
    One flat buffer each way: gloo's list all_to_all took about twice as long for the same bytes."""
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return received


def _to_heads(x: torch.Tensor, swap: Callable, cp: int) -> torch.Tensor:
    s, b, h, t, d = x.shape
    send = x.reshape(s, b, cp, h // cp, t, d).permute(2, 0, 1, 3, 4, 5).contiguous()  # head group r to rank r
    received = swap(send)  # (cp, S, B, H/cp, t, D): rank r's tokens of this rank's heads
    return received.permute(1, 2, 3, 0, 4, 5).reshape(s, b, h // cp, cp * t, d)


def _to_sequence(x: torch.Tensor, swap: Callable, cp: int) -> torch.Tensor:
    s, b, h, n, d = x.shape
    send = x.reshape(s, b, h, cp, n // cp, d).permute(3, 0, 1, 2, 4, 5).contiguous()  # rank r's tokens to rank r
    received = swap(send)  # (cp, S, B, H/cp, T/cp, D): head group r of this rank's tokens
    return received.permute(1, 2, 0, 3, 4, 5).reshape(s, b, h * cp, n // cp, d)


def all_to_all_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: torch.Tensor | None, *,
                         causal: bool, scale: float, group: dist.ProcessGroup,
                         window: int | None = None) -> torch.Tensor:
    """Attention of this rank's tokens (B, H, T/cp, D), exact; heads must be divisible by cp. Each rank sees
    the whole sequence of its heads, so a causal sliding `window` masks as in one process."""
    return _attention(q, k, v, key_valid, causal=causal, scale=scale, window=window, cp=dist.get_world_size(group),
                      swap=functools.partial(_exchange, group=group), group=group)


def loopback_all_to_all_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float,
                                  cp: int) -> torch.Tensor:
    """One cp rank's work of all_to_all_attention in one process: every swap's buffers made and reordered alike,
    the exchange a local copy of the same bytes, attention over T with H/cp heads. What the strategy search
    times (search/ring_cost.py); the exchange itself it prices from the calibrated all-to-all."""
    return _attention(q, k, v, None, causal=causal, scale=scale, window=None, cp=cp, swap=torch.clone, group=None)


def _attention(q, k, v, key_valid, *, causal: bool, scale: float, window: int | None, cp: int, swap: Callable,
               group: dist.ProcessGroup | None) -> torch.Tensor:
    local = q.shape[2]
    order = torch.cat([shard_positions(local * cp, r, cp, device=q.device) for r in range(cp)])
    natural = torch.argsort(order)  # tokens arrive in rank order; attention wants sequence order
    if q.shape == k.shape == v.shape:  # one swap for all three
        q, k, v = _SequenceToHeads.apply(torch.stack((q, k, v)), swap, cp, natural, order).unbind(0)
    else:  # (values of another head size)
        q, k, v = (_SequenceToHeads.apply(t[None], swap, cp, natural, order)[0] for t in (q, k, v))
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
    return _HeadsToSequence.apply(out[None], swap, cp, natural, order)[0]  # back to rank order, then home

