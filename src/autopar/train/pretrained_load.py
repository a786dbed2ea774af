"""Pretrained weights read into a set-up model: each rank reads only the tensors (and tensor-parallel
slices) it holds, and the run records how much every rank read and how long it took."""

from __future__ import annotations

import time
from typing import Any

import torch.distributed as dist
from torch import nn


def load_pretrained(pretrained: Any, model: nn.Module, tensor_parallel: Any) -> tuple[int, dict[str, Any]]:
    """(bytes this rank read, run.json entries over every rank). Collective."""
    began = time.perf_counter()
    read = pretrained.load_into(model, None if tensor_parallel is None else tensor_parallel.file_slices)
    seconds = time.perf_counter() - began
    per_rank: list = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, (read, seconds))
    return read, {"pretrained": f"{pretrained.folder} (MB read per rank: {[round(b / 1e6, 2) for b, _ in per_rank]})",
                  "pretrained_bytes_read": [b for b, _ in per_rank],
                  "pretrained_load_s": [round(s, 3) for _, s in per_rank]}
