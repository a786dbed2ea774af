"""What crosses a pipeline cut, as the memory model prices it: batch-free tensors (a rotary table, a mask) once per
micro-batch whatever its size, gradients for floating-point tensors only, and the fp32 residual stream under bf16
autocast at full width; and, under tp, what of a block's activations and transient one rank holds. By hand, on traced
toys and on hand-made profiles (no ranks)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autopar.search.cluster import Cluster, Link
from autopar.search.cost import Candidate, StepModel
from autopar.search.memory import stage_units
from autopar.search.profile import Crossing, ModelProfile, TPProfile, profile_graph
from autopar.trace import trace

WIDTH, SEQ = 16, 8


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x, table, mask):
        return x + self.fc(x * table) * mask[:, :1].float()


class _RotaryToy(nn.Module):
    """Each layer reads a table computed from a buffer and a boolean mask: both cross every cut, neither has a
    batch dimension, and the mask carries no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, WIDTH)
        self.register_buffer("angles", torch.randn(SEQ, WIDTH))
        self.layers = nn.ModuleList(_Layer() for _ in range(2))
        self.head = nn.Linear(WIDTH, 32)

    def forward(self, ids):
        x, t = self.emb(ids), ids.shape[1]
        table, mask = self.angles[:t].cos(), torch.ones(t, t, dtype=torch.bool).tril()
        for layer in self.layers:
            x = layer(x, table, mask)
        return self.head(x)


def test_profile_splits_a_cut_into_batch_bytes_fixed_bytes_and_gradient_bytes():
    profile = profile_graph(trace(_RotaryToy(), (torch.zeros(1, SEQ, dtype=torch.long),)), name="toy", seq_len=SEQ)
    hidden, table, mask = SEQ * WIDTH * 4, SEQ * WIDTH * 4, SEQ * SEQ  # fp32 per sequence; fp32 and bool, fixed
    assert profile.crossings[0] == Crossing(per_seq=hidden, fixed=table + mask, grad_per_seq=hidden, grad_fixed=table)
    assert profile.crossings[-1] == Crossing(per_seq=hidden, fixed=0.0, grad_per_seq=hidden, grad_fixed=0.0)
    assert profile.boundary_bytes[0] == hidden + table + mask  # the timing's figure is unchanged
    deeper = profile.with_layers(4)
    assert len(deeper.crossings) == deeper.num_blocks - 1 and deeper.crossings[2] == profile.crossings[1]


def test_stage_units_price_the_fixed_part_once_and_gradients_of_floats_only():
    stage_in, stage_out = Crossing(100.0, 40.0, 100.0, 30.0), Crossing(200.0, 10.0, 200.0, 0.0)
    units = stage_units(param_elements=0, saved=[0.0], inputs=[140.0], output_bytes=210.0, micro_batch_size=4,
                        recompute_blocks=0, whole_stage=False, activation_scale=0.5, optimizer="sgd", dp=1,
                        headroom=1.0, transient_bytes=0.0, stage_input=stage_in, stage_output=stage_out,
                        boundary_scale=1.0)
    _, stashed, _, sent_out, sent_grad, grad_in, _ = units.per_count
    assert (stashed, sent_out, sent_grad, grad_in) == (440.0, 810.0, 430.0, 800.0)
    old = stage_units(param_elements=0, saved=[0.0], inputs=[140.0], output_bytes=210.0, micro_batch_size=4,
                      recompute_blocks=0, whole_stage=False, activation_scale=0.5, optimizer="sgd", dp=1,
                      headroom=1.0, transient_bytes=0.0)
    assert old.per_count[1] == 140.0 * 4 * 0.5  # without crossings: every byte per sequence, at activation width


def _profile(crossings: tuple) -> ModelProfile:
    n = 4
    flops, saved, params = (1e5,) * n, (2e4,) * n, (10_000,) * n
    return ModelProfile(name="toy", seq_len=32, block_names=tuple(f"b{i}" for i in range(n)), flops=flops,
                        saved_bytes=saved, params=params, boundary_bytes=(8e3 + 2e3,) * (n - 1), shared_params=0,
                        crossings=crossings, tp={1: TPProfile(1, flops, params, saved, (0.0,) * n, (0,) * n)})


