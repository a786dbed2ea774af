"""`--batchnorm sync`: normalise with the statistics of the replicas' micro-batches together.

Like torch's SyncBatchNorm (which runs on GPUs only), but for any device and inside traced
stages: micro-batch i of every replica of a stage forms one batch of dp x its samples, whose
mean and biased variance every replica uses. The sums go through torch.distributed.nn's
differentiable all-reduce, so backward all-reduces the gradients of those sums and each
replica gets the gradient of the whole batch's loss. With one micro-batch per replica this is
one process running the global batch as a single micro-batch; with more, replica r's
micro-batch i joins the others' micro-batch i. Every replica records the same statistics, so
the running buffers need no gather: each replica replays its micro-batches' records.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.nn.functional import all_reduce


def synchronised_batch_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
                            group) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(normalised x, mean, unbiased variance) over every replica's `x` in `group` (channels on dim 1).

    The sums are taken in float64 (the CPU kernel accumulates in double too), the output in x's dtype."""
    dims = [0, *range(2, x.dim())]
    shape = [1, -1] + [1] * (x.dim() - 2)
    count = x.numel() // x.shape[1] * dist.get_world_size(group)  # every replica's micro-batch has one size
    mean = all_reduce(x.sum(dims, dtype=torch.float64), group=group) / count
    centred = x - mean.to(x.dtype).view(shape)
    squares = all_reduce(centred.square().sum(dims, dtype=torch.float64), group=group)
    invstd = torch.rsqrt(squares / count + eps).to(x.dtype)
    out = centred * invstd.view(shape)
    if weight is not None:
        out = out * weight.view(shape)
    if bias is not None:
        out = out + bias.view(shape)
    return out, mean.detach(), (squares / max(count - 1, 1)).detach()
