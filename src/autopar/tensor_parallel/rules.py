"""One sharding rule per aten operation: how a value split over the tp ranks passes through it.

The planner (plan.py) walks the exported graph in order; for every operation that reads a
sharded value it looks the operation up in `RULES` and calls its rule, which returns the
sharding of the result (a `Shard`, a list of them for ops returning several tensors, or
None when the result is replicated), records the static sizes to edit (a head count that
becomes heads / tp), or raises `PlanFailure` when the shards would be mixed. Adding an
operation is adding a rule: a small function decorated with `@rule(op, ...)` and listed in
the table at the end of this file. Each rule reads only its node and the `RuleContext`, so
it can be tested on a hand-built node.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable

import torch
from torch import fx

from ..errors import ConfigError

aten = torch.ops.aten

VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
PASS_THROUGH = (aten.dropout.default, aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default,
                aten.contiguous.default, aten.alias.default, aten.detach.default, aten.type_as.default,
                aten.clone.default, aten.native_dropout.default)
SPLITS = (aten.split.Tensor, aten.split_with_sizes.default)


@dataclass(frozen=True)
class Shard:
    """A value split over the tp ranks along `dim`, in contiguous per-segment slices."""

    dim: int
    segments: tuple[int, ...]  # global sizes of the segments along `dim` (fused q|k|v: three)
    origins: frozenset[str] = frozenset()  # the column layers this sharding comes from

    def same_layout(self, other: Shard) -> bool:
        return self.dim == other.dim and self.segments == other.segments

    def moved(self, dim: int) -> Shard:
        return Shard(dim, self.segments, self.origins)


SUMMED = "summed"  # the state of a whole value computed from a sum over tp ranks (its gradient is partial)


class PlanFailure(Exception):
    """A sharded value reached an operation that would mix its shards: its column layers go back to whole."""

    def __init__(self, origins: frozenset[str], reason: str):
        super().__init__(reason)
        self.origins, self.reason = origins, reason


def shape_of(node: Any) -> tuple[int, ...] | None:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def norm_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    """A call's argument by position or keyword (exported graphs use both)."""
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


@dataclass
class RuleContext:
    """What a rule may read (the tp degree, the sharding of every value so far) and what it records."""

    tp: int
    state: dict[fx.Node, Any] = field(default_factory=dict)  # value -> Shard | list | SUMMED | None (whole)
    module_of: Callable[[fx.Node], str] = lambda node: ""
    is_param: Callable[[fx.Node], bool] = lambda node: False
    # what the rules found, applied to the stage graphs by apply.py (keyed by node name)
    edits: dict[str, dict[int, Any]] = field(default_factory=dict)  # {arg index: local value}
    sums: dict[str, int] = field(default_factory=dict)  # divisor: result summed over tp ranks, then divided
    copies: dict[str, list[str]] = field(default_factory=dict)  # whole operands read through copy_to_tp
    # a parameter read per feature (a norm's weight): (its node, its split dim, segments), split like the features
    param_operands: dict[str, tuple[fx.Node, int, tuple[int, ...]]] = field(default_factory=dict)
    _carries: dict[fx.Node, bool] = field(default_factory=dict)  # carries_gradient's memo

    def carries_gradient(self, node: fx.Node) -> bool:
        """Whether a value depends on a parameter (so training gives it a gradient); memoised per node."""
        known = self._carries
        stack = [node]
        while stack:
            current = stack[-1]
            if current in known:
                stack.pop()
                continue
            if self.is_param(current):
                known[current] = True
                stack.pop()
                continue
            pending = [a for a in current.all_input_nodes if a not in known]
            if pending:
                stack.extend(pending)
                continue
            known[current] = any(known[a] for a in current.all_input_nodes)
            stack.pop()
        return known[node]

    def shard_of(self, node: Any) -> Shard | None:
        value = self.state.get(node) if isinstance(node, fx.Node) else None
        return value if isinstance(value, Shard) else None

    def edit(self, node: fx.Node, index: int, value: Any) -> None:
        self.edits.setdefault(node.name, {})[index] = value

    def fail(self, node: fx.Node, shards: list[Shard], why: str) -> PlanFailure:
        origins = frozenset().union(*(s.origins for s in shards)) if shards else frozenset()
        where = self.module_of(node) or node.name
        return PlanFailure(origins, f"{why} at {node.name} ({node.target}) in {where!r}")


