"""The zero-bubble backward split (pipeline/split_backward.py): I then W gives the fused backward's
gradients, and W runs none of the activation chain's nodes except the ones that read weights."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autopar.pipeline.split_backward import backward_input, backward_weight
from autopar.pipeline.split_plan import SplitPlanCache


class _Scale(torch.autograd.Function):
    """x * s as a custom autograd.Function: a boundary W cannot compute alone (its node is Python)."""

    @staticmethod
    def forward(ctx, x, s):
        ctx.save_for_backward(x, s)
        return x * s

    @staticmethod
    def backward(ctx, g):
        x, s = ctx.saved_tensors
        return g * s, (g * x).sum_to_size(s.shape)


class Block(nn.Module):
    """A pre-norm attention + MLP block (optionally one norm read twice) and an output made without the input."""

    def __init__(self, d: int = 16, shared_norm: bool = False, custom: bool = False):
        super().__init__()
        self.custom = custom
        self.norm, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        if shared_norm:
            self.norm2 = self.norm
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.scale = nn.Parameter(torch.ones(d))

    def forward(self, x):
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        x = x + self.proj(torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v)
        x = x + self.down(torch.nn.functional.gelu(self.up(self.norm2(x))))
        scaled = _Scale.apply(x, self.scale) if self.custom else x * self.scale
        return scaled, self.scale.exp().sum() * self.proj.bias  # second output: weights only


def _graph(roots):
    nodes, queue = set(), [r for r in roots if r is not None]
    while queue:
        node = queue.pop()
        if node not in nodes:
            nodes.add(node)
            queue += [n for n, _ in node.next_functions if n is not None]
    return nodes


@pytest.mark.parametrize("input_needs_grad,shared_norm,custom",
                         [(True, False, False), (False, False, False), (True, True, False), (True, False, True)])
def test_input_then_weight_equals_one_backward_without_rerunning_the_chain(input_needs_grad, shared_norm, custom):
    """False input_needs_grad: a first stage (token ids). shared_norm: a weight read at two places.
    custom: `x * scale` as a custom autograd.Function, the one boundary kind W hands back to autograd."""
    torch.manual_seed(0)
    block = Block(shared_norm=shared_norm, custom=custom)
    x0 = torch.randn(2, 5, 16)
    grads = [torch.randn(2, 5, 16), torch.randn(16)]
    params = list(block.parameters())

    x = x0.clone().requires_grad_(input_needs_grad)
    torch.autograd.backward(block(x), grads)
    fused = [x.grad, *(p.grad.clone() for p in params)] if input_needs_grad else [p.grad.clone() for p in params]

    for p in params:
        p.grad = None
    x = x0.clone().requires_grad_(input_needs_grad)
    outs = block(x)
    inputs = [x] if input_needs_grad else []
    got, work = backward_input(list(outs), grads, inputs, params)
    assert all(p.grad is None for p in params)  # I leaves the weights alone
    assert (work.held_bytes > 0) == input_needs_grad  # gradients kept at the weight-reading nodes
    assert bool(work.boundaries) == input_needs_grad  # a first stage skips the walk: W is its whole backward
    nodes = _graph([o.grad_fn for o in outs])
    chain = {n for n in nodes if input_needs_grad and x.view_as(x).grad_fn.next_functions[0][0] in _graph([n])}
    boundaries = set(work.boundaries)
    ran = []
    hooks = [n.register_prehook(lambda g, n=n: ran.append(n)) for n in nodes]
    backward_weight(work)
    for h in hooks:
        h.remove()
    split = [*got, *(p.grad for p in params)]
    # the same ops on the same values; only the order in which a weight's contributions are summed
    # may differ (a shared norm's two uses), hence a tolerance rather than bitwise
    for a, b in zip(fused, split):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)
    # every built-in boundary gets its weight half computed by W itself (matmul and layer norm from
    # saved tensors, `x * scale` by calling its node), so no autograd node of the chain runs in W;
    # a custom Function's node (the fallback) is the only one run through autograd
    rerun = [type(n).__name__ for n in ran if n in chain and n not in boundaries]
    assert not rerun, f"W ran activation-chain nodes again: {rerun}"  # a shared norm included: both uses direct
    if input_needs_grad:
        assert len(boundaries) < len(chain)
        assert {type(n).__name__ for n in ran if n in chain} == ({"_ScaleBackward"} if custom else set())

def test_direct_weight_halves_match_autograd_and_fire_accumulate_hooks():
    """W's own matmul (addmm with bias, mm without) and layer-norm weight gradients equal autograd's and
    go through AccumulateGrad, so the grad-sync hooks (post-accumulate)
    fire once per parameter as in a fused backward."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 12), nn.LayerNorm(12), nn.Linear(12, 6, bias=False))
    x0, grad = torch.randn(3, 4, 8), torch.randn(3, 4, 6)
    params = list(model.parameters())
    x = x0.clone().requires_grad_()
    model(x).backward(grad)
    fused = [x.grad, *(p.grad.clone() for p in params)]
    for p in params:
        p.grad = None
    fired = []
    hooks = [p.register_post_accumulate_grad_hook(lambda p: fired.append(p)) for p in params]
    x = x0.clone().requires_grad_()
    out = model(x)
    got, work = backward_input([out], [grad], [x], params)
    kinds = {type(b).__name__ for b in work.boundaries}
    assert kinds == {"AddmmBackward0", "MmBackward0", "NativeLayerNormBackward0"}  # all three direct rules
    assert not fired
    backward_weight(work)
    for h in hooks:
        h.remove()
    assert sorted(map(id, fired)) == sorted(map(id, params))  # each parameter's hook fired exactly once
    for a, b in zip(fused, [*got, *(p.grad for p in params)]):
        # the same kernels on the same operands, but the weight matmul may be issued transposed
        # (g^T x)^T against autograd's choice, so a tolerance rather than bitwise
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)


