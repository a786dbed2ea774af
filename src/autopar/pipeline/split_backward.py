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

What is held between I and W: the graph (I keeps it, as the weight branches need the saved
activations) plus the gradient at each boundary whose weight half W computes, and the early halves
(`WeightWork.held_bytes`).
The same idea as torch.distributed.pipelining's stage_backward_input/stage_backward_weight; our
own code.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from .split_plan import GroupPlan, SplitPlan, SplitPlanCache, analyse, node_of, structure_key, walk


@dataclass(frozen=True)
class _Layout:
    """A SplitPlan laid out for the two calls (built once per graph structure, cached with it): what
    I asks autograd for besides the inputs, and what W does with each answer. Numbers are node
    numbers of split_plan.walk and positions in the parameter and output lists."""

    chained: tuple[bool, ...]  # per output: does it depend on the inputs
    boundaries: tuple[int, ...]  # every boundary node
    captures: tuple[tuple[int, int, tuple], ...]  # (node, slot or -1 for all its inputs, what it is for):
    # ("item", i): item i's gradient; ("early", 0): a weight-side gradient W roots at as it is;
    # ("fallback", g, b): boundary b of fallback group g
    items: tuple[tuple[int, tuple[tuple[int, int, int], ...]], ...]  # (boundary, its W edges (k, target, slot))
    params: tuple[int, ...]  # the parameters of W's one call
    seeds: tuple[int, ...]  # outputs made without the inputs seeding that call (each once)
    fallback: tuple[GroupPlan, ...]  # groups with a custom autograd.Function boundary


def _layout(plan: SplitPlan, order: list[Node]) -> _Layout:
    """The plan's groups flattened: fallback groups apart, every other group's W work in one list."""
    captures, items, params, seeds, fallback = [], [], [], [], []
    for group in plan.groups:
        if group.fallback:
            captures += [(b, -1, ("fallback", len(fallback), i)) for i, b in enumerate(group.boundaries)]
            fallback.append(group)
            continue
        for b, edges in zip(group.boundaries, group.wanted):
            if edges:
                first_only = type(order[b]).__name__ in _WEIGHT_SIDE_RULES  # a rule reads input 0's gradient
                captures.append((b, 0 if first_only else -1, ("item", len(items))))
                items.append((b, edges))
        captures += [(j, slot, ("early", 0)) for j, slot in group.early]
        params += group.params
        seeds += [k for k in group.seeds if k not in seeds]
    return _Layout(plan.chained, tuple(b for g in plan.groups for b in g.boundaries), tuple(captures),
                   tuple(items), tuple(params), tuple(seeds), tuple(fallback))


@dataclass(eq=False)  # compared by identity (fields hold tensors)
class _Fallback:
    """A group W runs through autograd from its boundary nodes (a custom autograd.Function among them)."""

    params: list[torch.Tensor]
    boundaries: list[Node]
    seeds: list[tuple[GradientEdge, torch.Tensor]]
    grads: dict[int, tuple] = field(default_factory=dict)  # boundary index -> gradients at its inputs


