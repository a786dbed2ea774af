"""Find tensor-parallel layer pairs in a traced graph, from the data flow rather than from names.

Megatron needs hand-written parallel layers, torchtitan a per-model plan, Merak a list of
layer names per model family. Here the plan comes from the exported graph (static shapes):

1. Every linear whose input is replicated is a *column* candidate: its output features are
   split over the tp ranks, so its output is sharded on the last dimension.
2. Sharding is propagated forward through the operations that work per feature or per
   head: elementwise ops (with broadcast operands), views and reshapes (whose static sizes
   are edited: the head count becomes heads / tp), transposes, splits of a fused qkv
   output, rotary slicing, scaled-dot-product attention, batched matmuls. Each operation
   has its own small rule in rules.py (a table from aten op to rule); this file finds the
   column and row layers, runs the rules in graph order and assigns the parameters.
3. A linear whose input is sharded on its contraction dimension is the *row* partner: it
   sums partial products with one all-reduce, after which the value is replicated again.
4. A sum or mean over the sharded dimension (an RMS norm over all heads' features) is
   summed over the tp ranks with one all-reduce, and the norm's weight is split with the
   features it scales.
5. If a sharded value reaches an operation that would mix the shards (a layer norm or a
   max over the sharded dimension, a reshape that interleaves them, an unknown op),
   every column layer feeding it is put back to replicated and the analysis reruns, so a
   pattern the planner does not recognise stays replicated and the plan says why.

A fused projection (GPT-2's c_attn, phi3's qkv_proj and gate_up_proj: cut into pieces by a
split, a chunk, or slices that tile its features) is sharded per *segment*: each rank holds
its slice of q, of k and of v (of gate and of up), so the cut that follows still yields whole
heads, with its sizes or offsets edited to the local ones.
The token embedding and a tied output head become vocabulary-parallel; the logits then stay
sharded over the vocabulary and the loss is computed without gathering them.
"""

from __future__ import annotations

import operator
import re
from typing import Any

import torch
from torch import fx
from torch.export.graph_signature import InputKind

from ..errors import ConfigError
from ..trace import ModelGraph
from .layout import LayerDecision, ParamShard, TensorParallelPlan
from .rules import PASS_THROUGH, SPLITS, SUMMED, VIEWS, PlanFailure, RuleContext, Shard, norm_dim, rule_for, shape_of
from .rules import is_per_head_attention
from .rules import arg as rule_arg

aten = torch.ops.aten

LINEAR = {aten.linear.default}
ADDMM = {aten.addmm.default}  # Conv1D (HF GPT-2): addmm(bias, x2d, weight[in, out])
FOLLOW = set(VIEWS) | set(PASS_THROUGH) | {aten.unsqueeze.default}  # keep a column's features whole and last


