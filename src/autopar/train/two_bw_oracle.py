"""PipeDream-2BW's update rule on whole models: the single-process oracle of the pipelined 2BW.

    W(t+1) = opt(W(t), grad f_t(W(t-1))),   W(-1) = W(0)

where f_t is step t's loss over all of its micro-batches (every replica's), exactly as the
synchronous trainer forms it, and `opt` is the configured optimizer (SGD: W(t) - lr * g).
This is what the no-flush pipeline computes (pipeline/async_schedules.py): each stage runs
every micro-batch of step t on the weights before the last update, and updates the newest.
With one process it is the reference the pipelined runs are tested against; with several it
is 2BW's rule over data parallelism alone (gradients summed as usual). It keeps the older
version as a copy and swaps it in for the forward and backward.
"""

from __future__ import annotations

import torch

from .engine import DataParallelEngine


class DelayOneDataParallelEngine(DataParallelEngine):
    """The whole model per replica; step t's gradient is taken at W(t-1) and applied to W(t)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.older = [p.detach().clone() for p in self.sync.params]

    def forward_backward(self, batches, loss_fn) -> torch.Tensor:
        newest = [p.detach().clone() for p in self.sync.params]
        with torch.no_grad():
            for p, old in zip(self.sync.params, self.older):
                p.copy_(old)
        try:
            return super().forward_backward(batches, loss_fn)
        finally:
            with torch.no_grad():
                for p, new in zip(self.sync.params, newest):
                    p.copy_(new)
            self.older = newest
