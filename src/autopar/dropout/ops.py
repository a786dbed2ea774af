"""Dropout, alpha dropout, rrelu and attention-dropout computed with layout-free draws (mask.py) for one micro-batch.

Both the eager interception (eager.py) and the rewritten graph nodes (graph.py) call these,
so every engine runs the same operations on the same masks. The batch is the leading
dimension of the activation, possibly flattened with the dimensions after it
([B * T, F] is read as [B, T, F]); a tensor whose leading size is not a multiple of the
micro-batch size is refused (its samples cannot be told apart).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .._torch_internals import safe_softmax
from ..errors import ModelError
from .compiled import OpAtRunTime, ScopeAtRunTime, compiled_sample_keys, op_number, scope_keys
from .mask import element_ids, element_keys, keep_mask, sample_keys, shard_positions, uniform
from .scope import DropoutScope


Op = int | OpAtRunTime  # an operation number; in a compiled graph, possibly read at run time (compiled.py)


@dataclass(frozen=True)
class TPShard:
    """The activation is split over tp ranks along `dim` (of the activation), per segment."""

    dim: int
    segments: tuple[int, ...]
    rank: int
    tp: int


def _element_keys(shape: tuple[int, ...], batch: int, *, channel: bool, shard: TPShard | None,
                  device: torch.device, cache: dict | None) -> torch.Tensor:
    key = (shape, batch, channel, shard, device)
    if cache is not None and key in cache:
        return cache[key]
    if shape[0] % batch:
        raise ModelError(f"dropout on a tensor of shape {list(shape)}: its leading dimension is not a multiple of the "
                         f"micro-batch's {batch} samples, so the samples cannot be told apart; layout-independent "
                         f"dropout needs the batch as the leading dimension")
    per_sample = (shape[0] // batch, *(shape[1:2] if channel else shape[1:]))
    full, index = list(per_sample), [None] * len(per_sample)
    if shard is not None and shard.dim < len(per_sample):
        if shard.dim == 0:
            raise ModelError(f"dropout on a tensor of shape {list(shape)} split over tensor-parallel ranks along "
                             f"its batch dimension")
        full[shard.dim] = sum(shard.segments)
        index[shard.dim] = shard_positions(full[shard.dim], shard.segments, shard.rank, shard.tp)
    keys = element_keys(element_ids(full, index, device))
    if cache is not None:
        cache[key] = keys
    return keys


def _draws(shape: tuple[int, ...], op: Op, scope: DropoutScope, *, device: torch.device, channel: bool,
           shard: TPShard | None, cache: dict | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-sample keys [B], per-element keys) of operation `op` for an activation of `shape` (in a compiled
    graph, `op` may be read at run time: compiled.OpAtRunTime)."""
    if torch.compiler.is_compiling():  # keys by one opaque operator, read at run time (compiled.py); no caches:
        # a cache filled while tracing would be a guard, and the per-element keys fuse into the mask anyway
        if isinstance(scope, ScopeAtRunTime):
            elements = _element_keys(tuple(shape), scope.batch, channel=channel, shard=shard, device=device, cache=None)
            return scope_keys(op, scope.batch, scope.subbatch, device), elements
        samples = scope.samples.to(device)
        elements = _element_keys(tuple(shape), len(samples), channel=channel, shard=shard, device=device, cache=None)
        return compiled_sample_keys(scope.seed, scope.step_tensor, op, samples), elements
    samples = scope.samples_on(device)
    cache = scope.element_keys if cache is None else cache
    elements = _element_keys(tuple(shape), len(samples), channel=channel, shard=shard, device=device, cache=cache)
    return sample_keys(scope.seed, scope.step, op_number(op), samples), elements


def _as_activation(values: torch.Tensor, shape: tuple[int, ...], channel: bool) -> torch.Tensor:
    """[B, *per-sample] draws back in the activation's shape (channel draws broadcast over the rest)."""
    values = values.reshape(shape[0], *values.shape[2:])
    return values.reshape(*values.shape, *([1] * (len(shape) - 2))) if channel else values


def keep(shape: tuple[int, ...], p: float, op: Op, scope: DropoutScope, *, device: torch.device,
         channel: bool = False, shard: TPShard | None = None, cache: dict | None = None) -> torch.Tensor:
    """bool: which elements (channel: which (sample, channel) pairs, broadcastable) operation `op` keeps."""
    keys, elements = _draws(shape, op, scope, device=device, channel=channel, shard=shard, cache=cache)
    return _as_activation(keep_mask(keys, elements, p), shape, channel)


