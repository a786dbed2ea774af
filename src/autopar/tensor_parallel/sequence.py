"""Sequence parallelism (--sp): the parts of a tensor-parallel model between a row layer and the next
column layer run on 1/tp of the sequence.

Plain tensor parallelism leaves those parts (norms, dropout, residual adds) replicated: every
rank holds and computes the whole [batch, sequence, hidden] activation. Megatron's sequence
parallelism splits them along the sequence instead. Here that is found in the traced graph,
after the tp plan (plan.py), by following values forward from the places where tp sums:

1. A row layer's (or a vocabulary-parallel embedding's) all-reduce becomes a reduce-scatter:
   each rank keeps positions [r*T/tp, (r+1)*T/tp) of the sum.
2. The split follows operations that work per position: elementwise ops (a whole operand with
   a sequence dimension, like a position table, is read as this rank's slice; one broadcast
   over it, like a norm's weight, has its gradient summed over tp), norms and reductions over
   the hidden features, softmax over them, reshapes that keep the leading dims, linears kept
   whole.
3. Where a split value meets anything else it is all-gathered first: a column layer (whose
   backward then reduce-scatters the ranks' partial gradients), or an operation this file does
   not follow (whose replicated backward keeps each rank's slice of the gradient). A split value
   the model returns is gathered there.

A row output without a [batch, sequence, ...] layout (a flattened [batch*sequence, hidden]
matmul) keeps its all-reduce; the plan table says which.
"""

from __future__ import annotations

import operator

import torch
from torch import fx
from torch.export.graph_signature import InputKind

from ..errors import ConfigError
from ..trace import ModelGraph
from .layout import SequencePlan, TensorParallelPlan
from .rules import PASS_THROUGH, VIEWS, arg, norm_dim, shape_of

aten = torch.ops.aten

POINTWISE = set(PASS_THROUGH) | {
    aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.add.Scalar, aten.sub.Scalar,
    aten.mul.Scalar, aten.div.Scalar, aten.rsub.Scalar, aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor,
    aten.rsqrt.default, aten.sqrt.default, aten.neg.default, aten.exp.default, aten.log.default,
    aten.tanh.default, aten.sigmoid.default, aten.relu.default, aten.gelu.default, aten.silu.default,
    aten.abs.default, aten.reciprocal.default, aten.square.default, aten.clamp.default, aten.where.self,
    aten.masked_fill.Scalar, aten.dropout_.default, aten.add_.Tensor, aten.mul_.Tensor, aten.to.device,
    aten.type_as.default}
REDUCTIONS = {aten.mean.dim, aten.sum.dim_IntList, aten.amax.default, aten.amin.default, aten.var.correction,
              aten.std.correction}
NORMS = {aten.layer_norm.default: 1, aten.rms_norm.default: 1}  # op -> index of normalized_shape
SOFTMAX = {aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default}
IGNORED = {aten._assert_tensor_metadata.default}
LINEAR = {aten.linear.default}


def plan_sequence_parallel(graph: ModelGraph, plan: TensorParallelPlan) -> SequencePlan:
    """Which values of the traced model hold 1/tp of the sequence under `plan` (tp > 1)."""
    specs = graph.exported.graph_signature.input_specs
    main = next((s.arg.name for s in specs if s.kind == InputKind.USER_INPUT), None)
    nodes = {n.name: n for n in graph.graph.nodes}
    shape = shape_of(nodes[main]) if main else None
    if not shape or len(shape) != 2:
        raise ConfigError(f"--sp splits the sequence of a [batch, sequence] token input; the model's first input "
                          f"{main!r} has shape {list(shape) if shape else None}: use tensor parallelism without --sp")
    length = shape[1]
    if length % plan.tp:
        raise ConfigError(f"--sp with tp={plan.tp} splits the {length}-token sequence over {plan.tp} ranks; use a "
                          f"sequence length divisible by {plan.tp} (e.g. {-(-length // plan.tp) * plan.tp})")
    params = {s.arg.name for s in specs if s.kind == InputKind.PARAMETER}
    walk = _Walk(SequencePlan(length=length, tp=plan.tp), plan, params)
    for node in graph.graph.nodes:
        if node.op == "call_function":
            walk.visit(node)
        elif node.op == "output":
            walk.visit_output(node)
    return walk.seq


