"""A whole model's experts cut to this rank's rows, and gathered back whole for checkpoints.

Expert parallelism keeps the model's own modules and parameter names: each expert weight (E rows,
one per expert) is replaced by the E/ep rows this rank's place in its ep group owns, and the experts
module's forward by the dispatching one (dispatch.py). Checkpoints hold whole tensors: `gather`
and `shard` have the same meaning as tensor parallelism's (train/checkpoint.py calls them through
the engine's `tensor_parallel`), so a checkpoint written under one ep resumes under any other.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..errors import ConfigError
from .detect import ExpertPlan
from .dispatch import ExpertParallelForward


class ShardedExperts:
    """This rank's experts of every layer of `plan`, over `group` (ep ranks of one ep group)."""

    def __init__(self, plan: ExpertPlan, group, *, ep: int, ep_rank: int):
        self.plan, self.group, self.ep, self.rank = plan, group, ep, ep_rank
        self.rows = {name: layer.num_experts for layer in plan.layers for name in layer.params}
        self.forwards: dict[str, ExpertParallelForward] = {}

    # ------------------------------------------------------------- the checkpoint interface (tensor_parallel's)
    def is_sharded(self, fqn: str) -> bool:
        return fqn in self.rows

    def local_rows(self, fqn: str) -> tuple[int, int]:
        per_rank = self.rows[fqn] // self.ep
        return self.rank * per_rank, (self.rank + 1) * per_rank

    def shard(self, fqn: str, full: torch.Tensor) -> torch.Tensor:
        if fqn not in self.rows:
            return full
        start, stop = self.local_rows(fqn)
        return full[start:stop].clone()

    def gather(self, fqn: str, local: torch.Tensor) -> torch.Tensor:
        """Collective over the ep group: the whole tensor, rows in expert order."""
        if fqn not in self.rows:
            return local
        pieces = [torch.empty_like(local) for _ in range(self.ep)]
        dist.all_gather(pieces, local.contiguous(), group=self.group)
        return torch.cat(pieces)

    def full_shape(self, fqn: str, local: torch.Tensor) -> tuple[int, ...]:
        return (self.rows[fqn], *local.shape[1:]) if fqn in self.rows else tuple(local.shape)

    def file_slices(self, fqn: str) -> tuple[int, list[tuple[int, int]]] | None:
        """(dim, [(start, stop)]) of the whole tensor this rank holds: a pretrained load reads only these rows."""
        return (0, [self.local_rows(fqn)]) if fqn in self.rows else None

    def summary(self, dp: int) -> str:
        """The banner's line: how many experts each rank holds."""
        layers = self.plan.layers
        held = ", ".join(sorted({f"{layer.num_experts // self.ep} of {layer.num_experts}" for layer in layers}))
        return (f"expert parallelism ep={self.ep}: each rank holds {held} experts of each of {len(layers)} MoE "
                f"layer(s); dense weights replicated over dp={dp} (expert_plan.txt)")

    # ------------------------------------------------------------- metrics
    def load(self) -> dict[str, dict]:
        """Per layer, the last forward's tokens per expert (chosen on this rank) and rows its experts ran."""
        return {name: {"tokens_per_expert": f.tokens_per_expert.tolist(),
                       "rows_received": int(f.received_per_expert.sum())}
                for name, f in self.forwards.items()}


def shard_experts(module: nn.Module, plan: ExpertPlan, group, *, ep: int, ep_rank: int) -> ShardedExperts:
    """Cut every expert weight of `module` (real, whole) to this rank's rows and install the dispatch."""
    sharded = ShardedExperts(plan, group, ep=ep, ep_rank=ep_rank)
    modules = dict(module.named_modules())
    for layer in plan.layers:
        if layer.num_experts % ep:
            raise ConfigError(f"{layer.experts} has {layer.num_experts} experts, which ep={ep} does not divide; "
                              f"choose an --ep that divides {layer.num_experts}")
        experts = modules[layer.experts]
        prefix = layer.experts + "."
        for fqn in layer.params:
            name = fqn[len(prefix):]
            owner = experts.get_submodule(name.rpartition(".")[0]) if "." in name else experts
            leaf = name.rpartition(".")[2]
            whole = getattr(owner, leaf)
            local = nn.Parameter(sharded.shard(fqn, whole.detach()), requires_grad=whole.requires_grad)
            setattr(owner, leaf, local)
        if getattr(experts, "num_experts", None) == layer.num_experts:  # the count the module's forward reads
            experts.num_experts = layer.num_experts // ep
        dispatch = ExpertParallelForward(experts.forward, num_experts=layer.num_experts, group=group,
                                         ep_rank=ep_rank, ep=ep)
        experts.forward = dispatch
        sharded.forwards[layer.experts] = dispatch
    return sharded


class ExpertsBeside:
    """Sharded experts beside another layout of the other parameters (tensor parallelism): each name is asked of
    the one that slices it, so checkpoints gather and cut both with the same calls."""

    def __init__(self, experts: ShardedExperts, other):
        self.experts, self.other = experts, other

    def _owner(self, fqn: str):
        return self.experts if self.experts.is_sharded(fqn) or self.other is None else self.other

    def is_sharded(self, fqn: str) -> bool:
        return self._owner(fqn).is_sharded(fqn)

    def shard(self, fqn: str, full: torch.Tensor) -> torch.Tensor:
        return self._owner(fqn).shard(fqn, full)

    def gather(self, fqn: str, local: torch.Tensor) -> torch.Tensor:
        return self._owner(fqn).gather(fqn, local)

    def full_shape(self, fqn: str, local: torch.Tensor) -> tuple[int, ...]:
        return self._owner(fqn).full_shape(fqn, local)

    def file_slices(self, fqn: str):
        return self._owner(fqn).file_slices(fqn)
