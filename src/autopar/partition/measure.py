"""Measured forward+backward time of every block, for the `time` partition method.

Each block is built as a one-block stage and the chain is run on real tensors: forward
stage by stage, then backward stage by stage in reverse, timing each. The median of a few
repeats is kept (these machines are noisy). This materialises the whole model once, so
it is for models that fit one process; FLOP estimates (plan.CostModel) serve the rest.
"""

from __future__ import annotations

import copy
import statistics
import time

import torch
from torch import nn

from .._torch_internals import tree_leaves
from ..models.materialize import materialize
from ..trace import ModelGraph
from .stages import StageModule, lifted_constant_values, materialize_stage, plan_stages


def _example(value: torch.Tensor, device: torch.device) -> torch.Tensor:
    if value.is_floating_point():
        return torch.randn(value.shape, dtype=value.dtype, device=device)
    return torch.zeros(value.shape, dtype=value.dtype, device=device)


def measure_block_times(graph: ModelGraph, model: nn.Module, *, device: str = "cpu", seed: int = 0,
                        repeats: int = 3) -> list[float]:
    """Seconds of forward+backward per block; also stored in graph.blocks[i].time_s."""
    specs = plan_stages(graph, list(range(len(graph.blocks) + 1)))
    full = materialize(copy.deepcopy(model), device, seed=seed)
    stages = [StageModule(graph, spec, len(specs)) for spec in specs]
    if any(v is None for stage in stages for v in stage.constants.values()):
        constants = lifted_constant_values(model, graph, torch.device(device))
        for stage in stages:
            stage.constants.update({k: constants[k] for k in stage.constants if k in constants})
    stages = [materialize_stage(stage, full, device) for stage in stages]
    target = torch.device(device)
    samples: list[list[float]] = [[] for _ in stages]
    for repeat in range(repeats + 1):  # the first pass warms up
        values = tuple(_example(v, target) for v in graph.example_inputs)
        records = []
        for i, stage in enumerate(stages):
            inputs = tuple(v.detach().requires_grad_(v.is_floating_point()) for v in values)
            began = time.perf_counter()
            out = stage(*inputs)
            if stage.is_last:
                leaves = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
                out = (sum(t.float().square().mean() for t in leaves if t.requires_grad),)
            records.append([time.perf_counter() - began, inputs, out])
            values = out
        grads: tuple = (None,)
        for i in reversed(range(len(stages))):
            forward_s, inputs, out = records[i]
            pairs = [(o, g) for o, g in zip(out, grads) if o.requires_grad]
            began = time.perf_counter()
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            if repeat:
                samples[i].append(forward_s + time.perf_counter() - began)
            grads = tuple(x.grad if x.grad is not None else torch.zeros_like(x) if x.is_floating_point() else None
                          for x in inputs)
    times = [statistics.median(s) for s in samples]
    for block, seconds in zip(graph.blocks, times):
        block.time_s = seconds
    return times
