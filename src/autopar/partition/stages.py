"""Build one module per pipeline stage from the traced graph and a cut.

Why our own splitter rather than torch.distributed.pipelining.pipeline(): measured here,
it fails on every model with rotary embeddings (a top-level value several layers need)
and replicates tied weights without keeping them equal. Here:

- the values crossing each cut are computed from definitions and uses, so a value needed
  later than the next stage (attention mask, rotary cos/sin, a skip connection) is
  received and sent on by every stage in between: `outputs(s) == inputs(s + 1)`;
- each stage module holds only the parameters and buffers its operations read, under the
  model's own names (so checkpoints and tensor-parallel plans address them as usual);
- a parameter read by several stages (tied input/output embeddings) is owned by each of
  them; `Partition.shared` lists them so their gradients are summed every step.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils.checkpoint
from torch import fx, nn
from torch.export.graph_signature import InputKind

from .._torch_internals import tree_unflatten
from ..dropout import checkpoint_context_fn, dropout_numbering, replace_dropout_nodes
from ..errors import ModelError
from ..running_stats import replace_batch_norm_nodes
from ..trace import ModelGraph


@dataclass
class StageSpec:
    """What one stage computes and exchanges."""

    index: int
    blocks: list[str]
    nodes: list[str]  # operations, in graph order
    inputs: list[str]  # values received (stage 0: the model's inputs), in order
    outputs: list[str]  # values sent on (last stage: the model's outputs), in order
    params: list[str]  # parameter FQNs it reads (a tied one under the model's primary name)
    buffers: list[str] = field(default_factory=list)
    block_range: tuple[int, int] = (0, 0)  # blocks [first, last) of the traced graph


def plan_stages(graph: ModelGraph, bounds: list[int]) -> list[StageSpec]:
    """Which operations, parameters and crossing values each stage of a cut has."""
    num_stages = len(bounds) - 1
    stage_of_block = {}
    for s in range(num_stages):
        for b in range(bounds[s], bounds[s + 1]):
            stage_of_block[b] = s
    fx_graph = graph.graph
    user_inputs = [spec.arg.name for spec in graph.exported.graph_signature.input_specs
                   if spec.kind == InputKind.USER_INPUT]
    defined: dict[str, int] = {name: -1 for name in user_inputs}  # model inputs arrive at stage 0
    last_use: dict[str, int] = {}
    order: list[str] = list(user_inputs)
    for node in fx_graph.nodes:
        if node.op == "call_function":
            stage = stage_of_block[graph.nodes[node.name].block]
            defined[node.name] = stage
            order.append(node.name)
        elif node.op == "output":
            stage = num_stages - 1
        else:
            continue
        for arg in node.all_input_nodes:
            if arg.name in defined:
                last_use[arg.name] = max(last_use.get(arg.name, -1), stage)
    specs = []
    for s in range(num_stages):
        blocks = graph.blocks[bounds[s]:bounds[s + 1]]
        nodes = [n for b in blocks for n in b.nodes]
        inputs = user_inputs if s == 0 else [v for v in order if defined[v] < s <= last_use.get(v, -1)]
        if s == num_stages - 1:
            outputs = [a.name for a in _output_nodes(fx_graph)]
        else:
            outputs = [v for v in order if defined[v] <= s < last_use.get(v, -1)]
        params = []
        for b in blocks:
            params.extend(p for p in b.params if p not in params)
        specs.append(StageSpec(index=s, blocks=[b.name for b in blocks], nodes=nodes, inputs=inputs,
                               outputs=outputs, params=params, buffers=_buffers_read(graph, nodes),
                               block_range=(bounds[s], bounds[s + 1])))
    _check_crossings(graph, specs)
    return specs


def _output_nodes(fx_graph: fx.Graph) -> list[fx.Node]:
    output = next(n for n in fx_graph.nodes if n.op == "output")
    return [a for a in output.args[0] if isinstance(a, fx.Node)]


def _buffers_read(graph: ModelGraph, nodes: list[str]) -> list[str]:
    """Buffers and lifted tensor constants (a tensor made in forward) the nodes read: each stage
    that reads one holds its own copy."""
    buffer_of = {spec.arg.name: spec.target for spec in graph.exported.graph_signature.input_specs
                 if spec.kind in (InputKind.BUFFER, InputKind.CONSTANT_TENSOR)}
    wanted = set(nodes)
    found = []
    for node in graph.graph.nodes:
        if node.name in wanted:
            for arg in node.all_input_nodes:
                if arg.name in buffer_of and buffer_of[arg.name] not in found:
                    found.append(buffer_of[arg.name])
    return found


def _check_crossings(graph: ModelGraph, specs: list[StageSpec]) -> None:
    by_name = {n.name: n for n in graph.graph.nodes}
    for spec in specs[1:]:
        for name in spec.inputs:
            value = by_name[name].meta.get("val")
            if not isinstance(value, torch.Tensor):
                raise ModelError(f"the cut before stage {spec.index} ({spec.blocks[0]}) would send {name}, a "
                                 f"{type(value).__name__} rather than a tensor; choose another cut")


# ---------------------------------------------------------------------------- modules


def _set_by_path(root: nn.Module, fqn: str, value: torch.Tensor, *, buffer: bool, persistent: bool = True,
                 requires_grad: bool = True) -> None:
    """Register `value` at `fqn`; a parameter keeps the model's `requires_grad` (a frozen one stays frozen)."""
    *path, leaf = fqn.split(".")
    module = root
    for part in path:
        if not hasattr(module, part):
            module.add_module(part, nn.Module())
        module = getattr(module, part)
    if buffer:
        module.register_buffer(leaf, value, persistent=persistent)
    else:
        module.register_parameter(leaf, nn.Parameter(value, requires_grad=requires_grad and value.is_floating_point()))


