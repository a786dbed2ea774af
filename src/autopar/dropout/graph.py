"""Layout-free randomness in traced graphs: random nodes of pipeline / tensor-parallel stage pieces become modules.

Every stage piece is a slice of one exported graph, so a random node's number is its
position among the random nodes of the *whole* graph (`dropout_numbering`): every stage
agrees, and the number equals the call order eager.py counts in a whole-model forward.
Nodes replaced: aten.dropout, aten.feature_dropout (channel masks), aten.native_dropout,
aten.alpha_dropout, aten.feature_alpha_dropout (and the in-place forms), aten.rrelu in
training, and aten.scaled_dot_product_attention with dropout_p > 0 (written out,
ops.attention; nn.MultiheadAttention exports to it). Any other node that draws
(aten.randn, aten.bernoulli, an RNN with dropout, ...) is refused (random_ops.py).

The replacing module reads the active micro-batch scope (scope.py) at run time. It
honours the stage's train/eval mode (a traced node cannot: its `train` flag is baked in).
Under tensor parallelism `shard_dropout` tells each module how its activation is split
(from the plan's value layouts), so it draws its slice of the whole mask; a tp sub-batch
copy passes `subbatch=j` and takes its rows of the micro-batch's samples.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import fx, nn

from ..errors import ModelError
from . import ops
from .random_ops import draws, refusal, stack_hint
from .compiled import OpAtRunTime, ScopeAtRunTime
from .scope import active_scope

aten = torch.ops.aten

# node target -> (kind, in place): kind picks the ops.py computation
ELEMENTWISE = {aten.dropout.default: ("dropout", False), aten.dropout_.default: ("dropout", True),
               aten.native_dropout.default: ("native", False),
               aten.feature_dropout.default: ("channel", False), aten.feature_dropout_.default: ("channel", True),
               aten.alpha_dropout.default: ("alpha", False), aten.alpha_dropout_.default: ("alpha", True),
               aten.feature_alpha_dropout.default: ("feature_alpha", False),
               aten.feature_alpha_dropout_.default: ("feature_alpha", True)}
RRELU = {aten.rrelu.default: False, aten.rrelu_.default: True}  # (self, lower, upper, training, generator)
SDPA = aten.scaled_dot_product_attention.default
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _arg(node: fx.Node, index: int, name: str, default):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def draws_mask(node: fx.Node) -> bool:
    """Whether the node is a layout-free random op that draws in training (the eager call order counts the same)."""
    if node.op != "call_function":
        return False
    if node.target in ELEMENTWISE:
        return _arg(node, 2, "train", None) is not False if node.target is aten.native_dropout.default \
            else bool(_arg(node, 2, "train", False))
    if node.target in RRELU:
        return bool(_arg(node, 3, "training", False))
    if node.target is SDPA:
        return float(_arg(node, 4, "dropout_p", 0.0) or 0.0) > 0
    return False


def dropout_numbering(graph: fx.Graph) -> dict[str, int]:
    """Node name -> operation number, in graph order (compute on the whole traced graph).

    Any other node that draws random numbers is refused here (random_ops.py), before a stage runs."""
    numbering = {}
    for node in graph.nodes:
        if draws_mask(node):
            numbering[node.name] = len(numbering)
        elif node.op == "call_function" and draws(node.target, node.args, node.kwargs):
            raise refusal(str(node.target), stack_hint(node))
    return numbering


class GraphDropout(nn.Module):
    """One random node of a stage piece: layout-free draws of operation `op` over `batch`-sample micro-batches."""

    def __init__(self, kind: str, op: int, batch: int, source: str, inplace: bool = False):
        super().__init__()
        self.kind, self.op, self.batch, self.source, self.inplace = kind, op, batch, source, inplace
        self.shard: ops.TPShard | None = None
        self._keys: dict = {}  # per-element hashes: the shapes are static
        # the number as a tensor a compiled piece reads when it runs, so that identical blocks' pieces compile to one
        # graph (compiled.py); a plain attribute, not a buffer: no state_dict entry, never moved off the CPU
        self._op_tensor = torch.tensor(op, dtype=torch.int64, device="cpu")

    def _op(self) -> int | OpAtRunTime:
        return OpAtRunTime(self._op_tensor, 0) if torch.compiler.is_compiling() else self.op

    def extra_repr(self) -> str:
        return f"{self.kind}, op={self.op}, node={self.source}" + (f", {self.shard}" if self.shard else "")

    def _scope(self, subbatch: int):
        if torch.compiler.is_compiling():  # the scope is read when the compiled graph runs (compiled.py)
            return ScopeAtRunTime(self.batch, subbatch)
        scope = active_scope()
        if scope is None or scope.samples is None:
            return None
        if len(scope.samples) == self.batch:
            return scope
        if len(scope.samples) < (subbatch + 1) * self.batch:
            raise RuntimeError(f"dropout {self.source} was traced for {self.batch} samples, but the micro-batch has "
                               f"{len(scope.samples)}")
        rows = scope.samples[subbatch * self.batch:(subbatch + 1) * self.batch]
        return dataclasses.replace(scope, samples=rows, _on_device={})

    def forward(self, *args, subbatch: int = 0, **kwargs):
        if self.kind == "attention":
            return self._attention(subbatch, *args, **kwargs)
        if self.kind == "rrelu":
            return self._rrelu(subbatch, *args, **kwargs)
        x, p = args[0], float(args[1] if len(args) > 1 else kwargs.get("p", 0.5))
        scope = self._scope(subbatch) if self.training else None
        if self.training and p > 0 and scope is None:  # outside a trainer step (e.g. memory measurement)
            return self._native(x, p)
        if not self.training or p == 0:
            return (x, torch.ones_like(x, dtype=torch.bool)) if self.kind == "native" else x
        if self.kind in ("alpha", "feature_alpha"):
            return ops.alpha_dropout(x, p, self._op(), scope, channel=self.kind == "feature_alpha", shard=self.shard,
                                     inplace=self.inplace, cache=self._keys)
        noise = ops.dropout_noise(tuple(x.shape), p, self._op(), scope, dtype=x.dtype, device=x.device,
                                  channel=self.kind == "channel", shard=self.shard, cache=self._keys)
        out = x.mul_(noise) if self.inplace else x * noise
        return (out, noise != 0) if self.kind == "native" else out

    def _native(self, x: torch.Tensor, p: float):
        if self.kind == "native":
            return torch.native_dropout(x, p, True)
        name = {"dropout": "dropout", "channel": "feature_dropout", "alpha": "alpha_dropout",
                "feature_alpha": "feature_alpha_dropout"}[self.kind]
        return getattr(torch, name + ("_" if self.inplace else ""))(x, p, True)

    def _rrelu(self, subbatch: int, x: torch.Tensor, lower: float = 1.0 / 8, upper: float = 1.0 / 3, *_, **__):
        scope = self._scope(subbatch) if self.training else None
        if not self.training:  # eval: the mean slope, as torch's rrelu
            return F.rrelu(x, lower, upper, training=False, inplace=self.inplace)
        if scope is None:
            return (torch.rrelu_ if self.inplace else torch.rrelu)(x, lower, upper, True)
        return ops.rrelu(x, float(lower), float(upper), self._op(), scope, shard=self.shard, inplace=self.inplace,
                         cache=self._keys)

    def _attention(self, subbatch: int, *args, **kwargs):
        values = list(args) + [None] * (len(_SDPA_ARGS) - len(args))
        defaults = (None, None, None, None, 0.0, False, None, False)
        for i, name in enumerate(_SDPA_ARGS):
            if i >= len(args):
                values[i] = kwargs.get(name, defaults[i])
        q, k, v, mask, p, causal, scale, gqa = values
        scope = self._scope(subbatch) if self.training else None
        if not self.training or scope is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p if self.training else 0.0,
                                                  is_causal=causal, scale=scale, enable_gqa=gqa)
        return ops.attention(q, k, v, mask, float(p), bool(causal), scale, bool(gqa), self._op(), scope,
                             shard=self.shard, cache=self._keys)


def _kind(target) -> tuple[str, bool]:
    """(kind, in place) of a numbered node's target."""
    if target is SDPA:
        return "attention", False
    if target in RRELU:
        return "rrelu", RRELU[target]
    return ELEMENTWISE[target]


