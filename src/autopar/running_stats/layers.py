"""Which layers keep running statistics, which of them are replayed, and the refusals for the rest.

Replayed: torch's nn.BatchNorm1d/2d/3d with track_running_stats (their own forward, so their
update rule is the one `replay.py` reproduces). Refused wherever a layout would change their
statistics (more than one process): any other layer that keeps running statistics
(SyncBatchNorm, an InstanceNorm with track_running_stats, a subclass with its own forward),
and, in a traced graph, any other operation that writes a buffer in forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import fx, nn

from .._torch_internals import op_schema
from ..errors import ConfigError, ModelError

aten = torch.ops.aten
BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
BATCH_NORM_OP = aten.batch_norm.default
# kernels that update running statistics (their 4th argument) although their schema does not say they write them
STATS_UPDATING_OPS = tuple(getattr(aten, name).default for name in (
    "native_batch_norm", "_batch_norm_impl_index", "cudnn_batch_norm", "miopen_batch_norm", "instance_norm")
    if hasattr(aten, name))
REPLAYED = "torch's nn.BatchNorm1d/2d/3d"


def keeps_running_stats(module: nn.Module) -> bool:
    return bool(getattr(module, "track_running_stats", False)) and \
        isinstance(getattr(module, "running_mean", None), torch.Tensor)


def is_replayed(module: nn.Module) -> bool:
    """torch's BatchNorm with its own forward: the update rule the replay reproduces."""
    return isinstance(module, BATCH_NORMS) and type(module).forward is nn.BatchNorm2d.forward


def batch_norm_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Name -> module of every BatchNorm whose running statistics are replayed."""
    return {name: m for name, m in model.named_modules() if keeps_running_stats(m) and is_replayed(m)}


def check_running_stats(model: nn.Module, *, layout: str, replays: bool, processes: int) -> None:
    """Refuse, before any step, a layer whose running statistics `layout` would not keep as one process does.

    `replays`: the layout's engine replays BatchNorm statistics (synchronous dp, pp, tp); `processes`:
    how many processes train one model (1: one process, whose statistics are the reference)."""
    if processes == 1:
        return
    for name, module in model.named_modules():
        if not keeps_running_stats(module):
            continue
        what = f"{name or 'the model'} ({type(module).__name__})"
        if not is_replayed(module):
            raise ModelError(f"{what} is a norm layer that keeps running statistics, which {layout} would compute "
                             f"per rank, unlike one process; autopar keeps them exactly for {REPLAYED} only: use one "
                             f"of those, or track_running_stats=False")
        if not replays:
            raise ConfigError(f"{what} keeps running statistics, which {layout} would keep per rank, unlike one "
                              f"process; autopar keeps them exactly under synchronous dp, tp and pp only: use "
                              f"those, or track_running_stats=False")


def check_batch_norm_subbatches(model: nn.Module, tp_subbatches: int) -> None:
    """Sub-pipelined tensor parallelism runs each micro-batch as sub-batches: a BatchNorm would normalise
    with a sub-batch's statistics, not the micro-batch's one process uses."""
    if tp_subbatches > 1:
        for name, module in model.named_modules():
            if isinstance(module, (*BATCH_NORMS, nn.SyncBatchNorm)):
                raise ConfigError(f"{name} ({type(module).__name__}) normalises over the batch, and --tp-subbatches "
                                  f"{tp_subbatches} would split each micro-batch into sub-batches that it normalises "
                                  f"apart; use --tp-subbatches 1")


@contextlib.contextmanager
def traceable_cumulative_averages(model: nn.Module) -> Iterator[None]:
    """A BatchNorm with momentum=None (a cumulative average) reads its batch counter's value to pick its
    factor, which a trace cannot do. Traced with a stand-in momentum instead: the traced factor is never
    used, the replay applies the layer's own rule (replay.py), and the model gets None back after."""
    changed = [m for m in model.modules() if keeps_running_stats(m) and hasattr(m, "momentum") and m.momentum is None]
    for m in changed:
        m.momentum = 0.0
    try:
        yield
    finally:
        for m in changed:
            m.momentum = None