Inputs = list[tuple[fx.Node, Shard]]  # (argument, its sharding) for each sharded argument, in order
Rule = Callable[[RuleContext, fx.Node, Inputs], Any]


def rule(*ops: Any) -> Callable[[Rule], Rule]:
    """Mark a function as the sharding rule of these aten operations (collected into RULES below)."""
    def mark(fn: Rule) -> Rule:
        fn.ops = ops
        return fn
    return mark


def _origins(shards: list[Shard]) -> frozenset[str]:
    return frozenset().union(*(s.origins for s in shards))


# ---------------------------------------------------------------------- per feature: elementwise


@rule(*PASS_THROUGH)
def elementwise(ctx: RuleContext, node: fx.Node, inputs: Inputs) -> Shard:
    """Pointwise ops keep the sharding if every sharded operand agrees and replicated ones broadcast."""
    out_shape = shape_of(node)
    shards = [s for _, s in inputs]
    first_arg, first = inputs[0]
    dim = first.dim + len(out_shape) - len(shape_of(first_arg))
    for value, s in inputs:
        if s.dim + len(out_shape) - len(shape_of(value)) != dim or s.segments != first.segments:
            raise ctx.fail(node, shards, "an elementwise operation on values with different layouts")
    for value in node.all_input_nodes:
        shape = None if ctx.shard_of(value) else shape_of(value)
        if shape is None:
            continue
        pos = dim - (len(out_shape) - len(shape))
        if pos >= 0 and shape[pos] != 1:
            if ctx.is_param(value) and shape[pos] == sum(first.segments) and node.name not in ctx.param_operands:
                ctx.param_operands[node.name] = (value, pos, first.segments)  # a norm's weight: split with them
                continue
            raise ctx.fail(node, shards, f"a replicated operand ({value.name}, shape {list(shape)}) that is "
                                         f"not broadcast along the sharded dimension")
        if ctx.state.get(value) == SUMMED or ctx.carries_gradient(value):
            # a whole value broadcast against shards (a per-head norm's weight, a summed statistic): each rank's
            # gradient of it is its shard's part, so it is read through copy_to_tp, whose backward sums them
            ctx.copies.setdefault(node.name, []).append(value.name)
    return Shard(dim, first.segments, _origins(shards))


@rule(aten._assert_tensor_metadata.default)
def no_output(ctx: RuleContext, node: fx.Node, inputs: Inputs) -> None:
    return None


# ---------------------------------------------------------------------- shapes: views and moves


