"""Capture an unmodified model as a graph of operations with a cost on every node.

The front end is `torch.export` (non-strict): measured here, torch.fx symbolic tracing
fails on transformers 5.x GPT-2 and LLaMA, while export handles both in under a second.
The model may live on the meta device: export only propagates shapes, so a model larger
than this process's memory can be traced. Shapes are static (the micro-batch shape given),
which keeps every reshape size a constant that later passes (tensor parallelism) can edit.

Nodes are grouped into contiguous *blocks*, the units a pipeline cut may fall between:
the prelude (everything before the first repeated layer: embeddings, masks, rotary
tables), one block per repeated layer, and the postlude (final norm, head). The repeated
layers are the members of the model's *stacks* (trace/stacks.py: a ModuleList, a Sequential,
the repeated blocks of a ModuleDict or of a module's attributes; the outermost holding the
most parameters, plus an encoder-decoder's second stack), numbered in the order the forward
runs them; a model with no stack is one block (tensor parallelism works on the graph and
needs no cut); the code between two stacks (the encoder's final norm, the decoder's
embedding) joins the block before it. A cut between blocks is where few tensors cross: the
hidden state, plus any value a later layer still needs (attention mask, position
embeddings, the encoder's output), which the stage builder carries.

The model is traced on every input its forward takes from the batch (the main input
positional, the other fields as keywords: `train.loss.forward_inputs`); the graph's user
inputs are those tensors, in the order `ModelGraph.input_keys` names.
"""

from __future__ import annotations

import os
import re
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from .._torch_internals import decomposes
from ..errors import ModelError
from ..models.materialize import tied_groups
from ..running_stats import check_traced_buffer_updates, traceable_cumulative_averages
from .fake_device import export_on_device
from .stacks import Stack, find_stacks, in_order


_TORCH_DIR = os.path.dirname(torch.__file__)
_AUTOPAR_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class NodeCost:
    """One operation of the traced graph."""

    name: str
    target: str
    module_path: str  # the innermost module that ran it ("" for top-level code)
    block: int  # index into ModelGraph.blocks
    params: list[str]  # FQNs of parameters it reads directly
    out_bytes: int  # bytes of its tensor output(s)
    flops: int  # forward FLOPs (torch.utils.flop_counter)


@dataclass
class Block:
    """A contiguous run of nodes that is never split across pipeline stages."""

    name: str  # "prelude", "<layers>.<i>", "postlude"
    nodes: list[str] = field(default_factory=list)
    params: list[str] = field(default_factory=list)  # FQNs used (a tied parameter under its primary name)
    num_params: int = 0
    flops: int = 0
    activation_bytes: int = 0  # sum of node outputs: what backward may keep alive
    time_s: float | None = None  # measured forward+backward, when asked for


@dataclass
class ModelGraph:
    """The traced model: the exported program plus per-node and per-block costs."""

    exported: ExportedProgram
    nodes: dict[str, NodeCost]
    blocks: list[Block]
    layers_path: str | None  # FQN of the module holding the first stack ("": the model itself; None: no stack)
    param_numel: dict[str, int]  # primary FQN -> elements
    tied: list[list[str]]  # groups of FQNs naming one tensor (primary name first)
    example_inputs: tuple  # the user inputs, flat, in the graph's order
    export_names: dict[str, str] = field(default_factory=dict)  # primary FQN -> the exported program's name
    stacks: list[Stack] = field(default_factory=list)  # every stack of repeated layers that ran, in forward order
    input_keys: list[int | str] = field(default_factory=list)  # per user input: positional index or keyword
    example_args: tuple = ()
    example_kwargs: dict = field(default_factory=dict)

    def export_name(self, fqn: str) -> str:
        """The name torch.export gave a parameter (it may pick another alias of a tied weight)."""
        return self.export_names.get(fqn, fqn)

    @property
    def graph(self) -> fx.Graph:
        return self.exported.graph

    def block_of(self, node: fx.Node) -> int | None:
        cost = self.nodes.get(node.name)
        return cost.block if cost else None


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def _layer_index(path: str, stack: Stack, position: dict[str, int]) -> int | None:
    """Which member of `stack` the module at `path` is in (None: outside its layers)."""
    prefix = stack.path + "." if stack.path else ""
    if not path.startswith(prefix) or path == stack.path:
        return None
    return position.get(path[len(prefix):].split(".", 1)[0])


