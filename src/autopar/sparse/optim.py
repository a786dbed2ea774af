"""Optimizers for sparse tables: row-separable rules on sparse gradients, one state per shard.

A sharded table is updated by its own rank from a sparse COO gradient (the rows a step
touched). That is exact synchronous SGD only for optimizers whose update of a row depends
on that row's gradient alone and leaves untouched rows alone:
- `sgd` (no momentum, no weight decay): torch.optim.SGD on the sparse gradient;
- `adagrad`: torch.optim.Adagrad (sparse gradients supported; untouched rows keep their sum);
- `sparse-adam`: torch.optim.SparseAdam (lazy Adam: only touched rows' moments move; its step
  counter is per table), with Adam on the dense parameters.
Dense Adam/AdamW move every row's moments every step, and weight decay shrinks every row
every step: neither is row-separable, so tables always get weight_decay 0 (dense parameters
keep the configured weight decay), and adam/adamw are refused for sparse tables.

`HybridOptimizer` presents the dense optimizer and the per-table ones as ONE torch
Optimizer (shared param_groups and state), so the LR scheduler, gradient clipping and
checkpoints (torch.distributed.checkpoint) need not know there are several.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn

from ..config import TrainConfig
from ..errors import ConfigError
from ..train.optim import build_optimizer

ROW_SEPARABLE = ("sgd", "adagrad", "sparse-adam")


def table_optimizer(param: nn.Parameter, config: TrainConfig) -> torch.optim.Optimizer:
    """The row-separable rule for one sparse table (weight decay 0, see the module docstring)."""
    if config.optimizer == "sgd":
        return torch.optim.SGD([param], lr=config.lr)
    if config.optimizer == "adagrad":
        return torch.optim.Adagrad([param], lr=config.lr)
    if config.optimizer == "sparse-adam":
        return torch.optim.SparseAdam([param], lr=config.lr, betas=(config.beta1, config.beta2),
                                     eps=config.adam_eps)
    raise ConfigError(f"optimizer {config.optimizer!r} is not row-separable (it moves untouched rows every step), so "
                      f"sparse tables cannot be updated exactly from sparse gradients; use --optimizer one of "
                      f"{{{', '.join(ROW_SEPARABLE)}}}")


class _Params:
    """Lets train.optim.build_optimizer (which takes a model) build over a list of parameters."""

    def __init__(self, params: list[nn.Parameter]):
        self._params = params

    def parameters(self):
        return iter(self._params)


def dense_optimizer(params: list[nn.Parameter], config: TrainConfig) -> torch.optim.Optimizer | None:
    return build_optimizer(_Params(params), config) if params else None


class HybridOptimizer(torch.optim.Optimizer):
    """Several optimizers over disjoint parameters, seen as one (groups and state are shared, not copied)."""

    def __init__(self, parts: list[torch.optim.Optimizer]):
        params = [p for opt in parts for g in opt.param_groups for p in g["params"]]
        super().__init__(params, {})
        self.parts = parts
        self.param_groups = [g for opt in parts for g in opt.param_groups]
        self.state = defaultdict(dict)
        self._link()

    def _link(self) -> None:
        """Point every part at this optimizer's group dicts and state (after init or a load)."""
        offset = 0
        for opt in self.parts:
            count = len(opt.param_groups)
            opt.param_groups = self.param_groups[offset:offset + count]
            offset += count
            self.state.update(opt.state)
            opt.state = self.state

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        for opt in self.parts:
            opt.state = self.state
        self._link()

    @torch.no_grad()
    def step(self, closure=None):
        for opt in self.parts:
            opt.step()
        return None
