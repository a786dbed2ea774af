"""The data-parallel engine with each mixture-of-experts layer's experts sharded over ep ranks (--ep).

Why inside data parallelism: as in Megatron and DeepSpeed, the ep ranks of an expert group are
data-parallel replicas that agree to hold different experts. Every rank keeps the dense weights
(attention, norms, routers, shared experts) whole, trains on its own micro-batches, and sends each
token's hidden row to the rank holding the expert the router chose (experts/dispatch.py). So:
- dense gradients are summed over all dp ranks, as in the plain data-parallel engine;
- an expert's gradient already holds the contributions of the whole ep group's tokens (the
  all-to-all's backward brought them); it is summed over the dp/ep ranks holding the same experts;
- the gradient norm adds the ep ranks' expert parts to the dense part, once.
The expert layers come from the traced graph (experts/detect.py); a model with none is refused,
and checkpoints hold whole expert tensors (gathered over the ep group on save, cut on load).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from ..data_parallel import GradientSynchronizer
from ..errors import ConfigError
from ..experts import ExpertPlan, ShardedExperts, find_experts, shard_experts
from ..mesh import ProcessMesh
from ..models.materialize import materialize
from .base import EngineBase
from .engine import (LossFn, accumulate_gradients, broadcast_from_first_replica, on_every_rank,
                     whole_model_eval_sums, whole_model_running_stats)
from .fields import traced_call
from .loss import Batch


def expert_plan(model: nn.Module, example_batch: Batch, device: torch.device) -> ExpertPlan:
    """The model's expert layers, from its graph traced on one micro-batch (on meta when the model is)."""
    from ..models.hf import turn_off_kv_cache
    from ..trace import trace

    turn_off_kv_cache(model)
    real = not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    traced_on = next((t.device for t in model.parameters()), torch.device("cpu")) if real else torch.device("meta")
    was_training = model.training
    model.train()
    graph = trace(model, *traced_call(example_batch, traced_on), device=device)
    model.train(was_training)
    return find_experts(graph, model)


def expert_groups(dp_group, ep: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None, int]:
    """(this rank's ep group, the group of ranks holding the same experts or None when alone, ep rank).
    The ep groups are consecutive dp ranks; every rank creates every group (new_group is collective)."""
    ranks = dist.get_process_group_ranks(dp_group)
    me = ranks.index(dist.get_rank())
    mine = replicas = None
    for start in range(0, len(ranks), ep):
        group = dist.new_group(ranks[start:start + ep])
        if start <= me < start + ep:
            mine = group
    if len(ranks) > ep:
        for offset in range(ep):
            group = dist.new_group(ranks[offset::ep])
            if me % ep == offset:
                replicas = group
    return mine, replicas, me % ep


