"""What the traced graph says about experts and attention, per block: the facts the search prices expert and
context parallelism from (search/dimensions.py).

Why apart from profile.py: these read the expert detector (experts/detect.py) and the attention nodes, and
profile.py stays the dense model's costs. Both are read once, with the trace, like the rest of the profile.
"""

from __future__ import annotations

import torch
from torch import nn

from ..trace import ModelGraph
from .profile import AttentionCosts, ExpertCosts

_SDPA = torch.ops.aten.scaled_dot_product_attention.default  # what context parallelism rewrites


def expert_costs(graph: ModelGraph, model: nn.Module, seq_len: int) -> ExpertCosts | None:
    """The experts' parameters, FLOPs and dispatched bytes per block; None when no layer is recognised.

    FLOPs: each token runs top_k experts of (the layer's expert parameters / experts) elements, 2 FLOPs per
    element, whatever kernels the experts module uses (a gathered einsum reads no parameter directly, so the
    traced ops cannot say). Dispatched bytes: each token's hidden state once per choice, fp32."""
    from ..experts import find_experts  # read-only use of the detector
    plan = find_experts(graph, model)
    if not plan.layers:
        return None
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters(remove_duplicate=False)}
    block_of = {p: i for i, b in enumerate(graph.blocks) for p in b.params}
    n = len(graph.blocks)
    params, flops, dispatch = [0] * n, [0.0] * n, [0.0] * n
    for layer in plan.layers:
        blocks = {block_of[p] for p in layer.params if p in block_of}
        if not blocks:
            continue
        b = min(blocks)
        elements = sum(graph.param_numel.get(p, 0) for p in layer.params)
        params[b] += elements
        flops[b] += 2.0 * seq_len * layer.top_k * elements / layer.num_experts
        hidden = shapes.get(f"{layer.router}.weight", (0, 0))[-1]
        dispatch[b] += seq_len * layer.top_k * hidden * 4.0
    return ExpertCosts(num_experts=min(layer.num_experts for layer in plan.layers),
                       top_k=max(layer.top_k for layer in plan.layers), params=tuple(params), flops=tuple(flops),
                       dispatch_bytes=tuple(dispatch))


def attention_costs(graph: ModelGraph, scale: float) -> AttentionCosts | None:
    """Per block, the attentions, their key/value and query/key/value/output bytes and FLOPs per sequence (the
    graph traced at 1 / `scale` sequences); None when the model has no scaled-dot-product attention."""
    n = len(graph.blocks)
    layers, kv, qkvo, flops = [0] * n, [0.0] * n, [0.0] * n, [0.0] * n
    heads, kv_heads, head_dims, causal, masked = [], [], [], [], []
    for node in graph.graph.nodes:
        if node.op != "call_function" or node.target is not _SDPA or node.name not in graph.nodes:
            continue
        tensors = [a.meta.get("val") for a in node.args[:3] if hasattr(a, "meta")]
        if len(tensors) < 3 or any(t is None or t.dim() != 4 for t in tensors):
            continue
        q, k, v = tensors
        cost = graph.nodes[node.name]
        layers[cost.block] += 1
        kv[cost.block] += (k.numel() * k.element_size() + v.numel() * v.element_size()) * scale
        repeat = q.shape[1] // k.shape[1] if k.shape[1] and q.shape[1] % k.shape[1] == 0 else 1
        qkvo[cost.block] += (2 * q.numel() * q.element_size() + repeat * (k.numel() * k.element_size()  # all-to-all
                             + v.numel() * v.element_size())) * scale  # swaps keys/values repeated to the query heads
        flops[cost.block] += cost.flops * scale
        heads.append(q.shape[1])
        kv_heads.append(k.shape[1])
        head_dims.append(q.shape[-1])
        mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        masked.append(mask is not None)
        causal.append(mask is not None or bool(node.kwargs.get("is_causal", node.args[5] if len(node.args) > 5
                                                                else False)))
    if not heads:
        return None
    return AttentionCosts(heads=min(heads), kv_heads=min(kv_heads), layers=tuple(layers), kv_bytes=tuple(kv),
                          qkv_out_bytes=tuple(qkvo), flops=tuple(flops), head_dim=head_dims[0], causal=causal[0],
                          masked=masked[0], head_counts=tuple(sorted(set(heads))))
