"""Find mixture-of-experts layers in a traced graph, as the tensor-parallel planner finds its pairs.

A layer is recognised from operations, not class names: a `topk` over E scores that a linear with E
output rows computed (the router; softmax or sigmoid between them, and an optional renormalisation
of the chosen weights), and 3-d parameters with E rows whose values meet the top-k indices downstream
(the experts, run as a grouped product or gathered per token); the module that reads them is the
experts module, which the model calls as `experts(hidden, top_k_index, top_k_weights)` and which sums
the weighted outputs (the combine). That calling convention is what Hugging Face's MoE families
share (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3, gpt-oss) and what expert parallelism relies on: the
experts module is run on the tokens each rank receives, with its own rows only.

Anything else that looks like routing (a top-k fed by a router, but experts kept in one module per
expert, or experts mixed with other weights) stays replicated, and the plan says why.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from dataclasses import dataclass, field

from torch import fx, nn

from ..trace.graph import ModelGraph

# between the router's linear and its top-k: casts, reshapes, a score bias (DeepSeek-V3's correction), a mask
# (group-limited routing), a temperature; the walk follows the first tensor argument
_PASS_THROUGH = ("to", "_to_copy", "float", "view", "reshape", "contiguous", "_assert_tensor_metadata", "clone",
                 "add", "sub", "mul", "div", "type_as", "expand", "masked_fill", "where")
_SCORES = ("softmax", "_softmax", "sigmoid", "log_softmax")


@dataclass(frozen=True)
class ExpertLayer:
    """One mixture-of-experts layer the graph shows."""

    experts: str  # module path of the experts module (called as experts(hidden, top_k_index, top_k_weights))
    router: str  # module path of the router's linear
    num_experts: int
    top_k: int
    score: str  # softmax | sigmoid | none
    renormalised: bool  # the chosen weights divided by their sum
    params: tuple[str, ...]  # the experts' 3-d parameters, one row per expert


@dataclass
class ExpertPlan:
    """The expert layers of a model, and why any routing found was left replicated."""

    layers: list[ExpertLayer] = field(default_factory=list)
    unrecognised: list[str] = field(default_factory=list)

    @property
    def expert_params(self) -> list[str]:
        return [name for layer in self.layers for name in layer.params]

    def to_dict(self) -> dict:
        return {"layers": [dict(vars(layer), params=list(layer.params)) for layer in self.layers],
                "replicated": list(self.unrecognised)}

    def table(self, ep: int = 1) -> str:
        """What `autopar plan` prints: each layer's router and experts, and how many experts a rank holds."""
        if not self.layers and not self.unrecognised:
            return "mixture of experts: none found (no top-k routing in the graph)"
        lines = [f"mixture of experts: {len(self.layers)} layer(s) found" + (f", experts sharded over ep={ep}"
                                                                           if ep > 1 else "")]
        for layer in self.layers:
            per_rank = layer.num_experts // ep if ep > 1 else layer.num_experts
            lines.append(f"  {layer.experts}: {layer.num_experts} experts ({per_rank} per rank), top-{layer.top_k} "
                         f"{layer.score}{' renormalised' if layer.renormalised else ''}, router {layer.router}, "
                         f"weights {', '.join(p.rsplit('.', 1)[-1] for p in layer.params)}")
        lines += [f"  replicated: {why}" for why in self.unrecognised]
        return "\n".join(lines)


def find_experts(graph: ModelGraph, model: nn.Module) -> ExpertPlan:
    """Every routed expert layer of `model` (traced as `graph`), and why other routing stays replicated."""
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters(remove_duplicate=False)}
    modules = dict(model.named_modules())
    nodes = list(graph.graph.nodes)
    plan = ExpertPlan()
    seen: set[str] = set()
    for node in nodes:
        if node.op != "call_function" or _op_name(node) != "topk":
            continue
        layer, why = _layer_at(node, graph, shapes, modules)
        where = graph.nodes[node.name].module_path if node.name in graph.nodes else node.name
        if layer is None:
            if why:
                plan.unrecognised.append(f"top-k at {where or 'the model'}: {why}")
            continue
        if layer.experts not in seen:
            seen.add(layer.experts)
            plan.layers.append(layer)
    return plan


def _op_name(node: fx.Node) -> str:
    target = node.target
    name = getattr(target, "__name__", str(target))
    return name.split(".")[0]