class StageModule(nn.Module):
    """One pipeline stage: its own parameters (under the model's names) and its part of the graph.

    forward(*inputs) takes the values listed in `spec.inputs` and returns the tuple listed in
    `spec.outputs` (the last stage returns the model's output, rebuilt in its original form).
    Inside, the stage is a chain of one graph piece per block; the first `recompute_blocks`
    pieces run under activation checkpointing when gradients are on (they keep only their
    inputs and recompute the rest during backward: stage-aware recomputation).
    """

    def __init__(self, graph: ModelGraph, spec: StageSpec, num_stages: int):
        super().__init__()
        self.spec = spec
        self.is_last = spec.index == num_stages - 1
        self.recompute_blocks = 0
        example = graph.example_inputs[0] if graph.example_inputs else None
        self.traced_device = example.device if isinstance(example, torch.Tensor) else torch.device("meta")
        self._out_spec = graph.exported.call_spec.out_spec if self.is_last else None
        signature = graph.exported.graph_signature.input_specs
        names = {s.target: s.arg.name for s in signature}
        # a constant made in forward is no state of the model: kept out of the stage's state_dict (checkpoints)
        persistent = {s.target: s.kind == InputKind.BUFFER and s.persistent is not False for s in signature}
        state = graph.exported.state_dict
        for fqn in spec.params:
            traced = state[graph.export_name(fqn)]  # the model's Parameter: its requires_grad is the user's
            _set_by_path(self, fqn, torch.empty_like(traced, device="meta"), buffer=False,
                         requires_grad=traced.requires_grad)
        # lifted tensor constants (made in forward): their values, for materialize_stage; None where the
        # trace on meta knows only the shape (see lifted_constant_values)
        self.constants: dict[str, torch.Tensor | None] = {}
        kinds = {s.target: s.kind for s in signature}
        for fqn in spec.buffers:
            source = state.get(fqn, graph.exported.constants.get(fqn))
            if source is None:  # non-persistent buffers are kept with constants in the exported program
                source = _find_nonpersistent(graph, fqn)
            if kinds.get(fqn) == InputKind.CONSTANT_TENSOR:
                self.constants[fqn] = None if source.is_meta else source.detach().clone()
            _set_by_path(self, fqn, torch.empty_like(source, device="meta"), buffer=True,
                         persistent=persistent.get(fqn, True))
        by_name = {n.name: n for n in graph.graph.nodes}
        self.input_shapes = [tuple(by_name[name].meta["val"].shape) for name in spec.inputs]
        first, last = spec.block_range
        per_block = plan_stages(graph, list(range(len(graph.blocks) + 1)))[first:last]
        self.piece_specs = per_block
        self._pieces = nn.ModuleList(
            _stage_graph_module(graph, piece, names, is_last=self.is_last and piece is per_block[-1])
            for piece in per_block)
        buffer_of = {s.arg.name: s.target for s in signature if s.kind == InputKind.BUFFER}
        for piece in self._pieces:  # BatchNorm: statistics recorded per micro-batch, replayed after the step
            replace_batch_norm_nodes(piece, buffer_of)
        numbering = dropout_numbering(graph.graph)  # whole-graph order: every stage numbers alike
        if numbering:
            batch = graph.example_inputs[0].shape[0]
            for piece in self._pieces:
                replace_dropout_nodes(piece, numbering, batch)

    @property
    def pieces(self) -> list[fx.GraphModule]:
        """The stage's graph pieces, one per block, in order (what --compile compiles)."""
        return list(self._pieces)

    @property
    def num_blocks(self) -> int:
        return len(self.piece_specs)

    @property
    def pieces(self) -> list[fx.GraphModule]:
        """The graph pieces in order (one per block); the last stage's last one returns the model's outputs."""
        return list(self._pieces)

    def forward(self, *inputs: torch.Tensor) -> Any:
        if len(inputs) != len(self.spec.inputs):
            raise ValueError(f"stage {self.spec.index} takes {len(self.spec.inputs)} inputs "
                             f"({', '.join(self.spec.inputs)}), got {len(inputs)}")
        for value, expected in zip(inputs, self.input_shapes):
            if isinstance(value, torch.Tensor) and tuple(value.shape) != expected:
                raise ValueError(f"stage {self.spec.index} was traced for inputs of shape {list(expected)} and got "
                                 f"{list(value.shape)}; shapes are static: trace with the micro-batch shape you train with")
        values = tuple(inputs)
        for i, (piece, spec) in enumerate(zip(self._pieces, self.piece_specs)):
            state = [self.get_parameter(f) for f in spec.params] + [self.get_buffer(f) for f in spec.buffers]
            if i < self.recompute_blocks and torch.is_grad_enabled():
                values = torch.utils.checkpoint.checkpoint(piece, *state, *values, use_reentrant=False,
                                                     context_fn=checkpoint_context_fn)
            else:
                values = piece(*state, *values)
        if self.is_last:
            return tree_unflatten(values, self._out_spec)
        return tuple(values)


