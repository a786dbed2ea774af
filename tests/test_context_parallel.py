"""Context parallelism (--cp) trains like one process: the sequence split over ranks, attention whole.

Same reference as the other equivalence tests: a world of one on the whole global batch. Ring attention
(load-balanced chunks) at cp=2 and cp=4, all-to-all at cp=2, cp with dp, and LLaMA (rotary positions,
grouped-query attention) with right-padded batches: losses, gradient norms, eval loss and parameters
equal at fp32 tolerance.
"""

from __future__ import annotations

import pytest

from helpers import max_relative_difference, train_builtin

STEPS = 4
GLOBAL_BATCH = 4
MODELS = {"gpt-tiny": {"n_layer": 2}, "hf:llama": {"num_hidden_layers": 2}}
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
            assert (value - expected["params"][name]).abs().max() < 1e-5, (rank, name)
    assert expected["losses"][-1] < expected["losses"][0]


# (model, world, strategy, micro-batch size)
LAYOUTS = [
    ("gpt-tiny", 2, {"cp": 2}, 4),
    ("gpt-tiny", 2, {"cp": 2, "cp_mode": "all-to-all"}, 2),
    ("gpt-tiny", 4, {"cp": 4}, 4),
    ("gpt-tiny", 4, {"cp": 2, "dp": 2}, 2),
    ("hf:llama", 2, {"cp": 2}, 4),
]


def _name(layout: tuple) -> str:
    model, _, strategy, _ = layout
    return model.replace(":", "-") + "-" + "-".join(f"{k}{v}" for k, v in strategy.items())


@pytest.mark.parametrize("model,world,strategy,micro", LAYOUTS, ids=[_name(layout) for layout in LAYOUTS])
def test_context_parallel_matches_single_process(rank_pool, tmp_path, tmp_path_factory, model, world, strategy,
                                                 micro):
    expected = reference(rank_pool, tmp_path_factory, model)
    results = rank_pool(world).run(train_builtin, model, str(tmp_path), model_args=MODELS[model], steps=STEPS,
                                   strategy=strategy, global_batch_size=GLOBAL_BATCH, micro_batch_size=micro)
    assert_matches(expected, results)
