"""ZeRO-3: parameters, gradients and optimizer state sharded over the replicas, with torch's FSDP2.

Why FSDP2 (`torch.distributed.fsdp.fully_shard`) here and not our own: with the whole model on
every replica (dp only), gathering each block's parameters just before its forward and backward
and freeing them after is exactly what FSDP2 does, per module, overlapped with compute, on
DTensors that torch's optimizers, clipping and distributed checkpoints already understand. With
pp or tp, the pipeline engine shards each stage (one FSDP2 unit per stage) over its dp group
instead: zero/fully_sharded.py.

Every repeated layer the pipeline would cut between (trace/stacks.py: the blocks of a ModuleList,
Sequential, ModuleDict or of a module's attributes) becomes one FSDP unit, then the root
(embeddings, head, norms, and everything else); a model with no stack is one unit, gathered
whole. Gradients are summed, not averaged
(divide factor 1: the trainer pre-scales each replica's loss, see train/loss.py).
Under --dtype bf16, FSDP2's MixedPrecisionPolicy gathers bf16 parameters and reduce-scatters bf16
gradients into the fp32 sharded parameters (the masters) and fp32 gradient shards; unlike the
ZeRO-1/2 path, micro-batches of one step accumulate in the unsharded bf16 gradient (FSDP2's own
no-sync accumulation), not in fp32.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from ..mesh import ProcessMesh
from ..models.materialize import materialize
from ..trace import Stack, find_stacks
from .base import EngineBase
from .engine import (LossFn, accumulate_gradients, broadcast_from_first_replica, whole_model_eval_sums,
                     whole_model_running_stats)
from .loss import Batch


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class FullyShardedEngine(EngineBase):
    """The whole model, its parameters sharded over the dp group and gathered block by block (FSDP2)."""

    def __init__(self, model: nn.Module, mesh: ProcessMesh, *, device: torch.device, seed: int,
                 forward_fn: Callable, autocast: Callable, param_dtype: torch.dtype = torch.float32,
                 batchnorm: str = "exact"):
        self.module = materialize(model, device, seed=seed)
        self.mesh, self.forward_fn, self.autocast = mesh, forward_fn, autocast
        broadcast_from_first_replica(self.module, mesh)
        dp_mesh = mesh.device_mesh["dp"]
        policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=param_dtype,
                                      output_dtype=None, cast_forward_inputs=True)
        self.stacks: list[Stack] = find_stacks(self.module)
        self.unit_paths = [path for stack in self.stacks for path in stack.member_paths
                           if next(self.module.get_submodule(path).parameters(), None) is not None]
        self.units: list[FSDPModule] = [fully_shard(self.module.get_submodule(path), mesh=dp_mesh, mp_policy=policy)
                                        for path in self.unit_paths]
        self.units.append(fully_shard(self.module, mesh=dp_mesh, mp_policy=policy))
        for unit in self.units:
            unit.set_gradient_divide_factor(1.0)  # a sum, as the trainer pre-scales each replica's loss
            unit.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no pre-multiplied sum)
        self.params = list({id(p): p for p in self.module.parameters() if p.requires_grad}.values())
        self.batch_norms, self.running_stats = whole_model_running_stats(self.module, mesh, batchnorm)

    def banner_lines(self) -> list[str]:
        """Which modules are gathered one at a time: the peak memory depends on it."""
        if not self.unit_paths:
            return ["ZeRO-3: one FSDP2 unit, the whole model (no repeated layers found), gathered at once"]
        return [f"ZeRO-3: one FSDP2 unit per layer of {'; '.join(s.describe() for s in self.stacks)} "
                f"({len(self.unit_paths)} units), plus one for the rest of the model"]

    @contextlib.contextmanager
    def _no_sync(self):
        self.module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)

    def forward_backward(self, batches: list[Batch], loss_fn: LossFn) -> torch.Tensor:
        with self.running_stats.step(len(batches)):  # BatchNorm buffers: one process's updates, after the step
            return accumulate_gradients(self.module, self.forward_fn, self.autocast, batches, loss_fn, self._no_sync)

    def clip_gradients(self, max_norm: float) -> float:
        device = self.params[0].device
        squares = torch.zeros((), dtype=torch.float64, device=device)
        for p in self.params:
            if p.grad is not None:
                squares += _local(p.grad).double().square().sum()
        dist.all_reduce(squares, group=self.mesh.group("dp"))
        norm = math.sqrt(float(squares))
        if norm > max_norm and math.isfinite(max_norm):
            scale = max_norm / (norm + 1e-6)
            for p in self.params:
                if p.grad is not None:
                    _local(p.grad).mul_(scale)
        return norm

    @torch.no_grad()
    def eval_sums(self, batches: list[Batch], eval_loss: Callable) -> torch.Tensor:
        return whole_model_eval_sums(self.module, self.forward_fn, self.autocast, batches, eval_loss)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def local_bytes(self) -> dict[str, int]:
        """Bytes of parameters and gradients this rank holds (its shards)."""
        return {"params": sum(_local(p).numel() * _local(p).element_size() for p in self.params),
                "grads": sum(_local(p.grad).numel() * _local(p.grad).element_size()
                             for p in self.params if p.grad is not None)}

    def close(self) -> None:
        self.batch_norms.remove()
