"""Where a stage's weight branches meet its activation chain, found once per graph shape.

Why a cache: the zero-bubble split (split_backward.py) must know, before I runs, which autograd
nodes are boundaries (chain nodes whose backward feeds a weight) and which of their edges lead to
the weights. Finding that walks the whole graph several times in Python (the chain, then each
parameter's branch), a few ms per micro-batch at gpt-mini's width, while the graph's shape repeats
from one micro-batch to the next. So the analysis is stored by position (node i of a canonical walk,
parameter k of the list) and served again to any graph of the same shape.

Safety: the key is the graph's whole structure, not a guess at it: one walk in a fixed order (roots
in order, each node's edges in order) numbers the nodes and records, per node, its type and for
each edge the number of the node it leads to and that node's input slot; plus the numbers of the
roots, the inputs and every parameter. Two graphs with equal keys are the same labelled graph under
that numbering, so a plan found on one is exact for the other; a graph that differs anywhere (an
extra op, another branch taken, a parameter unused) has another key and is analysed afresh. The
walk that builds the key is the one walk that remains per micro-batch.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict, deque
from dataclasses import dataclass

import torch
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import Node, get_gradient_edge

from .._torch_internals import accumulate_grad_type


@dataclass(frozen=True)
class GroupPlan:
    """Parameters whose weight branches meet the chain at the same boundary nodes, by position."""

    params: tuple[int, ...]  # positions in the parameter list
    boundaries: tuple[int, ...]  # node numbers (walk order) of the chain nodes feeding the branch
    wanted: tuple[tuple[tuple[int, int, int], ...], ...]  # per boundary: (edge, target node, slot) W computes
    early: tuple[tuple[int, int], ...]  # (target node, slot): edges whose gradient I computes (see analyse)
    seeds: tuple[int, ...]  # outputs made without the inputs that reach these parameters (they seed W)
    fallback: bool  # a boundary is a Python autograd.Function node: W runs the group through autograd


@dataclass(frozen=True)
class SplitPlan:
    """What I needs to know about a graph: which outputs depend on the inputs, and the groups."""

    chained: tuple[bool, ...]  # per output
    groups: tuple[GroupPlan, ...]


class SplitPlanCache:
    """Plans by graph structure, the `size` most recently used (a stage has one or two shapes: the
    last stage's loss graph differs from the others'). Holds numbers and node types, never nodes or
    tensors, so a cached plan keeps no graph alive."""

    def __init__(self, size: int = 8):
        if size < 1:
            raise ValueError(f"SplitPlanCache size must be >= 1, got {size}")
        self.size, self.hits, self.misses = size, 0, 0
        self._plans: OrderedDict[tuple, SplitPlan] = OrderedDict()

    def get(self, key: tuple) -> SplitPlan | None:
        plan = self._plans.get(key)
        if plan is None:
            self.misses += 1
        else:
            self.hits += 1
            self._plans.move_to_end(key)
        return plan

    def put(self, key: tuple, plan: SplitPlan) -> None:
        self._plans[key] = plan
        if len(self._plans) > self.size:
            self._plans.popitem(last=False)

    def __len__(self) -> int:
        return len(self._plans)


def node_of(t: torch.Tensor) -> Node | None:
    """A tensor's autograd node: its grad_fn, or for a leaf its gradient accumulator."""
    return get_gradient_edge(t).node if t.requires_grad else None


def walk(roots: list[Node | None]) -> tuple[list[Node], dict[Node, int], tuple]:
    """Every node below `roots` in a fixed order, each node's number, and the structure key's core:
    per node its type, its edge count and, per edge, the target's number and input slot (-1: none)."""
    index: dict[Node, int] = {}
    order: list[Node] = []
    for root in roots:
        if root is not None and root not in index:
            index[root] = len(order)
            order.append(root)
    shape: list = []
    add = shape.append
    for node in order:  # grows while we walk it: breadth first
        edges = node.next_functions
        add(type(node))
        add(len(edges))
        for child, slot in edges:
            if child is None:
                add(-1)
                continue
            number = index.get(child)
            if number is None:
                number = index[child] = len(order)
                order.append(child)
            add(number)
            add(slot)
    return order, index, tuple(shape)