@rule(*VIEWS)
def view(ctx: RuleContext, node: fx.Node, inputs: Inputs) -> Shard:
    """A reshape keeps the sharded dim whole, merges it with inner dims, or splits it into (heads, head_dim)."""
    first_arg, first = inputs[0]
    in_shape, out_shape = shape_of(first_arg), shape_of(node)
    d, size = first.dim, in_shape[first.dim]
    prefix, inner = math.prod(in_shape[:d]), math.prod(in_shape[d + 1:])
    acc = 1
    for e, out in enumerate(out_shape):
        if acc == prefix and out != 1:
            if out == size:
                segments = first.segments
            elif len(first.segments) > 1:
                raise ctx.fail(node, [first], "reshaping a fused (multi-segment) sharded dimension")
            elif out % size == 0 and inner % (out // size) == 0:
                segments = (out,)  # merged with inner dims: the shard stays the outer factor
            elif size % out == 0:
                if out % ctx.tp and len(out_shape) - e > 2 and len(first.segments) == 1:
                    # (3, heads, head_dim) from one projection (timm's fused qkv): q, k and v are one segment
                    # here, so a rank's slice would not hold whole q/k/v heads; the layers stay whole
                    raise ctx.fail(node, [first], f"a fused projection reshaped into {list(out_shape[e:])} "
                                                  f"(q, k, v as a leading axis of {out} rather than a split)")
                if out % ctx.tp:  # split into (heads, head_dim): the heads are divided
                    module = ctx.module_of(node) or node.name
                    raise ConfigError(
                        f"tp={ctx.tp} does not divide the {out} heads (or groups) that {module!r} splits its "
                        f"{size} features into; use a tp that divides {out}")
                segments = (out,)
            else:
                break
            sizes = list(node.args[1])
            if sizes[e] != -1:
                sizes[e] = out // ctx.tp
                ctx.edit(node, 1, sizes)
            return Shard(e, segments, first.origins)
        acc *= out
        if acc > prefix:
            break
    if d > 0 and out_shape and out_shape[0] == math.prod(in_shape[:d + 1]):
        raise ctx.fail(node, [first], f"a reshape that merges the sharded heads into the batch dimension "
                                      f"({list(in_shape)} -> {list(out_shape)})")
    raise ctx.fail(node, [first], f"a reshape that interleaves the sharded dimension with others "
                                  f"({list(in_shape)} -> {list(out_shape)})")


@rule(aten.transpose.int)
def transpose(ctx: RuleContext, node: fx.Node, inputs: Inputs) -> Shard:
    (_, first), ndim = inputs[0], len(shape_of(inputs[0][0]))
    d0, d1 = (norm_dim(d, ndim) for d in node.args[1:3])
    return first.moved(d1 if first.dim == d0 else d0 if first.dim == d1 else first.dim)


@rule(aten.permute.default)
def permute(ctx: RuleContext, node: fx.Node, inputs: Inputs) -> Shard:
    (_, first), ndim = inputs[0], len(shape_of(inputs[0][0]))
    return first.moved([norm_dim(d, ndim) for d in node.args[1]].index(first.dim))


@rule(aten.t.default)
def transpose_2d(ctx: RuleContext, node: fx.Node, inputs: Inputs) -> Shard:
    return inputs[0][1].moved(1 - inputs[0][1].dim)


@rule(aten.unsqueeze.default)
def unsqueeze(ctx: RuleContext, node: fx.Node, inputs: Inputs) -> Shard:
    first = inputs[0][1]
    d = norm_dim(node.args[1], len(shape_of(node)))
    return first.moved(first.dim + (1 if d <= first.dim else 0))


@rule(aten.expand.default)
def expand(ctx: RuleContext, node: fx.Node, inputs: Inputs) -> Shard:
    value, first = inputs[0]
    dim = first.dim + len(shape_of(node)) - len(shape_of(value))
    sizes = list(node.args[1])
    if sizes[dim] != -1:
        sizes[dim] = sizes[dim] // ctx.tp
        ctx.edit(node, 1, sizes)
    return first.moved(dim)


# ---------------------------------------------------------------------- pieces: slices, splits, concatenation


def segment_at(segments: tuple[int, ...], start: int, end: int) -> int | None:
    """Index of the segment that spans exactly [start, end), or None."""
    offset = 0
    for k, size in enumerate(segments):
        if (start, min(end, sum(segments))) == (offset, offset + size):
            return k
        offset += size
    return None


@rule(aten.slice.Tensor)
def slice_(ctx: RuleContext, node: fx.Node, inputs: Inputs) -> Shard:
    """Slicing another dim keeps the sharding; slicing the sharded dim must take exactly one fused segment."""
    value, first = inputs[0]
    d = norm_dim(arg(node, 1, "dim", 0), len(shape_of(value)))
    if d != first.dim:
        return first
    start, end, step = arg(node, 2, "start", 0) or 0, arg(node, 3, "end", None), arg(node, 4, "step", 1)
    total = sum(first.segments)
    k = segment_at(first.segments, start, total if end is None else end) if step == 1 else None
    if k is None:
        raise ctx.fail(node, [first], f"slicing [{start}:{end}] along the sharded dimension, which does not "
                                      f"take one of its segments {list(first.segments)}")
    if any(key in node.kwargs for key in ("dim", "start", "end")):
        raise ctx.fail(node, [first], "a slice of the sharded dimension with keyword bounds")
    local_start = sum(s // ctx.tp for s in first.segments[:k])
    local = {1: d, 2: local_start, 3: local_start + first.segments[k] // ctx.tp}
    for index in range(1, min(len(node.args), 4)):  # an absent start is 0 and an absent end the last segment's
        ctx.edit(node, index, local[index])
    return Shard(d, (first.segments[k],), first.origins)


@rule(aten.select.int)
def select(ctx: RuleContext, node: fx.Node, inputs: Inputs) -> Shard:
    value, first = inputs[0]
    d = norm_dim(arg(node, 1, "dim", 0), len(shape_of(value)))
    if d == first.dim:
        raise ctx.fail(node, [first], "selecting one index of the sharded dimension")
    return first.moved(first.dim - (1 if d < first.dim else 0))


@rule(*SPLITS)
def split(ctx: RuleContext, node: fx.Node, inputs: Inputs) -> list[Shard]:
    """Splitting the sharded dim must follow its segments (fused q|k|v); each piece keeps its own share."""
    value, first = inputs[0]
    d = norm_dim(arg(node, 2, "dim", 0), len(shape_of(value)))
    out_count = len(node.meta["val"])
    if d != first.dim:
        return [first] * out_count
    sizes = node.args[1]
    sizes = [sizes] * out_count if isinstance(sizes, int) else list(sizes)
    if sizes != list(first.segments):
        raise ctx.fail(node, [first], f"a split {sizes} of the sharded dimension that does not follow its "
                                      f"segments {list(first.segments)}")
    ctx.edit(node, 1, sizes[0] // ctx.tp if node.target is aten.split.Tensor else [s // ctx.tp for s in sizes])
    return [Shard(d, (s,), first.origins) for s in sizes]


@rule(aten.chunk.default)
def chunk(ctx: RuleContext, node: fx.Node, inputs: Inputs) -> list[Shard]:
    """chunk(n) of the sharded dim is a split into n equal segments: each rank chunks its own share."""
    value, first = inputs[0]
    d = norm_dim(arg(node, 2, "dim", 0), len(shape_of(value)))
    out_count = len(node.meta["val"])
    if d != first.dim:
        return [first] * out_count
    if len(first.segments) != out_count or len(set(first.segments)) != 1:
        raise ctx.fail(node, [first], f"chunk({out_count}) of the sharded dimension that does not follow its "
                                      f"segments {list(first.segments)}")
    return [Shard(d, (s,), first.origins) for s in first.segments]


@rule(aten.cat.default)
def cat(ctx: RuleContext, node: fx.Node, inputs: Inputs) -> Shard:
    first = inputs[0][1]
    d = norm_dim(arg(node, 1, "dim", 0), len(shape_of(node)))
    states = [ctx.shard_of(t) for t in node.args[0]]
    if d == first.dim or not all(s is not None and s.same_layout(first) for s in states):
        raise ctx.fail(node, [s for _, s in inputs], "concatenating values with different tensor-parallel layouts")
    return Shard(first.dim, first.segments, _origins(states))


# ---------------------------------------------------------------------- reductions and normalisations


@rule(aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default)
def softmax(ctx: RuleContext, node: fx.Node, inputs: Inputs) -> Shard:
    value, first = inputs[0]
    if norm_dim(node.args[1], len(shape_of(value))) == first.dim:
        raise ctx.fail(node, [first], "softmax over the sharded dimension")
    return first


@rule(aten.mean.dim, aten.sum.dim_IntList, aten.amax.default, aten.amin.default)
def reduction(ctx: RuleContext, node: fx.Node, inputs: Inputs) -> Shard | None:
    """Other dims keep the sharding; a sum or mean over the sharded dim only is summed over the tp ranks.

    Every rank holds the same number of the features, so the whole mean is the mean of the
    ranks' means (an RMS norm over all heads' features, as olmo2's q_norm): one all-reduce.
    """
    value, first = inputs[0]
    ndim = len(shape_of(value))
    dims = arg(node, 1, "dim", None)
    dims = [norm_dim(d, ndim) for d in ([dims] if isinstance(dims, int) else dims or [])]
    if dims == [first.dim] and node.target in (aten.mean.dim, aten.sum.dim_IntList) and not node.kwargs.get("dtype"):
        ctx.sums[node.name] = ctx.tp if node.target is aten.mean.dim else 1
        return SUMMED  # whole once summed; its gradient is summed where it meets the shards again
    if not dims or first.dim in dims:
        what = "a norm or mean" if node.target is aten.mean.dim else "a reduction"
        raise ctx.fail(node, [first], f"{what} over all heads' features (the sharded dimension): it would mix "
                                      f"the shards")
    keep = arg(node, 2, "keepdim", False)
    return first.moved(first.dim if keep else first.dim - sum(1 for d in dims if d < first.dim))


@rule(aten.layer_norm.default)
def layer_norm(ctx: RuleContext, node: fx.Node, inputs: Inputs) -> Shard:
    value, first = inputs[0]
    if first.dim >= len(shape_of(value)) - len(node.args[1]):
        raise ctx.fail(node, [first], "a normalisation over the sharded dimension")
    return first


# ---------------------------------------------------------------------- attention and batched matmuls


@rule(aten.scaled_dot_product_attention.default)
def attention(ctx: RuleContext, node: fx.Node, inputs: Inputs) -> Shard:
    """Attention is per head: q, k and v must all be split by heads, and the mask broadcast over heads."""
    q, k, v = node.args[:3]
    shards = [s for _, s in inputs]
    states = [ctx.shard_of(t) for t in (q, k, v)]
    q_shape = shape_of(q)
    head_dim = len(q_shape) - 3
    if not all(s is not None and s.dim == head_dim for s in states):
        inside = [name for name, s in zip("qkv", states) if s is not None and s.dim == len(q_shape) - 1]
        if inside:
            raise ctx.fail(node, shards, f"attention with fewer key/value heads than tp={ctx.tp} (multi-query): "
                                         f"{'/'.join(inside)} would be split inside the heads, and every rank "
                                         f"needs them whole")
        whole = [name for name, s in zip("qkv", states) if s is None]
        split_ = [name for name, s in zip("qkv", states) if s is not None]
        raise ctx.fail(node, shards, f"attention whose {'/'.join(whole)} stay whole while {'/'.join(split_)} "
                                     f"would be split by heads")
    mask = arg(node, 3, "attn_mask")
    if isinstance(mask, fx.Node):
        if ctx.shard_of(mask) is not None:
            raise ctx.fail(node, shards, "an attention mask split by heads")
        shape = shape_of(mask)
        pos = head_dim - (len(q_shape) - len(shape))
        if pos >= 0 and shape[pos] != 1:
            raise ctx.fail(node, shards, f"an attention mask with a head dimension ({list(shape)})")
    return Shard(head_dim, states[0].segments, _origins(states))


@rule(aten.matmul.default, aten.bmm.default)
def matmul(ctx: RuleContext, node: fx.Node, inputs: Inputs) -> Shard:
    """A batched matmul of two values split on the same batch-like dim (scores @ v per head)."""
    a, b = node.args[:2]
    shards = [s for _, s in inputs]
    sa, sb = ctx.shard_of(a), ctx.shard_of(b)
    out_ndim = len(shape_of(node))
    if sa is None or sb is None:
        raise ctx.fail(node, shards, "a matmul of a sharded and a replicated value")
    da = sa.dim + out_ndim - len(shape_of(a))
    db = sb.dim + out_ndim - len(shape_of(b))
    if da != db or da >= out_ndim - 2 or sa.segments != sb.segments:
        raise ctx.fail(node, shards, "a matmul over the sharded dimension")
    return Shard(da, sa.segments, sa.origins | sb.origins)


def _table(*rules: Rule) -> MappingProxyType:
    table = {}
    for fn in rules:
        for op in fn.ops:
            assert op not in table, f"two sharding rules for {op}"
            table[op] = fn
    return MappingProxyType(table)


RULES = _table(elementwise, no_output, view, transpose, permute, transpose_2d, unsqueeze, expand, slice_, select,
               split, chunk, cat, softmax, reduction, layer_norm, attention, matmul)


def rule_for(target: Any) -> Rule | None:
    """The rule of an operation: its entry in RULES, else the elementwise rule for any pointwise aten op."""
    found = RULES.get(target)
    if found is None and torch.Tag.pointwise in getattr(target, "tags", ()):
        return elementwise
    if found is None and is_per_head_attention(target):
        return attention
    return found


def is_per_head_attention(target: Any) -> bool:
    """torch's attention, or a function standing in for it (context parallelism's ring and all-to-all
    attention mark themselves `per_head_attention`): q, k, v (B, H, T, D), independent per head."""
    return target is aten.scaled_dot_product_attention.default or getattr(target, "per_head_attention", False)
