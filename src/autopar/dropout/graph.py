"""Layout-free dropout in traced graphs: dropout nodes of pipeline stage pieces become modules.

Every stage piece is a slice of one exported graph, so a dropout node's number is its
position among the dropout nodes of the *whole* graph (`dropout_numbering`): every stage
agrees, and the number equals the call order eager.py counts in a whole-model forward.
Nodes replaced: aten.dropout, aten.feature_dropout (channel masks), aten.native_dropout,
and aten.scaled_dot_product_attention with dropout_p > 0 (written out, ops.attention).
Alpha dropout with p > 0 is refused.

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
from .scope import active_scope

aten = torch.ops.aten

ELEMENTWISE = {aten.dropout.default: "dropout", aten.native_dropout.default: "native",
               aten.feature_dropout.default: "channel"}
REFUSED = {aten.alpha_dropout.default, aten.feature_alpha_dropout.default}
SDPA = aten.scaled_dot_product_attention.default
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _arg(node: fx.Node, index: int, name: str, default):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def draws_mask(node: fx.Node) -> bool:
    """Whether the node is a dropout that draws a mask in training (the eager call order counts the same)."""
    if node.op != "call_function":
        return False
    if node.target in ELEMENTWISE:
        return bool(_arg(node, 2, "train", False))
    if node.target is SDPA:
        return float(_arg(node, 4, "dropout_p", 0.0) or 0.0) > 0
    return False


def dropout_numbering(graph: fx.Graph) -> dict[str, int]:
    """Node name -> operation number, in graph order (compute on the whole traced graph)."""
    numbering = {}
    for node in graph.nodes:
        if node.op == "call_function" and node.target in REFUSED and _arg(node, 2, "train", False) \
                and float(_arg(node, 1, "p", 0.0)) > 0:
            raise ModelError(f"{node.target} at {node.name} is not supported with layout-independent dropout; use "
                             f"dropout or set its probability to 0")
        if draws_mask(node):
            numbering[node.name] = len(numbering)
    return numbering


class GraphDropout(nn.Module):
    """One dropout node of a stage piece: layout-free mask number `op` over `batch`-sample micro-batches."""

    def __init__(self, kind: str, op: int, batch: int, source: str):
        super().__init__()
        self.kind, self.op, self.batch, self.source = kind, op, batch, source
        self.shard: ops.TPShard | None = None
        self._keys: dict = {}  # per-element hashes: the shapes are static

    def extra_repr(self) -> str:
        return f"{self.kind}, op={self.op}, node={self.source}" + (f", {self.shard}" if self.shard else "")

    def _scope(self, subbatch: int):
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
        x, p = args[0], float(args[1] if len(args) > 1 else kwargs.get("p", 0.5))
        scope = self._scope(subbatch) if self.training else None
        if self.training and p > 0 and scope is None:  # outside a trainer step (e.g. memory measurement)
            return self._native(x, p)
        if not self.training or p == 0:
            return (x, torch.ones_like(x, dtype=torch.bool)) if self.kind == "native" else x
        noise = ops.dropout_noise(tuple(x.shape), p, self.op, scope, dtype=x.dtype, device=x.device,
                                  channel=self.kind == "channel", shard=self.shard, cache=self._keys)
        out = x * noise
        return (out, noise != 0) if self.kind == "native" else out

    def _native(self, x: torch.Tensor, p: float):
        if self.kind == "native":
            return torch.native_dropout(x, p, True)
        return (torch.feature_dropout if self.kind == "channel" else torch.dropout)(x, p, True)

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
        return ops.attention(q, k, v, mask, float(p), bool(causal), scale, bool(gqa), self.op, scope,
                             shard=self.shard, cache=self._keys)


def replace_dropout_nodes(module: fx.GraphModule, numbering: dict[str, int], batch: int) -> int:
    """Replace the numbered dropout nodes of a piece by GraphDropout modules; returns how many."""
    graph, count = module.graph, 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.name not in numbering:  # a placeholder may carry the name
            continue
        kind = "attention" if node.target is SDPA else ELEMENTWISE[node.target]
        value = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
        drops = kind == "attention" or float(_arg(node, 1, "p", 0.5)) > 0  # p = 0 stays the identity anyway
        if drops and isinstance(value, torch.Tensor) and (value.dim() == 0 or value.shape[0] % batch):
            raise ModelError(f"dropout {node.name} acts on a tensor of shape {list(value.shape)} whose leading "
                             f"dimension is not a multiple of the micro-batch's {batch} samples; layout-independent "
                             f"dropout needs the batch as the leading dimension (or set this dropout to 0)")
        name = f"layout_free_{node.name}"
        module.add_module(name, GraphDropout(kind, numbering[node.name], batch, node.name))
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