def replace_dropout_nodes(module: fx.GraphModule, numbering: dict[str, int], batch: int) -> int:
    """Replace the numbered dropout nodes of a piece by GraphDropout modules; returns how many."""
    graph, count = module.graph, 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.name not in numbering:  # a placeholder may carry the name
            continue
        kind, inplace = _kind(node.target)
        value = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
        drops = kind in ("attention", "rrelu") or float(_arg(node, 1, "p", 0.5)) > 0  # p = 0: the identity anyway
        if drops and isinstance(value, torch.Tensor) and (value.dim() == 0 or value.shape[0] % batch):
            raise ModelError(f"dropout {node.name} acts on a tensor of shape {list(value.shape)} whose leading "
                             f"dimension is not a multiple of the micro-batch's {batch} samples; layout-independent "
                             f"dropout needs the batch as the leading dimension (or set this dropout to 0)")
        name = f"layout_free_{node.name}"
        module.add_module(name, GraphDropout(kind, numbering[node.name], batch, node.name, inplace))
        with graph.inserting_after(node):
            replacement = graph.call_module(name, node.args, dict(node.kwargs))
        replacement.meta = dict(node.meta)
        node.replace_all_uses_with(replacement)
        graph.erase_node(node)
        count += 1
    if count:
        graph.lint()
        module.recompile()
    return count


def shard_dropout(module: nn.Module, value_shards: dict[str, tuple[int, tuple[int, ...]]], rank: int, tp: int) -> None:
    """Tell each GraphDropout under `module` which slice of its activation this tp rank holds."""
    for child in module.modules():
        if isinstance(child, GraphDropout) and child.source in value_shards:
            dim, segments = value_shards[child.source]
            child.shard = ops.TPShard(dim, tuple(segments), rank, tp)
            child._keys.clear()