@pytest.mark.parametrize("dtype, width", [("fp32", 1.0), ("bf16-autocast", 1.0), ("bf16", 0.5)])
def test_step_model_stashes_the_stage_input_at_the_residual_stream_width(dtype, width):
    """pp=2, one micro-batch of 4: the second stage stashes its input, 8e3 per sequence and 2e3 whatever the batch.
    Under bf16 autocast the residual stream crossing the cut stays fp32 (the activations inside halve)."""
    cluster = Cluster(name="toy", source="test", num_devices=2, devices_per_node=2, memory_per_device_gb=1.0,
                      flops_per_s={"fp32": 1e9, "bf16": 2e9}, compute_efficiency=1.0,
                      memory_bandwidth_bytes_per_s=1e10, intra_node=Link(1e-5, 1e9), inter_node=Link(1e-4, 1e8),
                      per_action_overhead_s=1e-4)
    profile = _profile((Crossing(8e3, 2e3, 8e3, 0.0),) * 3)
    # without clipping: its float64 copy of a bf16 bucket (search/update_memory.py) would be this toy's peak
    e = StepModel(profile, cluster, global_batch_size=4, dtype=dtype, clip_gradients=False).evaluate(
        Candidate(dp=1, tp=1, pp=2, micro_batch_size=4, num_microbatches=1, schedule="1f1b", partition="uniform"))
    assert e.memory_per_stage[1].stashed_inputs == pytest.approx((8e3 * 4 + 2e3) * width)
    # the first stage keeps its one sent output to the step's end and receives its gradient (floats only)
    assert e.memory_per_stage[0].buffers == pytest.approx((8e3 * 4 + 2e3 + 8e3 * 4) * width)


@pytest.mark.parametrize("saved, during_backward", [
    (300.0, 4000.0),  # small activations: the backward's end rules, the whole gradient (1000 fp32) alone
    (10_000.0, 10_100.0),  # large ones: its start rules, activations and one block's transient; no gradient yet
])
def test_zero2_backward_peaks_at_its_start_or_its_end_not_both(saved, during_backward):
    """ZeRO-2's whole gradient is alive at the end of a backward, when that micro-batch's activations are gone
    (measured on hf:llama dp=4: pricing both at once read +14% over the peak)."""
    units = stage_units(param_elements=1000, saved=[saved], inputs=[0.0], output_bytes=0.0, micro_batch_size=1,
                        recompute_blocks=0, whole_stage=False, activation_scale=1.0, optimizer="sgd", dp=4,
                        headroom=1.0, transient_bytes=100.0, zero=2)
    backward = units.at((1, 1, 0, 0, 0, 0, 1))
    assert backward.activations + backward.transient == pytest.approx(during_backward)
    forward = units.at((1, 1, 0, 0, 0, 0, 0))  # no backward running: neither transient nor the gradient
    assert forward.activations + forward.transient == pytest.approx(saved)


