"""Context parallelism written into the traced graph: attention and positions follow the sequence shard.

The model is traced on this rank's share of the sequence (layout.py), so every operation already has
the local length. Two kinds of nodes still need the whole sequence and are rewritten in place (same
node, same block: the partitioner and the stage builder see the graph they always see):

- torch's scaled_dot_product_attention becomes ring or all-to-all attention (ring.py, all_to_all.py)
  over the cp group, with the mask the model built read from a probe (below) and re-made from global
  positions and the batch's padding mask for every key block;
- `arange(local length)`, which models use for position ids, learned position tables and rotary
  tables, becomes this rank's global positions.

What the model's mask means is decided once on a short probe: the model is traced at a few tokens,
the mask computation alone is run on concrete inputs (one row padded at the end), and the result must
be causal or full, with or without the padding of `attention_mask`, or a causal sliding window (the
probe is long enough to show a window the model's config declares, `config.sliding_window`). A bias
(ALiBi), a document mask, attention written as matmul + softmax, or a mask that needs weights is refused with the
node named. Masks built for the whole sequence become dead and are dropped with what feeds them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import fx
from torch.export.graph_signature import InputKind

from ..errors import ModelError
from ..trace import ModelGraph
from .all_to_all import all_to_all_attention, heads_per_rank, swaps_heads
from .layout import shard_positions
from .ring import ring_attention

aten = torch.ops.aten  # graph operators by name, as the tensor-parallel rules match them
SDPA = aten.scaled_dot_product_attention.default
ATTENTION_FUNCTIONS = {"ring": ring_attention, "all-to-all": all_to_all_attention}
_SOFTMAX = (aten.softmax.int, aten._softmax.default, aten._safe_softmax.default)
_ARANGE = (aten.arange.default, aten.arange.start, aten.arange.start_step)
_PURE_ASSERTS = (aten._assert_tensor_metadata.default,)


@dataclass(frozen=True)
class MaskKind:
    """What one attention's mask means: causal or not, whether padding keys of attention_mask are hidden, and
    a causal sliding window (a query sees keys less than `window` positions back; None: no window)."""

    causal: bool
    padding: bool
    window: int | None = None

    def describe(self) -> str:
        return (("causal" if self.causal else "full") + (f" window {self.window}" if self.window else "")
                + (" + padding" if self.padding else ""))


def attention_nodes(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op == "call_function" and n.target is SDPA]


def check_rewritable(graph: ModelGraph, cp: int, mode: str, tp: int = 1) -> None:
    """Refuse, with the node named, attention this rewrite cannot run over a split sequence (`tp`: the
    heads are split by tensor parallelism first, so all-to-all swaps 1/tp of them)."""
    nodes = attention_nodes(graph.graph)
    for node in graph.graph.nodes:
        if node.op != "call_function":
            continue
        name = str(node.target)
        if node.target in _SOFTMAX and _is_over_sequence(node):
            raise ModelError(f"context parallelism: node {node.name} ({name}, in {_where(graph, node)}) looks like "
                             f"attention written as matmul + softmax, which cannot run over a split sequence; load "
                             f"the model with torch's scaled_dot_product_attention (Hugging Face: "
                             f"attn_implementation='sdpa') or use --cp 1")
        if "attention" in name and node.target is not SDPA:
            raise ModelError(f"context parallelism: node {node.name} ({name}, in {_where(graph, node)}) is an "
                             f"attention kernel the rewrite does not know; only "
                             f"torch.nn.functional.scaled_dot_product_attention is rewritten; use --cp 1")
    if not nodes:
        raise ModelError("context parallelism: the traced model has no scaled_dot_product_attention node to "
                         "rewrite; --cp needs attention over a sequence (use --cp 1)")
    for node in nodes:
        q, k = node.args[0].meta["val"], node.args[1].meta["val"]
        dropout = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
        if dropout:
            raise ModelError(f"context parallelism: attention node {node.name} (in {_where(graph, node)}) has "
                             f"dropout_p={dropout}; attention dropout over a split sequence is not supported yet: "
                             f"set the model's attention dropout to 0 or use --cp 1")
        local_heads = heads_per_rank(q.shape[1], tp)
        if mode == "all-to-all" and not swaps_heads(q.shape[1], tp, cp):
            held = f"{q.shape[1]} heads" + (f" ({local_heads} per tp rank at tp={tp})" if tp > 1 else "")
            raise ModelError(f"--cp-mode all-to-all swaps the sequence split for a head split, but attention node "
                             f"{node.name} (in {_where(graph, node)}) has {held}, not divisible by --cp {cp}; use "
                             f"--cp-mode ring or a cp dividing {local_heads}")
        if k.shape[1] != q.shape[1] and not node.kwargs.get("enable_gqa", False):
            raise ModelError(f"context parallelism: attention node {node.name} has {q.shape[1]} query heads and "
                             f"{k.shape[1]} key heads without enable_gqa; use --cp 1")


def _is_over_sequence(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dim() == 4 and val.shape[-1] == val.shape[-2]


def _where(graph: ModelGraph, node: fx.Node) -> str:
    cost = graph.nodes.get(node.name)
    return (cost.module_path or "the model's forward") if cost else "the model's forward"


def mask_kinds(probe: ModelGraph, probe_inputs: dict[str, torch.Tensor]) -> list[MaskKind]:
    """Per attention node of the probe's graph, in order: what its mask means (causal / padding), or a
    ModelError naming the node whose mask is something else."""
    graph = probe.graph
    user = [spec.arg.name for spec in probe.exported.graph_signature.input_specs if spec.kind == InputKind.USER_INPUT]
    values: dict[str, object] = {name: probe_inputs[key if isinstance(key, str) else "__main__"]
                                 for name, key in zip(user, probe.input_keys)}
    kinds = []
    padding_rows = probe_inputs.get("attention_mask")
    for node in attention_nodes(graph):
        mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        is_causal = bool(node.args[5] if len(node.args) > 5 else node.kwargs.get("is_causal", False))
        if mask is None:
            kinds.append(MaskKind(causal=is_causal, padding=False))
            continue
        allowed = _evaluate(graph, mask, values, node)
        kinds.append(_classify(node, allowed, is_causal, padding_rows))
    return kinds


def _evaluate(graph: fx.Graph, target: fx.Node, values: dict[str, object], attention: fx.Node) -> torch.Tensor:
    """The value of `target` from the graph's user inputs alone (the mask must not need weights)."""
    needed: set[str] = set()
    stack = [target]
    while stack:
        node = stack.pop()
        if node.name in needed:
            continue
        needed.add(node.name)
        stack.extend(node.all_input_nodes)
    env: dict[str, object] = {}
    for node in graph.nodes:
        if node.name not in needed:
            continue
        if node.op == "placeholder":
            if node.name not in values:
                raise ModelError(f"context parallelism: the mask of attention node {attention.name} is computed "
                                 f"from the model's weights or buffers ({node.name}); only masks made from the "
                                 f"inputs (causal, padding) can follow a split sequence; use --cp 1")
            env[node.name] = values[node.name]
            continue
        args = fx.node.map_arg(node.args, lambda n: env[n.name])
        kwargs = fx.node.map_arg(node.kwargs, lambda n: env[n.name])
        env[node.name] = node.target(*args, **kwargs)
    value = env[target.name]
    if value.dtype == torch.bool:
        return value
    hidden = value < -1e4
    if not torch.all((value == 0) | hidden):
        raise ModelError(f"context parallelism: the mask of attention node {attention.name} adds a bias to the "
                         f"scores (not only 0 or -inf), e.g. ALiBi; ring and all-to-all attention re-make only "
                         f"causal and padding masks; use --cp 1")
    return ~hidden