@dataclass(eq=False)
class WeightWork:
    """What I leaves for W (empty lists when nothing needs a weight gradient)."""

    nodes: list[Node]  # the graph's nodes in walk order (W's edges name them by number)
    items: list[tuple[Node, tuple, tuple]]  # (boundary, its W edges, the gradients I kept at its inputs)
    early: list[tuple[GradientEdge, torch.Tensor]]  # weight-side gradients I computed, with their edges
    seeds: list[tuple[GradientEdge, torch.Tensor]]  # outputs made without the inputs, with their gradients
    params: list[torch.Tensor]  # what W's one call accumulates
    fallback: list[_Fallback]
    boundaries: list[Node]  # every boundary node (what the split found; for tests and reports)

    @property
    def held_bytes(self) -> int:
        """Bytes of the gradients kept for W (the graph's saved activations come on top)."""
        kept = [g for _, _, grads in self.items for g in grads] + [g for _, g in self.early]
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
        return [None] * len(inputs), WeightWork([], [], [], seeds, list(params), [], [])
    roots = [node_of(o) for o in outputs]
    order, index, shape = walk(roots)
    key = structure_key(shape, order, index, roots, inputs, params) if cache is not None else None
    layout = cache.get(key) if cache is not None else None
    if layout is None:
        layout = _layout(analyse(order, index, roots, inputs, params, _EARLY_EDGES), order)
        if cache is not None:
            cache.put(key, layout)
    edges, purposes = [], []
    for j, slot, purpose in layout.captures:
        node = order[j]
        slots = (slot,) if slot >= 0 else range(len(node._input_metadata))
        edges += [GradientEdge(node, s) for s in slots]
        purposes += [purpose] * len(slots)
    wanted = [x for x in inputs if x.requires_grad]
    chained = [(o, g) for o, g, c in zip(outputs, grad_outputs, layout.chained) if c]
    got = torch.autograd.grad([o for o, _ in chained], wanted + edges, [g for _, g in chained],
                              retain_graph=True, allow_unused=True) if chained and (wanted or edges) else ()
    got = list(got) or [None] * (len(wanted) + len(edges))
    kept: list[list] = [[] for _ in layout.items]
    early: list[tuple[GradientEdge, torch.Tensor]] = []
    fallback = [_Fallback([params[k] for k in g.params], [order[b] for b in g.boundaries],
                          [(get_gradient_edge(outputs[k]), grad_outputs[k]) for k in g.seeds])
                for g in layout.fallback]
    for edge, purpose, g in zip(edges, purposes, got[len(wanted):]):
        if purpose[0] == "item":
            kept[purpose[1]].append(g)
        elif purpose[0] == "early":
            if g is not None:
                early.append((edge, g))
        else:
            group = fallback[purpose[1]]
            group.grads[purpose[2]] = group.grads.get(purpose[2], ()) + (g,)
    work = WeightWork(order, [(order[b], w, tuple(k)) for (b, w), k in zip(layout.items, kept)], early,
                      [(get_gradient_edge(outputs[k]), grad_outputs[k]) for k in layout.seeds],
                      [params[k] for k in layout.params], fallback, [order[b] for b in layout.boundaries])
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
    boundary nodes instead, a call of its own.
    """
    for group in work.fallback:
        _through_autograd(group)
    edges, grads = [], []
    for node, wanted, kept in work.items:
        if not kept or all(g is None for g in kept):
            continue  # no gradient reached it during I: none flows to its weights
        rule = _WEIGHT_SIDE_RULES.get(type(node).__name__)
        ks = [k for k, _, _ in wanted]
        got = rule(node, kept[0], ks) if rule is not None else _call_node(node, kept, ks)
        for k, j, slot in wanted:
            if got[k] is not None:
                edges.append(GradientEdge(work.nodes[j], slot))
                grads.append(got[k])
    for edge, g in work.early + work.seeds:
        edges.append(edge)
        grads.append(g)
    if edges:  # retain: the graph goes with `work`, which the caller drops
        _run_backward(edges, grads, work.params)
    work.items.clear()
    work.early.clear()
    work.fallback.clear()


def _run_backward(edges: list[GradientEdge], grads: list[torch.Tensor], params: list[torch.Tensor]) -> None:
    """torch.autograd.backward(edges, grads, inputs=params), without its per-root Python checks (shape
    against each edge's metadata: about 5 us a root, 50 roots here); the rules above give every root
    its edge's shape. Falls back to the public call where torch lacks the engine entry point."""
    run = getattr(torch.autograd.graph, "_engine_run_backward", None)
    if run is None:
        torch.autograd.backward(edges, grads, inputs=params, retain_graph=True)
    else:
        run(tuple(edges), tuple(grads), True, False, tuple(params), allow_unreachable=True, accumulate_grad=True)


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
    meta = child._input_metadata[slot]
    if g.shape != meta.shape:
        g = g.sum_to_size(meta.shape)
    return g if g.dtype == meta.dtype else g.to(meta.dtype)


# The gradients a matmul or layer-norm node sends along its edges `wanted` (those off the chain: I has
# sent the others), from the node's saved tensors, with the formulas of autograd's own derivative of
# each op (x @ w: grad_w = x^T g). None: a case not covered (the group then takes autograd's path).

def _addmm(node: Node, g: torch.Tensor, wanted: list[int]) -> dict[int, torch.Tensor]:
    """addmm(self, mat1, mat2) = beta * self + alpha * mat1 @ mat2 (nn.Linear on 2-D input)."""
    alpha, beta, out = node._saved_alpha, node._saved_beta, {}
    if 0 in wanted:  # a bias I could not take early (it gets gradient from elsewhere too)
        out[0] = _fit(node, 0, g if beta == 1 else g * beta)
    if 1 in wanted:
        out[1] = g @ node._saved_mat2.mH
    if 2 in wanted:
        out[2] = _weight_grad(node._saved_mat1, g, node._saved_mat2)
    return {k: (v if k == 0 or alpha == 1 else v * alpha) for k, v in out.items()}


def _mm(node: Node, g: torch.Tensor, wanted: list[int]) -> dict[int, torch.Tensor]:
    """mm(self, mat2) (nn.Linear without bias on 3-D input)."""
    out = {}
    if 0 in wanted:
        out[0] = g @ node._saved_mat2.mH
    if 1 in wanted:
        out[1] = _weight_grad(node._saved_self, g, node._saved_mat2)
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
        g, node._saved_input, list(node._saved_normalized_shape), node._saved_result1, node._saved_result2,
        node._saved_weight, node._saved_bias, [k in wanted for k in range(3)])
    return {k: grads[k] for k in wanted}


_WEIGHT_SIDE_RULES = {"AddmmBackward0": _addmm, "MmBackward0": _mm, "NativeLayerNormBackward0": _layer_norm}
# Weight-side edges I computes as it passes (`analyse` checks the target gets nothing else): a bias (a
# row sum of the gradient) and a norm's affine (the layer-norm backward kernel yields it in the same
# pass as the input gradient), where a fused B computes them, with the gradient still in cache. Done
# in W instead they cost several times more (the gradient read back from memory, a second norm
# kernel) and W would have to keep the norms' gradients. W is left the weight matmuls.
_EARLY_EDGES = {"AddmmBackward0": frozenset({0}), "NativeLayerNormBackward0": frozenset({1, 2})}
