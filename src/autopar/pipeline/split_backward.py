"""Zero-bubble backward split: I computes the input gradients, W only the weight gradients.

Why not two backward passes: I = autograd.grad to the inputs, then W = a backward to the
parameters, runs the activation chain (every node between the outputs and the inputs) twice,
so I + W costs about B + I and a zero-bubble schedule gains less than it adds.

How: the autograd graph of a stage splits into the *chain* (nodes that depend on the stage's
inputs: autograd.grad to the inputs runs exactly these) and *weight branches* (nodes that lead
only to parameters, e.g. the weight side of a matmul or a layer norm's affine). A weight branch
hangs off the chain at *boundary* nodes (the matmul, the layer norm). During I a pre-hook on each
boundary node keeps the gradient arriving at it; W then starts the backward at those boundary
nodes with the kept gradients, asking only for that branch's parameters, so autograd runs the
boundary node's parameter half and the branch, never the chain. Matmuls and layer norms (nn.Linear,
nn.LayerNorm: nearly every boundary) go faster: W computes their parameter half itself from the node's
saved tensors (grad_w = x^T g) and feeds it to the weight branch, all such groups in one autograd call,
so W costs those kernels plus one small traversal instead of one autograd call per group.
Parameters sharing a boundary (a layer norm's weight and bias) or reached from several boundaries (a
weight tied within the stage) form one group, run together. For other boundary kinds, such a weight,
read at two places of the chain, is the one case where W re-runs chain nodes: those between its two
uses (autograd runs every path to a requested parameter). An output made without the inputs (a
stage's weights-only output) seeds W directly.

What is held between I and W: the graph (I keeps it, as the weight branches need the saved
activations) plus one gradient per boundary-node output (`WeightWork.held_bytes`).
The same idea as torch.distributed.pipelining's stage_backward_input/stage_backward_weight; our
own code.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


@dataclass(eq=False)  # compared by identity (fields hold tensors)
class _Group:
    """Parameters whose weight branches meet the chain at the same boundary nodes."""

    params: list[torch.Tensor]
    boundaries: list[Node]  # chain nodes whose gradients feed the branch (captured during I)
    seeds: list[tuple[GradientEdge, torch.Tensor]] = field(default_factory=list)  # off-chain outputs' own grads
    grads: dict[int, tuple] = field(default_factory=dict)  # boundary index -> gradients at that node's outputs
    branch: set[Node] = field(default_factory=set)  # the off-chain nodes between the boundaries and params


@dataclass
class WeightWork:
    """What I leaves for W: one entry per parameter group (empty when nothing needs a weight gradient)."""

    groups: list[_Group]

    @property
    def held_bytes(self) -> int:
        """Bytes of the gradients kept at boundary nodes (the graph's saved activations come on top)."""
        return sum(g.numel() * g.element_size() for group in self.groups for grads in group.grads.values()
                   for g in grads if g is not None)


def _node_of(t: torch.Tensor) -> Node | None:
    """A tensor's autograd node: its grad_fn, or for a leaf its gradient accumulator."""
    return get_gradient_edge(t).node if t.requires_grad else None


def backward_input(outputs: list[torch.Tensor], grad_outputs: list[torch.Tensor | None],
                   inputs: list[torch.Tensor], params: list[torch.Tensor]
                   ) -> tuple[list[torch.Tensor | None], WeightWork]:
    """Gradients of `inputs` (None where unused), and the work W needs for the parameters' gradients.

    `grad_outputs[i]` None means ones (a loss). The graph is kept for W.
    """
    grad_outputs = [torch.ones_like(o) if g is None else g for o, g in zip(outputs, grad_outputs)]
    roots = [_node_of(o) for o in outputs]
    users: dict[Node, list[Node]] = defaultdict(list)  # node -> the nodes whose backward feeds it
    seen, queue = set(roots), deque(r for r in roots if r is not None)
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            users[child].append(node)
            if child not in seen:
                seen.add(child)
                queue.append(child)
    chain = _reached(users, [_node_of(x) for x in inputs], stop=set())
    groups = _groups(users, params, chain, seen)
    loose = [(o, g, r) for o, g, r in zip(outputs, grad_outputs, roots) if r is not None and r not in chain]
    for group in groups if loose else ():  # outputs made without the inputs seed W directly with their gradients
        reach = _reached(users, [_node_of(p) for p in group.params], stop=chain)
        group.seeds = [(get_gradient_edge(o), g) for o, g, r in loose if r in reach]
    handles = []
    for group in groups:
        for index, node in enumerate(group.boundaries):
            def keep(grads, group=group, index=index):
                group.grads[index] = tuple(grads)
            handles.append(node.register_prehook(keep))
    try:
        wanted = [x for x in inputs if x.requires_grad]
        chained = [(o, g) for o, g, r in zip(outputs, grad_outputs, roots) if r in chain]
        got = torch.autograd.grad([o for o, _ in chained], wanted, [g for _, g in chained], retain_graph=True,
                                  allow_unused=True) if wanted and chained else [None] * len(wanted)
    finally:
        for handle in handles:
            handle.remove()
    by_id = dict(zip(map(id, wanted), got))
    return [by_id.get(id(x)) for x in inputs], WeightWork(groups)


def backward_weight(work: WeightWork) -> None:
    """Accumulate the parameters' gradients into .grad (post-accumulate hooks fire, as in a full backward).

    Groups whose boundaries are all matmuls or layer norms (`_WEIGHT_SIDE_RULES`) get their
    boundary's weight-side gradients computed here from the saved inputs, and every such group then
    runs in ONE autograd call rooted at those weight-side edges (off the chain, so only the weight
    branches run: each autograd call walks the graph below its roots, so one call instead of one per
    group is most of the saving). Other groups take a backward from their boundary nodes, one call each.
    """
    direct_edges, direct_grads, direct_params = [], [], []
    for group in work.groups:
        pairs = _direct_pairs(group)
        if pairs is not None:
            for edge, g in pairs + group.seeds:
                direct_edges.append(edge)
                direct_grads.append(g)
            direct_params += group.params
            group.grads.clear()
            continue
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
    if direct_edges:  # retain: the graph goes with `work`, as above
        torch.autograd.backward(direct_edges, direct_grads, inputs=direct_params, retain_graph=True)
    work.groups.clear()


def _direct_pairs(group: _Group) -> list[tuple[GradientEdge, torch.Tensor]] | None:
    """(weight-side edge, its gradient) for every boundary of `group`; None when one is not supported."""
    pairs = []
    for index, node in enumerate(group.boundaries):
        rule = _WEIGHT_SIDE_RULES.get(type(node).__name__)
        if rule is None:
            return None
        kept = group.grads.get(index)
        if kept is None or kept[0] is None:  # no gradient reached it during I: none flows to its weights
            continue
        wanted = [k for k, (child, _) in enumerate(node.next_functions) if child in group.branch]
        grads = rule(node, kept[0], wanted)
        if grads is None:
            return None
        pairs += [(GradientEdge(*node.next_functions[k]), grads[k]) for k in wanted]
    return pairs


# The gradients a matmul or layer-norm node sends along its edges `wanted` (those off the chain: I has
# sent the others), from the node's saved tensors, with the formulas of autograd's own derivative of
# each op (x @ w: grad_w = x^T g). None: a case not covered (the group then takes autograd's path).

def _addmm(node: Node, g: torch.Tensor, wanted: list[int]) -> dict[int, torch.Tensor] | None:
    """addmm(self, mat1, mat2) = beta * self + alpha * mat1 @ mat2 (nn.Linear on 2-D input)."""
    alpha, beta, out = node._saved_alpha, node._saved_beta, {}
    if 0 in wanted:  # a bias: a root's gradient must have its shape, so reduce the broadcast here
        bias = getattr(node.next_functions[0][0], "variable", None)  # AccumulateGrad's parameter
        if bias is None:
            return None
        out[0] = (g if beta == 1 else g * beta).sum_to_size(bias.shape)
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


def _reached(users: dict[Node, list[Node]], starts: list[Node | None], stop: set[Node]) -> set[Node]:
    """Nodes whose backward feeds any of `starts` (them included), not walking through `stop` nodes."""
    found = {s for s in starts if s is not None}
    queue = deque(found)
    while queue:
        for user in users.get(queue.popleft(), ()):
            if user not in found and user not in stop:
                found.add(user)
                queue.append(user)
    return found


def _groups(users: dict[Node, list[Node]], params: list[torch.Tensor], chain: set[Node],
            graph: set[Node]) -> list[_Group]:
    """Parameter groups: each parameter's branch, walked up to the chain; groups sharing a boundary merge."""
    boundary_of: dict[Node, _Group] = {}
    groups: list[_Group] = []
    for p in params:
        node = _node_of(p)
        if node is None or node not in graph:
            continue  # not used by this stage's forward
        hit: list[Node] = []
        seen, queue = {node}, deque([node])
        while queue:
            for user in users.get(queue.popleft(), ()):
                if user in chain:
                    if user not in hit:
                        hit.append(user)
                elif user not in seen:
                    seen.add(user)
                    queue.append(user)
        group = _Group([p], hit, branch=seen)
        joined = {id(boundary_of[b]): boundary_of[b] for b in hit if b in boundary_of}
        if not hit:  # reaches no chain node (stage 0, or an output made without the inputs): one group for all
            joined = {id(g): g for g in groups if not g.boundaries}
        for other in joined.values():
            group.params += [q for q in other.params if all(q is not r for r in group.params)]
            group.boundaries += [b for b in other.boundaries if b not in group.boundaries]
            group.branch |= other.branch
            groups.remove(other)
        for b in group.boundaries:
            boundary_of[b] = group
        groups.append(group)
    return groups
