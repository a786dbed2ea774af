"""Tensor parallelism, alone and in 3D with data and pipeline parallelism, trains like one process.

Same reference as the other equivalence tests: a world of one on the whole global batch.
Losses within 1e-5 relative over 10 steps, the same gradient norms (tensor-parallel slices
summed over ranks), the same eval loss, and the same parameters once the slices are
gathered. The models cover the plan's patterns: separate q/k/v (reference GPT), fused qkv
in Conv1D (GPT-2), grouped-query attention with SwiGLU and rotary embeddings (LLaMA), and
BERT's masked-LM head (which stays replicated: its LayerNorm mixes the features).
"""

from __future__ import annotations

import re

import pytest

from helpers import max_relative_difference, train_builtin

STEPS = 10
GLOBAL_BATCH = 8
MODELS = {"gpt-tiny": {"n_layer": 2}, "hf:llama": {"num_hidden_layers": 2}, "hf:gpt2": {"n_layer": 2},
          "hf:bert": {"num_hidden_layers": 2}}
_references: dict = {}


def reference(rank_pool, tmp_path_factory, model: str) -> dict:
    if model not in _references:
        out = str(tmp_path_factory.mktemp("reference"))
        _references[model] = rank_pool(1).run(train_builtin, model, out, model_args=MODELS[model], steps=STEPS,
                                               global_batch_size=GLOBAL_BATCH, micro_batch_size=GLOBAL_BATCH)[0]
    return _references[model]


def assert_matches(expected: dict, results: list[dict]) -> None:
    for rank, got in enumerate(results):
        assert max_relative_difference(expected["losses"], got["losses"]) < 1e-5, (rank, expected["losses"], got["losses"])
        assert max_relative_difference(expected["grad_norms"], got["grad_norms"]) < 1e-4, rank
        assert abs(expected["eval_loss"] - got["eval_loss"]) / expected["eval_loss"] < 1e-5, rank
        for name, value in got["params"].items():
            assert value.shape == expected["params"][name].shape, (rank, name)
            assert (value - expected["params"][name]).abs().max() < 1e-5, (rank, name)
    assert expected["losses"][-1] < expected["losses"][0]


# (model, world, strategy, micro-batch size)
LAYOUTS = [
    ("gpt-tiny", 2, {"tp": 2}, 2),
    ("hf:llama", 2, {"tp": 2}, 2),
    ("hf:gpt2", 2, {"tp": 2}, 4),
    ("hf:bert", 2, {"tp": 2}, 4),
    ("gpt-tiny", 4, {"tp": 4}, 4),
    ("gpt-tiny", 4, {"tp": 2, "pp": 2, "schedule": "1f1b"}, 2),
    ("hf:llama", 4, {"tp": 2, "pp": 2, "schedule": "1f1b"}, 2),
    ("gpt-tiny", 4, {"tp": 2, "dp": 2}, 2),
    ("hf:llama", 4, {"tp": 2, "dp": 2}, 2),
    ("gpt-tiny", 8, {"dp": 2, "tp": 2, "pp": 2, "schedule": "1f1b"}, 2),
    ("hf:llama", 8, {"dp": 2, "tp": 2, "pp": 2, "schedule": "1f1b"}, 2),
]


@pytest.mark.parametrize("model,world,strategy,micro", LAYOUTS, ids=lambda v: str(v))
def test_tensor_parallel_matches_single_process(rank_pool, tmp_path, tmp_path_factory, model, world, strategy, micro):
    expected = reference(rank_pool, tmp_path_factory, model)
    results = rank_pool(world).run(train_builtin, model, str(tmp_path), model_args=MODELS[model], steps=STEPS,
                                   strategy=strategy, global_batch_size=GLOBAL_BATCH, micro_batch_size=micro)
    assert_matches(expected, results)
    whole = sum(v.numel() for v in expected["params"].values())
    per_stage = whole / strategy.get("pp", 1)
    for got in results:  # each rank really holds only its slices
        assert got["local_numel"] < 0.8 * per_stage, (got["local_numel"], per_stage)