def dropout_noise(shape: tuple[int, ...], p: float, op: Op, scope: DropoutScope, *, dtype: torch.dtype,
                  device: torch.device, channel: bool = False, shard: TPShard | None = None,
                  cache: dict | None = None) -> torch.Tensor:
    """keep / (1 - p) for an activation of `shape` (channel: one draw per (sample, channel), broadcast)."""
    kept = keep(shape, p, op, scope, device=device, channel=channel, shard=shard, cache=cache)
    if p >= 1.0:
        return torch.zeros(kept.shape, dtype=dtype, device=device)
    return kept.to(dtype).div_(1.0 - p)


def dropout(x: torch.Tensor, p: float, op: Op, scope: DropoutScope, *, channel: bool = False,
            shard: TPShard | None = None, inplace: bool = False, cache: dict | None = None) -> torch.Tensor:
    """x * keep / (1 - p), as torch's dropout computes it, with the layout-free mask of operation `op`."""
    _check_channel(x, channel)
    noise = dropout_noise(tuple(x.shape), p, op, scope, dtype=x.dtype, device=x.device, channel=channel,
                          shard=shard, cache=cache)
    return x.mul_(noise) if inplace else x * noise


# torch's SELU constants' product (alpha * scale): alpha dropout sets dropped units to SELU's negative saturation
_ALPHA = 1.7580993408473766


def alpha_dropout(x: torch.Tensor, p: float, op: Op, scope: DropoutScope, *, channel: bool = False,
                  shard: TPShard | None = None, inplace: bool = False, cache: dict | None = None) -> torch.Tensor:
    """Alpha dropout as torch computes it (mean and variance kept for SELU), with the mask of operation `op`:
    a kept element becomes a * x, a dropped one a * (-alpha) + alpha * a * p, a = ((alpha^2 p + 1)(1 - p))^-1/2."""
    _check_channel(x, channel)
    if p >= 1.0:
        return x.mul_(0.0) if inplace else x * 0.0
    kept = keep(tuple(x.shape), p, op, scope, device=x.device, channel=channel, shard=shard, cache=cache).to(x.dtype)
    a = 1.0 / math.sqrt((_ALPHA * _ALPHA * p + 1) * (1 - p))
    shift = kept.add(-1).mul_(_ALPHA * a).add_(_ALPHA * a * p)
    return x.mul_(kept.mul_(a)).add_(shift) if inplace else (x * kept.mul_(a)).add_(shift)


def rrelu(x: torch.Tensor, lower: float, upper: float, op: Op, scope: DropoutScope, *,
          shard: TPShard | None = None, inplace: bool = False, cache: dict | None = None) -> torch.Tensor:
    """Randomized leaky ReLU in training: x where x > 0, else x * r with r ~ U(lower, upper) drawn per element
    from operation `op`'s hash (torch's gradient too: r below zero, 1 above)."""
    keys, elements = _draws(tuple(x.shape), op, scope, device=x.device, channel=False, shard=shard, cache=cache)
    slopes = _as_activation(uniform(keys, elements, lower, upper, x.dtype), tuple(x.shape), False)
    noise = torch.where(x > 0, torch.ones((), dtype=x.dtype, device=x.device), slopes)
    return x.mul_(noise) if inplace else x * noise


def _check_channel(x: torch.Tensor, channel: bool) -> None:
    if channel and x.dim() < 2:
        raise ModelError(f"channel dropout needs a batched input [N, C, ...], got shape {list(x.shape)}")


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None, p: float,
              is_causal: bool, scale: float | None, enable_gqa: bool, op: Op, scope: DropoutScope, *,
              shard: TPShard | None = None, cache: dict | None = None) -> torch.Tensor:
    """Scaled dot-product attention written out, with layout-free dropout on the attention weights.

    The fused kernels draw their own random numbers; the explicit form is what lets the
    mask be ours. The mask's elements are the whole [heads, L, S] weights of a sample (a
    tp rank holding some heads draws their slice).
    """
    length, source = q.size(-2), k.size(-2)
    if enable_gqa and k.size(-3) != q.size(-3):
        k = k.repeat_interleave(q.size(-3) // k.size(-3), dim=-3)
        v = v.repeat_interleave(q.size(-3) // v.size(-3), dim=-3)
    factor = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * factor
    if is_causal:
        allowed = torch.ones(length, source, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~allowed, float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    # a query that may attend to nothing (a left-padded row) gets zero weights, as torch's SDPA gives it,
    # not softmax's NaN: the safe softmax is the op SDPA's own math path uses
    weights = safe_softmax(scores, -1)
    weights = dropout(weights, p, op, scope, shard=shard, cache=cache)
    return weights @ v