def structure_key(shape: tuple, order: list[Node], index: dict[Node, int], roots: list[Node | None],
                  inputs: list[torch.Tensor], params: list[torch.Tensor]) -> tuple:
    """The graph's shape plus where its roots, inputs and parameters sit in it (-1: not in it).

    A leaf's node is found among the walked gradient accumulators (`get_gradient_edge` would make a
    view per leaf, most of the key's cost with fifty parameters)."""
    leaf_at = {id(n.variable): k for k, n in enumerate(order) if type(n) is _ACCUMULATE}
    def at(t):
        if not t.requires_grad:
            return -1
        return leaf_at.get(id(t), -1) if t.grad_fn is None else index.get(t.grad_fn, -1)
    return (shape, tuple(-1 if r is None else index[r] for r in roots), tuple(map(at, inputs)),
            tuple(map(at, params)))


_ACCUMULATE = accumulate_grad_type()  # a leaf's gradient accumulator node


def analyse(order: list[Node], index: dict[Node, int], roots: list[Node | None], inputs: list[torch.Tensor],
            params: list[torch.Tensor], early_edges: dict[str, frozenset[int]]) -> SplitPlan:
    """The chain (nodes that depend on the inputs), and each parameter group's boundaries and branch.

    `early_edges` (boundary type name -> edges) names weight-side edges cheap enough for I to compute
    as it passes (a bias, a norm's affine). Such an edge is taken early only where its target gets
    nothing else: every edge into the target is one of those (then what I captures there is all of
    it, and W adds nothing to it), and the group is not a fallback one.
    """
    users: dict[Node, list[tuple[Node, int]]] = defaultdict(list)  # node -> (node whose backward feeds it, edge)
    for node in order:
        for k, (child, _) in enumerate(node.next_functions):
            if child is not None:
                users[child].append((node, k))
    plain = {child: [u for u, _ in us] for child, us in users.items()}
    chain = _reached(plain, [node_of(x) for x in inputs], stop=set())
    groups = _groups(plain, params, chain, set(order))
    chained = tuple(r is not None and r in chain for r in roots)
    loose = [k for k, r in enumerate(roots) if r is not None and r not in chain]
    position = {id(p): k for k, p in enumerate(params)}
    fallback = {b: any(isinstance(n, BackwardCFunction) for n in boundaries)
                for _, boundaries, _ in groups for b in boundaries}

    def early(child: Node) -> bool:
        return all(u in fallback and not fallback[u] and k in early_edges.get(type(u).__name__, ())
                   for u, k in users[child])

    plans = []
    for group_params, boundaries, branch in groups:
        seeds: tuple[int, ...] = ()
        if loose:  # outputs made without the inputs seed W directly with their gradients
            reach = _reached(plain, [node_of(p) for p in group_params], stop=chain)
            seeds = tuple(k for k in loose if roots[k] in reach)
        wanted, taken = [], []
        for b in boundaries:
            edges = [(k, child, slot) for k, (child, slot) in enumerate(b.next_functions) if child in branch]
            for k, child, slot in edges:
                if early(child) and (index[child], slot) not in taken:
                    taken.append((index[child], slot))
            wanted.append(tuple((k, index[child], slot) for k, child, slot in edges if not early(child)))
        plans.append(GroupPlan(tuple(position[id(p)] for p in group_params), tuple(index[b] for b in boundaries),
                               tuple(wanted), tuple(taken), seeds, any(fallback[b] for b in boundaries)))
    return SplitPlan(chained, tuple(plans))


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
            graph: set[Node]) -> list[tuple[list[torch.Tensor], list[Node], set[Node]]]:
    """(parameters, boundaries, branch) per group: each parameter's branch walked up to the chain;
    groups sharing a boundary merge (a layer norm's weight and bias, a weight read at two places)."""
    boundary_of: dict[Node, int] = {}
    groups: dict[int, tuple[list[torch.Tensor], list[Node], set[Node]]] = {}
    for key, p in enumerate(params):
        node = node_of(p)
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
        group = ([p], hit, seen)
        joined = {boundary_of[b] for b in hit if b in boundary_of}
        if not hit:  # reaches no chain node (stage 0, or an output made without the inputs): one group for all
            joined = {k for k, g in groups.items() if not g[1]}
        for k in sorted(joined):
            other_params, other_boundaries, other_branch = groups.pop(k)
            group[0].extend(q for q in other_params if all(q is not r for r in group[0]))
            group[1].extend(b for b in other_boundaries if b not in group[1])
            group[2].update(other_branch)
        for b in group[1]:
            boundary_of[b] = key
        groups[key] = group
    return list(groups.values())