def _find_nonpersistent(graph: ModelGraph, fqn: str) -> torch.Tensor:
    for spec in graph.exported.graph_signature.input_specs:
        if spec.target == fqn:
            node = next(n for n in graph.graph.nodes if n.name == spec.arg.name)
            return node.meta["val"]
    raise ModelError(f"buffer {fqn!r} not found in the traced model")


def _stage_graph_module(graph: ModelGraph, spec: StageSpec, name_of_target: dict[str, str], *,
                        is_last: bool) -> fx.GraphModule:
    """A GraphModule computing this stage: (params..., buffers..., inputs...) -> outputs."""
    source = graph.graph
    by_name = {n.name: n for n in source.nodes}
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for fqn in [*spec.params, *spec.buffers]:
        old = by_name[name_of_target[graph.export_name(fqn)]]
        env[old] = new.placeholder(old.name)
    for name in spec.inputs:
        env[by_name[name]] = new.placeholder(name)
    root = nn.Module()

    def lookup(node: fx.Node) -> fx.Node:
        if node not in env:
            if node.op == "get_attr":  # e.g. the body of a higher-order op (rotary under no_grad)
                root.add_module(node.target, getattr(graph.exported.graph_module, node.target))
                env[node] = new.get_attr(node.target)
            else:
                raise ModelError(f"stage {spec.index} needs {node.name}, which no earlier stage sends")
        return env[node]

    for name in spec.nodes:
        node = by_name[name]
        env[node] = new.node_copy(node, lookup)
    if is_last:  # the model's flat outputs, non-tensor leaves (None) included, for tree_unflatten
        original = next(n for n in source.nodes if n.op == "output").args[0]
        new.output(tuple(lookup(a) if isinstance(a, fx.Node) else a for a in original))
    else:
        new.output(tuple(lookup(by_name[name]) for name in spec.outputs))
    return fx.GraphModule(root, new)