def _data_dependent_site(exc: Exception) -> tuple[str, str] | None:
    """(file:line, code) of the model's line that needed a tensor's value: the innermost frame outside torch,
    autopar and generated code, else the call torch's message names (installed packages, e.g. transformers)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not f.filename.startswith((_TORCH_DIR, _AUTOPAR_DIR, "<")) and "site-packages" not in f.filename]
    if frames:
        return f"{frames[-1].filename}:{frames[-1].lineno}", (frames[-1].line or "").strip()
    named = re.findall(r'File "([^"]+)", line (\d+), in \S+\n\s+(.+)', str(exc))
    return (f"{named[-1][0]}:{named[-1][1]}", named[-1][2].strip()) if named else None


def _trace_hint(exc: Exception) -> str:
    """What to do about a torch.export failure, by its real cause."""
    if isinstance(exc, GuardOnDataDependentSymNode) or "data-dependent" in str(exc):
        site = _data_dependent_site(exc)
        where = f" (at {site[0]}: {site[1]})" if site else ""
        if site and site[1].startswith("for "):
            hint = (f"The forward loops over a tensor's values{where}: how many times only the data knows, which a "
                    f"traced graph cannot do. Loop over a fixed count (every candidate, masked), or train with pp=1 "
                    f"and tp=1 (data parallelism runs the model as written)")
            if "expert" in site[1]:
                hint += ("; a Hugging Face mixture of experts runs every expert as one grouped product when loaded "
                         "with experts_implementation='grouped_mm' (its default) instead of 'eager'")
            return hint
        return (f"The forward branches on a tensor's values{where}, which a traced graph cannot do: compute both "
                f"branches and pick with torch.where, or move the decision out of forward")
    if "FakeTensorDeviceMismatch" in type(exc).__name__ or "found at least two devices" in str(exc):
        return ("The model's tensors and its inputs are on different devices while tracing: build the whole "
                "model either on the meta device or for real (a tensor attribute that is neither a parameter "
                "nor a buffer keeps the device it was made on)")
    return "Make the failing operation traceable by torch.export (non-strict), or pass a model whose forward takes only tensors"


def _real_like(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A meta example input as zeros on `device` (its shape and dtype are what tracing reads); others as they are."""
    return torch.zeros(t.shape, dtype=t.dtype, device=device) if t.is_meta else t