class ExpertParallelEngine(EngineBase):
    """Dense weights replicated over dp; each expert layer's experts split over ep ranks of every dp group."""

    def __init__(self, model: nn.Module, mesh: ProcessMesh, *, device: torch.device, seed: int,
                 forward_fn: Callable, autocast: Callable, example_batch: Batch, ep: int, batchnorm: str = "exact"):
        self.plan = on_every_rank(lambda: _plan_or_refuse(model, example_batch, device, ep))
        self.module = materialize(model, device, seed=seed)
        self.mesh, self.forward_fn, self.autocast, self.ep = mesh, forward_fn, autocast, ep
        broadcast_from_first_replica(self.module, mesh)
        self.ep_group, replicas, self.ep_rank = expert_groups(mesh.group("dp"), ep)
        self.experts: ShardedExperts = shard_experts(self.module, self.plan, self.ep_group, ep=ep, ep_rank=self.ep_rank)
        self.tensor_parallel = self.experts  # what checkpoints ask to gather whole and cut again
        names = dict(self.module.named_parameters())
        self.expert_params = [names[n] for n in self.plan.expert_params if names[n].requires_grad]
        expert_ids = {id(p) for p in self.expert_params}
        dense = [p for p in self.module.parameters() if id(p) not in expert_ids]
        self.sync = GradientSynchronizer(dense, mesh.group("dp"))
        self.expert_sync = GradientSynchronizer(self.expert_params, replicas) if replicas is not None else None
        self.batch_norms, self.running_stats = whole_model_running_stats(self.module, mesh, batchnorm)
        self.zero_grad()

    @contextlib.contextmanager
    def _no_sync(self):
        with contextlib.ExitStack() as stack:
            stack.enter_context(self.sync.no_sync())
            if self.expert_sync is not None:
                stack.enter_context(self.expert_sync.no_sync())
            yield

    def forward_backward(self, batches: list[Batch], loss_fn: LossFn) -> torch.Tensor:
        for dispatch in self.experts.forwards.values():
            dispatch.reset_counts()
        with self.running_stats.step(len(batches)):
            total = accumulate_gradients(self.module, self.forward_fn, self.autocast, batches, loss_fn, self._no_sync)
            self.sync.finish()
            if self.expert_sync is not None:
                self.expert_sync.finish()
            return total

    def clip_gradients(self, max_norm: float) -> float:
        """The norm of the whole model's gradient: dense parts (equal on every rank) plus every expert once."""
        expert_ids = {id(p) for p in self.expert_params}
        dense = [p.grad for p in self.sync.params if p.grad is not None and id(p) not in expert_ids]
        experts = [p.grad for p in self.expert_params if p.grad is not None]
        squares = torch.stack([sum((g.double() ** 2).sum() for g in grads) if grads else torch.zeros((), dtype=torch.float64)
                               for grads in (dense, experts)])
        dist.all_reduce(squares[1:], group=self.ep_group)
        norm = math.sqrt(float(squares.sum()))
        if norm > max_norm and math.isfinite(max_norm):
            for g in [*dense, *experts]:
                g.mul_(max_norm / (norm + 1e-6))
        return norm

    @torch.no_grad()
    def eval_sums(self, batches: list[Batch], eval_loss: Callable) -> torch.Tensor:
        return whole_model_eval_sums(self.module, self.forward_fn, self.autocast, batches, eval_loss)

    def zero_grad(self) -> None:
        self.sync.zero_grad()
        if self.expert_sync is not None:
            self.expert_sync.zero_grad()
        else:  # an expert no token reached still gets a zero gradient, as on one process
            for p in self.expert_params:
                p.grad = torch.zeros_like(p)

    def step_stats(self, elapsed: float, peak_bytes: int) -> dict:
        """Per layer, over the whole dp group since the step began: tokens per expert, per ep rank, and the
        load imbalance (max / mean) of each. One all-reduce, on steps that write metrics only."""
        forwards = list(self.experts.forwards.items())
        if not forwards:
            return {}
        counts = torch.cat([f.tokens_per_expert for _, f in forwards]).to(next(self.module.parameters()).device)
        dist.all_reduce(counts, group=self.mesh.group("dp"))
        counts, stats, offset = counts.cpu(), {}, 0
        for name, f in forwards:
            per_expert = counts[offset:offset + f.num_experts]
            offset += f.num_experts
            per_rank = per_expert.view(self.ep, -1).sum(1)
            stats[name] = {"tokens_per_expert": per_expert.tolist(), "tokens_per_rank": per_rank.tolist(),
                           "expert_imbalance": _imbalance(per_expert), "rank_imbalance": _imbalance(per_rank)}
        return {"experts": stats}

    def banner_lines(self) -> list[str]:
        return [self.experts.summary(self.mesh.dp_size)]

    def run_files(self) -> dict[str, str]:
        return {"expert_plan.txt": self.plan.table(self.ep) + "\n"}

    def run_info(self) -> dict:
        return {"ep": self.ep, "expert_layers": [layer.experts for layer in self.plan.layers]}

    def close(self) -> None:
        self.sync.remove()
        if self.expert_sync is not None:
            self.expert_sync.remove()
        self.batch_norms.remove()


def _imbalance(counts: torch.Tensor) -> float:
    mean = float(counts.double().mean())
    return round(float(counts.max()) / mean, 4) if mean > 0 else 1.0


def _plan_or_refuse(model: nn.Module, example_batch: Batch, device: torch.device, ep: int) -> ExpertPlan:
    plan = expert_plan(model, example_batch, device)
    if not plan.layers:
        raise ConfigError(f"--ep {ep} needs mixture-of-experts layers to shard, and none was recognised in "
                          f"{type(model).__name__}:\n{plan.table()}\nuse --ep 1 (experts, if any, replicated)")
    uneven = [f"{layer.experts} ({layer.num_experts})" for layer in plan.layers if layer.num_experts % ep]
    if uneven:
        raise ConfigError(f"--ep {ep} does not divide the expert count of {', '.join(uneven)}; choose an --ep that "
                          f"divides it")
    return plan
