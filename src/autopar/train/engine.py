"""How one optimizer step's forward and backward run with the whole model on every replica.

The engines (this one, and those of pipeline/, gossip/, async_sgd/, sparse/) expose the same few
operations to the trainer:
- `module`: the nn.Module whose parameters this rank trains (for the optimizer and
  checkpoints; parameter names are always the user's model's own);
- `forward_backward(batches, scale)`: every micro-batch of this replica, gradients
  synchronised; returns this rank's share of the loss (summed over ranks = the loss);
- `clip_gradients(max_norm)`: global gradient norm, clipped;
- `eval_sums(batches)`: (loss sum, target count) this rank contributes, no gradients;
- `token_loss_sum(output, batch)`: the default loss (token cross-entropy sum), which under
  tensor parallelism reads logits sharded over the vocabulary.

Tensor parallelism runs through the pipeline engine (pipeline/engine.py; a single stage when
pp=1), because it rewrites the traced stage graphs.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..dropout import eager_micro_batch
from ..errors import AutoparError
from ..mesh import ProcessMesh
from ..models.materialize import materialize
from ..running_stats import EagerBatchNorms, RunningStatsReplay
from ..zero import ShardedGradients, gradient_sync, to_compute_dtype
from .base import EngineBase
from .loss import Batch, count_targets, token_loss_sum

LossFn = Callable[[Any, Batch], torch.Tensor]  # (model output, batch) -> this micro-batch's loss share


class DataParallelEngine(EngineBase):
    """The whole model on every rank; gradients summed over the dp group."""

    def __init__(self, model: nn.Module, mesh: ProcessMesh, *, device: torch.device, seed: int,
                 forward_fn: Callable, autocast: Callable, zero: int = 0, param_dtype: torch.dtype = torch.float32,
                 batchnorm: str = "exact"):
        """zero 1/2: gradients reduce-scattered into shards (zero/); param_dtype bf16: fp32 masters kept there;
        batchnorm: Strategy.batchnorm (exact | sync)."""
        self.module = materialize(model, device, seed=seed)
        self.mesh, self.forward_fn, self.autocast = mesh, forward_fn, autocast
        broadcast_from_first_replica(self.module, mesh)
        to_compute_dtype(self.module.parameters(), param_dtype)
        self.sync = gradient_sync(self.module.parameters(), mesh.group("dp"), zero=zero,
                                  master_weights=param_dtype != torch.float32, per_micro_batch=True)
        self.batch_norms, self.running_stats = whole_model_running_stats(self.module, mesh, batchnorm)

    def forward_backward(self, batches: list[Batch], loss_fn: LossFn) -> torch.Tensor:
        with self.running_stats.step(len(batches)):  # BatchNorm buffers: one process's updates, after the step
            if isinstance(self.sync, ShardedGradients) and self.sync.per_micro_batch:  # zero 2: reduce each one
                return accumulate_gradients(self.module, self.forward_fn, self.autocast, batches, loss_fn,
                                            after_each=self.sync.finish)
            total = accumulate_gradients(self.module, self.forward_fn, self.autocast, batches, loss_fn,
                                         self.sync.no_sync)
            self.sync.finish()
            return total

    def clip_gradients(self, max_norm: float) -> float:
        if isinstance(self.sync, ShardedGradients):
            norm = math.sqrt(float(self.sync.squared_norms(lambda p: 0).sum()))
            if norm > max_norm and math.isfinite(max_norm):
                self.sync.scale_gradients(max_norm / (norm + 1e-6))
            return norm
        return float(torch.nn.utils.clip_grad_norm_(self.sync.params, max_norm))

    @torch.no_grad()
    def eval_sums(self, batches: list[Batch], eval_loss: Callable) -> torch.Tensor:
        return whole_model_eval_sums(self.module, self.forward_fn, self.autocast, batches, eval_loss)

    def zero_grad(self) -> None:
        self.sync.zero_grad()

    def close(self) -> None:
        self.sync.remove()
        self.batch_norms.remove()


def whole_model_running_stats(module: nn.Module, mesh: ProcessMesh,
                              batchnorm: str = "exact") -> tuple[EagerBatchNorms, RunningStatsReplay]:
    """A whole model's BatchNorms recorded per micro-batch and replayed over the replicas (running_stats/);
    with --batchnorm sync, normalised over the replicas' micro-batches together."""
    sync = batchnorm == "sync" and mesh.dp_size > 1
    # one replica: torch's own updates are one process's, bitwise; nothing to record
    batch_norms = EagerBatchNorms(module if mesh.dp_size > 1 else nn.Module(),
                                  sync_group=mesh.group("dp") if sync else None)
    momenta = {name: m.momentum for name, m in batch_norms.layers.items()}
    return batch_norms, RunningStatsReplay(module, momenta, mesh.group("dp"), mesh.dp_rank, mesh.dp_size,
                                           gather=not sync)


