"""Deterministic distributed sampling.

The sequence of global batches is a pure function of (dataset size, global batch size,
seed, step): it does not depend on the number of replicas or the micro-batch size. Each
data-parallel rank takes its contiguous slice of the global batch and cuts it into
micro-batches. So a run on 1 process and a run on 4 train on exactly the same samples in
every step, which is what lets the equivalence tests compare them step by step, and a
resumed run continues exactly where it stopped (the position is the step number).
Uneven `shares` (data/shares.py) move the slices' boundaries, never the samples.
"""

from __future__ import annotations

import torch

from ..errors import DataError
from .shares import offsets


class GlobalBatchSampler:
    def __init__(self, num_samples: int, global_batch_size: int, *, seed: int, shuffle: bool = True,
                 shares: tuple[int, ...] | None = None):
        if num_samples < 1:
            raise DataError("the dataset is empty; it needs at least one sample")
        if shares is not None and sum(shares) != global_batch_size:
            raise DataError(f"replica shares {list(shares)} sum to {sum(shares)}, not the global batch "
                            f"({global_batch_size})")
        self.num_samples, self.global_batch_size = num_samples, global_batch_size
        self.shares = shares  # samples per replica; None: equal slices
        self.seed, self.shuffle = seed, shuffle
        self._orders: dict[int, torch.Tensor] = {}

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch not in self._orders:
            if self.shuffle:
                gen = torch.Generator().manual_seed(self.seed * 7919 + epoch)
                order = torch.randperm(self.num_samples, generator=gen)
            else:
                order = torch.arange(self.num_samples)
            self._orders = {epoch: order}  # keep only the current epoch
        return self._orders[epoch]

    def global_batch(self, step: int) -> list[int]:
        """Sample indices of global batch `step`; epochs follow each other with fresh shuffles."""
        first = step * self.global_batch_size
        indices = []
        for position in range(first, first + self.global_batch_size):
            epoch, offset = divmod(position, self.num_samples)
            indices.append(int(self._order(epoch)[offset]))
        return indices

    def local_micro_batches(self, step: int, *, dp_rank: int, dp_size: int, micro_batch_size: int) -> list[list[int]]:
        """This replica's slice of global batch `step`, cut into micro-batches."""
        batch = self.global_batch(step)
        start, size = self._slice(dp_rank, dp_size)
        mine = batch[start:start + size]
        return [mine[i:i + micro_batch_size] for i in range(0, len(mine), micro_batch_size)]

    def local_micro_positions(self, step: int, *, dp_rank: int, dp_size: int, micro_batch_size: int) -> list[list[int]]:
        """Global sample index (position in the stream of samples: step * global batch + offset) of each
        sample of `local_micro_batches`, in the same order; independent of how the batch is split."""
        start, size = self._slice(dp_rank, dp_size)
        first = step * self.global_batch_size + start
        mine = list(range(first, first + size))
        return [mine[i:i + micro_batch_size] for i in range(0, len(mine), micro_batch_size)]

    def _slice(self, dp_rank: int, dp_size: int) -> tuple[int, int]:
        """(first offset, samples) of replica `dp_rank`'s part of every global batch."""
        if self.shares is None:
            per_rank = self.global_batch_size // dp_size
            return dp_rank * per_rank, per_rank
        if len(self.shares) != dp_size:
            raise DataError(f"replica shares {list(self.shares)} are for {len(self.shares)} replicas, not {dp_size}")
        return offsets(self.shares)[dp_rank], self.shares[dp_rank]