def _module_of(node: fx.Node) -> str:
    stack = list(node.meta.get("nn_module_stack", {}).values())
    if not stack:
        return "the model's own forward"
    path, kind = stack[-1]
    name = kind.__name__ if isinstance(kind, type) else str(kind).rsplit(".", 1)[-1]
    return f"{path} ({name})"


def batch_norm_layer(node: fx.Node, buffer_of: dict[str, str]) -> str | None:
    """The layer name of a training batch_norm node reading a BatchNorm's running buffers, else None."""
    if node.op != "call_function" or node.target is not BATCH_NORM_OP:
        return None
    running_mean = node.args[3] if len(node.args) > 3 else node.kwargs.get("running_mean")
    training = node.args[5] if len(node.args) > 5 else node.kwargs.get("training")
    if not training or not isinstance(running_mean, fx.Node):
        return None
    fqn = buffer_of.get(running_mean.name, "")
    if fqn != "running_mean" and not fqn.endswith(".running_mean"):
        return None
    return fqn[:-len("running_mean")].rstrip(".")


def counter_layer(node: fx.Node, buffer_of: dict[str, str]) -> str | None:
    """The layer whose `num_batches_tracked += 1` this node is, else None."""
    if node.op != "call_function" or node.target is not aten.add_.Tensor or not isinstance(node.args[0], fx.Node):
        return None
    fqn = buffer_of.get(node.args[0].name, "")
    if fqn != "num_batches_tracked" and not fqn.endswith(".num_batches_tracked"):
        return None
    return fqn[:-len("num_batches_tracked")].rstrip(".")


def _writes(node: fx.Node) -> list[fx.Node]:
    """The inputs an operation writes in place (its schema's mutable arguments)."""
    schema = op_schema(node.target)
    if schema is None:
        return []
    written = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            if isinstance(value, fx.Node):
                written.append(value)
    return written


def check_traced_buffer_updates(graph: fx.Graph, buffer_of: dict[str, str], model_name: str) -> None:
    """Refuse a traced forward that updates a buffer in a way the stages cannot keep as one process does.

    `buffer_of`: placeholder name -> buffer FQN. A BatchNorm's batch_norm node and its counter's
    `add_` are replayed (record.py); any other in-place write to a buffer, or a kernel that updates
    running statistics of another kind, is refused with the module that does it."""
    calls: dict[str, list[fx.Node]] = {}
    for n in graph.nodes:
        if (layer := batch_norm_layer(n, buffer_of)) is not None:
            calls.setdefault(layer, []).append(n)
    for layer, nodes in calls.items():
        if len(nodes) > 1:  # each stage would replay its own calls on its own copy of the buffers
            raise ModelError(f"{_module_of(nodes[0])} in {model_name} runs {len(nodes)} times in one forward (a "
                             f"module shared between places, or called in a loop): one process updates its running "
                             f"statistics once per call, which autopar replays for one call per micro-batch only; "
                             f"give each call its own BatchNorm, or set track_running_stats=False on it")
    layers = set(calls)
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in STATS_UPDATING_OPS and len(node.args) > 3 and isinstance(node.args[3], fx.Node):
            raise ModelError(f"{_module_of(node)} in {model_name} updates running statistics in forward "
                             f"({node.target}), which pipeline and tensor-parallel stages cannot keep as one process "
                             f"does; autopar keeps them for {REPLAYED} only (or use track_running_stats=False)")
        written = [a for a in _writes(node) if a.name in buffer_of]
        if not written or (counter_layer(node, buffer_of) in layers and not node.users):
            continue
        raise ModelError(f"{_module_of(node)} in {model_name} updates its buffer {buffer_of[written[0].name]} in "
                         f"forward ({node.target}), which pipeline and tensor-parallel stages cannot keep as one "
                         f"process does (each stage or rank would update its own copy); autopar keeps running "
                         f"statistics for {REPLAYED} only: update the buffer outside forward, or train with data "
                         f"parallelism")