def test_plan_cache_serves_only_graphs_of_the_same_structure():
    """The boundary analysis is kept per graph structure: a repeat is served from the cache; the same ops
    wired to the other weights (two linears swapped: a stale plan would swap their gradients), a weight
    left unused or another op are analysed afresh. Every run's gradients equal a fused backward's."""
    torch.manual_seed(0)
    a, b, norm = nn.Linear(8, 8), nn.Linear(8, 8), nn.LayerNorm(8)
    params = [*a.parameters(), *b.parameters(), *norm.parameters()]
    cache = SplitPlanCache()
    x0, grad = torch.randn(3, 8), torch.randn(3, 8)
    runs = [(lambda x: b(a(norm(x))), 0), (lambda x: b(a(norm(x))), 1), (lambda x: a(b(norm(x))), 1),
            (lambda x: a(norm(x)), 1), (lambda x: b(a(norm(x)) * 2), 1), (lambda x: a(b(norm(x))), 2)]
    for forward, hits in runs:
        for p in params:
            p.grad = None
        x = x0.clone().requires_grad_()
        forward(x).backward(grad)
        fused = [x.grad, *(None if p.grad is None else p.grad.clone() for p in params)]
        for p in params:
            p.grad = None
        x = x0.clone().requires_grad_()
        got, work = backward_input([forward(x)], [grad], [x], params, cache)
        backward_weight(work)
        assert cache.hits == hits
        for want, have in zip(fused, [*got, *(p.grad for p in params)]):
            assert (want is None) == (have is None)
            assert want is None or torch.allclose(want, have, rtol=1e-5, atol=1e-7)
    assert cache.misses == 4 and len(cache) == 4


def test_changing_structure_between_micro_batches_with_an_input_that_needs_no_gradient():
    """Micro-batches whose graph changes shape back and forth (a data-dependent branch adds a matmul and a
    bias add W must call as a node) share one cache: each shape is analysed once, the repeats are served,
    and every run equals a fused backward. The second input (a mask) needs no gradient, so backward_input
    answers None for it beside the first's gradient. W lets the kept gradients go (held_bytes 0 after)."""
    torch.manual_seed(0)
    norm, a, b = nn.LayerNorm(8), nn.Linear(8, 8), nn.Linear(8, 8, bias=False)
    extra = nn.Parameter(torch.randn(8))
    params = [*norm.parameters(), *a.parameters(), *b.parameters(), extra]

    def forward(x, mask, long):
        h = a(norm(x)) * mask
        if long:
            h = b(h) + extra  # another matmul and a bias add (a boundary W runs by calling its node)
        return h

    cache = SplitPlanCache()
    mask = (torch.rand(3, 8) > 0.3).float()
    for step, long in enumerate([False, True, False, True, True]):
        x0, grad = torch.randn(3, 8), torch.randn(3, 8)
        for p in params:
            p.grad = None
        x = x0.clone().requires_grad_()
        forward(x, mask, long).backward(grad)
        fused = [x.grad, *(None if p.grad is None else p.grad.clone() for p in params)]
        for p in params:
            p.grad = None
        x = x0.clone().requires_grad_()
        got, work = backward_input([forward(x, mask, long)], [grad], [x, mask], params, cache)
        assert got[1] is None and work.held_bytes > 0
        kinds = {type(n).__name__ for n in work.boundaries}
        assert kinds == ({"NativeLayerNormBackward0", "AddmmBackward0", "MmBackward0", "AddBackward0"} if long
                         else {"NativeLayerNormBackward0", "AddmmBackward0"})
        backward_weight(work)
        assert work.held_bytes == 0
        for want, have in zip(fused, [got[0], *(p.grad for p in params)]):
            assert (want is None) == (have is None)
            assert want is None or torch.allclose(want, have, rtol=1e-5, atol=1e-7)
    assert (cache.misses, cache.hits) == (2, 3)


def test_a_gradient_of_the_wrong_shape_is_refused_before_the_engine_runs():
    layer = nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"gradient of shape \(2, 3\) for an output of shape \(2, 4\)"):
        backward_input([layer(x)], [torch.randn(2, 3)], [x], list(layer.parameters()))


def test_a_first_stage_weight_pass_frees_the_graph_as_a_full_backward_does():
    """W is the graph's last use: it frees each node's saved tensors once run, so a first stage's W (there, the
    whole backward) peaks like a fused backward instead of holding every activation to its end. Afterwards the
    graph's saved tensors are gone: another backward through it is refused."""
    torch.manual_seed(0)
    model = Block()
    x = torch.randn(2, 5, 16)  # token embeddings' stand-in: no gradient wanted, as at a first stage
    out, _ = model(x)
    _, work = backward_input([out], [torch.randn_like(out)], [x], list(model.parameters()))
    backward_weight(work)
    assert model.up.weight.grad is not None and model.qkv.weight.grad is not None
    with pytest.raises(RuntimeError, match="second time|freed"):
        torch.autograd.grad(out, [model.up.weight], torch.ones_like(out))