def materialize_stage(stage: StageModule, full_model: nn.Module, device: str | torch.device) -> StageModule:
    """Give a stage the values of a materialised model (same seed -> same weights as one process), on `device`.

    `full_model` may be partially materialised (models.materialize_partial): only the
    stage's own parameters and buffers are read. The device is the caller's (where the run
    trains), never guessed from the model: a stage may hold no parameters at all (an
    activation or a loss-side op alone), and then the partial model may have none either.
    """
    device = torch.device(device)
    stage.to_empty(device=device)
    retarget_device(stage, device, traced=stage.traced_device)
    with torch.no_grad():
        for fqn in stage.spec.params:
            stage.get_parameter(fqn).copy_(full_model.get_parameter(fqn))
        for fqn in stage.spec.buffers:
            value = stage.constants[fqn] if fqn in stage.constants else full_model.get_buffer(fqn)
            if value is None:
                raise ModelError(f"stage {stage.spec.index} reads the tensor constant {fqn!r}, made in forward, "
                                 f"whose value is unknown; fill StageModule.constants (lifted_constant_values)")
            stage.get_buffer(fqn).copy_(value)
    return stage


def lifted_constant_values(model: nn.Module, graph: ModelGraph, device: torch.device) -> dict[str, torch.Tensor]:
    """The values of the tensor constants a model makes in forward (`torch.tensor(..., device=x.device)`).

    A trace on meta knows only their shapes, so the model is traced once more with its
    tensors on `device`: this costs an uninitialised copy of the whole model there, paid only
    by models that make such constants. Names agree because the same code runs in the same order.
    Only constants made in forward are returned: the exported program keeps non-persistent
    buffers (rotary inv_freq) among its constants too, and the copy's are uninitialised memory.
    """
    from ..trace import trace
    real = copy.deepcopy(model).to_empty(device=device)
    zeros = lambda t: torch.zeros(t.shape, dtype=t.dtype, device=device)
    again = trace(real, tuple(zeros(a) for a in graph.example_args),
                  {k: zeros(v) for k, v in graph.example_kwargs.items()})
    made_in_forward = {s.target for s in again.exported.graph_signature.input_specs
                       if s.kind == InputKind.CONSTANT_TENSOR}
    return {k: v.detach().clone() for k, v in again.exported.constants.items()
            if k in made_in_forward and isinstance(v, torch.Tensor) and not v.is_meta}


def _swap_device(value: Any, device: torch.device, traced: torch.device) -> Any:
    if isinstance(value, torch.device) and (value.type == "meta" or value == traced):
        return device
    if isinstance(value, (list, tuple)):
        return type(value)(_swap_device(v, device, traced) for v in value)
    return value


def retarget_device(module: nn.Module, device: torch.device, traced: torch.device = torch.device("meta")) -> None:
    """Rewrite device arguments baked in by tracing on meta, or on `traced` where a model built for real was
    traced where it lives (arange, to, metadata asserts), nested graphs too."""
    for sub in module.modules():
        if not isinstance(sub, fx.GraphModule):
            continue
        for node in sub.graph.nodes:
            node.args = _swap_device(node.args, device, traced)
            node.kwargs = {k: _swap_device(v, device, traced) for k, v in node.kwargs.items()}
        sub.recompile()
