"""Expert parallelism (--ep) in the pipeline engine: the groups, the gradient sums and the norm of sharded experts.

The ep ranks of an expert group are data-parallel replicas of one stage (and one tp rank) that hold
different experts of that stage's expert layers (experts/splice.py puts the dispatch in the stage graphs).
So, per stage:
- dense gradients are summed over the stage's dp group, as without ep;
- an expert's gradient already holds the whole ep group's tokens (the all-to-all's backward brought
  them) and is summed over the replicas holding the same experts (dp / ep of them);
- the gradient norm adds the ep ranks' expert parts once.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from ..data_parallel import GradientSynchronizer
from ..distributed import backend_for, group_options
from ..mesh import ProcessMesh


def expert_groups_on_mesh(mesh: ProcessMesh, ep: int, device: torch.device,
                          timeout_s: float) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None, int]:
    """(this rank's ep group, the group of ranks holding the same experts or None when alone, its ep rank).

    Every dp group of the mesh (one per stage and tp rank) is cut into groups of ep consecutive dp ranks;
    every rank creates every group in the same order (new_group is collective over the world)."""
    grid = mesh.device_mesh.mesh
    dp_axis = list(mesh.dims).index("dp")
    rows = grid.movedim(dp_axis, -1).reshape(-1, grid.shape[dp_axis]).tolist()
    backend = backend_for(device.type)
    me, mine, replicas, ep_rank = dist.get_rank(), None, None, 0
    new = lambda ranks: dist.new_group(ranks, backend=backend, pg_options=group_options(backend, timeout_s))  # noqa: E731
    for ranks in rows:
        for start in range(0, len(ranks), ep):
            group = new(ranks[start:start + ep])
            if me in ranks[start:start + ep]:
                mine, ep_rank = group, ranks.index(me) % ep
        if len(ranks) > ep:
            for offset in range(ep):
                group = new(ranks[offset::ep])
                if me in ranks[offset::ep]:
                    replicas = group
    return mine, replicas, ep_rank


class DenseAndExpertGradients:
    """The stage's dense gradient sync, and the experts' own over the replicas holding the same experts."""

    def __init__(self, dense, expert_params: list[nn.Parameter], replicas: dist.ProcessGroup | None):
        self.dense, self.expert_params = dense, expert_params
        self.experts = GradientSynchronizer(expert_params, replicas) if replicas is not None else None
        self.zero_grad()

    @property
    def params(self) -> list[nn.Parameter]:
        return [*self.dense.params, *self.expert_params]

    @contextlib.contextmanager
    def no_sync(self):
        with contextlib.ExitStack() as stack:
            stack.enter_context(self.dense.no_sync())
            if self.experts is not None:
                stack.enter_context(self.experts.no_sync())
            yield

    def finish(self) -> None:
        self.dense.finish()
        if self.experts is not None:
            self.experts.finish()

    def zero_grad(self) -> None:
        self.dense.zero_grad()
        if self.experts is not None:
            self.experts.zero_grad()
        else:  # an expert no token reached still gets a zero gradient, as on one process
            for p in self.expert_params:
                p.grad = torch.zeros_like(p)

    def remove(self) -> None:
        self.dense.remove()
        if self.experts is not None:
            self.experts.remove()


def expert_squares(expert_params: list[nn.Parameter], ep_group, device: torch.device) -> torch.Tensor:
    """The squared norm of every expert's gradient of this stage once: the ep ranks' parts summed (float64)."""
    squares = torch.zeros((), dtype=torch.float64, device=device)
    for p in expert_params:
        if p.grad is not None:
            squares += p.grad.double().square().sum()
    dist.all_reduce(squares, group=ep_group)
    return squares


def expert_load(experts, tp: int, device: torch.device) -> dict:
    """Per expert layer of the whole model, over every replica since the step began: tokens per expert, per ep
    rank, and the load imbalance (max / mean). Each stage's ranks count their own layers (every tp rank alike);
    one all-reduce over the world, on steps that write metrics only. A recomputed stage counts its tokens again."""
    from ..train.expert_engine import _imbalance
    layers = experts.plan.layers
    counts = torch.zeros(sum(layer.num_experts for layer in layers), dtype=torch.long)
    offset = 0
    for layer in layers:
        if layer.experts in experts.forwards:
            counts[offset:offset + layer.num_experts] = experts.forwards[layer.experts].tokens_per_expert
        offset += layer.num_experts
    counts = counts.to(device)
    dist.all_reduce(counts)
    counts, stats, offset = counts.cpu() // tp, {}, 0
    for layer in layers:
        per_expert = counts[offset:offset + layer.num_experts]
        offset += layer.num_experts
        per_rank = per_expert.view(experts.ep, -1).sum(1)
        stats[layer.experts] = {"tokens_per_expert": per_expert.tolist(), "tokens_per_rank": per_rank.tolist(),
                                "expert_imbalance": _imbalance(per_expert), "rank_imbalance": _imbalance(per_rank)}
    return {"experts": stats}
