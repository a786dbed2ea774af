"""The model's trainable parameters seen as one flat fp32 vector, cut into contiguous server shards.

Why flat: a parameter server moves and updates parameters by key range; one flat vector
gives every worker and server the same index space, so a push or a pull is one message
per server whatever the model's structure, and a shard boundary may fall inside a
parameter. The order is `module.parameters()` (tied weights appear once), the same list
the trainer's optimizer is built from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..errors import ConfigError


@dataclass(frozen=True)
class Segment:
    """The part of one parameter that falls inside a shard: [start, stop) in the flat vector."""

    param_index: int
    start: int
    stop: int
    ndim: int  # of the original parameter (weight decay applies to >= 2-D ones, as in train/optim.py)


class FlatLayout:
    """Where each trainable parameter lives in the flat vector, and which range each server owns."""

    def __init__(self, module: nn.Module, num_shards: int):
        self.params = [p for p in module.parameters() if p.requires_grad]
        if not self.params:
            raise ConfigError("the model has no trainable parameters; a parameter server has nothing to serve")
        dtypes = {p.dtype for p in self.params}
        if dtypes != {torch.float32}:
            raise ConfigError(f"dp_mode=async needs fp32 parameters (the flat vector is fp32), got {sorted(map(str, dtypes))}")
        self.offsets = []
        total = 0
        for p in self.params:
            self.offsets.append(total)
            total += p.numel()
        self.numel = total
        if num_shards > total:
            raise ConfigError(f"{num_shards} servers for {total} parameters: every server needs at least one; "
                              f"use --servers <= {total}")
        self.bounds = [total * k // num_shards for k in range(num_shards + 1)]

    @property
    def num_shards(self) -> int:
        return len(self.bounds) - 1

    def shard_range(self, shard: int) -> tuple[int, int]:
        return self.bounds[shard], self.bounds[shard + 1]

    def segments(self, shard: int) -> list[Segment]:
        """The pieces of parameters inside `shard`, in flat order (offsets relative to the shard)."""
        lo, hi = self.shard_range(shard)
        pieces = []
        for i, (p, start) in enumerate(zip(self.params, self.offsets)):
            a, b = max(start, lo), min(start + p.numel(), hi)
            if a < b:
                pieces.append(Segment(i, a - lo, b - lo, p.ndim))
        return pieces

    @torch.no_grad()
    def gather_params(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.params])

    @torch.no_grad()
    def gather_grads(self, out: torch.Tensor) -> torch.Tensor:
        """Gradients into `out` (a parameter that got none contributes zeros)."""
        for p, start in zip(self.params, self.offsets):
            view = out[start:start + p.numel()]
            if p.grad is None:
                view.zero_()
            else:
                view.copy_(p.grad.reshape(-1))
        return out

    @torch.no_grad()
    def load_params(self, flat: torch.Tensor) -> None:
        for p, start in zip(self.params, self.offsets):
            p.copy_(flat[start:start + p.numel()].view_as(p))
