"""Dropout masks that are a pure function of (seed, step, sample, operation, element).

torch's dropout draws from the process's random stream, so a mask depends on how many
numbers that process drew before: on the rank, the micro-batch size, the pipeline
schedule, recomputation. Here a mask is a counter-based hash instead:

    keep(seed, t, g, k, e)  iff  hash(seed, t, g, k, e) >= p * 2**32

for element e of global sample g at dropout operation k of step t. Nothing else enters,
so every layout draws the mask one process would, and a tensor-parallel shard that knows
the global indices of its elements gets exactly its slice of the whole mask.

The hash is a 32-bit avalanche mix (xor-shift / multiply, three rounds) evaluated with
int64 tensor ops (in place where the tensor is ours): values stay below 2**32 and the multipliers below 2**31, so no product
overflows (no reliance on wrapping signed arithmetic). The per-element part is hashed
once per layout and combined with a per-sample key by a two-round mix, so the cost on the
activation is about ten integer element-wise ops (measured cost: dropout/__init__.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_MASK32 = 0xFFFFFFFF
# odd multipliers below 2**31 (so that a 32-bit value times one fits in int64)
_MULTIPLIERS = (0x7FEB352D, 0x27D4EB2D, 0x165667B1)
_SALT_SEED, _SALT_STEP, _SALT_OP, _SALT_SAMPLE = 0x3C6EF372, 0x1B873593, 0x2545F491, 0x68E31DA4


def mix32(h: torch.Tensor, rounds: int = 3) -> torch.Tensor:
    """A bijective 32-bit avalanche mix of int64 values in [0, 2**32) (a new tensor)."""
    return _mix32_(h.clone(), rounds)


def _mix32_(h: torch.Tensor, rounds: int) -> torch.Tensor:
    """mix32 in place, on a tensor nobody else holds (fewer temporaries on the activation-sized path)."""
    for m in _MULTIPLIERS[:rounds]:
        h.bitwise_xor_(h >> 16)
        h.mul_(m).bitwise_and_(_MASK32)
    return h.bitwise_xor_(h >> 16)


def _mix_int(h: int) -> int:
    """mix32 on a Python int (the same function, for the scalar part of a key)."""
    h &= _MASK32
    for m in _MULTIPLIERS:
        h ^= h >> 16
        h = (h * m) & _MASK32
    return h ^ (h >> 16)


def sample_keys(seed: int, step: int, op: int, samples: torch.Tensor) -> torch.Tensor:
    """One 32-bit key per sample (int64 [B]) for operation `op` of step `step`."""
    base = _SALT_SEED
    for word in (seed, seed >> 32, step ^ _SALT_STEP, step >> 32, op ^ _SALT_OP):
        base = _mix_int(base ^ (word & _MASK32))
    samples = samples.to(torch.int64)
    low, high = samples & _MASK32, (samples >> 32) & _MASK32
    return mix32(mix32(low ^ (base ^ _SALT_SAMPLE)) ^ high)


def threshold(p: float) -> int:
    """Keep an element iff its hash is >= this: a fraction 1 - p of the 2**32 values."""
    return min(int(round(p * 2**32)), 2**32)


def element_ids(full_shape: Sequence[int], local_index: Sequence[torch.Tensor | None],
                device: torch.device) -> torch.Tensor:
    """Row-major index of each local element within the whole per-sample tensor.

    full_shape: the whole per-sample shape; local_index[d]: the global positions (int64)
    this rank holds along dim d, or None for all of them. Returns int64 of the local shape.
    """
    numel = 1
    for size in full_shape:
        numel *= size
    if numel >= 2**32:
        raise ValueError(f"a dropout input with {numel} elements per sample is too large for 32-bit element "
                         f"indices (at most 2**32 - 1)")
    ids = torch.zeros((), dtype=torch.int64, device=device)
    stride = 1
    for d in reversed(range(len(full_shape))):
        index = local_index[d] if local_index[d] is not None else torch.arange(full_shape[d], device=device)
        shape = [1] * len(full_shape)
        shape[d] = -1
        ids = ids + index.to(device=device, dtype=torch.int64).view(shape) * stride
        stride *= full_shape[d]
    return ids


def element_keys(ids: torch.Tensor) -> torch.Tensor:
    """The per-element half of the hash (independent of seed, step, sample and op: cacheable)."""
    return mix32(ids ^ 0x5BD1E995)


def element_hash(keys: torch.Tensor, elements: torch.Tensor) -> torch.Tensor:
    """int64 [B, *elements.shape] in [0, 2**32): the hash of (sample b's key, element).

    Both halves are already well mixed (3 rounds each), so combining them takes two rounds
    (the xor-multiply-xor-multiply of a "lowbias32"-style hash), on the activation's size.
    """
    h = elements.unsqueeze(0) ^ keys.view(-1, *([1] * elements.dim()))
    return _mix32_(h, 2)


def keep_mask(keys: torch.Tensor, elements: torch.Tensor, p: float) -> torch.Tensor:
    """bool [B, *elements.shape]: True where sample b keeps the element."""
    return element_hash(keys, elements) >= threshold(p)


def uniform(keys: torch.Tensor, elements: torch.Tensor, low: float, high: float, dtype: torch.dtype) -> torch.Tensor:
    """[B, *elements.shape] of `dtype`: low + (high - low) * u, u = hash / 2**32 in [0, 1) (rrelu's slopes)."""
    u = element_hash(keys, elements).to(torch.float64).mul_(2.0 ** -32)
    return u.mul_(high - low).add_(low).to(dtype)


def shard_positions(size: int, segments: Sequence[int], rank: int, tp: int) -> torch.Tensor:
    """Global positions along a dim split over tp ranks per segment (each segment sliced contiguously)."""
    if sum(segments) != size:
        raise ValueError(f"segments {list(segments)} do not add up to the dimension's size {size}")
    parts, offset = [], 0
    for seg in segments:
        part = seg // tp
        parts.append(torch.arange(offset + rank * part, offset + (rank + 1) * part))
        offset += seg
    return torch.cat(parts)