def trace(model: nn.Module, example_inputs: tuple, example_kwargs: dict | None = None, *,
          device: torch.device | None = None) -> ModelGraph:
    """Export `model` on the given inputs (meta tensors are fine) and cost every node.

    Called as the model is called: `model(*example_inputs, **example_kwargs)`; every input
    must be a tensor (a graph input the pipeline can carry and tp can split into sub-batches).
    `device`: where a model on meta will train; it is traced as if it lived there (fake_device.py), so code
    that branches on its tensors' device records the branch that will run.
    """
    example_kwargs = dict(example_kwargs or {})
    for key, value in [*enumerate(example_inputs), *example_kwargs.items()]:
        if not isinstance(value, torch.Tensor):
            raise ModelError(f"cannot trace {type(model).__name__} with input {key!r} of type "
                             f"{type(value).__name__}: traced inputs must be tensors")
    held = [*model.parameters(), *model.buffers()]
    real = {t.device for t in held if not t.is_meta}
    if len(real) == 1 and len(real) == len({t.device for t in held}):
        # a model built for real, traced on meta example inputs (only their shapes count): torch 2.11's export
        # refuses an op that meets both devices ("Unhandled FakeTensor Device Propagation"), 2.13's takes it
        (where,) = real
        example_inputs = tuple(_real_like(t, where) for t in example_inputs)
        example_kwargs = {k: _real_like(t, where) for k, t in example_kwargs.items()}
    on_meta = all(t.is_meta for t in [*held, *example_inputs, *example_kwargs.values()])
    try:
        with traceable_cumulative_averages(model):
            exported = None
            if device is not None and torch.device(device).type != "meta" and on_meta:
                exported = export_on_device(model, tuple(example_inputs), example_kwargs, torch.device(device))
            if exported is None:
                exported = torch.export.export(model, tuple(example_inputs), kwargs=example_kwargs, strict=False)
    except Exception as exc:  # export reports many kinds of failure; name the op and the way out
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelError(f"torch.export could not trace {type(model).__name__}: {type(exc).__name__}: {first[:400]}. "
                         f"{_trace_hint(exc)}") from None
    mutated = [s for s in exported.graph_signature.output_specs if s.kind != OutputKind.USER_OUTPUT]
    if mutated:
        raise ModelError(f"{type(model).__name__} updates buffers or inputs in forward "
                         f"({', '.join(str(s.target) for s in mutated[:3])}); pipeline partitioning does not "
                         f"support that yet")
    check_traced_buffer_updates(exported.graph, buffer_names(exported), type(model).__name__)
    stacks = find_stacks(model)
    # A tied weight is named as the model's own named_parameters() names it (its first alias),
    # so stages, checkpoints and optimizers agree with the unpartitioned model.
    params = dict(model.named_parameters(remove_duplicate=False))
    primary = {id(p): name for name, p in reversed(list(params.items()))}
    canonical = {spec.arg.name: primary[id(params[spec.target])] for spec in exported.graph_signature.input_specs
                 if spec.kind == InputKind.PARAMETER}
    export_names = {primary[id(params[spec.target])]: spec.target for spec in exported.graph_signature.input_specs
                    if spec.kind == InputKind.PARAMETER}
    param_numel = {fqn: params[fqn].numel() for fqn in canonical.values()}
    nodes, blocks, stacks = _assign_blocks(exported, stacks, canonical)
    keys = _input_keys(exported, len(example_inputs))
    flat = tuple(example_inputs[k] if isinstance(k, int) else example_kwargs[k] for k in keys)
    _count_flops(exported, nodes, flat)
    for cost in nodes.values():
        block = blocks[cost.block]
        block.flops += cost.flops
        block.activation_bytes += cost.out_bytes
    for block in blocks:
        block.num_params = sum(param_numel[p] for p in block.params)
    return ModelGraph(exported=exported, nodes=nodes, blocks=blocks, layers_path=stacks[0].path if stacks else None, param_numel=param_numel,
                      tied=tied_groups(model)[0], example_inputs=flat, export_names=export_names,
                      stacks=stacks, input_keys=keys, example_args=tuple(example_inputs),
                      example_kwargs=example_kwargs)


def buffer_names(exported: ExportedProgram) -> dict[str, str]:
    """Placeholder name -> buffer FQN of a traced graph's buffer inputs."""
    return {spec.arg.name: spec.target for spec in exported.graph_signature.input_specs
            if spec.kind == InputKind.BUFFER}


