"""Pipeline stages with their own tensor-parallel degrees (--stage-tp) train like one process.

Same reference as the other equivalence tests: a world of one on the whole global batch; losses
and eval loss within 1e-5 relative, gradient norms (tied embedding/head counted once, slices summed
over each stage's tp ranks) within 1e-4, whole parameters within 1e-5. One pool per world size,
2 steps each. The boundary transfer is pipeline/hetero_boundary.py's (whole tensor, modular routing).
"""

from __future__ import annotations

import pytest

import autopar
from autopar.errors import ConfigError
from helpers import max_relative_difference, train_builtin

STEPS = 2
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
        assert max_relative_difference(expected["grad_norms"], got["grad_norms"]) < 1e-4, \
            (rank, expected["grad_norms"], got["grad_norms"])
        assert abs(expected["eval_loss"] - got["eval_loss"]) / expected["eval_loss"] < 1e-5, rank
        for name, value in got["params"].items():  # each rank's own stage, its slices gathered
            assert value.shape == expected["params"][name].shape, (rank, name)
            assert (value - expected["params"][name]).abs().max() < 1e-5, (rank, name)


# (model, world, strategy): one pipeline each (dp=1) except where dp is given
LAYOUTS = [
    ("gpt-tiny", 3, {"stage_tp": "1,2"}),
    ("gpt-tiny", 3, {"stage_tp": "2,1", "schedule": "gpipe"}),
    ("gpt-tiny", 6, {"stage_tp": "2,4"}),
    ("gpt-tiny", 6, {"stage_tp": "4,2"}),
    ("gpt-tiny", 4, {"stage_tp": "1,2,1"}),
    ("hf:llama", 3, {"stage_tp": "2,1"}),
]


@pytest.mark.parametrize("model,world,strategy", LAYOUTS,
                         ids=[f"{m}-tp{s['stage_tp'].replace(',', '_')}-{s.get('schedule', '1f1b')}" for m, _, s in LAYOUTS])
def test_stage_tp_matches_single_process(rank_pool, tmp_path, tmp_path_factory, model, world, strategy):
    expected = reference(rank_pool, tmp_path_factory, model)
    results = rank_pool(world).run(train_builtin, model, str(tmp_path), model_args=MODELS[model], steps=STEPS,
                                   strategy=strategy, global_batch_size=GLOBAL_BATCH, micro_batch_size=1)
    assert_matches(expected, results)
