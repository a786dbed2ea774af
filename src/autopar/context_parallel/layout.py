"""Which tokens of a sequence each context-parallel rank holds, and a batch cut to them.

The sequence is cut into 2 x cp equal chunks and rank r holds chunks r and 2cp-1-r. Under a causal
mask a late chunk attends to much more than an early one; pairing an early chunk with a late one
gives every rank the same attention work (the load balancing of Megatron's and torchtitan's ring
attention). The same layout serves both attention modes, so positions never depend on the mode.
"""

from __future__ import annotations

import math

import torch

from ..errors import ConfigError


def chunk_indices(rank: int, cp: int) -> tuple[int, int]:
    """The two chunks (of 2 x cp) rank `rank` holds."""
    return rank, 2 * cp - 1 - rank


def shard_positions(seq_len: int, rank: int, cp: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Global positions of this rank's tokens, in the order the rank holds them (int64)."""
    check_divisible(seq_len, cp)
    size = seq_len // (2 * cp)
    first, second = chunk_indices(rank, cp)
    return torch.cat([torch.arange(first * size, (first + 1) * size, device=device),
                      torch.arange(second * size, (second + 1) * size, device=device)])


def check_divisible(seq_len: int, cp: int, sequence_tp: int = 1) -> None:
    """`sequence_tp`: with --sp, each rank's share is cut again over that many tp ranks."""
    multiple = math.lcm(2 * cp, cp * sequence_tp)
    if seq_len % multiple != 0:
        fits = (seq_len // multiple) * multiple
        again = f" and each rank's share again over --sp's tp={sequence_tp}" if sequence_tp > 1 else ""
        raise ConfigError(f"context parallelism cuts each sequence into 2 x cp = {2 * cp} equal chunks{again}, but "
                          f"the sequence length is {seq_len}; use a length divisible by {multiple} (e.g. "
                          f"{max(fits, multiple)}) or another --cp")


def shard_batch(batch: dict[str, torch.Tensor], rank: int, cp: int) -> dict[str, torch.Tensor]:
    """This rank's share of a micro-batch: every field whose second dimension is the sequence, cut to
    the rank's positions (token ids, token-aligned labels, the padding mask); others whole."""
    seq_len = _sequence_length(batch)
    index = shard_positions(seq_len, rank, cp, device=next(iter(batch.values())).device)
    return {key: value.index_select(1, index) if value.dim() >= 2 and value.shape[1] == seq_len else value
            for key, value in batch.items()}


def _sequence_length(batch: dict[str, torch.Tensor]) -> int:
    main = batch.get("input_ids", batch.get("inputs"))
    if main is None or main.dim() < 2:
        raise ConfigError(f"context parallelism splits the sequence (dimension 1) of the batch's input_ids or "
                          f"inputs; got fields {sorted(batch)} with shapes "
                          f"{ {k: tuple(v.shape) for k, v in batch.items()} }")
    return main.shape[1]