class _Walk:
    def __init__(self, seq: SequencePlan, plan: TensorParallelPlan, params: set[str]):
        self.seq, self.plan, self.params = seq, plan, params
        self.split: dict[fx.Node, int] = {}  # sequence-split value -> its sequence dim
        self._grad: dict[fx.Node, bool] = {}

    def carries_gradient(self, node: fx.Node) -> bool:
        """Whether a value depends on a parameter (its gradient must be summed where split ranks read it)."""
        stack = [node]
        while stack:
            current = stack[-1]
            if current in self._grad:
                stack.pop()
                continue
            pending = [a for a in current.all_input_nodes if a not in self._grad]
            if current.name in self.params or not pending:
                self._grad[current] = current.name in self.params or any(self._grad[a] for a in current.all_input_nodes)
                stack.pop()
            else:
                stack.extend(pending)
        return self._grad[node]

    def mark(self, node: fx.Node, dim: int) -> None:
        self.split[node] = dim
        self.seq.values[node.name] = dim

    def gather(self, node: fx.Node, operands: list[fx.Node]) -> None:
        self.seq.gathers.setdefault(node.name, []).extend(a.name for a in operands)

    def visit(self, node: fx.Node) -> None:
        out = shape_of(node)
        if node.name in self.plan.row or node.name in self.plan.embeddings:
            if out and len(out) >= 3 and out[1] == self.seq.length:
                self.seq.scatter.add(node.name)
                self.mark(node, 1)
            elif node.name in self.plan.row:
                self.seq.kept.append(f"{node.name}: output {list(out) if out else '?'} has no [batch, "
                                     f"{self.seq.length}-token sequence, ...] layout")
            return
        inputs = [a for a in node.all_input_nodes if a in self.split]
        if not inputs or node.target in IGNORED:
            return
        feature_split = (node.name in self.plan.value_shards or node.name in self.plan.column
                         or node.name in self.plan.sums or node.target is operator.getitem
                         or any(a.name in self.plan.value_shards for a in node.all_input_nodes))
        dim = None if feature_split or out is None else self.follow(node, inputs, out)
        if dim is None:
            self.gather(node, inputs)
        else:
            self.mark(node, dim)

    def follow(self, node: fx.Node, inputs: list[fx.Node], out: tuple[int, ...]) -> int | None:
        """The sequence dim of the result when the op works per position, recording its whole operands; else None."""
        first = inputs[0]
        d = self.split[first]
        in_shape = shape_of(first)
        if node.target in POINTWISE:
            return self.pointwise(node, inputs, out)
        if node.target in LINEAR and node.args[0] is first and len(inputs) == 1 and d < len(in_shape) - 1:
            self.whole_operands(node, [a for a in node.all_input_nodes if a is not first], d, out)
            return d
        if node.target in NORMS and node.args[0] is first and len(inputs) == 1:
            normalized = len(node.args[NORMS[node.target]])
            if d < len(in_shape) - normalized:
                self.whole_operands(node, [a for a in node.all_input_nodes if a is not first], d, out)
                return d
            return None
        if node.target in SOFTMAX and len(inputs) == 1 and norm_dim(node.args[1], len(in_shape)) != d:
            return d
        if node.target in REDUCTIONS and len(inputs) == 1 and len(node.all_input_nodes) == 1:
            dims = arg(node, 1, "dim", None)
            if dims is None:
                return None
            dims = [norm_dim(x, len(in_shape)) for x in ([dims] if isinstance(dims, int) else dims)]
            if d in dims:
                return None
            keep = arg(node, 2, "keepdim", False)
            return d if keep else d - sum(1 for x in dims if x < d)
        if node.target in VIEWS and len(inputs) == 1:
            sizes = list(node.args[1])
            if tuple(in_shape[:d + 1]) != tuple(out[:d + 1]) or sizes[d] not in (self.seq.length, -1) \
                    or (sizes[d] == -1 and -1 in sizes[d + 1:]):
                return None
            if sizes[d] == self.seq.length:
                sizes[d] = self.seq.length // self.seq.tp
                self.seq.edits[node.name] = {1: sizes}
            return d
        return None

    def pointwise(self, node: fx.Node, inputs: list[fx.Node], out: tuple[int, ...]) -> int | None:
        dims = {self.split[a] + len(out) - len(shape_of(a)) for a in inputs}
        if len(dims) != 1 or out[next(iter(dims))] != self.seq.length:
            return None
        dim = dims.pop()
        whole = [a for a in node.all_input_nodes if a not in self.split]
        if not self.whole_operands(node, whole, dim, out):
            return None
        return dim

    def whole_operands(self, node: fx.Node, whole: list[fx.Node], dim: int, out: tuple[int, ...]) -> bool:
        """Record how each whole operand meets the split: sliced along its sequence dim, or broadcast."""
        slices, copies = [], []
        for value in whole:
            shape = shape_of(value)
            if shape is None:
                continue
            pos = dim - (len(out) - len(shape))
            if node.target in LINEAR or node.target in NORMS or pos < 0 or shape[pos] == 1:
                if self.carries_gradient(value):  # each rank's gradient covers its positions only: summed
                    copies.append(value.name)
            elif shape[pos] == self.seq.length:
                slices.append((value.name, pos))
            else:
                return False
        if slices:
            self.seq.slices[node.name] = slices
        if copies:
            self.seq.copies[node.name] = copies
        return True

    def visit_output(self, node: fx.Node) -> None:
        values = node.args[0] if isinstance(node.args[0], (list, tuple)) else [node.args[0]]
        for value in values:
            if isinstance(value, fx.Node) and value in self.split:
                self.seq.outputs.add(value.name)
