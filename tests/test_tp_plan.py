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