def _classify(node: fx.Node, allowed: torch.Tensor, is_causal: bool, padding_rows: torch.Tensor | None) -> MaskKind:
    length = allowed.shape[-1]
    tril = torch.ones(length, length, dtype=torch.bool).tril()
    index = torch.arange(length, dtype=torch.int32)
    back = index[:, None] - index[None, :]  # how far back each key lies
    windows = []  # the one causal sliding window the mask can be: the farthest key any query sees, plus one
    seen = allowed.cpu() & tril
    if seen.any():
        window = int(torch.broadcast_to(back, seen.shape)[seen].max()) + 1
        windows = [(window, tril & (back < window))] if window < length else []
    for padding in (True, False):
        if padding and padding_rows is None:
            continue
        for causal, window, expected in [(True, None, tril), (False, None, torch.ones_like(tril)),
                                         *((True, w, m) for w, m in windows)]:
            if padding:
                expected = expected & (padding_rows != 0)[:, None, None, :].cpu()
            if is_causal:
                expected = expected & tril
            shape = torch.broadcast_shapes(allowed.shape, expected.shape)
            if torch.equal(torch.broadcast_to(allowed.cpu(), shape), torch.broadcast_to(expected, shape)):
                return MaskKind(causal=causal or is_causal, padding=padding, window=window)
    raise ModelError(f"context parallelism: the mask of attention node {node.name} is neither causal nor full "
                     f"(with or without the padding of attention_mask, or a causal sliding window) on a probe of "
                     f"{length} tokens, e.g. a document mask; ring and all-to-all attention cannot re-make it "
                     f"yet; use --cp 1")


