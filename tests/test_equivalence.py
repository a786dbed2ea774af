"""The main correctness test: every parallel layout trains like one process on the whole batch.

A reference run on a world of one (global batch in a single micro-batch) is compared step
by step with data-parallel runs at dp in {1, 2, 4} and several micro-batch sizes
(gradient accumulation): fp32 losses within 1e-5 relative, the same gradient norms, and the
same final parameters. Later strategies (tp, pp, schedules) join the LAYOUTS table.
"""

from __future__ import annotations

import pytest

from helpers import max_param_difference, max_relative_difference, train_builtin

# (model, model args, steps): the reference GPT with tied embeddings, and the HF families:
# gpt2 (tied, Conv1D), llama (GQA, rotary), bert (masked LM: ranks hold different numbers of targets).
MODELS = {
    "gpt-tiny": ({}, 20),
    "hf:bert": ({}, 20),
    "hf:gpt2": ({}, 10),
    "hf:llama": ({}, 10),
}
# (world size, strategy, micro-batch size) compared against the reference.
LAYOUTS = [
    (1, {"dp": 1}, 2),   # gradient accumulation over 4 micro-batches
    (2, {"dp": 2}, 2),   # 2 replicas x 2 micro-batches
    (4, {"dp": 4}, 2),   # 4 replicas, no accumulation
    (4, {}, 1),          # dp inferred from the world size; 2 micro-batches of 1
]
GLOBAL_BATCH = 8
_references: dict = {}


def reference(rank_pool, tmp_path_factory, model: str) -> dict:
    if model not in _references:
        args, steps = MODELS[model]
        out = str(tmp_path_factory.mktemp("reference"))
        _references[model] = rank_pool(1).run(train_builtin, model, out, model_args=args, steps=steps,
                                               global_batch_size=GLOBAL_BATCH, micro_batch_size=GLOBAL_BATCH)[0]
    return _references[model]


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("world,strategy,micro", LAYOUTS, ids=lambda v: str(v))
def test_data_parallel_matches_single_process(rank_pool, tmp_path, tmp_path_factory, model, world, strategy, micro):
    args, steps = MODELS[model]
    expected = reference(rank_pool, tmp_path_factory, model)
    results = rank_pool(world).run(train_builtin, model, str(tmp_path), model_args=args, steps=steps,
                                   strategy=strategy, global_batch_size=GLOBAL_BATCH, micro_batch_size=micro)
    for rank, got in enumerate(results):
        assert len(got["losses"]) == steps
        assert max_relative_difference(expected["losses"], got["losses"]) < 1e-5, (rank, expected["losses"], got["losses"])
        assert max_relative_difference(expected["grad_norms"], got["grad_norms"]) < 1e-4, rank
        assert max_param_difference(expected["params"], got["params"]) < 1e-5, rank
        assert abs(expected["eval_loss"] - got["eval_loss"]) / expected["eval_loss"] < 1e-5, rank
    # the loss must actually move, or equality would prove little
    assert expected["losses"][-1] < expected["losses"][0]


# Uneven replica shares (--dp-shares): replica k takes its weight's part of each global batch, whole
# micro-batches; gradients are summed and losses normalised over the global batch, so nothing else moves.
# hf:bert is the masked LM: replicas hold different numbers of target tokens as well as of samples.
@pytest.mark.parametrize("model", ["gpt-tiny", "hf:bert"])
def test_uneven_replica_shares_match_single_process(rank_pool, tmp_path, tmp_path_factory, model):
    args, steps = MODELS[model]
    expected = reference(rank_pool, tmp_path_factory, model)
    results = rank_pool(4).run(train_builtin, model, str(tmp_path), model_args=args, steps=steps,
                               strategy={"dp": 4, "dp_shares": "3,1,1,3"}, global_batch_size=GLOBAL_BATCH,
                               micro_batch_size=1)
    assert [got["local_micro_batches"] for got in results] == [3, 1, 1, 3]  # the shares took effect
    for rank, got in enumerate(results):
        assert max_relative_difference(expected["losses"], got["losses"]) < 1e-5, (rank, got["losses"])
        assert max_relative_difference(expected["grad_norms"], got["grad_norms"]) < 1e-4, rank
        assert max_param_difference(expected["params"], got["params"]) < 1e-5, rank