def plan_tensor_parallel(graph: ModelGraph, tp: int, *, sequence: bool = False) -> TensorParallelPlan:
    """The tensor-parallel plan of a traced model for `tp` ranks (tp=1: nothing is split).
    `sequence`: sequence parallelism too (--sp: sequence.py)."""
    if tp < 1:
        raise ConfigError(f"tp must be a positive integer, got {tp}")
    analysis = _Analysis(graph, tp)
    analysis.check_heads()
    excluded: dict[str, str] = {}
    while True:
        try:
            analysis.run(excluded)
            analysis.assign_params(excluded)
            break
        except PlanFailure as failure:
            if not failure.origins:  # nothing to put back: a bug in the rules, not the model
                raise
            for origin in failure.origins:
                excluded.setdefault(origin, failure.reason)
    plan = analysis.finish(excluded)
    if sequence and tp > 1:
        from .sequence import plan_sequence_parallel
        plan.sequence = plan_sequence_parallel(graph, plan)
    return plan


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

    def check_heads(self) -> None:
        """A tp that does not divide the query heads of an attention is an error, not a silent whole attention."""
        for node in self.graph.graph.nodes:
            q_shape = shape_of(node.args[0]) if is_per_head_attention(node.target) else None
            if self.tp > 1 and q_shape and len(q_shape) == 4 and q_shape[1] % self.tp:
                raise ConfigError(f"tp={self.tp} does not divide the {q_shape[1]} heads of the attention in "
                                  f"{self.module_of(node) or node.name!r}; use a tp that divides {q_shape[1]}")

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
        """Segments of a column output: how the pieces taken from its features further down cut them.

        A fused projection (q|k|v, gate|up) is cut by a split, a chunk, or slices that together
        cover the features; each segment is then sharded on its own, so every rank holds its share
        of each piece. Without such a cut the features are one segment.
        """
        frontier, seen, slices = [node], set(), set()
        while frontier:
            value = frontier.pop()
            in_shape = shape_of(value)
            for user in value.users:
                if user in seen:
                    continue
                seen.add(user)
                shape = shape_of(user)
                if user.target in SPLITS + (aten.chunk.default, aten.slice.Tensor):
                    dim_index = 1 if user.target is aten.slice.Tensor else 2
                    dim = norm_dim(rule_arg(user, dim_index, "dim", 0), len(in_shape))
                    if dim != len(in_shape) - 1:
                        continue
                    if user.target is aten.slice.Tensor:
                        start, end = rule_arg(user, 2, "start", 0) or 0, rule_arg(user, 3, "end", None)
                        if rule_arg(user, 4, "step", 1) == 1:
                            slices.add((start, min(features, features if end is None else end)))
                        continue
                    sizes = user.args[1]
                    if user.target is aten.chunk.default:
                        sizes = features // sizes if features % sizes == 0 else features
                    if isinstance(sizes, int):
                        return tuple([sizes] * (features // sizes)) if features % sizes == 0 else (features,)
                    return tuple(sizes)
                elif user.target in FOLLOW and shape and shape[-1] == features:
                    frontier.append(user)
        ordered = sorted(slices)
        if len(ordered) > 1 and ordered[0][0] == 0 and ordered[-1][1] == features and all(
                a[1] == b[0] for a, b in zip(ordered, ordered[1:])):
            return tuple(end - start for start, end in ordered)  # slices that tile the features: the segments
        return (features,)

    # ------------------------------------------------------------------ propagation

    def run(self, excluded: dict[str, str]) -> None:
        self.rules = RuleContext(self.tp, module_of=self.module_of, is_param=lambda n: n.name in self.param_of)
        self.state = self.rules.state
        self.edits = self.rules.edits
        self.columns: dict[str, tuple[fx.Node, int, tuple[int, ...]]] = {}
        self.rows: dict[str, tuple[fx.Node, tuple[int, ...]]] = {}
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
        for value in node.all_input_nodes:
            s = self.state.get(value)
            if isinstance(s, Shard):
                found.append((value, s))
            elif isinstance(s, list) and any(isinstance(x, Shard) for x in s) and node.target is not operator.getitem:
                raise PlanFailure(frozenset().union(*(x.origins for x in s if isinstance(x, Shard))),
                                  f"{node.name} ({node.target}) takes a split list of sharded values")
        return found

    def visit(self, node: fx.Node, excluded: dict[str, str]) -> Any:
        """The sharding of one node's result: linears start or end it, every other op follows its rule."""
        linear = self.linear_parts(node)
        inputs = self.sharded_inputs(node)
        if linear is not None:
            return self.visit_linear(node, linear, inputs, excluded)
        if node.target is operator.getitem:
            parent = self.state.get(node.args[0])
            return parent[node.args[1]] if isinstance(parent, list) else None
        if not inputs:  # whole; a value computed from a tp sum stays marked so its gradient is summed too
            return SUMMED if any(self.state.get(v) == SUMMED for v in node.all_input_nodes) else None
        op_rule = rule_for(node.target)
        if op_rule is None:
            raise self.rules.fail(node, [s for _, s in inputs], "an operation the tensor-parallel planner does not know")
        return op_rule(self.rules, node, inputs)

    def visit_linear(self, node: fx.Node, linear: tuple, inputs: list[tuple[fx.Node, Shard]],
                     excluded: dict[str, str]) -> Shard | None:
        """A linear on a replicated input becomes a column layer; on features sharded by one, its row partner."""
        x, w, bias, out_dim, in_dim = linear
        xs = self.state.get(x)
        features = shape_of(w)[out_dim]
        if xs is None or xs == SUMMED:
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
            return Shard(len(shape_of(node)) - 1, segments, frozenset([node.name]))
        x_shape = shape_of(x)
        if isinstance(xs, Shard) and xs.dim == len(x_shape) - 1 and x_shape[-1] == shape_of(w)[in_dim]:
            self.rows[node.name] = (w, xs.segments)
            self.row_origins[node.name] = xs.origins
            return None
        raise self.rules.fail(node, [s for _, s in inputs],
                              "a linear layer reads a value sharded on a non-feature dimension")

    def visit_output(self, node: fx.Node) -> None:
        outputs = list(node.args[0]) if isinstance(node.args[0], (list, tuple)) else [node.args[0]]
        for i, value in enumerate(outputs):
            s = self.state.get(value) if isinstance(value, fx.Node) else None
            if not isinstance(s, Shard):
                continue
            shape = shape_of(value)
            if i == 0 and s.dim == len(shape) - 1 and len(s.segments) == 1:
                vocab = {shape_of(n.args[0])[0] for n in self.graph.graph.nodes
                         if n.target is aten.embedding.default and isinstance(n.args[1], fx.Node)
                         and n.args[1].name == self.main_input}
                if vocab and s.segments[0] not in vocab:  # a classifier's head on a token model: not a vocabulary
                    raise PlanFailure(s.origins, f"the model output has {s.segments[0]} classes, not the "
                                                 f"{sorted(vocab)[0]}-token vocabulary its embedding splits: "
                                                 f"a classifier head stays whole")
                self.vocab_output, self.vocab_origins = True, s.origins
            else:
                raise PlanFailure(s.origins, f"model output {i} ({value.name}) would leave the model sharded")

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
        for name, (param, dim, segments) in self.rules.param_operands.items():  # a norm's per-feature weight
            claim(name, param, ParamShard(self.param_of[param.name], dim, segments, "column"))
        # every other read of a split parameter must agree with its layout
        split = set(claims)
        self.embeddings: dict[str, int] = {}
        for node in self.graph.graph.nodes:
            if node.op != "call_function" or node.name in self.columns or node.name in self.rows:
                continue
            operand = self.rules.param_operands.get(node.name)
            for arg in node.all_input_nodes:
                fqn = self.param_of.get(arg.name)
                if fqn not in split or (operand is not None and operand[0] is arg):
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
                    if name in self.rules.param_operands:
                        origins |= self.state[self.node(name)].origins
                raise PlanFailure(frozenset(origins), f"parameter {fqn!r} is read by layers that would split it "
                                                   f"differently (or not at all)")
            self.params[fqn] = uses[0][1]
        # a token embedding (looked up with the model's main input ids) is vocab-parallel on its own too
        for node in self.graph.graph.nodes:
            if node.target is aten.embedding.default and node.name not in self.embeddings:
                weight, ids = node.args[0], node.args[1]
                fqn = self.param_of.get(weight.name) if isinstance(weight, fx.Node) else None
                if fqn is None or fqn in self.params or not (isinstance(ids, fx.Node) and ids.name == self.main_input):
                    continue
                vocab = shape_of(weight)[0]
                if vocab % self.tp:  # the largest layer would stay whole on every rank: say so, with the way out
                    raise ConfigError(f"tp={self.tp} does not divide the vocabulary of {vocab} rows of {fqn!r}; pad "
                                      f"the vocabulary to a multiple of {self.tp} (e.g. vocab_size="
                                      f"{-(-vocab // self.tp) * self.tp}: extra rows are never looked up) or use "
                                      f"a tp that divides {vocab}")
                if any(u is not node for u in weight.users):
                    continue
                self.embeddings[node.name] = vocab
                self.params[fqn] = ParamShard(fqn, 0, (vocab,), "vocab")

    def whole_layer_feeding(self, node: fx.Node, excluded: dict[str, str]) -> str | None:
        """The module of a layer kept whole whose output reaches this linear's input without another linear."""
        frontier, seen = [self.linear_parts(node)[0]], set()
        while frontier and len(seen) < 64:
            value = frontier.pop()
            if not isinstance(value, fx.Node) or value in seen or value.op != "call_function":
                continue
            seen.add(value)
            if self.linear_parts(value) is not None:
                if value.name in excluded:
                    return self.module_of(value) or value.name
                continue
            frontier.extend(value.all_input_nodes)
        return None

    def node(self, name: str) -> fx.Node:
        if not hasattr(self, "_by_name"):
            self._by_name = {n.name: n for n in self.graph.graph.nodes}
        return self._by_name[name]

    def finish(self, excluded: dict[str, str]) -> TensorParallelPlan:
        plan = TensorParallelPlan(tp=self.tp, params=self.params, row=set(self.rows), embeddings=self.embeddings,
                                  arg_edits=self.edits, vocab_output=self.vocab_output, sums=self.rules.sums,
                                  copies=self.rules.copies)
        sizes = {v for v in self.embeddings.values()}
        if self.vocab_output:
            head = next(iter(self.vocab_origins))
            w, out_dim, _ = self.columns[head]
            sizes.add(shape_of(w)[out_dim])
        if len(sizes) > 1:
            raise ConfigError(f"tensor parallelism found vocabulary-parallel layers of different sizes {sorted(sizes)}")
        plan.vocab_size = sizes.pop() if sizes else None
        for name, (w, out_dim, segments) in self.columns.items():
            node = self.node(name)
            plan.column[name] = 0 if node.target in LINEAR else 1
            role = "vocab-head" if name in self.vocab_origins else "column"
            detail = (f"output features split: {self.param_of[w.name]} {list(shape_of(w))} -> "
                      f"{'+'.join(str(s // self.tp) for s in segments)} per rank"
                      + (f" ({len(segments)} fused segments)" if len(segments) > 1 else ""))
            plan.decisions.append(LayerDecision(name, self.module_of(node), [self.param_of[w.name]], role, detail))
        for name, (w, segments) in self.rows.items():
            node = self.node(name)
            plan.decisions.append(LayerDecision(name, self.module_of(node), [self.param_of[w.name]], "row",
                                                f"input features split, outputs summed (all-reduce): "
                                                f"{self.param_of[w.name]} {list(shape_of(w))}"))
        for name, (param, dim, segments) in self.rules.param_operands.items():
            node, fqn = self.node(name), self.param_of[param.name]
            plan.decisions.append(LayerDecision(name, self.module_of(node), [fqn], "per-feature",
                                                f"weight split with the features it scales: {fqn} "
                                                f"{list(shape_of(param))} -> {sum(segments) // self.tp} per rank"))
        for name, divisor in self.rules.sums.items():
            node = self.node(name)
            plan.decisions.append(LayerDecision(name, self.module_of(node), [], "tp-sum",
                                                f"{'mean' if divisor > 1 else 'sum'} over the split features: "
                                                f"local {'mean' if divisor > 1 else 'sum'}s summed over the tp ranks "
                                                f"(all-reduce){f', divided by {divisor}' if divisor > 1 else ''}"))
        for name, vocab in self.embeddings.items():
            node = self.node(name)
            fqn = self.param_of[node.args[0].name]
            plan.decisions.append(LayerDecision(name, self.module_of(node), [fqn], "vocab-embedding",
                                                f"rows split: {vocab} -> {vocab // self.tp} per rank, lookups summed"))
        for name, reason in excluded.items():
            node = self.node(name)
            parts = self.linear_parts(node)
            fqn = self.param_of[parts[1].name] if parts else ""
            why, _, where = reason.partition(" at ")
            leaf = re.search(r" in '([^']*)'$", where)
            short = re.sub(r" \([^()]*\)", "", why) + (f" in {leaf.group(1).rpartition('.')[2]}" if leaf else "")
            feeding = self.whole_layer_feeding(node, excluded) if parts else None
            if feeding:  # would have been the row partner of a layer kept whole: say that first
                short = "its input comes from a layer kept whole"
                reason = f"its input comes from {feeding!r}, kept whole; as a column layer on its own: {reason}"
            plan.decisions.append(LayerDecision(name, self.module_of(node), [fqn] if fqn else [], "replicated",
                                                f"{fqn}: {reason}", reason=short))
        plan.linears = sum(1 for n in self.graph.graph.nodes if n.op == "call_function" and self.linear_parts(n))
        plan.replicated_params = [fqn for fqn in dict.fromkeys(self.param_of.values()) if fqn not in self.params]
        order = {n.name: i for i, n in enumerate(self.graph.graph.nodes)}
        plan.decisions.sort(key=lambda d: order.get(d.node, 0))
        # how each sharded value is split (dropout draws its slice of the whole mask: autopar/dropout)
        plan.value_shards = {n.name: (s.dim, s.segments) for n, s in self.state.items() if isinstance(s, Shard)}
        return plan
