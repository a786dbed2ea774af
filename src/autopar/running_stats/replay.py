"""Replaying one process's running-statistics updates from every replica's recorded micro-batches.

The global batch's micro-batches in one process's order are replica 0's micro-batches
0..A-1, then replica 1's, and so on (data/sampler.py gives each replica a contiguous slice of
the global batch, cut into micro-batches in order). At the end of a step the replicas of a
stage (its dp group; tp ranks hold the same replicated statistics and replay alike) gather
their records, one flat tensor each, and every one of them applies the same updates in that
order to its own buffers, on the device and without a host read:

    num_batches_tracked += 1
    m = momentum, or 1 / num_batches_tracked when momentum is None (a cumulative average)
    running_mean <- (1 - m) running_mean + m * mean
    running_var  <- (1 - m) running_var  + m * unbiased variance

computed in float64 and rounded to the buffer's dtype after each micro-batch, as the kernel
rounds its buffer. A micro-batch a layer did not run in (a branch it skipped) is no update.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from .record import StepStatistics, recording


@dataclass
class _Layer:
    name: str
    momentum: float | None
    running_mean: torch.Tensor
    running_var: torch.Tensor
    num_batches_tracked: torch.Tensor | None

    @property
    def channels(self) -> int:
        return self.running_mean.numel()


class RunningStatsReplay:
    """This rank's BatchNorm buffers, kept as one process keeps them over the global batch's micro-batches.

    `holder`: the module whose buffers this rank trains (the whole model, or its pipeline stages under
    the model's names); `momenta`: layer name -> momentum (None: cumulative average), from the user's
    model; `group`: the replicas of this rank's stage, of which this is `dp_rank`; `gather`: False where
    every replica already recorded the same statistics (--batchnorm sync, sync.py)."""

    def __init__(self, holder: nn.Module, momenta: dict[str, float | None], group, dp_rank: int, dp_size: int,
                 gather: bool = True):
        buffers = dict(holder.named_buffers())
        prefix = lambda layer: f"{layer}." if layer else ""  # noqa: E731
        self.layers = [_Layer(name, momentum, buffers[f"{prefix(name)}running_mean"],
                              buffers[f"{prefix(name)}running_var"], buffers.get(f"{prefix(name)}num_batches_tracked"))
                       for name, momentum in sorted(momenta.items()) if f"{prefix(name)}running_mean" in buffers]
        self.group, self.dp_rank, self.dp_size = group, dp_rank, dp_size if gather else 1

    def __bool__(self) -> bool:
        return bool(self.layers)

    @contextlib.contextmanager
    def step(self, micro_batches: int) -> Iterator[None]:
        """Around one step's forwards and backwards of `micro_batches` local micro-batches: record, then replay."""
        if not self.layers:
            yield
            return
        stats = StepStatistics()
        with recording(stats):
            yield
        self._replay(self._gather(stats, micro_batches), micro_batches * self.dp_size)

    def _gather(self, stats: StepStatistics, micro_batches: int) -> torch.Tensor:
        """[global micro-batch, per layer: (present, mean..., var...)] in float64, every replica's rows in order."""
        device = self.layers[0].running_mean.device
        width = sum(1 + 2 * layer.channels for layer in self.layers)
        one, zero = (torch.full((1,), v, dtype=torch.float64, device=device) for v in (1.0, 0.0))
        parts = []  # one concatenation, not a copy per (micro-batch, layer)
        for i in range(micro_batches):
            for layer in self.layers:
                found = stats.values.get((layer.name, i))
                if found is None:
                    parts += [zero, torch.zeros(2 * layer.channels, dtype=torch.float64, device=device)]
                else:
                    parts += [one, found[0].reshape(-1).to(torch.float64), found[1].reshape(-1).to(torch.float64)]
        local = torch.cat(parts).view(micro_batches, width)
        if self.dp_size == 1:
            return local
        tagged = torch.cat([torch.full((micro_batches, 1), float(self.dp_rank), dtype=torch.float64, device=device),
                            local], dim=1)  # each part says whose it is: ordered by the sampler's dp rank
        gathered = [torch.empty_like(tagged) for _ in range(self.dp_size)]
        dist.all_gather(gathered, tagged, group=self.group)
        by_replica = torch.stack(gathered)  # [replicas, micro-batches, 1 + width]
        order = torch.argsort(by_replica[:, 0, 0])
        return by_replica[order, :, 1:].reshape(self.dp_size * micro_batches, width)

    @torch.no_grad()
    def _replay(self, rows: torch.Tensor, total: int) -> None:
        """The updates of `total` micro-batches, every layer of one buffer dtype at once (one loop over the
        micro-batches, not over layers x micro-batches: a ResNet has dozens of norms)."""
        offsets, offset = [], 0
        for layer in self.layers:
            offsets.append(offset)
            offset += 1 + 2 * layer.channels
        by_dtype: dict[torch.dtype, list[tuple[_Layer, int]]] = {}
        for layer, start in zip(self.layers, offsets):
            by_dtype.setdefault(layer.running_mean.dtype, []).append((layer, start))
        for dtype, group in by_dtype.items():
            self._replay_group(rows, total, dtype, group)

    @staticmethod
    def _replay_group(rows: torch.Tensor, total: int, dtype: torch.dtype, group: list[tuple[_Layer, int]]) -> None:
        device = rows.device
        widths = [layer.channels for layer, _ in group]
        layer_of_channel = torch.tensor([i for i, c in enumerate(widths) for _ in range(c)], device=device)
        per_channel = lambda per_layer: per_layer[..., layer_of_channel]  # noqa: E731 (no host read, unlike repeat_interleave)
        present = rows[:, [start for _, start in group]]  # [micro-batches, layers]: 0 where a layer did not run
        means = torch.cat([rows[:, s + 1:s + 1 + layer.channels] for layer, s in group], dim=1)
        variances = torch.cat([rows[:, s + 1 + layer.channels:s + 1 + 2 * layer.channels] for layer, s in group], dim=1)
        mean = torch.cat([layer.running_mean.reshape(-1).double() for layer, _ in group])
        var = torch.cat([layer.running_var.reshape(-1).double() for layer, _ in group])
        count = torch.stack([layer.num_batches_tracked.double() if layer.num_batches_tracked is not None
                             else torch.zeros((), dtype=torch.float64, device=device) for layer, _ in group])
        cumulative = torch.tensor([layer.momentum is None for layer, _ in group], device=device)
        momentum = torch.tensor([0.0 if layer.momentum is None else layer.momentum for layer, _ in group],
                                dtype=torch.float64, device=device)
        for g in range(total):
            count = count + present[g]
            factor = per_channel(torch.where(cumulative, 1.0 / count.clamp_min(1.0), momentum) * present[g])
            mean = ((1 - factor) * mean + factor * means[g]).to(dtype).double()  # rounded as the buffer is
            var = ((1 - factor) * var + factor * variances[g]).to(dtype).double()
        for (layer, _), m, v, c in zip(group, mean.split(widths), var.split(widths), count):
            layer.running_mean.copy_(m.view_as(layer.running_mean))
            layer.running_var.copy_(v.view_as(layer.running_var))
            if layer.num_batches_tracked is not None:
                layer.num_batches_tracked.copy_(c)
