"""The optimizer of a ZeRO-1/2 replica: fp32 master weights and optimizer state for its shard only.

`ShardedOptimizer` wraps the optimizer the trainer configured (its class, hyperparameters and
parameter groups, e.g. weight decay on matrices only) and rebuilds it over this replica's
pieces of the flat buckets of `ShardedGradients`: one fp32 master slice per (parameter, shard)
overlap, whose gradient is a view into the reduce-scattered shard gradient. Every optimizer
with element-wise per-parameter state (AdamW, Adam, Adagrad, SGD with momentum) then updates
exactly the elements one process would; `step()` is followed by an all-gather of the updated
shards into every replica's parameters (cast to the parameters' dtype: bf16 under --dtype bf16).

With a group of one it is the bf16 mode's master-weight optimizer without sharding.

Checkpoints see it whole: `whole_state_dict()` all-gathers the shards into the same
name-keyed layout torch's `get_state_dict` gives for an unsharded optimizer, and
`load_whole_state_dict()` keeps this replica's part of one, so runs resume across zero levels.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .._torch_internals import foreach_copy_
from ..distributed import all_gather_single
from .grads import ShardedBucket, ShardedGradients


class ShardedOptimizer(torch.optim.Optimizer):
    """`template`'s optimizer, stepped on this replica's shard; parameters all-gathered after each step."""

    def __init__(self, template: torch.optim.Optimizer, grads: ShardedGradients, names: dict[int, str]):
        # torch.optim.Optimizer.__init__ is not called: the inner optimizer owns groups and state;
        # this object exposes them so the lr scheduler and the trainer drive it like any optimizer.
        self.grads, self.names = grads, names
        group_of = {id(p): i for i, g in enumerate(template.param_groups) for p in g["params"]}
        self._pieces: list[tuple[ShardedBucket, nn.Parameter, int, int, int, torch.Tensor]] = []
        self._masters: list[torch.Tensor] = []  # one fp32 flat shard per bucket
        per_group: list[list[torch.Tensor]] = [[] for _ in template.param_groups]
        for bucket in grads.buckets:
            master = torch.zeros(bucket.shard, dtype=torch.float32, device=bucket.device)
            self._masters.append(master)
            for p, p_start, start, length in bucket.pieces(grads.rank):
                piece = master[start:start + length]
                piece.copy_(p.detach().reshape(-1)[p_start:p_start + length])
                piece.grad = bucket.shard_grad[start:start + length]
                per_group[group_of[id(p)]].append(piece)
                self._pieces.append((bucket, p, p_start, start, length, piece))
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": members}
                  for g, members in zip(template.param_groups, per_group)]
        self.inner = type(template)(groups)  # every hyperparameter is in the groups
        self._members = [[names[id(p)] for p in g["params"]] for g in template.param_groups]
        self.defaults = self.inner.defaults
        self._gathered: list[torch.Tensor | None] = [None] * len(grads.buckets)

    # the Optimizer interface the trainer and the lr scheduler use
    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.grads.zero_grad()

    def __getstate__(self):
        raise TypeError("a ShardedOptimizer holds process-group state; save it with whole_state_dict()")

    def __repr__(self) -> str:
        return f"ShardedOptimizer(level {self.grads.level}, dp {self.grads.world}, {self.inner!r})"

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("ShardedOptimizer.step does not take a closure")
        self.inner.step()
        self.gather_parameters()

    @torch.no_grad()
    def gather_parameters(self) -> None:
        """Every replica's parameters become the updated masters (all-gathered, cast to the parameter dtype).

        Every bucket's all-gather is launched before the first is waited on, and each lands in the
        parameters with one foreach copy, not a Python loop of copies."""
        launched = []
        for bucket, master in zip(self.grads.buckets, self._masters):
            shard = master.to(bucket.dtype)
            if self.grads.world == 1:
                launched.append((bucket, shard, None))
                continue
            whole = torch.empty(bucket.numel, dtype=shard.dtype, device=shard.device)
            work = all_gather_single(whole, shard.contiguous(), group=self.grads.group, async_op=True)
            launched.append((bucket, whole, work))
        for bucket, whole, work in launched:
            if work is not None:
                work.wait()
            foreach_copy_([p.data for p in bucket.params],
                          [whole[off:off + p.numel()].view_as(p) for p, off in zip(bucket.params, bucket.offsets)])

    def _gather(self, shard: torch.Tensor, bucket: ShardedBucket) -> torch.Tensor:
        if self.grads.world == 1:
            return shard
        whole = torch.empty(bucket.numel, dtype=shard.dtype, device=shard.device)
        all_gather_single(whole, shard.contiguous(), group=self.grads.group)
        return whole

    @torch.no_grad()
    def reload_masters(self) -> None:
        """The masters become the parameters (after a checkpoint loaded new parameters)."""
        for _, p, p_start, _, length, piece in self._pieces:
            piece.copy_(p.detach().reshape(-1)[p_start:p_start + length])

    # ------------------------------------------------------------------ bytes (tests, benchmarks)

    def state_bytes(self) -> int:
        """Bytes of element-wise optimizer state this rank holds (master weights and step counts excluded)."""
        return sum(v.numel() * v.element_size() for s in self.inner.state.values() for v in s.values()
                   if isinstance(v, torch.Tensor) and v.dim() > 0)

    def master_bytes(self) -> int:
        return sum(m.numel() * m.element_size() for m in self._masters)

    # ------------------------------------------------------------------ checkpoints: whole tensors

    def ensure_state(self) -> None:
        """Create the inner state (a zero-lr step on zero gradients) so loads have tensors to fill."""
        if self.inner.state:
            return
        saved = [g["lr"] for g in self.inner.param_groups]
        for g in self.inner.param_groups:
            g["lr"] = 0.0
        grads = [piece.grad.clone() for *_, piece in self._pieces]
        for *_, piece in self._pieces:
            piece.grad.zero_()
        self.inner.step()
        for (*_, piece), g in zip(self._pieces, grads):
            piece.grad.copy_(g)
        for g, lr in zip(self.inner.param_groups, saved):
            g["lr"] = lr

    def _state_keys(self) -> tuple[list[str], list[str]]:
        """(element-wise keys, scalar keys) of the inner optimizer's per-parameter state."""
        self.ensure_state()
        sample = next(iter(self.inner.state.values()), None)
        if sample is None and not self.grads.buckets:  # nothing trainable here (a pipeline stage of frozen layers)
            return [], []
        if sample is None:
            raise RuntimeError("this replica's shard holds no parameter; use fewer replicas for so small a model")
        elementwise = sorted(k for k, v in sample.items() if isinstance(v, torch.Tensor) and v.dim() > 0)
        scalars = sorted(k for k in sample if k not in elementwise)
        return elementwise, scalars

    @torch.no_grad()
    def whole_params(self) -> dict[str, torch.Tensor]:
        """Every parameter by name, whole, in fp32 (the masters, all-gathered)."""
        out = {}
        for bucket, master in zip(self.grads.buckets, self._masters):
            whole = self._gather(master, bucket)
            for p, off in zip(bucket.params, bucket.offsets):
                out[self.names[id(p)]] = whole[off:off + p.numel()].view(p.shape).clone()
        return out

    @torch.no_grad()
    def load_whole_params(self, whole: dict[str, torch.Tensor]) -> None:
        """Masters and parameters from whole fp32 tensors by name."""
        for bucket in self.grads.buckets:
            for p in bucket.params:
                p.copy_(whole[self.names[id(p)]].to(p.dtype))
        for _, p, p_start, _, length, piece in self._pieces:
            piece.copy_(whole[self.names[id(p)]].reshape(-1)[p_start:p_start + length])

    @torch.no_grad()
    def whole_state_dict(self) -> dict[str, Any]:
        """{"state": {name: {key: whole tensor}}, "param_groups": [...]}: torch's get_state_dict layout."""
        elementwise, scalars = self._state_keys()
        state: dict[str, dict[str, Any]] = {}
        sample = next(iter(self.inner.state.values()), {})  # empty: no trainable parameter on this rank
        for bucket, master in zip(self.grads.buckets, self._masters):
            for key in elementwise:
                flat = torch.zeros_like(master)
                for b, _, _, start, length, piece in self._pieces:
                    if b is bucket:
                        flat[start:start + length] = self.inner.state[piece][key]
                whole = self._gather(flat, bucket)
                for p, off in zip(bucket.params, bucket.offsets):
                    state.setdefault(self.names[id(p)], {})[key] = whole[off:off + p.numel()].view(p.shape).clone()
            for p in bucket.params:  # scalars (the step count) are the same for every parameter
                for key in scalars:
                    value = sample[key]
                    state[self.names[id(p)]][key] = value.clone() if isinstance(value, torch.Tensor) else value
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": names}  # every parameter's name
                  for g, names in zip(self.inner.param_groups, self._members)]
        return {"state": state, "param_groups": groups}

    @torch.no_grad()
    def load_whole_state_dict(self, whole: dict[str, Any]) -> None:
        """This replica's part of a whole-tensor optimizer state (hyperparameters stay this run's)."""
        self.ensure_state()
        for _, p, p_start, _, length, piece in self._pieces:
            saved = whole["state"][self.names[id(p)]]
            for key, value in self.inner.state[piece].items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    value.copy_(saved[key].reshape(-1)[p_start:p_start + length])
                elif isinstance(value, torch.Tensor):
                    value.copy_(torch.as_tensor(saved[key]))
                else:
                    self.inner.state[piece][key] = saved[key]