def train_hf(family: str, out: str, *, strategy: dict | None = None, micro_batch_size: int) -> dict:
    """A tiny Hugging Face model of this family built on meta from AutoConfig, trained 3 steps."""
    import json
    from pathlib import Path

    import autopar
    from autopar.data.tokenizer import padded_vocab_size
    from helpers import small_data, whole_parameters
    from transformers import AutoConfig, AutoModelForCausalLM
    import torch

    config = AutoConfig.for_model(family, vocab_size=padded_vocab_size(258), use_cache=False, hidden_size=64,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  intermediate_size=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    train_data, eval_data = small_data("causal-lm", 32)
    trainer = autopar.Trainer(model, train_data, eval_data=eval_data, strategy=autopar.Strategy(**(strategy or {})),
                              config=autopar.TrainConfig(steps=3, global_batch_size=GLOBAL_BATCH, lr=1e-3,
                                                         micro_batch_size=micro_batch_size, warmup_steps=1,
                                                         eval_batches=1, out=out, progress=False, timeout_s=60))
    result = trainer.train()
    records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    got = {"losses": result.losses, "eval_loss": result.eval_loss, "grad_norms": [r["grad_norm"] for r in records],
           "params": whole_parameters(trainer), "local_numel": sum(p.numel() for p in trainer.model.parameters()),
           "banner": trainer._banner(0)}
    trainer.close()
    return got


def test_phi3_fused_projections_split_per_segment_match_single_process(rank_pool, tmp_path):
    """phi3's qkv_proj (sliced into q|k|v) and gate_up_proj (chunked) split per segment at tp=2, as one process."""
    expected = rank_pool(1).run(train_hf, "phi3", str(tmp_path / "one"), micro_batch_size=GLOBAL_BATCH)[0]
    results = rank_pool(2).run(train_hf, "phi3", str(tmp_path / "tp"), strategy={"tp": 2}, micro_batch_size=4)
    assert_matches(expected, results)
    whole = sum(v.numel() for v in expected["params"].values())
    assert all(got["local_numel"] < 0.6 * whole for got in results)  # every layer linear is split, not only the head
    table = (tmp_path / "tp" / "tp_plan.txt").read_text()  # the run folder says what was split
    for layer in (0, 1):
        assert re.search(rf"column +model\.layers\.{layer}\.self_attn\.qkv_proj .*3 fused segments", table)
        assert re.search(rf"column +model\.layers\.{layer}\.mlp\.gate_up_proj .*2 fused segments", table)
        assert re.search(rf"row +model\.layers\.{layer}\.mlp\.down_proj", table)
    assert "tensor parallel: 9 of 9 linears split (column 4, row 4, vocab 1)" in results[0]["banner"]
    assert not (tmp_path / "one" / "tp_plan.txt").exists()  # tp=1: nothing to report


def test_olmo2_q_norm_and_k_norm_over_split_heads_match_single_process(rank_pool, tmp_path):
    """olmo2's RMS norm over all heads' features: local means summed over tp, its weight split with the heads."""
    expected = rank_pool(1).run(train_hf, "olmo2", str(tmp_path / "one"), micro_batch_size=GLOBAL_BATCH)[0]
    results = rank_pool(2).run(train_hf, "olmo2", str(tmp_path / "tp"), strategy={"tp": 2}, micro_batch_size=4)
    assert_matches(expected, results)
    table = (tmp_path / "tp" / "tp_plan.txt").read_text()
    assert re.search(r"column +model\.layers\.0\.self_attn\.q_proj ", table)
    assert re.search(r"per-feature +model\.layers\.0\.self_attn\.q_norm .*\[64\] -> 32 per rank", table)
    assert re.search(r"tp-sum +model\.layers\.0\.self_attn\.k_norm ", table)
    assert "tensor parallel: 15 of 15 linears split" in results[0]["banner"]
