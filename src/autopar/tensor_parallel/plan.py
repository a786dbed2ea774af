"""Find tensor-parallel layer pairs in a traced graph, from the data flow rather than from names.

Megatron needs hand-written parallel layers, torchtitan a per-model plan, Merak a list of
layer names per model family. Here the plan comes from the exported graph (static shapes):

1. Every linear whose input is replicated is a *column* candidate: its output features are
   split over the tp ranks, so its output is sharded on the last dimension.
2. Sharding is propagated forward through the operations that work per feature or per
   head: elementwise ops (with broadcast operands), views and reshapes (whose static sizes
   are edited: the head count becomes heads / tp), transposes, splits of a fused qkv
   output, rotary slicing, scaled-dot-product attention, batched matmuls.
3. A linear whose input is sharded on its contraction dimension is the *row* partner: it
   sums partial products with one all-reduce, after which the value is replicated again.
4. If a sharded value reaches an operation that would mix the shards (a norm or a
   reduction over the sharded dimension, a reshape that interleaves them, an unknown op),
   every column layer feeding it is put back to replicated and the analysis reruns, so a
   pattern the planner does not recognise stays replicated and the plan says why.

A fused projection (GPT-2's c_attn, split into q, k, v) is sharded per *segment*: each rank
holds its slice of q, of k and of v, so the split that follows still yields whole heads.
The token embedding and a tied output head become vocabulary-parallel; the logits then stay
sharded over the vocabulary and the loss is computed without gathering them.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.export.graph_signature import InputKind

from ..errors import ConfigError
from ..trace import ModelGraph
from .layout import LayerDecision, ParamShard, TensorParallelPlan

aten = torch.ops.aten

LINEAR = {aten.linear.default}
ADDMM = {aten.addmm.default}  # Conv1D (HF GPT-2): addmm(bias, x2d, weight[in, out])
VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
PASS_THROUGH = {aten.dropout.default, aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default,
                aten.contiguous.default, aten.alias.default, aten.detach.default, aten.type_as.default,
                aten.clone.default, aten.native_dropout.default}
SOFTMAX = {aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default}
REDUCTIONS = {aten.mean.dim, aten.sum.dim_IntList, aten.amax.default, aten.amin.default}
SDPA = {aten.scaled_dot_product_attention.default}
MATMUL = {aten.matmul.default, aten.bmm.default}


@dataclass(frozen=True)
class Shard:
    """A value split over the tp ranks along `dim`, in contiguous per-segment slices."""

    dim: int
    segments: tuple[int, ...]  # global sizes of the segments along `dim` (fused q|k|v: three)
    origins: frozenset[str] = frozenset()  # the column layers this sharding comes from

    def same_layout(self, other: Shard) -> bool:
        return self.dim == other.dim and self.segments == other.segments


class _Failure(Exception):
    def __init__(self, origins: frozenset[str], reason: str):
        super().__init__(reason)
        self.origins, self.reason = origins, reason


def _shape(node: Any) -> tuple[int, ...] | None:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def _norm_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def plan_tensor_parallel(graph: ModelGraph, tp: int) -> TensorParallelPlan:
    """The tensor-parallel plan of a traced model for `tp` ranks (tp=1: nothing is split)."""
    if tp < 1:
        raise ConfigError(f"tp must be a positive integer, got {tp}")
    analysis = _Analysis(graph, tp)
    excluded: dict[str, str] = {}
    while True:
        try:
            analysis.run(excluded)
            analysis.assign_params(excluded)
            break
        except _Failure as failure:
            if not failure.origins:  # nothing to put back: a bug in the rules, not the model
                raise
            for origin in failure.origins:
                excluded.setdefault(origin, failure.reason)
    return analysis.finish(excluded)


class _Analysis:
    def __init__(self, graph: ModelGraph, tp: int):
        self.graph, self.tp = graph, tp
        signature = graph.exported.graph_signature
        primary_of_export = {v: k for k, v in graph.export_names.items()}
        self.param_of: dict[str, str] = {}  # placeholder name -> primary FQN
        for spec in signature.input_specs:
            if spec.kind == InputKind.PARAMETER:
                self.param_of[spec.arg.name] = primary_of_export.get(spec.target, spec.target)
        self.user_inputs = {spec.arg.name for spec in signature.input_specs if spec.kind == InputKind.USER_INPUT}
        # the model's main input (positional): other inputs (token types, positions) index small tables
        self.main_input = next((s.arg.name for s in signature.input_specs if s.kind == InputKind.USER_INPUT), None)

    # ------------------------------------------------------------------ helpers

    def module_of(self, node: fx.Node) -> str:
        cost = self.graph.nodes.get(node.name)
        return cost.module_path if cost else ""

    def linear_parts(self, node: fx.Node) -> tuple[fx.Node, fx.Node, Any, int, int] | None:
        """(input, weight, bias, weight's output dim, weight's input dim) of a linear on a parameter."""
        if node.target in LINEAR:
            x, w = node.args[0], node.args[1]
            bias = node.args[2] if len(node.args) > 2 else None
            out_dim, in_dim = 0, 1
        elif node.target in ADDMM and not node.kwargs:
            bias, x, w = node.args[0], node.args[1], node.args[2]
            out_dim, in_dim = 1, 0
        else:
            return None
        if not (isinstance(w, fx.Node) and w.name in self.param_of):
            return None
        if bias is not None and not (isinstance(bias, fx.Node) and bias.name in self.param_of):
            return None
        return x, w, bias, out_dim, in_dim

    def column_layout(self, node: fx.Node, features: int) -> tuple[int, ...]:
        """Segments of a column output: the sizes of a split on its feature dim further down (fused qkv)."""
        frontier, seen = [node], set()
        while frontier:
            value = frontier.pop()
            for user in value.users:
                if user in seen:
                    continue
                seen.add(user)
                shape = _shape(user)
                if user.target in (aten.split.Tensor, aten.split_with_sizes.default):
                    in_shape = _shape(value)
                    dim = _norm_dim(user.args[2] if len(user.args) > 2 else user.kwargs.get("dim", 0), len(in_shape))
                    if dim == len(in_shape) - 1 and in_shape[-1] == features:
                        sizes = user.args[1]
                        if isinstance(sizes, int):
                            return tuple([sizes] * (features // sizes)) if features % sizes == 0 else (features,)
                        return tuple(sizes)
                elif (user.target in VIEWS or user.target in PASS_THROUGH) and shape and shape[-1] == features:
                    frontier.append(user)
        return (features,)

    # ------------------------------------------------------------------ propagation

    def run(self, excluded: dict[str, str]) -> None:
        self.state: dict[fx.Node, Any] = {}
        self.columns: dict[str, tuple[fx.Node, int, tuple[int, ...]]] = {}
        self.rows: dict[str, tuple[fx.Node, tuple[int, ...]]] = {}
        self.edits: dict[str, dict[int, Any]] = {}
        self.vocab_output = False
        self.vocab_origins: frozenset[str] = frozenset()
        self.row_origins: dict[str, frozenset[str]] = {}  # row layer -> the column layers feeding it
        for node in self.graph.graph.nodes:
            if node.op == "call_function":
                self.state[node] = self.visit(node, excluded)
            elif node.op == "output":
                self.visit_output(node)

    def sharded_inputs(self, node: fx.Node) -> list[tuple[fx.Node, Shard]]:
        found = []
        for arg in node.all_input_nodes:
            s = self.state.get(arg)
            if isinstance(s, Shard):
                found.append((arg, s))
            elif isinstance(s, list) and any(isinstance(x, Shard) for x in s) and node.target is not operator.getitem:
                raise _Failure(frozenset().union(*(x.origins for x in s if isinstance(x, Shard))),
                               f"{node.name} ({node.target}) takes a split list of sharded values")
        return found

    def fail(self, node: fx.Node, shards: list[Shard], why: str) -> _Failure:
        origins = frozenset().union(*(s.origins for s in shards)) if shards else frozenset()
        where = self.module_of(node) or node.name
        return _Failure(origins, f"{why} at {node.name} ({node.target}) in {where!r}")

    def visit(self, node: fx.Node, excluded: dict[str, str]) -> Any:
        linear = self.linear_parts(node)
        inputs = self.sharded_inputs(node)
        shards = [s for _, s in inputs]
        if linear is not None:
            x, w, bias, out_dim, in_dim = linear
            xs = self.state.get(x)
            features = _shape(w)[out_dim]
            if xs is None:
                if node.name in excluded:
                    return None
                if features % self.tp:
                    excluded[node.name] = f"{features} output features are not divisible by tp={self.tp}"
                    return None
                segments = self.column_layout(node, features)
                if any(s % self.tp for s in segments):
                    excluded[node.name] = f"segments {list(segments)} are not divisible by tp={self.tp}"
                    return None
                self.columns[node.name] = (w, out_dim, segments)
                return Shard(len(_shape(node)) - 1, segments, frozenset([node.name]))
            x_shape = _shape(x)
            if isinstance(xs, Shard) and xs.dim == len(x_shape) - 1 and x_shape[-1] == _shape(w)[in_dim]:
                self.rows[node.name] = (w, xs.segments)
                self.row_origins[node.name] = xs.origins
                return None
            raise self.fail(node, shards, "a linear layer reads a value sharded on a non-feature dimension")
        if node.target is operator.getitem:
            parent = self.state.get(node.args[0])
            return parent[node.args[1]] if isinstance(parent, list) else None
        if not shards:
            return None
        target = node.target
        out_shape = _shape(node)
        first_arg, first = inputs[0]
        if target in PASS_THROUGH or (hasattr(target, "tags") and torch.Tag.pointwise in target.tags):
            return self.elementwise(node, inputs)
        if target is aten._assert_tensor_metadata.default:
            return None
        in_shape = _shape(first_arg)
        if target in VIEWS:
            return self.view(node, first, in_shape, out_shape)
        if target is aten.transpose.int:
            d0, d1 = (_norm_dim(d, len(in_shape)) for d in node.args[1:3])
            dim = d1 if first.dim == d0 else d0 if first.dim == d1 else first.dim
            return Shard(dim, first.segments, first.origins)
        if target is aten.permute.default:
            dims = [_norm_dim(d, len(in_shape)) for d in node.args[1]]
            return Shard(dims.index(first.dim), first.segments, first.origins)
        if target is aten.t.default:
            return Shard(1 - first.dim, first.segments, first.origins)
        if target is aten.unsqueeze.default:
            d = _norm_dim(node.args[1], len(out_shape))
            return Shard(first.dim + (1 if d <= first.dim else 0), first.segments, first.origins)
        if target is aten.expand.default:
            offset = len(out_shape) - len(in_shape)
            dim = first.dim + offset
            sizes = list(node.args[1])
            if sizes[dim] != -1:
                sizes[dim] = sizes[dim] // self.tp
                self.edits.setdefault(node.name, {})[1] = sizes
            return Shard(dim, first.segments, first.origins)
        if target in (aten.slice.Tensor, aten.select.int):
            d = _norm_dim(node.args[1] if len(node.args) > 1 else 0, len(in_shape))
            if d == first.dim:
                raise self.fail(node, shards, "slicing along the sharded dimension")
            dim = first.dim - (1 if target is aten.select.int and d < first.dim else 0)
            return Shard(dim, first.segments, first.origins)
        if target is aten.cat.default:
            tensors = node.args[0]
            d = _norm_dim(node.args[1] if len(node.args) > 1 else 0, len(out_shape))
            states = [self.state.get(t) for t in tensors]
            if not all(isinstance(s, Shard) and s.same_layout(first) for s in states) or d == first.dim:
                raise self.fail(node, shards, "concatenating values with different tensor-parallel layouts")
            return Shard(first.dim, first.segments, frozenset().union(*(s.origins for s in states)))
        if target in (aten.split.Tensor, aten.split_with_sizes.default):
            return self.split(node, first, in_shape)
        if target in SOFTMAX:
            if _norm_dim(node.args[1], len(in_shape)) == first.dim:
                raise self.fail(node, shards, "softmax over the sharded dimension")
            return first
        if target in REDUCTIONS:
            dims = node.args[1] if len(node.args) > 1 else None
            dims = [_norm_dim(d, len(in_shape)) for d in ([dims] if isinstance(dims, int) else dims or [])]
            keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
            if not dims or first.dim in dims:
                raise self.fail(node, shards, "a reduction over the sharded dimension")
            dim = first.dim if keep else first.dim - sum(1 for d in dims if d < first.dim)
            return Shard(dim, first.segments, first.origins)
        if target is aten.layer_norm.default:
            if first.dim >= len(in_shape) - len(node.args[1]):
                raise self.fail(node, shards, "a normalisation over the sharded dimension")
            return first
        if target in SDPA:
            return self.attention(node, inputs)
        if target in MATMUL:
            return self.matmul(node, inputs)
        raise self.fail(node, shards, "an operation the tensor-parallel planner does not know")

    def elementwise(self, node: fx.Node, inputs: list[tuple[fx.Node, Shard]]) -> Shard:
        out_shape = _shape(node)
        shards = [s for _, s in inputs]
        first_arg, first = inputs[0]
        dim = first.dim + len(out_shape) - len(_shape(first_arg))
        for arg, s in inputs:
            if s.dim + len(out_shape) - len(_shape(arg)) != dim or s.segments != first.segments:
                raise self.fail(node, shards, "an elementwise operation on values with different layouts")
        for arg in node.all_input_nodes:
            if isinstance(self.state.get(arg), Shard):
                continue
            shape = _shape(arg)
            if shape is None:
                continue
            pos = dim - (len(out_shape) - len(shape))
            if pos >= 0 and shape[pos] != 1:
                raise self.fail(node, shards, f"a replicated operand ({arg.name}, shape {list(shape)}) that is "
                                               f"not broadcast along the sharded dimension")
        return Shard(dim, first.segments, frozenset().union(*(s.origins for s in shards)))

    def view(self, node: fx.Node, first: Shard, in_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> Shard:
        d, size = first.dim, in_shape[first.dim]
        prefix = math.prod(in_shape[:d])
        inner = math.prod(in_shape[d + 1:])
        acc = 1
        for e, out in enumerate(out_shape):
            if acc == prefix and out != 1:
                if out == size:
                    segments = first.segments
                elif len(first.segments) > 1:
                    raise self.fail(node, [first], "reshaping a fused (multi-segment) sharded dimension")
                elif out % size == 0 and inner % (out // size) == 0:
                    segments = (out,)  # merged with inner dims: the shard stays the outer factor
                elif size % out == 0:
                    if out % self.tp:  # split into (heads, head_dim): the heads are divided
                        module = self.module_of(node) or node.name
                        raise ConfigError(
                            f"tp={self.tp} does not divide the {out} heads (or groups) that {module!r} splits its "
                            f"{size} features into; use a tp that divides {out}")
                    segments = (out,)
                else:
                    break
                sizes = list(node.args[1])
                if sizes[e] != -1:
                    sizes[e] = out // self.tp
                    self.edits.setdefault(node.name, {})[1] = sizes
                return Shard(e, segments, first.origins)
            acc *= out
            if acc > prefix:
                break
        raise self.fail(node, [first], "a reshape that interleaves the sharded dimension with others")

    def split(self, node: fx.Node, first: Shard, in_shape: tuple[int, ...]) -> list:
        d = _norm_dim(node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0), len(in_shape))
        out_count = len(node.meta["val"])
        if d != first.dim:
            return [first] * out_count
        sizes = node.args[1]
        sizes = [sizes] * out_count if isinstance(sizes, int) else list(sizes)
        if sizes[:len(first.segments)] != list(first.segments) or len(sizes) != len(first.segments):
            raise self.fail(node, [first], "a split of the sharded dimension that does not follow its segments")
        new = sizes[0] // self.tp if node.target is aten.split.Tensor else [s // self.tp for s in sizes]
        self.edits.setdefault(node.name, {})[1] = new
        return [Shard(d, (s,), first.origins) for s in sizes]

    def attention(self, node: fx.Node, inputs: list[tuple[fx.Node, Shard]]) -> Shard:
        q, k, v = node.args[:3]
        shards = [s for _, s in inputs]
        states = [self.state.get(t) for t in (q, k, v)]
        head_dim = len(_shape(q)) - 3
        if not all(isinstance(s, Shard) and s.dim == head_dim for s in states):
            raise self.fail(node, shards, "attention whose q, k and v are not all split by heads")
        mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        if isinstance(mask, fx.Node):
            if isinstance(self.state.get(mask), Shard):
                raise self.fail(node, shards, "an attention mask split by heads")
            shape = _shape(mask)
            pos = head_dim - (len(_shape(q)) - len(shape))
            if pos >= 0 and shape[pos] != 1:
                raise self.fail(node, shards, f"an attention mask with a head dimension ({list(shape)})")
        return Shard(head_dim, states[0].segments, frozenset().union(*(s.origins for s in states)))

    def matmul(self, node: fx.Node, inputs: list[tuple[fx.Node, Shard]]) -> Shard:
        a, b = node.args[:2]
        shards = [s for _, s in inputs]
        sa, sb = self.state.get(a), self.state.get(b)
        out_ndim = len(_shape(node))
        if not (isinstance(sa, Shard) and isinstance(sb, Shard)):
            raise self.fail(node, shards, "a matmul of a sharded and a replicated value")
        da = sa.dim + out_ndim - len(_shape(a))
        db = sb.dim + out_ndim - len(_shape(b))
        if da != db or da >= out_ndim - 2 or sa.segments != sb.segments:
            raise self.fail(node, shards, "a matmul over the sharded dimension")
        return Shard(da, sa.segments, sa.origins | sb.origins)

    def visit_output(self, node: fx.Node) -> None:
        outputs = list(node.args[0]) if isinstance(node.args[0], (list, tuple)) else [node.args[0]]
        for i, value in enumerate(outputs):
            s = self.state.get(value) if isinstance(value, fx.Node) else None
            if not isinstance(s, Shard):
                continue
            shape = _shape(value)
            if i == 0 and s.dim == len(shape) - 1 and len(s.segments) == 1:
                self.vocab_output, self.vocab_origins = True, s.origins
            else:
                raise _Failure(s.origins, f"model output {i} ({value.name}) would leave the model sharded")

    # ------------------------------------------------------------------ parameters

    def assign_params(self, excluded: dict[str, str]) -> None:
        """Each parameter gets one layout; a conflict (one weight in two roles) puts its layers back."""
        self.params: dict[str, ParamShard] = {}
        claims: dict[str, list[tuple[str, ParamShard]]] = {}

        def claim(node_name: str, param: fx.Node | None, shard: ParamShard | None) -> None:
            if param is None:
                return
            fqn = self.param_of[param.name]
            claims.setdefault(fqn, []).append((node_name, shard))

        for name, (w, out_dim, segments) in self.columns.items():
            node = self.node(name)
            bias = self.linear_parts(node)[2]
            role = "vocab" if name in self.vocab_origins else "column"
            claim(name, w, ParamShard(self.param_of[w.name], out_dim, segments, role))
            if bias is not None:
                claim(name, bias, ParamShard(self.param_of[bias.name], 0, segments, role))
        for name, (w, segments) in self.rows.items():
            in_dim = self.linear_parts(self.node(name))[4]
            claim(name, w, ParamShard(self.param_of[w.name], in_dim, segments, "row"))
        # every other read of a split parameter must agree with its layout
        split = set(claims)
        self.embeddings: dict[str, int] = {}
        for node in self.graph.graph.nodes:
            if node.op != "call_function" or node.name in self.columns or node.name in self.rows:
                continue
            for arg in node.all_input_nodes:
                fqn = self.param_of.get(arg.name)
                if fqn not in split:
                    continue
                if node.target is aten.embedding.default and node.args[0] is arg:
                    layout = [s for _, s in claims[fqn]][0]
                    if layout.dim == 0 and len(layout.segments) == 1:
                        self.embeddings[node.name] = layout.segments[0]
                        claims[fqn].append((node.name, ParamShard(fqn, 0, layout.segments, "vocab")))
                        continue
                claims[fqn].append((node.name, None))  # read whole somewhere else: cannot be split
        for fqn, uses in claims.items():
            layouts = {(s.dim, s.segments) if s else None for _, s in uses}
            if len(layouts) > 1:
                origins = set()
                for name, _ in uses:
                    if name in self.columns:
                        origins.add(name)
                    origins |= self.row_origins.get(name, frozenset())
                raise _Failure(frozenset(origins), f"parameter {fqn!r} is read by layers that would split it "
                                                   f"differently (or not at all)")
            self.params[fqn] = uses[0][1]
        # a token embedding (looked up with the model's main input ids) is vocab-parallel on its own too
        for node in self.graph.graph.nodes:
            if node.target is aten.embedding.default and node.name not in self.embeddings:
                weight, ids = node.args[0], node.args[1]
                fqn = self.param_of.get(weight.name) if isinstance(weight, fx.Node) else None
                if fqn is None or fqn in self.params or not (isinstance(ids, fx.Node) and ids.name == self.main_input):
                    continue
                vocab = _shape(weight)[0]
                if vocab % self.tp:  # the largest layer would stay whole on every rank: say so, with the way out
                    raise ConfigError(f"tp={self.tp} does not divide the vocabulary of {vocab} rows of {fqn!r}; pad "
                                      f"the vocabulary to a multiple of {self.tp} (e.g. vocab_size="
                                      f"{-(-vocab // self.tp) * self.tp}: extra rows are never looked up) or use "
                                      f"a tp that divides {vocab}")
                if any(u is not node for u in weight.users):
                    continue
                self.embeddings[node.name] = vocab
                self.params[fqn] = ParamShard(fqn, 0, (vocab,), "vocab")

    def node(self, name: str) -> fx.Node:
        if not hasattr(self, "_by_name"):
            self._by_name = {n.name: n for n in self.graph.graph.nodes}
        return self._by_name[name]

    def finish(self, excluded: dict[str, str]) -> TensorParallelPlan:
        plan = TensorParallelPlan(tp=self.tp, params=self.params, row=set(self.rows), embeddings=self.embeddings,
                                  arg_edits=self.edits, vocab_output=self.vocab_output)
        sizes = {v for v in self.embeddings.values()}
        if self.vocab_output:
            head = next(iter(self.vocab_origins))
            w, out_dim, _ = self.columns[head]
            sizes.add(_shape(w)[out_dim])
        if len(sizes) > 1:
            raise ConfigError(f"tensor parallelism found vocabulary-parallel layers of different sizes {sorted(sizes)}")
        plan.vocab_size = sizes.pop() if sizes else None
        for name, (w, out_dim, segments) in self.columns.items():
            node = self.node(name)
            plan.column[name] = 0 if node.target in LINEAR else 1
            role = "vocab-head" if name in self.vocab_origins else "column"
            detail = (f"output features split: {self.param_of[w.name]} {list(_shape(w))} -> "
                      f"{'+'.join(str(s // self.tp) for s in segments)} per rank"
                      + (f" ({len(segments)} fused segments)" if len(segments) > 1 else ""))
            plan.decisions.append(LayerDecision(name, self.module_of(node), [self.param_of[w.name]], role, detail))
        for name, (w, segments) in self.rows.items():
            node = self.node(name)
            plan.decisions.append(LayerDecision(name, self.module_of(node), [self.param_of[w.name]], "row",
                                                f"input features split, outputs summed (all-reduce): "
                                                f"{self.param_of[w.name]} {list(_shape(w))}"))
        for name, vocab in self.embeddings.items():
            node = self.node(name)
            fqn = self.param_of[node.args[0].name]
            plan.decisions.append(LayerDecision(name, self.module_of(node), [fqn], "vocab-embedding",
                                                f"rows split: {vocab} -> {vocab // self.tp} per rank, lookups summed"))
        for name, reason in excluded.items():
            node = self.node(name)
            parts = self.linear_parts(node)
            fqn = self.param_of[parts[1].name] if parts else ""
            plan.decisions.append(LayerDecision(name, self.module_of(node), [fqn] if fqn else [], "replicated",
                                                f"{fqn}: {reason}"))
        plan.replicated_params = [fqn for fqn in dict.fromkeys(self.param_of.values()) if fqn not in self.params]
        order = {n.name: i for i, n in enumerate(self.graph.graph.nodes)}
        plan.decisions.sort(key=lambda d: order.get(d.node, 0))
        # how each sharded value is split (dropout draws its slice of the whole mask: autopar/dropout)
        plan.value_shards = {n.name: (s.dim, s.segments) for n, s in self.state.items() if isinstance(s, Shard)}
        return plan
