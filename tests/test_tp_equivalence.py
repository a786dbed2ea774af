"""Tensor parallelism, alone and in 3D with data and pipeline parallelism, trains like one process.

Same reference as the other equivalence tests: a world of one on the whole global batch.
Losses within 1e-5 relative over 10 steps, the same gradient norms (tensor-parallel slices
summed over ranks), the same eval loss, and the same parameters once the slices are
gathered. The models cover the plan's patterns: separate q/k/v (reference GPT), fused qkv
in Conv1D (GPT-2), grouped-query attention with SwiGLU and rotary embeddings (LLaMA), and
BERT's masked-LM head (which stays replicated: its LayerNorm mixes the features).
"""

from __future__ import annotations

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
