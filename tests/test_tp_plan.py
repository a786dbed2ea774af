"""The tensor-parallel plan is found in the traced graph for every model family, without name lists.

Pure graph analysis on meta models (no processes): which layers become column / row /
vocabulary-parallel, how fused and grouped-query projections are segmented, which static
sizes are edited, what stays replicated and why, and the clear errors for a tp that does
not divide heads, kv-heads or the vocabulary. That the rewritten graphs compute the same
numbers is tests/test_tp_equivalence.py's job.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autopar.cli import main as cli_main
from autopar.errors import ConfigError
from autopar.models import build_model
from autopar.tensor_parallel import plan_tensor_parallel
from autopar.trace import trace


def plan_for(name: str, tp: int, **args):
    model, _ = build_model(name, args, vocab_size=320, device="meta")
    graph = trace(model, (torch.zeros(2, 16, dtype=torch.long, device="meta"),))
    return plan_tensor_parallel(graph, tp)


def roles(plan) -> dict[str, str]:
    return {d.module: d.role for d in plan.decisions}


def test_reference_gpt_attention_and_mlp_pairs():
    plan = plan_for("gpt-tiny", 2)
    r = roles(plan)
    for layer in (0, 1):
        for proj in ("q_proj", "k_proj", "v_proj"):
            assert r[f"blocks.{layer}.attn.{proj}"] == "column"
        assert r[f"blocks.{layer}.attn.out_proj"] == "row"
        assert r[f"blocks.{layer}.mlp.fc_in"] == "column"
        assert r[f"blocks.{layer}.mlp.fc_out"] == "row"
        assert f"blocks.{layer}.ln_1.weight" in plan.replicated_params  # norms stay whole
        assert plan.params[f"blocks.{layer}.attn.out_proj.weight"].dim == 1  # row: input features
        assert f"blocks.{layer}.attn.out_proj.bias" not in plan.params  # added once, after the all-reduce
    assert r["tok_emb"] == "vocab-embedding" and r["lm_head"] == "vocab-head"
    assert plan.vocab_output and plan.vocab_size == 320
    assert plan.params["tok_emb.weight"].role == "vocab"  # the tied head and embedding share one split


def test_gpt2_fused_qkv_is_split_per_segment():
    plan = plan_for("hf:gpt2", 2)
    r = roles(plan)
    assert r["transformer.h.0.attn.c_attn"] == "column" and r["transformer.h.0.attn.c_proj"] == "row"
    assert r["transformer.h.0.mlp.c_fc"] == "column" and r["transformer.h.0.mlp.c_proj"] == "row"
    shard = plan.params["transformer.h.0.attn.c_attn.weight"]
    assert shard.dim == 1 and shard.segments == (64, 64, 64)  # Conv1D keeps weights as [in, out]
    assert shard.local_slices(1, 2) == [(32, 32), (96, 32), (160, 32)]  # its part of q, of k and of v
    edits = {name: e[1] for name, e in plan.arg_edits.items()}
    assert [2, 16, 96] in edits.values() and 32 in edits.values()  # the view and the split sizes


def test_llama_grouped_query_attention_and_swiglu():
    plan = plan_for("hf:llama", 2)
    r = roles(plan)
    for proj in ("q_proj", "k_proj", "v_proj"):
        assert r[f"model.layers.0.self_attn.{proj}"] == "column"
    assert r["model.layers.0.self_attn.o_proj"] == "row"
    assert r["model.layers.0.mlp.gate_proj"] == "column" and r["model.layers.0.mlp.up_proj"] == "column"
    assert r["model.layers.0.mlp.down_proj"] == "row"
    assert plan.params["model.layers.0.self_attn.k_proj.weight"].segments == (32,)  # 2 kv heads of 16
    # repeat_kv: expand [b, kv, rep, s, d] and its reshape to heads follow the split
    assert [2, 1, 2, 16, 16] in [e[1] for e in plan.arg_edits.values()]
    assert [2, 2, 16, 16] in [e[1] for e in plan.arg_edits.values()]
    assert "model.norm.weight" in plan.replicated_params


def test_bert_head_with_layernorm_stays_replicated_and_says_why():
    plan = plan_for("hf:bert", 2)
    r = roles(plan)
    assert r["bert.encoder.layer.0.attention.self.query"] == "column"
    assert r["bert.encoder.layer.0.attention.output.dense"] == "row"
    assert r["bert.encoder.layer.0.intermediate.dense"] == "column"
    assert r["bert.encoder.layer.0.output.dense"] == "row"
    transform = next(d for d in plan.decisions if d.module == "cls.predictions.transform.dense")
    assert transform.role == "replicated" and "normalisation over the sharded dimension" in transform.detail
    assert r["cls.predictions.decoder"] == "vocab-head"  # tied to the word embeddings, split with them
    assert r["bert.embeddings.word_embeddings"] == "vocab-embedding"


class CumsumLayer(nn.Module):
    """A pattern the planner does not know: a cumulative sum over the features between two linears."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return x + self.down(torch.cumsum(self.up(x), dim=-1))


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([CumsumLayer(), CumsumLayer()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_unknown_pattern_stays_replicated_and_the_plan_says_why():
    graph = trace(Stack().to("meta"), (torch.zeros(2, 4, 8, device="meta"),))
    plan = plan_tensor_parallel(graph, 2)
    assert not plan.params and not plan.vocab_output
    up = next(d for d in plan.decisions if d.module == "layers.0.up")
    assert up.role == "replicated" and "does not know" in up.detail and "cumsum" in up.detail
    assert "replicated" in plan.table()


@pytest.mark.parametrize("name,tp,args,message", [
    ("gpt-tiny", 4, {"n_head": 2}, "tp=4 does not divide the 2 heads"),
    ("hf:llama", 4, {}, "tp=4 does not divide the 2 heads"),  # 4 query heads, but only 2 kv heads
    ("gpt-tiny", 2, {"vocab_size": 321}, "pad the vocabulary to a multiple of 2 (e.g. vocab_size=322"),
])
def test_indivisible_degrees_are_clear_errors(name, tp, args, message):
    vocab = args.pop("vocab_size", 320)
    model, _ = build_model(name, args, vocab_size=vocab, device="meta")
    graph = trace(model, (torch.zeros(2, 16, dtype=torch.long, device="meta"),))
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        plan_tensor_parallel(graph, tp)


def test_plan_command_shows_the_split(capsys):
    assert cli_main(["plan", "--model", "gpt-tiny", "--pp", "1", "--tp", "2", "--seq-len", "16",
                     "--micro-batch-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "tensor parallelism: tp=2" in out
    assert "column" in out and "row" in out and "vocab-embedding" in out and "whole on every rank" in out


# ---------------------------------------------------------------------- the rule table, one rule at a time

from torch import fx  # noqa: E402

from autopar.tensor_parallel import rules  # noqa: E402
from autopar.tensor_parallel.rules import RULES, PlanFailure, RuleContext, Shard, rule_for  # noqa: E402

aten = torch.ops.aten


def hand_built(op, in_shape, args, out_shapes):
    """A graph of one op on one meta input, with the shapes an export would record."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(in_shape, device="meta")
    node = graph.call_function(op, (x, *args))
    vals = [torch.empty(s, device="meta") for s in out_shapes]
    node.meta["val"] = vals[0] if len(vals) == 1 else vals
    return x, node


def test_every_rule_is_in_the_table_and_pointwise_ops_fall_back_to_elementwise():
    assert RULES[aten.slice.Tensor] is rules.slice_ and RULES[aten.chunk.default] is rules.chunk
    assert RULES[aten.scaled_dot_product_attention.default] is rules.attention
    assert rule_for(aten.silu.default) is rules.elementwise  # pointwise tag, no entry of its own
    assert rule_for(aten.cumsum.default) is None  # unknown: the planner keeps its layers whole


def test_slice_rule_takes_one_fused_segment_and_edits_its_offsets_to_local_ones():
    fused = Shard(2, (64, 32, 32), frozenset({"qkv"}))
    x, k = hand_built(aten.slice.Tensor, (2, 16, 128), (2, 64, 96), [(2, 16, 32)])
    ctx = RuleContext(tp=2, state={x: fused})
    assert rules.slice_(ctx, k, [(x, fused)]) == Shard(2, (32,), fused.origins)
    assert ctx.edits[k.name] == {1: 2, 2: 32, 3: 48}  # rank-local q|k|v is 32+16+16
    x, v = hand_built(aten.slice.Tensor, (2, 16, 128), (-1, 96, 2**63 - 1), [(2, 16, 32)])
    ctx = RuleContext(tp=2, state={x: fused})
    assert rules.slice_(ctx, v, [(x, fused)]).segments == (32,) and ctx.edits[v.name] == {1: 2, 2: 48, 3: 64}
    x, across = hand_built(aten.slice.Tensor, (2, 16, 128), (2, 32, 96), [(2, 16, 64)])
    with pytest.raises(PlanFailure, match=r"slicing \[32:96\] along the sharded dimension") as failure:
        rules.slice_(RuleContext(tp=2, state={x: fused}), across, [(x, fused)])
    assert failure.value.origins == {"qkv"}  # the column layer to put back


def test_chunk_rule_follows_equal_segments_and_refuses_others():
    gate_up = Shard(2, (128, 128), frozenset({"gate_up"}))
    x, node = hand_built(aten.chunk.default, (2, 16, 256), (2, -1), [(2, 16, 128), (2, 16, 128)])
    assert rules.chunk(RuleContext(tp=2), node, [(x, gate_up)]) == [Shard(2, (128,), gate_up.origins)] * 2
    whole = Shard(2, (256,), frozenset({"fc"}))
    with pytest.raises(PlanFailure, match=r"chunk\(2\) of the sharded dimension"):
        rules.chunk(RuleContext(tp=2), node, [(x, whole)])
    x, other = hand_built(aten.chunk.default, (2, 16, 256), (2, 1), [(2, 8, 256), (2, 8, 256)])
    assert rules.chunk(RuleContext(tp=2), other, [(x, whole)]) == [whole, whole]  # another dim: untouched


def test_view_rule_divides_the_heads_or_says_tp_does_not_divide_them():
    shard = Shard(2, (64,), frozenset({"q"}))
    x, node = hand_built(aten.view.default, (2, 16, 64), ([2, 16, 4, 16],), [(2, 16, 4, 16)])
    ctx = RuleContext(tp=2)
    assert rules.view(ctx, node, [(x, shard)]).dim == 2 and ctx.edits[node.name] == {1: [2, 16, 2, 16]}
    with pytest.raises(ConfigError, match="tp=8 does not divide the 4 heads"):
        rules.view(RuleContext(tp=8), node, [(x, shard)])


# ---------------------------------------------------------------------- Hugging Face families as they come

HF_TINY = {"phi3": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=128, pad_token_id=0, bos_token_id=1, eos_token_id=2),
           "bloom": dict(hidden_size=64, n_layer=2, n_head=4),
           "gpt_bigcode": dict(n_embd=64, n_layer=2, n_head=4),
           "olmo2": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)}


def hf_model(family: str, **overrides):
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.for_model(family, vocab_size=256, use_cache=False, **{**HF_TINY[family], **overrides})
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def hf_plan(family: str, tp: int, **overrides):
    graph = trace(hf_model(family, **overrides), (torch.zeros(2, 16, dtype=torch.long, device="meta"),))
    return plan_tensor_parallel(graph, tp)


def test_phi3_fused_qkv_and_gate_up_are_column_layers_split_per_segment():
    plan = hf_plan("phi3", 2)
    r = roles(plan)
    for layer in (0, 1):
        assert r[f"model.layers.{layer}.self_attn.qkv_proj"] == "column"
        assert r[f"model.layers.{layer}.self_attn.o_proj"] == "row"
        assert r[f"model.layers.{layer}.mlp.gate_up_proj"] == "column"
        assert r[f"model.layers.{layer}.mlp.down_proj"] == "row"
    qkv = plan.params["model.layers.0.self_attn.qkv_proj.weight"]
    assert qkv.dim == 0 and qkv.segments == (64, 32, 32)  # 4 query heads, 2 kv heads of 16, cut by slices
    assert qkv.local_slices(1, 2) == [(32, 32), (80, 16), (112, 16)]  # its heads of q, of k and of v
    gate_up = plan.params["model.layers.0.mlp.gate_up_proj.weight"]
    assert gate_up.segments == (128, 128) and gate_up.local_slices(0, 2) == [(0, 64), (128, 64)]  # cut by chunk
    local_slices = {(e[2], e[3]) for e in plan.arg_edits.values() if 2 in e and 3 in e}
    assert local_slices == {(0, 32), (32, 48), (48, 64)}  # q, k, v of the rank-local projection
    assert not any(d.role == "replicated" for d in plan.decisions)
    assert plan.summary().startswith("tensor parallel: 9 of 9 linears split (column 4, row 4, vocab 1)")


def test_gpt_bigcode_multi_query_attention_stays_whole_and_says_why():
    plan = hf_plan("gpt_bigcode", 2)
    c_attn = next(d for d in plan.decisions if d.module == "transformer.h.0.attn.c_attn")
    assert c_attn.role == "replicated"
    assert "fewer key/value heads than tp=2 (multi-query)" in c_attn.detail  # 1 kv head for 4 query heads
    c_proj = next(d for d in plan.decisions if d.module == "transformer.h.0.attn.c_proj")
    assert c_proj.role == "replicated" and "its input comes from 'transformer.h.0.attn.c_attn'" in c_proj.detail
    r = roles(plan)
    assert r["transformer.h.0.mlp.c_fc"] == "column" and r["transformer.h.0.mlp.c_proj"] == "row"
    assert "4 kept whole" in plan.summary() and "multi-query" not in plan.summary()  # short reasons only
    assert "fewer key/value heads than tp=2" in plan.summary()


def test_bloom_attention_stays_whole_because_heads_merge_into_the_batch():
    plan = hf_plan("bloom", 2)
    qkv = next(d for d in plan.decisions if d.module == "transformer.h.0.self_attention.query_key_value")
    assert qkv.role == "replicated"
    assert "merges the sharded heads into the batch dimension ([2, 4, 16, 16] -> [8, 16, 16])" in qkv.detail
    r = roles(plan)
    assert r["transformer.h.0.mlp.dense_h_to_4h"] == "column" and r["transformer.h.0.mlp.dense_4h_to_h"] == "row"


def test_olmo2_q_norm_and_k_norm_are_split_with_their_heads_and_summed_over_tp():
    plan = hf_plan("olmo2", 2)
    r = roles(plan)
    for proj in ("q_proj", "k_proj", "v_proj"):
        assert r[f"model.layers.0.self_attn.{proj}"] == "column"
    assert r["model.layers.0.self_attn.o_proj"] == "row"
    for norm, features in (("q_norm", 64), ("k_norm", 32)):
        shard = plan.params[f"model.layers.0.self_attn.{norm}.weight"]  # scales the split features: split too
        assert shard.dim == 0 and shard.segments == (features,)
    sums = [d for d in plan.decisions if d.role == "tp-sum"]
    assert {d.module for d in sums} == {f"model.layers.{i}.self_attn.{n}" for i in (0, 1) for n in ("q_norm", "k_norm")}
    assert set(plan.sums.values()) == {2}  # a mean: the ranks' means summed, divided by tp
    assert len(plan.copies) == 4  # each norm's rsqrt meets the shards through copy_to_tp (its gradient summed)
    assert "model.layers.0.post_attention_layernorm.weight" in plan.replicated_params  # on the residual: whole


def test_a_max_over_the_split_features_still_keeps_its_layers_whole():
    x = hand_built(aten.amax.default, (2, 16, 64), ([-1], True), [(2, 16, 1)])
    with pytest.raises(PlanFailure, match="a reduction over all heads' features"):
        rules.reduction(RuleContext(tp=2), x[1], [(x[0], Shard(2, (64,), frozenset({"q"})))])


@pytest.mark.parametrize("heads", [1, 3])
def test_a_tp_that_does_not_divide_the_query_heads_is_an_error(heads):
    with pytest.raises(ConfigError, match=f"tp=2 does not divide the {heads} heads of the attention in 'model.layers.0.self_attn'"):
        hf_plan("phi3", 2, num_attention_heads=heads, num_key_value_heads=1, hidden_size=16 * heads)