def accumulate_gradients(module: nn.Module, forward_fn: Callable, autocast: Callable, batches: list[Batch],
                         loss_fn: LossFn, no_sync: Callable | None = None,
                         after_each: Callable[[], None] | None = None) -> torch.Tensor:
    """Forward and backward of every micro-batch of a replica holding the whole model; returns the
    summed loss. `no_sync` (a context factory) defers gradient communication until the last one;
    `after_each()` runs after every micro-batch's backward (ZeRO-2 reduces each one)."""
    total = torch.zeros((), device=batches[0]["labels"].device)
    module.train()
    for i, batch in enumerate(batches):
        last = i == len(batches) - 1
        with (contextlib.nullcontext() if last or no_sync is None else no_sync()), eager_micro_batch(i):
            with autocast():
                loss = loss_fn(forward_fn(module, batch), batch)
            loss.backward()
        if after_each is not None:
            after_each()
        total += loss.detach().float()
    return total


@torch.no_grad()
def whole_model_eval_sums(module: nn.Module, forward_fn: Callable, autocast: Callable, batches: list[Batch],
                          eval_loss: Callable) -> torch.Tensor:
    """[loss sum, weight] of a replica holding the whole model, in eval mode (dropout off)."""
    module.eval()
    sums = torch.zeros(2, dtype=torch.float64, device=batches[0]["labels"].device)
    for batch in batches:
        with autocast():
            sums += eval_loss(forward_fn(module, batch), batch)
    module.train()
    return sums


def broadcast_from_first_replica(module: nn.Module, mesh: ProcessMesh) -> None:
    """Every replica starts from replica 0's weights (a no-op after seeded meta materialisation)."""
    if mesh.dp_size == 1:
        return
    group = mesh.group("dp")
    broadcast_state(module, group, src=dist.get_global_rank(group, 0))


def broadcast_state(module: nn.Module, group: Any, *, src: int, device: torch.device | None = None) -> None:
    """Overwrite `module`'s parameters and buffers with global rank `src`'s, over `group` (sent from
    `device` when given: a model still on the CPU under a GPU backend)."""
    unique = list({id(t): t for t in module.state_dict(keep_vars=True).values()}.values())
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in unique:
        by_dtype.setdefault(t.dtype, []).append(t)
    with torch.no_grad():
        for tensors in by_dtype.values():
            flat = torch.cat([t.detach().reshape(-1) for t in tensors])
            flat = flat.to(device) if device is not None else flat
            dist.broadcast(flat, src=src, group=group)
            offset = 0
            for t in tensors:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()


def on_every_rank(build: Callable[[], Any]) -> Any:
    """`build()`, where a user error one rank finds is raised on every rank (the others would wait on it)."""
    error = None
    try:
        result = build()
    except AutoparError as exc:
        error = exc
    messages: list = [None] * dist.get_world_size()
    dist.all_gather_object(messages, None if error is None else (type(error), str(error)))
    if error is not None:
        raise error
    found = next((m for m in messages if m is not None), None)
    if found is not None:
        kind, text = found
        raise kind(f"(found on rank {messages.index(found)}) {text}")
    return result


def eval_token_sums(output: Any, batch: Batch, loss_sum: Callable = token_loss_sum) -> torch.Tensor:
    return torch.stack([loss_sum(output, batch).double(),
                        torch.tensor(count_targets(batch), dtype=torch.float64, device=batch["labels"].device)])