def rewrite_graph(graph: ModelGraph, kinds: list[MaskKind], *, mode: str, group: dist.ProcessGroup,
                  rank: int, cp: int) -> int:
    """Rewrite `graph` (traced on the local shard) in place; returns the number of attention nodes rewritten."""
    fx_graph = graph.graph
    nodes = attention_nodes(fx_graph)
    if len(nodes) != len(kinds):
        raise ModelError(f"context parallelism: the probe found {len(kinds)} attention nodes but the model traced "
                         f"on the shard has {len(nodes)}; its attention depends on the sequence length; use --cp 1")
    padding_input = _input_node(graph, "attention_mask")
    attend = _attention_call(ATTENTION_FUNCTIONS[mode], group)
    for node, kind in zip(nodes, kinds):
        q = node.args[0].meta["val"]
        scale = node.kwargs.get("scale")
        node.target = attend
        node.args = (node.args[0], node.args[1], node.args[2], padding_input if kind.padding else None)
        node.kwargs = {"causal": kind.causal, "scale": float(scale) if scale is not None else q.shape[-1] ** -0.5,
                       "window": kind.window}
    local = graph.example_inputs[0].shape[1]
    positions = 0
    for node in list(fx_graph.nodes):
        if node.op == "call_function" and node.target in _ARANGE and _counts_to(node, local):
            node.target = _positions_call(local * cp, rank, cp, node.meta["val"].dtype)
            node.args, node.kwargs = (), {"device": node.kwargs.get("device")}
            positions += 1
    _drop_dead(graph)
    return len(nodes)


def _counts_to(node: fx.Node, length: int) -> bool:
    """arange(length), arange(0, length) or arange(0, length, 1): positions of the local tokens."""
    args = list(node.args)
    if len(args) == 1:
        args = [0, args[0], 1]
    elif len(args) == 2:
        args = [*args, 1]
    return args == [0, length, 1]


def _input_node(graph: ModelGraph, key: str) -> fx.Node | None:
    user = [spec.arg.name for spec in graph.exported.graph_signature.input_specs if spec.kind == InputKind.USER_INPUT]
    names = dict(zip(graph.input_keys, user))
    if key not in names:
        return None
    return next(n for n in graph.graph.nodes if n.op == "placeholder" and n.name == names[key])


def _attention_call(function: Callable, group: dist.ProcessGroup) -> Callable:
    def context_parallel_attention(q, k, v, padding_mask, *, causal: bool, scale: float, window: int | None = None):
        if k.shape[1] != q.shape[1]:  # grouped-query attention: every query head its key/value head
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        valid = padding_mask != 0 if padding_mask is not None else None
        return function(q, k, v, valid, causal=causal, scale=scale, window=window, group=group)
    # attention is independent per head (dimension 1): the tensor-parallel planner splits it by heads as it
    # splits torch's attention, and each tp rank's exchange runs within its own cp group
    context_parallel_attention.per_head_attention = True
    return context_parallel_attention


def _positions_call(seq_len: int, rank: int, cp: int, dtype: torch.dtype) -> Callable:
    cache: dict = {}

    def context_parallel_positions(*, device=None):
        key = str(device)
        if key not in cache:
            cache[key] = shard_positions(seq_len, rank, cp, device=device or "cpu").to(dtype)
        return cache[key]
    return context_parallel_positions


def _drop_dead(graph: ModelGraph) -> None:
    """Remove nodes nothing uses any more (the whole-sequence masks) from the graph and its blocks."""
    removed: set[str] = set()
    for node in reversed(list(graph.graph.nodes)):
        if node.op != "call_function" or node.users:
            continue
        if node.target in _PURE_ASSERTS or not node.is_impure():
            removed.add(node.name)
            graph.graph.erase_node(node)
    for name in removed:
        graph.nodes.pop(name, None)
    for block in graph.blocks:
        block.nodes = [n for n in block.nodes if n not in removed]
