"""Zero-bubble backward split: I computes the input gradients, W only the weight gradients.

Why not two backward passes: I = autograd.grad to the inputs, then W = a backward to the
parameters, runs the activation chain (every node between the outputs and the inputs) twice,
so I + W costs about B + I and a zero-bubble schedule gains less than it adds.

How: the autograd graph of a stage splits into the *chain* (nodes that depend on the stage's
inputs: autograd.grad to the inputs runs exactly these) and *weight branches* (nodes that lead
only to parameters, e.g. the weight side of a matmul or a layer norm's affine). A weight branch
hangs off the chain at *boundary* nodes (the matmul, the layer norm). I asks its one autograd call
for the gradient arriving at each boundary node besides the inputs' (the engine keeps it as it
passes), and for the cheap weight-side halves, a bias or a norm's affine, where a fused backward
makes them; W then computes, from the kept gradients alone, what each boundary sends into its weight
branch (the weight matmuls: grad_w = x^T g from the node's saved input; other built-in ops by calling
their node) and runs every branch in ONE autograd call rooted at those weight-side edges, so
autograd runs the branches and never the chain. Only a custom autograd.Function at a boundary falls
back to a backward from its boundary nodes asking for that group's parameters (parameters sharing a
boundary, or a weight read at several, form one group); there a weight read at two places of the
chain re-runs the chain nodes between its two uses. An output made without the inputs (a stage's
weights-only output) seeds W directly. Which nodes are boundaries is found by walking the graph;
split_plan.py keeps that analysis per graph structure, so a repeated micro-batch pays one walk.

What I + W costs beyond B (gpt-mini, benchmarks/split_overhead.py --parts --profile): the same matmuls
run 4-10% slower than in B (W reads gradients and inputs that have left the cache since I; B multiplies
while they are hot), W's engine call (its own set-up, and AccumulateGrad copies each early gradient, as
Python holds a reference), the walk and structure key (mostly the first Python touch of each new node),
and a little Python in each pass (the layout is flat so that it is loops over numbers).

What is held between I and W: the graph (I keeps it, as the weight branches need the saved
activations) plus the gradient at each boundary whose weight half W computes, and the early halves
(`WeightWork.held_bytes`).
The same idea as torch.distributed.pipelining's stage_backward_input/stage_backward_weight; our
own code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from .._torch_internals import engine_backward, engine_grad, input_metadata, saved
from .split_plan import GroupPlan, SplitPlan, SplitPlanCache, analyse, node_of, structure_key, walk


@dataclass(frozen=True)
class _Item:
    """One boundary whose weight half W computes: by a rule from its saved tensors, or by calling the node."""

    node: int  # its number in split_plan.walk's order
    rule: Callable | None  # its _WEIGHT_SIDE_RULES entry (I captures the gradient at its input 0); None: call it
    edges: tuple[int, ...]  # the node's edges W computes
    roots: tuple[tuple[int, int, int], ...]  # per such edge (edge, target node, slot): where W's call is rooted


@dataclass(frozen=True)
class _Layout:
    """A SplitPlan laid out for the two calls (built once per graph structure, cached with it), flat so
    that I and W loop over numbers: what I asks autograd for besides the inputs, and what W does with
    each answer. Numbers are node numbers of split_plan.walk and positions in the parameter and output
    lists."""

    chained: tuple[bool, ...]  # per output: does it depend on the inputs
    boundaries: tuple[int, ...]  # every boundary node
    fixed: tuple[tuple[int, int], ...]  # (node, slot) I captures: each rule item's input 0, then the early edges
    rules: int  # how many of `fixed` are rule items' (the rest are early edges: W roots at them as they are)
    spread: tuple[tuple[int, tuple], ...]  # (node, purpose) captured at every input of the node (their number
    # is read from the node, not assumed): ("item", i) a called item, ("fallback", g, b) boundary b of group g
    items: tuple[_Item, ...]
    rule_items: tuple[int, ...] | None  # item positions of the rule captures; None: every item is a rule item
    params: tuple[int, ...] | None  # the parameters of W's one call; None: all of them, in order
    seeds: tuple[int, ...]  # outputs made without the inputs seeding that call (each once)
    fallback: tuple[GroupPlan, ...]  # groups with a custom autograd.Function boundary


def _layout(plan: SplitPlan, order: list[Node], num_params: int) -> _Layout:
    """The plan's groups flattened: fallback groups apart, every other group's W work in one list."""
    items, fixed, early, spread, rule_items, params, seeds, fallback = [], [], [], [], [], [], [], []
    for group in plan.groups:
        if group.fallback:
            spread += [(b, ("fallback", len(fallback), i)) for i, b in enumerate(group.boundaries)]
            fallback.append(group)
            continue
        for b, edges in zip(group.boundaries, group.wanted):
            if edges:
                rule = _WEIGHT_SIDE_RULES.get(type(order[b]).__name__)  # a rule reads input 0's gradient only
                if rule is None:
                    spread.append((b, ("item", len(items))))
                else:
                    fixed.append((b, 0))
                    rule_items.append(len(items))
                items.append(_Item(b, rule, tuple(k for k, _, _ in edges), edges))
        early += group.early
        params += group.params
        seeds += [k for k in group.seeds if k not in seeds]
    every = rule_items == list(range(len(items)))
    return _Layout(plan.chained, tuple(b for g in plan.groups for b in g.boundaries), tuple(fixed + early),
                   len(fixed), tuple(spread), tuple(items), None if every else tuple(rule_items),
                   None if params == list(range(num_params)) else tuple(params), tuple(seeds), tuple(fallback))


@dataclass(eq=False)  # compared by identity (fields hold tensors)
class _Fallback:
    """A group W runs through autograd from its boundary nodes (a custom autograd.Function among them)."""

    params: list[torch.Tensor]
    boundaries: list[Node]
    seeds: list[tuple[GradientEdge, torch.Tensor]]
    grads: dict[int, tuple] = field(default_factory=dict)  # boundary index -> gradients at its inputs


@dataclass(eq=False)
class WeightWork:
    """What I leaves for W (nothing to do when `layout` is None and there are no seeds)."""

    nodes: list[Node]  # the graph's nodes in walk order (the layout names them by number)
    layout: _Layout | None  # None: a first stage, whose W is the whole backward from `seeds`
    kept: list  # per layout item, what I captured: a rule item's gradient, a called item's tuple
    early: list[tuple[GradientEdge, torch.Tensor | None]]  # weight-side edges I computed, with their gradients
    seeds: list[tuple[GradientEdge, torch.Tensor]]  # outputs made without the inputs, with their gradients
    params: list[torch.Tensor]  # what W's one call accumulates
    fallback: list[_Fallback]

    @property
    def boundaries(self) -> list[Node]:
        """Every boundary node the split found (for tests and reports)."""
        return [] if self.layout is None else [self.nodes[b] for b in self.layout.boundaries]

    @property
    def held_bytes(self) -> int:
        """Bytes of the gradients kept for W (the graph's saved activations come on top)."""
        kept = [g for k in self.kept for g in (k if isinstance(k, tuple) else (k,))] + [g for _, g in self.early]
        kept += [g for group in self.fallback for grads in group.grads.values() for g in grads]
        return sum(g.numel() * g.element_size() for g in kept if g is not None)


def backward_input(outputs: list[torch.Tensor], grad_outputs: list[torch.Tensor | None],
                   inputs: list[torch.Tensor], params: list[torch.Tensor], cache: SplitPlanCache | None = None
                   ) -> tuple[list[torch.Tensor | None], WeightWork]:
    """Gradients of `inputs` (None where unused), and the work W needs for the parameters' gradients.

    `grad_outputs[i]` None means ones (a loss). The graph is kept for W. `cache` (one per runtime)
    serves the boundary analysis again to a graph of the same structure (split_plan.py says how
    that is checked); without it every call analyses afresh. The gradients W needs are asked of the
    same autograd call as the inputs' (as extra inputs at the boundary nodes' edges: the engine keeps
    them, no Python runs per node), as are the early weight-side ones (`_EARLY_EDGES`).
    """
    grad_outputs = [torch.ones_like(o) if g is None else g for o, g in zip(outputs, grad_outputs)]
    if not any(x.requires_grad for x in inputs):
        # a first stage (token ids): no chain, so I has nothing to compute and W is the whole backward,
        # seeded at the outputs; skipping the walk saved 0.15-0.3 ms a micro-batch (benchmarks/zbv_breakdown.py)
        seeds = [(get_gradient_edge(o), g) for o, g in zip(outputs, grad_outputs) if o.requires_grad]
        return [None] * len(inputs), WeightWork([], None, [], [], seeds, list(params), [])
    roots = [node_of(o) for o in outputs]
    order, index, shape = walk(roots)
    key = structure_key(shape, order, index, roots, inputs, params) if cache is not None else None
    layout = cache.get(key) if cache is not None else None
    if layout is None:
        layout = _layout(analyse(order, index, roots, inputs, params, _EARLY_EDGES), order, len(params))
        if cache is not None:
            cache.put(key, layout)
    edges = [GradientEdge(order[j], slot) for j, slot in layout.fixed]
    spread = []  # (purpose, how many edges) of the captures at every input of a node
    for j, purpose in layout.spread:
        node = order[j]
        count = len(input_metadata(node))
        edges += [GradientEdge(node, s) for s in range(count)]
        spread.append((purpose, count))
    wanted = [x for x in inputs if x.requires_grad]
    chained = [(o, g) for o, g, c in zip(outputs, grad_outputs, layout.chained) if c]
    got = _run_grad([o for o, _ in chained], [g for _, g in chained], wanted + edges) \
        if chained and (wanted or edges) else [None] * (len(wanted) + len(edges))
    n, rules, fixed = len(wanted), layout.rules, len(layout.fixed)
    if layout.rule_items is None:  # every item is a rule item, in order
        kept = list(got[n:n + rules])
    else:
        kept = [None] * len(layout.items)
        for i, g in zip(layout.rule_items, got[n:n + rules]):
            kept[i] = g
    early = list(zip(edges[rules:fixed], got[n + rules:n + fixed]))
    fallback = [_Fallback([params[k] for k in g.params], [order[b] for b in g.boundaries],
                          [(get_gradient_edge(outputs[k]), grad_outputs[k]) for k in g.seeds])
                for g in layout.fallback]
    at = n + fixed
    for purpose, count in spread:
        grads, at = tuple(got[at:at + count]), at + count
        if purpose[0] == "item":
            kept[purpose[1]] = grads
        else:
            fallback[purpose[1]].grads[purpose[2]] = grads
    work = WeightWork(order, layout, kept, early,
                      [(get_gradient_edge(outputs[k]), grad_outputs[k]) for k in layout.seeds],
                      list(params) if layout.params is None else [params[k] for k in layout.params], fallback)
    if n == len(inputs):
        return list(got[:n]), work
    by_id = dict(zip(map(id, wanted), got))
    return [by_id.get(id(x)) for x in inputs], work


def backward_weight(work: WeightWork) -> None:
    """Accumulate the parameters' gradients into .grad (post-accumulate hooks fire, as in a full backward).

    Each boundary's weight-side gradients are computed here from what I kept (weight matmuls and,
    where I could not take them early, bias and norm halves by `_WEIGHT_SIDE_RULES`; other built-in
    ops by calling their node), and all of them, with the halves I computed, then run in ONE autograd
    call rooted at those weight-side edges (off the chain, so only the weight branches run: each
    autograd call walks the graph below its roots, so one call instead of one per group is most of
    the saving). A group with a custom autograd.Function at a boundary takes a backward from its
    boundary nodes instead, a call of its own. A kept gradient is let go once its item is done.
    """
    for group in work.fallback:
        _through_autograd(group)
    edges, grads, nodes, kept = [], [], work.nodes, work.kept
    for i, item in enumerate(work.layout.items if work.layout is not None else ()):
        g, kept[i] = kept[i], None
        if item.rule is not None:
            if g is None:
                continue  # no gradient reached it during I: none flows to its weights
            got = item.rule(nodes[item.node], g, item.edges)
        else:
            if not g or all(x is None for x in g):
                continue
            got = _call_node(nodes[item.node], g, item.edges)
        for k, j, slot in item.roots:
            if got[k] is not None:
                edges.append(GradientEdge(nodes[j], slot))
                grads.append(got[k])
    for edge, g in work.early:
        if g is not None:
            edges.append(edge)
            grads.append(g)
    for edge, g in work.seeds:
        edges.append(edge)
        grads.append(g)
    work.kept, work.early, work.fallback = [], [], []
    if edges:  # the graph's last use: each node's saved tensors are freed once it has run, as a full
        # backward frees them (retaining them held a first stage's every activation through its whole W:
        # one hidden-width tensor more at its peak, 30.2 MiB against 26.5 for gpt-mini's first of 4 stages).
        # Without backward()'s per-root Python checks (about 5 us a root, 50 roots here): the rules
        # above give every root its edge's shape
        engine_backward(edges, grads, work.params, retain_graph=False)


def _run_grad(outputs: list[torch.Tensor], grads: list[torch.Tensor], inputs: list) -> tuple:
    """torch.autograd.grad(outputs, inputs, grads, retain_graph=True, allow_unused=True) without its
    Python per-argument work (the engine checks each root gradient's shape against its output);
    the public call where torch lacks the engine entry point."""
    for o, g in zip(outputs, grads):
        if g.shape != o.shape:
            raise RuntimeError(f"gradient of shape {tuple(g.shape)} for an output of shape {tuple(o.shape)}")
    return engine_grad(outputs, grads, inputs)


def _through_autograd(group: _Fallback) -> None:
    """A backward from the group's boundary nodes with the kept gradients, asking for its parameters only."""
    edges, grads = [], []
    for index, node in enumerate(group.boundaries):
        for k, g in enumerate(group.grads.get(index, ())):
            if g is not None:
                edges.append(GradientEdge(node, k))
                grads.append(g)
    for edge, g in group.seeds:
        edges.append(edge)
        grads.append(g)
    handles = []
    if len(group.boundaries) > 1:  # one boundary may feed another along the chain: pin each to what I saw
        handles = [node.register_prehook(lambda _, kept=group.grads.get(i): kept)
                   for i, node in enumerate(group.boundaries) if i in group.grads]
    try:
        if edges:  # retain: groups may share weight-side nodes; the graph goes with `work`
            torch.autograd.backward(edges, grads, inputs=group.params, retain_graph=True)
    finally:
        for handle in handles:
            handle.remove()
    group.grads.clear()


def _call_node(node: Node, kept: tuple, wanted: list[int]) -> dict[int, torch.Tensor | None]:
    """Any other built-in op (a bias add, `x * scale`, a convolution): run the node itself on the kept
    gradients. It also recomputes its chain-side halves (I sent those already), wasted but small for
    the element-wise ops met here, and cheaper than an autograd call of the group's own."""
    got = node(*kept)
    got = got if isinstance(got, (tuple, list)) else (got,)
    return {k: None if got[k] is None else _fit(node, k, got[k]) for k in wanted}


def _fit(node: Node, k: int, g: torch.Tensor) -> torch.Tensor:
    """`g` as the root of W's autograd call at `node`'s edge k: with that edge's shape (a broadcast
    reduced) and dtype, as autograd does between two nodes."""
    child, slot = node.next_functions[k]
    meta = input_metadata(child)[slot]
    if g.shape != meta.shape:
        g = g.sum_to_size(meta.shape)
    return g if g.dtype == meta.dtype else g.to(meta.dtype)


# The gradients a matmul or layer-norm node sends along its edges `wanted` (those off the chain: I has
# sent the others), from the node's saved tensors, with the formulas of autograd's own derivative of
# each op (x @ w: grad_w = x^T g). None: a case not covered (the group then takes autograd's path).

def _addmm(node: Node, g: torch.Tensor, wanted: list[int]) -> dict[int, torch.Tensor]:
    """addmm(self, mat1, mat2) = beta * self + alpha * mat1 @ mat2 (nn.Linear on 2-D input)."""
    alpha, beta, out = saved(node, "alpha"), saved(node, "beta"), {}
    if 0 in wanted:  # a bias I could not take early (it gets gradient from elsewhere too)
        out[0] = _fit(node, 0, g if beta == 1 else g * beta)
    if 1 in wanted:
        out[1] = g @ saved(node, "mat2").mH
    if 2 in wanted:
        out[2] = _weight_grad(saved(node, "mat1"), g, saved(node, "mat2"))
    return {k: (v if k == 0 or alpha == 1 else v * alpha) for k, v in out.items()}


def _mm(node: Node, g: torch.Tensor, wanted: list[int]) -> dict[int, torch.Tensor]:
    """mm(self, mat2) (nn.Linear without bias on 3-D input)."""
    out = {}
    if 0 in wanted:
        out[0] = g @ saved(node, "mat2").mH
    if 1 in wanted:
        out[1] = _weight_grad(saved(node, "self"), g, saved(node, "mat2"))
    return out


def _weight_grad(x: torch.Tensor, g: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x^T g laid out like `weight`: nn.Linear multiplies by W.t(), so computing (g^T x).t() hands
    AccumulateGrad a gradient with W's own strides (no copy there), as autograd's matmul backward does."""
    if weight.dim() == 2 and weight.stride(0) == 1 and weight.stride(1) != 1:
        return (g.mH @ x).mH
    return x.mH @ g


def _layer_norm(node: Node, g: torch.Tensor, wanted: list[int]) -> dict[int, torch.Tensor]:
    """native_layer_norm(input, shape, weight, bias): one kernel call for the weight and bias halves."""
    grads = torch.ops.aten.native_layer_norm_backward(
        g, saved(node, "input"), list(saved(node, "normalized_shape")), saved(node, "result1"), saved(node, "result2"),
        saved(node, "weight"), saved(node, "bias"), [k in wanted for k in range(3)])
    return {k: grads[k] for k in wanted}


_WEIGHT_SIDE_RULES = {"AddmmBackward0": _addmm, "MmBackward0": _mm, "NativeLayerNormBackward0": _layer_norm}
# Weight-side edges I computes as it passes (`analyse` checks the target gets nothing else): a bias (a
# row sum of the gradient) and a norm's affine (the layer-norm backward kernel yields it in the same
# pass as the input gradient), where a fused B computes them, with the gradient still in cache. Done
# in W instead they cost several times more (the gradient read back from memory, a second norm
# kernel) and W would have to keep the norms' gradients. W is left the weight matmuls.
_EARLY_EDGES = {"AddmmBackward0": frozenset({0}), "NativeLayerNormBackward0": frozenset({1, 2})}
