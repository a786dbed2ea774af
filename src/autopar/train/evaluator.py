"""Evaluation on held-out data, and when the loop runs it (every --eval-every steps and after the last).

The eval batches are fixed global batches, split over the ranks exactly as training batches
are, so every layout reduces the same numbers in the same precision as one process.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from ..config import TrainConfig
from ..data.sampler import GlobalBatchSampler
from .inputs import BatchLoader, Losses


class Evaluator:
    """The mean eval loss over `eval_batches` global batches; `due` says after which steps."""

    def __init__(self, *, engine: Any, loader: BatchLoader, losses: Losses, eval_data: Dataset | None,
                 config: TrainConfig, device: torch.device, replica: tuple[int, int]):
        self.engine, self.loader, self.losses, self.eval_data = engine, loader, losses, eval_data
        self.config, self.device, self.replica = config, device, replica

    def due(self, number: int) -> bool:
        """After step `number` (1-based): every --eval-every steps, and always after the last step."""
        every = self.config.eval_every
        return bool(every and number % every == 0) or number == self.config.steps

    def evaluate(self, replica: tuple[int, int] | None = None) -> float | None:
        """Mean loss over the fixed eval batches (None without eval data). Collective.

        `replica` is (index, count) of this rank among the ranks that split the eval batches, exactly as the
        training batches are split (default: its dp coordinates); (0, 0) takes part in the sum only. The split
        must be the training split: a parameter server's lone worker then evaluates the whole batch in one
        micro-batch as one process does, the same reduction in the same precision.
        """
        if self.eval_data is None:
            return None
        cfg = self.config
        index, count = replica if replica is not None else self.replica
        shares = self.loader.sampler.shares if count == self.loader.dp_size else None  # the training split
        sampler = GlobalBatchSampler(len(self.eval_data), cfg.global_batch_size, seed=cfg.seed, shuffle=False,
                                     shares=shares)
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)
        for k in range(cfg.eval_batches if count else 0):
            micro = sampler.local_micro_batches(k, dp_rank=index, dp_size=count, micro_batch_size=cfg.micro_batch_size)
            batches = [self.loader.load(indices, self.eval_data) for indices in micro]
            sums += self.engine.eval_sums(batches, self.losses.eval_pair)
        dist.all_reduce(sums)
        return float(sums[0] / sums[1].clamp_min(1))
