"""Expert parallelism inside traced stage graphs (pipeline and tensor parallelism): the experts module's
operations in a stage graph replaced by one call that dispatches the tokens and runs the model's own
experts module on this rank's rows.

Why a splice rather than the eager swap of shard.py: a stage runs the model as traced operations, so
the experts module's forward is no longer called; its operations (traced with every expert and a static
token count) sit in the stage graph between the three values the model passed it (hidden rows, top-k
indices, top-k weights). Those operations are cut out and one call node takes their place. The call
runs the dispatch of dispatch.py with the experts module itself (its original forward, eager: the
token count a rank receives varies) on the stage's own expert parameters, cut to this rank's rows;
gradients flow to them through the stage's inputs as for every other parameter.
"""

from __future__ import annotations

import torch
from torch import fx, nn
from torch.func import functional_call

from .._torch_internals import own_parameter_table, parameter_table
from ..errors import ModelError
from ..trace.graph import ModelGraph
from .detect import ExpertLayer, ExpertPlan
from .dispatch import ExpertParallelForward
from .shard import ShardedExperts


class ExpertDispatchCall(nn.Module):
    """What a stage graph calls in place of an experts module: (hidden, index, weights, *expert params) -> output.

    The experts module is held outside the module tree (it lives on meta, with every expert): only the
    parameters the stage passes in are used, named as the module names them.
    """

    def __init__(self, experts: nn.Module, names: list[str], dispatch: ExpertParallelForward):
        super().__init__()
        self._experts = (experts,)  # a tuple: not a submodule, so not part of the stage's state
        self.names, self.dispatch = names, dispatch

    @torch.compiler.disable  # --compile: the exchange runs eager between the compiled parts of its block
    def forward(self, hidden, index, weights, *params):
        experts, table = self._experts[0], dict(zip(self.names, params))
        self.dispatch.local_forward = lambda *args: functional_call(experts, table, args)
        return self.dispatch(hidden, index, weights)


def splice_expert_dispatch(stages: dict[int, nn.Module], graph: ModelGraph, model: nn.Module, plan: ExpertPlan,
                           group, *, ep: int, ep_rank: int) -> ShardedExperts:
    """In every stage of `stages` (StageModules), each expert layer's operations become a dispatching call and its
    expert parameters this rank's rows. Returns what checkpoints gather whole and cut again, with the dispatches."""
    sharded = ShardedExperts(plan, group, ep=ep, ep_rank=ep_rank)
    for layer in plan.layers:
        if layer.num_experts % ep:
            raise ModelError(f"{layer.experts} has {layer.num_experts} experts, which ep={ep} does not divide")
    for stage in stages.values():
        for piece, spec in zip(stage.pieces, stage.piece_specs):
            for layer in plan.layers:
                call = _splice_layer(piece, spec, graph, model, layer, sharded, group, ep=ep, ep_rank=ep_rank)
                if call is not None:
                    _cut_rows(stage, layer, sharded)
    return sharded


def _splice_layer(piece: fx.GraphModule, spec, graph: ModelGraph, model: nn.Module, layer: ExpertLayer,
                  sharded: ShardedExperts, group, *, ep: int, ep_rank: int) -> ExpertDispatchCall | None:
    prefix = layer.experts + "."
    path = lambda node: graph.nodes[node.name].module_path if node.name in graph.nodes else None  # noqa: E731
    inside = [n for n in piece.graph.nodes if n.op == "call_function"
              and (path(n) == layer.experts or (path(n) or "").startswith(prefix))]
    if not inside:
        return None
    members = set(inside)
    placeholders = [n for n in piece.graph.nodes if n.op == "placeholder"]
    param_of = {node: fqn for node, fqn in zip(placeholders, spec.params)}  # placeholders: params, buffers, inputs
    outside_inputs = []
    for node in inside:
        for arg in node.all_input_nodes:
            if arg not in members and arg not in outside_inputs:
                outside_inputs.append(arg)
    params = [a for a in outside_inputs if param_of.get(a) in layer.params]
    values = [a for a in outside_inputs if a not in params]
    results = [n for n in inside if any(user not in members for user in n.users)]
    where = f"the traced operations of {layer.experts}"
    if len(results) != 1 or len(values) != 3 or len(params) != len(layer.params):
        raise ModelError(f"{where} take {[a.name for a in values]} and give {[n.name for n in results]}: expected "
                         f"the three values experts(hidden, top_k_index, top_k_weights) and one output; expert "
                         f"parallelism cannot splice its dispatch there (use --ep 1, or pp=1 tp=1 with --ep)")
    hidden, index, weights = _call_arguments(values, where)
    names = [param_of[a][len(prefix):] for a in params]
    experts = _local_view(model.get_submodule(layer.experts), layer, ep)
    dispatch = ExpertParallelForward(None, num_experts=layer.num_experts, group=group, ep_rank=ep_rank, ep=ep)
    call = ExpertDispatchCall(experts, names, dispatch)
    target = f"expert_dispatch_{layer.experts.replace('.', '_')}"
    piece.add_submodule(target, call)
    with piece.graph.inserting_after(inside[-1]):
        node = piece.graph.call_module(target, (hidden, index, weights, *params))
    node.meta = dict(results[0].meta)
    results[0].replace_all_uses_with(node)
    for old in reversed(inside):
        piece.graph.erase_node(old)
    piece.graph.lint()
    piece.recompile()
    sharded.forwards[layer.experts] = dispatch
    return call


def _call_arguments(values: list[fx.Node], where: str) -> tuple[fx.Node, fx.Node, fx.Node]:
    """(hidden, index, weights) among the experts module's three inputs: the indices are integers, the weights
    have the indices' shape, the hidden rows are the other one."""
    val = lambda node: node.meta.get("val")  # noqa: E731
    index = [v for v in values if val(v) is not None and not val(v).is_floating_point()]
    if len(index) != 1:
        raise ModelError(f"{where}: no single integer input (the top-k indices) among {[v.name for v in values]}")
    rest = [v for v in values if v is not index[0]]
    weights = [v for v in rest if tuple(val(v).shape) == tuple(val(index[0]).shape)]
    if len(weights) != 1:
        raise ModelError(f"{where}: cannot tell the top-k weights from the hidden rows among {[v.name for v in rest]}")
    hidden = next(v for v in rest if v is not weights[0])
    return hidden, index[0], weights[0]


def _local_view(experts: nn.Module, layer: ExpertLayer, ep: int) -> nn.Module:
    """A shallow copy of the model's experts module that believes it holds E/ep experts (its forward reads the
    count); its parameters are always given by the call."""
    import copy
    view = copy.copy(experts)
    view.__dict__ = dict(experts.__dict__)
    own_parameter_table(view)
    if getattr(view, "num_experts", None) == layer.num_experts:
        view.num_experts = layer.num_experts // ep
    return view


def _cut_rows(stage: nn.Module, layer: ExpertLayer, sharded: ShardedExperts) -> None:
    """The stage's whole expert parameters of `layer` replaced by this rank's rows (once per stage)."""
    for fqn in layer.params:
        owner_path, _, leaf = fqn.rpartition(".")
        owner = stage.get_submodule(owner_path)
        whole = parameter_table(owner)[leaf]
        if whole.shape[0] != layer.num_experts:
            continue  # already cut (the layer's operations span two pieces of this stage)
        parameter_table(owner)[leaf] = nn.Parameter(sharded.shard(fqn, whole.detach()), requires_grad=whole.requires_grad)
