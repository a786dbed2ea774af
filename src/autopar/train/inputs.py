"""What a step trains on: this rank's micro-batches on the device, and the loss as one process would see it.

`BatchLoader` exists before the engine (engines that run ahead, like PipeDream-2BW's look-ahead,
load the batches of later steps themselves); `Losses` needs the engine (its token loss, its
tensor-parallel logits) and its data-parallel group (the global target count).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Dataset, default_collate

from ..config import TrainConfig
from ..data.sampler import GlobalBatchSampler
from ..models.output import aux_loss_of
from .engine import eval_token_sums
from .loss import Batch, LossFn, align_labels, as_batch, main_input, target_count


class BatchLoader:
    """Samples to batches on this rank's device; a step's micro-batches of this replica."""

    def __init__(self, *, config: TrainConfig, sampler: GlobalBatchSampler, device: torch.device,
                 shift_labels: bool, dp_rank: int, dp_size: int):
        self.config, self.sampler, self.device, self.shift_labels = config, sampler, device, shift_labels
        self.dp_rank, self.dp_size = dp_rank, dp_size

    def load(self, indices: list[int], data: Dataset) -> Batch:
        batch = align_labels(default_collate([as_batch(data[i]) for i in indices]), self.shift_labels)
        return {k: v.to(self.device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}

    def local_batches(self, step: int, data: Dataset) -> list[Batch]:
        micro = self.sampler.local_micro_batches(step, dp_rank=self.dp_rank, dp_size=self.dp_size,
                                                 micro_batch_size=self.config.micro_batch_size)
        return [self.load(indices, data) for indices in micro]

    def local_positions(self, step: int) -> list[list[int]]:
        """The global sample positions of this replica's micro-batches (what dropout masks are drawn from)."""
        return self.sampler.local_micro_positions(step, dp_rank=self.dp_rank, dp_size=self.dp_size,
                                                  micro_batch_size=self.config.micro_batch_size)


class Losses:
    """The training loss share of a micro-batch and the eval sums, normalised over the global batch."""

    def __init__(self, *, engine: Any, loss_fn: LossFn | None, config: TrainConfig, device: torch.device,
                 dp_group: Any, aux_coef: float = 0.0):
        """aux_coef: the weight of the model's own auxiliary (load-balancing) loss, added to the default loss."""
        self.engine, self.loss_fn, self.config, self.device, self.dp_group = engine, loss_fn, config, device, dp_group
        self.aux_coef = aux_coef

    @property
    def token_loss(self) -> bool:
        """The default loss: token cross-entropy normalised by the global target count."""
        return self.loss_fn is None

    def train(self, output: Any, batch: Batch, global_count: torch.Tensor | None) -> torch.Tensor:
        if self.loss_fn is None:
            loss = self.engine.token_loss_sum(output, batch) / global_count
            aux = aux_loss_of(output) if self.aux_coef else None
            if aux is not None:  # the model's own value for this micro-batch, weighted by its share of the batch
                loss = loss + self.aux_coef * aux.float() * (len(main_input(batch)) / self.config.global_batch_size)
            return loss
        if self.engine.tensor_parallel is not None:  # a custom loss sees whole logits
            output = self.engine.tensor_parallel.full_output(output)
        samples = len(main_input(batch))
        return self.loss_fn(output, batch) * (samples / self.config.global_batch_size)

    def global_target_count(self, batches: list[Batch]) -> torch.Tensor | None:
        if self.loss_fn is not None:
            return None
        # counted on the device: a host count would wait for the batch to land on the GPU
        count = torch.stack([target_count(b) for b in batches]).sum().float()
        with self.engine.waits.timed("data_parallel"):
            dist.all_reduce(count, group=self.dp_group)
        return count.clamp_min(1.0)

    def eval_pair(self, output: Any, batch: Batch) -> torch.Tensor:
        """[loss sum, weight] of one eval micro-batch."""
        if self.loss_fn is None:
            return eval_token_sums(output, batch, self.engine.token_loss_sum)
        if self.engine.tensor_parallel is not None:
            output = self.engine.tensor_parallel.full_output(output)
        n = len(main_input(batch))
        return torch.stack([self.loss_fn(output, batch).double() * n,
                            torch.tensor(float(n), dtype=torch.float64, device=self.device)])
