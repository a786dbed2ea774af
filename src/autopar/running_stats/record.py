"""Recording each micro-batch's BatchNorm statistics instead of updating the running buffers.

While a step records (`recording`), a BatchNorm in training mode normalises exactly as
before, but runs torch's kernel with momentum 1 on zeroed scratch buffers: the kernel then
writes the micro-batch's own mean and unbiased variance there (1 * stat + 0 * 0), which are
kept under (layer, micro-batch index). The real running buffers are not touched during the
step; `replay.py` updates them from the records at its end. The micro-batch index is the
dropout scope's (the trainer and the pipeline runtime open `micro_batch(i)` around every
forward and recomputation); outside a step scope the i-th call of a layer counts as
micro-batch i. A recomputation records the same values again under the same index.

With `--batchnorm sync` the forward normalises with the statistics of every replica's
micro-batch together instead (sync.py) and records those.

Outside a recording step (evaluation, a measurement of the stages) nothing is recorded: a
whole model runs as torch runs it, and a traced stage leaves its buffers alone in training
mode and reads them in eval mode (a traced node's `training` flag is baked in: the module
that replaces it honours the stage's mode, as an eager BatchNorm does).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from contextvars import ContextVar

import torch
from torch import fx, nn

from ..dropout.scope import active_scope
from ..errors import ModelError
from .layers import batch_norm_layer, batch_norm_layers, counter_layer
from .sync import synchronised_batch_norm


class StepStatistics:
    """(layer, micro-batch index) -> (mean, unbiased variance) of this rank's step so far."""

    def __init__(self) -> None:
        self.values: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._calls: dict[str, int] = {}
        self._sources: dict[tuple[str, int], str | None] = {}

    def add(self, layer: str, mean: torch.Tensor, var: torch.Tensor, source: str | None = None) -> None:
        """`source`: the traced node that ran (a stage's recomputation runs the same node again and
        records the same values); None for a whole model's module, which runs once per micro-batch."""
        scope = active_scope()
        if scope is not None and scope.index is not None:
            index = scope.index
        else:  # no step scope (an engine driven directly): calls come in micro-batch order
            index = self._calls.get(layer, 0)
            self._calls[layer] = index + 1
        key = (layer, index)
        if key in self.values and (source is None or self._sources[key] != source):
            raise ModelError(f"the BatchNorm {layer or 'model'} runs more than once in one micro-batch's forward (a "
                             f"module shared between places, or called in a loop): one process updates its running "
                             f"statistics once per call, which autopar replays for one call per micro-batch only; "
                             f"give each call its own BatchNorm, or set track_running_stats=False on it")
        self._sources[key] = source
        self.values[key] = (mean.detach(), var.detach())


_ACTIVE: ContextVar[StepStatistics | None] = ContextVar("autopar_running_stats", default=None)


@contextlib.contextmanager
def recording(stats: StepStatistics) -> Iterator[StepStatistics]:
    token = _ACTIVE.set(stats)
    try:
        yield stats
    finally:
        _ACTIVE.reset(token)


class EagerBatchNorms:
    """Hooks on the BatchNorms of a model run whole (data parallelism, ZeRO-3).

    `sync_group`: `--batchnorm sync` over these replicas; each BatchNorm instance then gets a forward of
    its own (sync.py) while the engine lives, since a hook cannot change what a forward computes."""

    def __init__(self, model: nn.Module, sync_group=None):
        self.layers = batch_norm_layers(model)
        self._saved: dict[str, tuple] = {}
        self._handles = []
        self.sync_group = sync_group
        for name, module in self.layers.items():
            if sync_group is not None:
                module.forward = functools.partial(self._synchronised, name, module)
                continue
            self._handles.append(module.register_forward_pre_hook(lambda m, args, n=name: self._before(n, m)))
            self._handles.append(module.register_forward_hook(lambda m, args, out, n=name: self._after(n, m)))

    def _synchronised(self, name: str, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if not module.training:
            return type(module).forward(module, x)
        out, mean, var = synchronised_batch_norm(x, module.weight, module.bias, module.eps, self.sync_group)
        stats = _ACTIVE.get()
        if stats is not None:
            stats.add(name, mean, var)
        return out

    def _before(self, name: str, module: nn.Module) -> None:
        if not module.training or _ACTIVE.get() is None:
            return
        self._saved[name] = (module.running_mean, module.running_var, module.num_batches_tracked, module.momentum)
        # assigning a tensor to a buffer's name replaces the buffer: the kernel writes these scratch tensors
        module.running_mean = torch.zeros_like(module.running_mean)
        module.running_var = torch.zeros_like(module.running_var)
        module.num_batches_tracked = module.num_batches_tracked.clone()
        module.momentum = 1.0

    def _after(self, name: str, module: nn.Module) -> None:
        saved = self._saved.pop(name, None)
        if saved is None:
            return
        stats = _ACTIVE.get()
        if stats is not None:
            stats.add(name, module.running_mean, module.running_var)
        module.running_mean, module.running_var, module.num_batches_tracked, module.momentum = saved

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        for module in self.layers.values():
            module.__dict__.pop("forward", None)


class GraphBatchNorm(nn.Module):
    """One traced batch_norm node of a stage piece: records in training, reads the running statistics in eval."""

    def __init__(self, layer: str, source: str):
        super().__init__()
        self.layer, self.source = layer, source
        self.sync_group = None  # --batchnorm sync: the stage's replicas (the pipeline engine sets it)

    def extra_repr(self) -> str:
        return f"{self.layer}, node={self.source}"

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                running_mean: torch.Tensor, running_var: torch.Tensor, training: bool, momentum: float, eps: float,
                cudnn_enabled: bool) -> torch.Tensor:
        if not self.training:  # eval mode: the running statistics, as an eager BatchNorm in eval mode
            return torch.batch_norm(x, weight, bias, running_mean, running_var, False, 0.0, eps, cudnn_enabled)
        if self.sync_group is not None:
            out, mean, var = synchronised_batch_norm(x, weight, bias, eps, self.sync_group)
        else:
            mean, var = torch.zeros_like(running_mean), torch.zeros_like(running_var)
            out = torch.batch_norm(x, weight, bias, mean, var, True, 1.0, eps, cudnn_enabled)
        stats = _ACTIVE.get()
        if stats is not None:
            stats.add(self.layer, mean, var, source=self.source)
        return out


def replace_batch_norm_nodes(module: fx.GraphModule, buffer_of: dict[str, str]) -> int:
    """Replace a stage piece's BatchNorm nodes by GraphBatchNorm modules and drop their counters' `add_`
    (the replay counts); `buffer_of`: placeholder name -> buffer FQN. Returns how many were replaced."""
    graph, count = module.graph, 0
    for node in list(graph.nodes):
        layer = batch_norm_layer(node, buffer_of)
        if layer is None:
            continue
        name = f"running_stats_{node.name}"
        module.add_module(name, GraphBatchNorm(layer, node.name))
        names = ("input", "weight", "bias", "running_mean", "running_var", "training", "momentum", "eps",
                 "cudnn_enabled")
        args = list(node.args) + [node.kwargs[n] for n in names[len(node.args):]]
        with graph.inserting_after(node):
            replacement = graph.call_module(name, tuple(args))
        replacement.meta = dict(node.meta)
        node.replace_all_uses_with(replacement)
        graph.erase_node(node)
        count += 1
    for node in list(graph.nodes):
        if counter_layer(node, buffer_of) is not None and not node.users:
            graph.erase_node(node)
            count += 1
    if count:
        graph.lint()
        module.recompile()
    return count