def _input_keys(exported: ExportedProgram, num_args: int) -> list[int | str]:
    """Which call argument each user input of the graph is (export may order keywords its own way)."""
    spec = exported.call_spec.in_spec  # (args, kwargs)
    kwargs_spec = spec.child(1) if spec is not None and spec.num_children == 2 else None
    names = list(kwargs_spec.context) if kwargs_spec is not None and kwargs_spec.context else []
    keys: list[int | str] = [*range(num_args), *names]
    users = [s for s in exported.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
    if len(users) != len(keys):
        raise ModelError(f"the traced graph has {len(users)} inputs for {len(keys)} call arguments ({keys}); "
                         f"every input must be a tensor")
    return keys


def _layer_key(module_stack: list[tuple[str, Any]], stacks: list[Stack],
               children: list[dict[str, int]]) -> tuple[int, int] | None:
    """(stack, layer) of the innermost repeated layer an operation ran in, or None."""
    found = None
    for path, _ in module_stack:
        for k, stack in enumerate(stacks):
            if (i := _layer_index(path, stack, children[k])) is not None:
                found = (k, i)
    return found


def _assign_blocks(exported: ExportedProgram, stacks: list[Stack],
                   canonical: dict[str, str]) -> tuple[dict[str, NodeCost], list[Block], list[Stack]]:
    """Give every operation a block index, non-decreasing in graph order (so blocks are contiguous).

    Layers are numbered in the order the graph first runs them (attribute-held blocks in the
    order forward calls them; an encoder's layers before its decoder's); returns the stacks
    that ran, in that order, each holding the members that ran, in that order.
    """
    children = [{name: i for i, name in enumerate(stack.members)} for stack in stacks]
    calls = [n for n in exported.graph.nodes if n.op == "call_function"]
    layer_of = {}
    for n in calls:
        module_stack = list(n.meta.get("nn_module_stack", {}).values())
        path = module_stack[-1][0] if module_stack else ""
        layer_of[n.name] = (path, _layer_key(module_stack, stacks, children))
    seen_layers = list(dict.fromkeys(key for _, key in layer_of.values() if key is not None))
    if stacks and not seen_layers:
        raise ModelError(f"no operation ran inside the repeated layers {'; '.join(s.describe() for s in stacks)}; "
                         f"cannot cut the model")
    position = {layer: k + 1 for k, layer in enumerate(seen_layers)}  # block 0 is the prelude
    blocks = ([Block("prelude")] + [Block(stacks[k].member_path(i)) for k, i in seen_layers]
              + [Block("postlude")] if seen_layers else [Block("model")])  # no stack: one block, nothing to cut
    ran = [in_order(stacks[k], [i for j, i in seen_layers if j == k]) for k in dict.fromkeys(k for k, _ in seen_layers)]
    nodes: dict[str, NodeCost] = {}
    current = 0
    last_layer_op = max((i for i, n in enumerate(calls) if layer_of[n.name][1] is not None), default=len(calls))
    for index, n in enumerate(calls):
        path, layer = layer_of[n.name]
        if layer is not None:
            current = max(current, position[layer])
        elif index > last_layer_op:  # no later operation belongs to a layer: the postlude
            current = len(blocks) - 1
        reads = [canonical[a.name] for a in n.all_input_nodes if a.name in canonical]
        nodes[n.name] = NodeCost(name=n.name, target=str(n.target), module_path=path, block=current,
                                 params=reads, out_bytes=_tensor_bytes(n.meta.get("val")), flops=0)
        block = blocks[current]
        block.nodes.append(n.name)
        block.params.extend(p for p in reads if p not in block.params)
    return nodes, blocks, ran




def _count_flops(exported: ExportedProgram, nodes: dict[str, NodeCost], user_inputs: tuple) -> None:
    """Forward FLOPs per node, each operation run alone on the fake values the trace recorded.

    Every node's inputs carry the shapes export saw (`node.meta["val"]`, fake tensors of the
    trace's own fake mode), so each operation is replayed on those under a flop counter: no
    data is read, nothing is rerun on real or meta tensors (a model built for real makes
    tensors on its input's device, copies constants, views transposed results; replaying the
    graph on meta broke on each). Counting is an estimate for balancing cuts and must never
    break a run: an operation that cannot be replayed alone counts zero."""
    del user_inputs  # the recorded fake values already carry the inputs' shapes

    def fake(value: Any) -> Any:
        if isinstance(value, fx.Node):
            return value.meta.get("val")
        if isinstance(value, (list, tuple)):
            return type(value)(fake(v) for v in value)
        if isinstance(value, dict):
            return {k: fake(v) for k, v in value.items()}
        return value

    for n in exported.graph.nodes:
        if n.op != "call_function" or n.name not in nodes or not callable(n.target) or not _may_count(n.target):
            continue
        args, kwargs = fake(n.args), fake(n.kwargs)
        if _is_attention(n.target):
            nodes[n.name].flops = _attention_flops(*args[:3])
            continue
        try:
            with torch.no_grad(), FlopCounterMode(display=False) as counter:
                n.target(*args, **kwargs)
            nodes[n.name].flops = counter.get_total_flops()
        except Exception:  # an estimate only: an op that cannot be replayed alone counts zero
            nodes[n.name].flops = 0


def _may_count(target: Any) -> bool:
    """False for an aten operation the flop counter would count as zero (not one it has a formula for, and
    not a composite it would see as such operations): most of a graph (views, elementwise work), replayed for
    nothing. Anything else (a Python function, a higher-order operation) is replayed."""
    packet = getattr(target, "overloadpacket", None)
    return packet is None or packet in flop_registry or _is_attention(target) or decomposes(target)


def _is_attention(target: Any) -> bool:
    return getattr(target, "overloadpacket", None) is torch.ops.aten.scaled_dot_product_attention


def _attention_flops(q: Any, k: Any, v: Any) -> int:
    """Scaled dot-product attention's two matmuls, counted from shapes.

    Counted here, not by the flop counter: which kernel the op dispatches to depends on the
    device the model was built on (the math path on meta, counted; a fused CPU kernel on a
    model built for real, which the counter does not know), and the count must not."""
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return 0
    batch = q.numel() // (q.shape[-2] * q.shape[-1])  # every leading dimension: batch and heads
    return 2 * batch * q.shape[-2] * k.shape[-2] * (q.shape[-1] + v.shape[-1])