def _router_linear(scores: fx.Node, graph: ModelGraph, shapes: dict, experts: int) -> tuple[fx.Node | None, str]:
    """The linear whose E outputs the top-k ranks, walking back over casts, reshapes, a bias and the score."""
    score, node = "none", scores
    for _ in range(12):
        name = _op_name(node)
        if name in ("linear", "mm", "addmm", "matmul"):
            readers = [node, *(a for a in node.args if isinstance(a, fx.Node))]  # the weight may come cast
            params = [p for n in readers if n.name in graph.nodes for p in graph.nodes[n.name].params]
            if any(len(shapes.get(p, ())) == 2 and shapes[p][0] == experts for p in params):
                return node, score
            return None, score
        if name in _SCORES:
            score = name.lstrip("_").replace("log_", "")
        elif name not in _PASS_THROUGH:
            return None, score
        inputs = [a for a in node.args if isinstance(a, fx.Node)]
        if name == "where" and len(inputs) > 1:
            inputs = inputs[1:]  # where(mask, scores, fill)
        if not inputs:
            return None, score
        node = inputs[0]
    return None, score


def _downstream(starts: Iterable[fx.Node], limit: int = 4000) -> set[fx.Node]:
    """Every node reachable from `starts` through data flow (bounded: routing meets experts within a layer)."""
    seen: set[fx.Node] = set()
    frontier = list(starts)
    while frontier and len(seen) < limit:
        node = frontier.pop()
        for user in node.users:
            if user not in seen:
                seen.add(user)
                frontier.append(user)
    return seen


def _layer_at(topk: fx.Node, graph: ModelGraph, shapes: dict, modules: dict) -> tuple[ExpertLayer | None, str]:
    scores = topk.args[0]
    value = scores.meta.get("val") if isinstance(scores, fx.Node) else None
    if value is None or value.dim() < 1:
        return None, ""
    experts = int(value.shape[-1])
    k = int(topk.args[1]) if len(topk.args) > 1 else 1
    router, score = _router_linear(scores, graph, shapes, experts)
    if router is None:
        return None, ""  # a top-k over values no router computed (sampling, a metric): not routing
    chosen = {int(u.args[1]): u for u in topk.users if _op_name(u) == "getitem" and u.users}
    if 1 not in chosen:
        return None, ""  # a top-k whose values only are read (a group score): not the routing itself
    router_path = graph.nodes[router.name].module_path
    block = router_path.rpartition(".")[0]  # the MoE block: the module that calls the router and the experts
    inside = lambda node: node.name in graph.nodes and _under(graph.nodes[node.name].module_path, block)
    routed = {n for n in _downstream([chosen[1]]) if inside(n)}
    readers: dict[str, list[str]] = {}  # 3-d parameter with E rows -> module paths that read it
    for node in graph.graph.nodes:
        cost = graph.nodes.get(node.name)
        if cost is None or not inside(node):
            continue
        for p in cost.params:
            if len(shapes.get(p, ())) == 3 and shapes[p][0] == experts and routed & _downstream([node], 400):
                readers.setdefault(p, []).append(cost.module_path)
    if not readers:
        return None, (f"router {router_path} picks {k} of {experts}, but no 3-d weight with {experts} rows is read "
                      f"under its choices (experts kept as one module each stay replicated; batch them as 3-d "
                      f"parameters to shard them with --ep)")
    owner = _common_path([path for paths in readers.values() for path in paths])
    module = modules.get(owner)
    if module is None or not owner:
        return None, f"the expert weights {sorted(readers)} are read from no single module"
    own = {f"{owner}.{name}": tuple(p.shape) for name, p in module.named_parameters()}
    mixed = [name for name, shape in own.items() if not (len(shape) >= 2 and shape[0] == experts)]
    if mixed:
        return None, (f"experts module {owner} also holds parameters with no row per expert ({', '.join(mixed)}); "
                      f"only a module of expert weights alone can be sharded")
    if len(_positional(module)) < 3:
        return None, (f"experts module {owner} is not called as experts(hidden, top_k_index, top_k_weights) "
                      f"(its forward takes {_positional(module)})")
    renormalised = 0 in chosen and any(_op_name(u) in ("div", "div_") for u in chosen[0].users)
    if score == "none" and 0 in chosen and any(_op_name(u) in _SCORES for u in chosen[0].users):
        score = "softmax of the chosen"  # gpt-oss: the top-k logits normalised among themselves
    return ExpertLayer(experts=owner, router=router_path, num_experts=experts, top_k=k, score=score,
                       renormalised=renormalised, params=tuple(sorted(own))), ""


def _under(path: str, prefix: str) -> bool:
    return not prefix or path == prefix or path.startswith(prefix + ".")


def _positional(module: nn.Module) -> list[str]:
    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return []
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return ["*args", "*args", "*args"]
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _common_path(paths: list[str]) -> str:
    parts = [p.split(".") if p else [] for p in paths]
    common = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return ".".join(common)


def expert_rows(plan: ExpertPlan) -> dict[str, int]:
    """Parameter name -> the number of experts (rows) it holds, for every expert weight of `plan`."""
    return {name: layer.num_experts for layer in plan.layers for name in layer.params}