def _measured_tp_profile() -> ModelProfile:
    """Four one-block stages' worth of blocks, measured at tp = 1 (weight gradients 4e4 whatever the batch, 3e4 more
    per sequence), whose saved bytes and parameters tp = 2 halves; 8e3 per sequence crosses each cut, either way."""
    from autopar.search.measure_profile import BlockCosts
    n, flops = 4, (1e5,) * 4
    block = BlockCosts(forward_fixed_s=1e-3, forward_per_seq_s=1e-3, backward_fixed_s=2e-3, backward_per_seq_s=2e-3,
                       saved_per_seq=2e4, transient_fixed=4e4, transient_per_seq=3e4)
    tps = {t: TPProfile(t, flops, (10_000 // t,) * n, (2e4 / t,) * n, (0.0,) * n, (0,) * n) for t in (1, 2)}
    return ModelProfile(name="toy", seq_len=32, block_names=tuple(f"b{i}" for i in range(n)), flops=flops,
                        saved_bytes=(2e4,) * n, params=(10_000,) * n, boundary_bytes=(8e3,) * (n - 1),
                        shared_params=0, crossings=(Crossing(8e3, 0.0, 8e3, 0.0),) * (n - 1), tp=tps,
                        measured=(block,) * n)


@pytest.mark.parametrize("tp, middle, last", [
    # tp = 1 as measured: 4e4 + 2 x 3e4; the middle stage's sent output and its gradient in are buffers
    (1, 1e5 - 2 * 2 * 8e3, 1e5),
    # tp = 2: the weight gradients halve (2e4) like the parameters; the input gradient (2 x 8e3) stays whole, and so do
    # the output and its gradient (2 x 2 x 8e3, the middle stage's buffers); the rest (6e4 less those) halves
    (2, (6e4 - 2 * 8e3 - 2 * 2 * 8e3) / 2 + 2e4 + 2 * 8e3, (6e4 - 2 * 8e3) / 2 + 2e4 + 2 * 8e3),
])
def test_a_tp_ranks_transient_keeps_the_residual_stream_whole_and_splits_the_weight_gradients(tp, middle, last):
    """Measured at tp = 1, a block's backward holds its input gradient and its output with that output's gradient
    (the residual stream: whole on every tp rank without --sp) and its weight gradients before they are added into
    the buffers (split like the parameters). Scaling all of it like the saved activations priced gpt-small's last
    stage at dp=1 tp=2 pp=4 micro-batch 8 at 6.4 MiB, measured 7.2 (live_memory, benchmarks/strategy_user_jobs.py)."""
    cluster = Cluster(name="toy", source="test", num_devices=8, devices_per_node=8, memory_per_device_gb=1.0,
                      flops_per_s={"fp32": 1e9}, compute_efficiency=1.0, memory_bandwidth_bytes_per_s=1e10,
                      intra_node=Link(1e-5, 1e9), inter_node=Link(1e-4, 1e8), per_action_overhead_s=1e-4)
    e = StepModel(_measured_tp_profile(), cluster, global_batch_size=2, optimizer="sgd", clip_gradients=False).evaluate(
        Candidate(dp=1, tp=tp, pp=4, micro_batch_size=2, num_microbatches=1, schedule="1f1b", partition="uniform"))
    assert e.bounds == (0, 1, 2, 3, 4)
    assert [s.transient for s in e.memory_per_stage[1:]] == pytest.approx([middle, middle, last])


class _MlpToy(nn.Module):
    """A column layer and its row partner around a GELU: what tp splits (fc1's output, the GELU's) and what it does
    not (the norm, fc2's summed output, the residual)."""

    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, WIDTH)
        self.layers = nn.ModuleList(nn.ModuleDict({"ln": nn.LayerNorm(WIDTH), "fc1": nn.Linear(WIDTH, hidden),
                                                   "fc2": nn.Linear(hidden, WIDTH)}) for _ in range(2))
        self.head = nn.Linear(WIDTH, 32)

    def forward(self, ids):
        x = self.emb(ids)
        for layer in self.layers:
            x = x + layer["fc2"](nn.functional.gelu(layer["fc1"](layer["ln"](x))))
        return self.head(x)


def test_a_tp_profile_splits_the_activations_the_plan_splits():
    """A layer's traced bytes on one tp rank: fc1's and the GELU's outputs (the plan's sharded values) / tp, the
    rest whole; not Megatron's 10 + 24/tp of 34 units, which a SwiGLU or small-width block does not follow (it
    priced hf:gpt2 at dp=1 tp=4 17-20% over what each rank held)."""
    hidden = 64
    profile = profile_graph(trace(_MlpToy(hidden), (torch.zeros(1, SEQ, dtype=torch.long),)), name="toy",
                            seq_len=SEQ, tp_degrees=(1, 2, 4))
    split = 2 * SEQ * hidden * 4  # fc1's and the GELU's fp32 outputs, per sequence
    for tp in (2, 4):
        assert profile.at_tp(tp).saved_bytes[1] == pytest.approx(profile.saved_bytes[1] - split * (1 - 1 / tp))


class _Attention(nn.Module):
    """Grouped-query attention as Hugging Face's Llama writes it: each key/value head repeated for its query heads
    by an expand and a reshape (a copy)."""

    def __init__(self, heads: int, kv_heads: int, dim: int = 4) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.dim = heads, kv_heads, dim
        self.q, self.o = nn.Linear(WIDTH, heads * dim), nn.Linear(heads * dim, WIDTH)
        self.k, self.v = nn.Linear(WIDTH, kv_heads * dim), nn.Linear(WIDTH, kv_heads * dim)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.dim).transpose(1, 2)
        k, v = (p(x).view(b, s, self.kv_heads, self.dim).transpose(1, 2)[:, :, None]
                .expand(b, self.kv_heads, self.heads // self.kv_heads, s, self.dim)
                .reshape(b, self.heads, s, self.dim) for p in (self.k, self.v))
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(out.transpose(1, 2).reshape(b, s, self.heads * self.dim))


class _GqaToy(nn.Module):
    def __init__(self, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(32, WIDTH), nn.Linear(WIDTH, 32)
        self.layers = nn.ModuleList([_Attention(heads, kv_heads)])

    def forward(self, ids):
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


@pytest.mark.parametrize("heads, kv_heads, views", [(4, 2, 2), (8, 4, 0)])
def test_repeated_key_value_heads_are_views_on_a_rank_left_one_of_them(heads, kv_heads, views, monkeypatch):
    """At tp = 2 with 2 key/value heads a rank has one left, and its repeating reshape is a view that holds nothing
    (measured on hf:llama tp=2: no repeated keys or values alive at the peak); with 4, two per rank, it copies."""
    from autopar.search import profile as profiling
    from autopar.tensor_parallel import plan_tensor_parallel
    graph = trace(_GqaToy(heads, kv_heads), (torch.zeros(1, SEQ, dtype=torch.long),))
    plan = plan_tensor_parallel(graph, 2)
    repeats = [n for n in graph.exported.graph.nodes if n.target is torch.ops.aten.reshape.default
               and n.args[0].target is torch.ops.aten.expand.default]
    assert len(repeats) == 2  # keys and values
    assert sum(profiling._local_view(n, plan.value_shards, 2) for n in repeats) == views
    held = profile_graph(graph, name="toy", seq_len=SEQ, tp_degrees=(1, 2)).at_tp(2).saved_bytes[1]
    monkeypatch.setattr(profiling, "_local_view", lambda *args: False)
    copied = profile_graph(graph, name="toy", seq_len=SEQ, tp_degrees=(1, 2)).at_tp(2).saved_bytes[1]
    assert copied - held == pytest.approx(views * SEQ * heads * 4 * 4 / 2)  # each a rank's half of fp32 q-sized
