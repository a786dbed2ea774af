"""Sequence parallelism (--sp): tensor parallelism whose norms, dropout and residual adds hold 1/tp of the
sequence, trains like one process.

Same reference as the tensor-parallel equivalence tests: a world of one on the whole global
batch; losses within 1e-5 relative, the same gradient norms (norm weights' gradients summed over
the tp ranks), the same eval loss and parameters. gpt-tiny runs with dropout on, so each rank must
draw exactly its positions' slice of the mask.
"""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.errors import ConfigError
from helpers import train_builtin
from test_dropout import MODEL_ARGS as DROPOUT_ARGS
from test_dropout import STEPS as DROPOUT_STEPS
from test_dropout import reference as dropout_reference
from test_tp_equivalence import MODELS as TP_MODELS
from test_tp_equivalence import STEPS as TP_STEPS
from test_tp_equivalence import assert_matches
from test_tp_equivalence import reference as tp_reference

GLOBAL_BATCH = 8
# the references (one process) are the dropout and tp equivalence tests' own, computed once per test run
CASES = {"gpt-tiny": (DROPOUT_ARGS, DROPOUT_STEPS, lambda pool, paths: dropout_reference(pool, paths, "gpt-tiny",
                                                                                           DROPOUT_ARGS)),
         "hf:llama": (TP_MODELS["hf:llama"], TP_STEPS, lambda pool, paths: tp_reference(pool, paths, "hf:llama")),
         "hf:gpt2": (TP_MODELS["hf:gpt2"], TP_STEPS, lambda pool, paths: tp_reference(pool, paths, "hf:gpt2"))}

# (model, world, strategy, micro-batch size, sums reduce-scattered)
LAYOUTS = [
    ("gpt-tiny", 2, {"tp": 2, "sp": True}, 4, 5),
    ("hf:llama", 2, {"tp": 2, "sp": True}, 4, 5),
    # Conv1D rows on [batch*sequence, hidden] keep their all-reduce; the embedding's sum is scattered, the stream
    # gathered for the replicated ops that follow, and their whole outputs sliced where they meet it again
    ("hf:gpt2", 2, {"tp": 2, "sp": True}, 4, 1),
    ("gpt-tiny", 4, {"tp": 2, "pp": 2, "sp": True, "schedule": "1f1b"}, 2, 5),
    # recomputed stages: the column layers' slice-keeping hooks run inside activation checkpointing
    ("gpt-tiny", 2, {"tp": 2, "sp": True, "recompute": "all"}, 4, 5),
]


@pytest.mark.parametrize("model,world,strategy,micro,scattered", LAYOUTS, ids=lambda v: str(v))
def test_sequence_parallel_matches_single_process(rank_pool, tmp_path, tmp_path_factory, model, world, strategy,
                                                  micro, scattered):
    model_args, steps, reference = CASES[model]
    expected = reference(rank_pool, tmp_path_factory)
    results = rank_pool(world).run(train_builtin, model, str(tmp_path), model_args=model_args, steps=steps,
                                   strategy=strategy, global_batch_size=GLOBAL_BATCH, micro_batch_size=micro)
    assert_matches(expected, results)
    # the norm weights are whole on both tp ranks and read by different positions: their gradients summed over
    # tp keep them bit-identical
    for name, value in results[0]["params"].items():
        assert torch.equal(value, results[1]["params"][name]), name
    table = (tmp_path / "tp_plan.txt").read_text()  # the sums really became reduce-scatters over the sequence
    assert f"sequence parallel: {scattered} sums reduce-scattered over the 32-token sequence (16 per rank)" in table, \
        table


_graphs: dict = {}


def one_layer_gpt():
    """gpt-tiny with one layer and dropout, traced on meta at batch 2 x 16 tokens (once per test run)."""
    if not _graphs:
        from autopar.data import padded_vocab_size
        from autopar.models import build_model
        from autopar.trace import trace
        model, _ = build_model("gpt-tiny", {"n_layer": 1, "dropout": 0.1}, vocab_size=padded_vocab_size(258),
                               device="meta")
        model.train()
        _graphs["gpt"] = trace(model, (torch.zeros(2, 16, dtype=torch.long, device="meta"),), {}, device="cpu")
    return _graphs["gpt"]


def test_plan_splits_the_regions_between_row_and_column_layers():
    """gpt-tiny: the embedding's and each row layer's sum scatter; the residual stream, norms and dropout stay
    split until a column layer (or the head) gathers; the position table is sliced, norm weights summed."""
    from autopar.tensor_parallel import plan_tensor_parallel

    graph = one_layer_gpt()
    seq = plan_tensor_parallel(graph, 2, sequence=True).sequence
    assert seq.scatter == {"embedding", "linear_3", "linear_5"}  # token embedding, out_proj, fc_out
    assert {"dropout", "layer_norm", "dropout_1", "add_1", "layer_norm_2"} <= set(seq.values)
    assert seq.gathers == {"linear": ["layer_norm"], "linear_1": ["layer_norm"], "linear_2": ["layer_norm"],
                           "linear_4": ["layer_norm_1"], "linear_6": ["layer_norm_2"]}
    assert seq.slices == {"add": [("embedding_1", 0)]}  # the [16, 64] position rows of this rank
    assert seq.copies["layer_norm"] == ["p_blocks_0_ln_1_weight", "p_blocks_0_ln_1_bias"]
    assert plan_tensor_parallel(graph, 2).sequence is None
    with pytest.raises(ConfigError, match="sequence length divisible by 3"):
        _plan_sp_with_tp(graph, 3)


def test_memory_model_splits_every_activation_of_a_split_layer_under_sp():
    """The hand-set memory check's profile: tp keeps whole what its plan does not shard (norms, residuals); --sp
    splits all of it over tp."""
    from autopar.search.profile import profile_graph

    graph = one_layer_gpt()
    whole = profile_graph(graph, name="gpt", seq_len=16).tp[1].saved_bytes
    tp = profile_graph(graph, name="gpt", seq_len=16, tp_degrees=(2,)).tp[2].saved_bytes
    sp = profile_graph(graph, name="gpt", seq_len=16, tp_degrees=(2,), sequence_parallel=True).tp[2].saved_bytes
    assert all(s == pytest.approx(w / 2) for s, w in zip(sp, whole))  # every block of gpt holds a split layer
    assert tp[0] == pytest.approx(whole[0])  # the vocabulary-parallel embedding's output is summed, whole on a rank
    assert all(w / 2 < t < w for t, w in zip(tp[1:], whole[1:]))  # a layer, the head: some values split, some not


def _plan_sp_with_tp(graph, tp: int):
    from autopar.tensor_parallel.layout import TensorParallelPlan
    from autopar.tensor_parallel.sequence import plan_sequence_parallel
    return plan_sequence_parallel(graph, TensorParallelPlan(tp=tp))


@pytest.mark.parametrize("fields, rule", [(dict(sp=True), "sp-needs-tp"),
                                          (dict(sp=True, tp=2, tp_subbatches=2), "sp-subbatches")])
def test_sp_without_what_it_needs_is_refused_before_ranks_start(fields, rule):
    from autopar.strategies import resolve
    with pytest.raises(ConfigError, match=rf"\(rule {rule}\)"):
        resolve(autopar.Strategy(**fields), autopar.TrainConfig(global_batch_size=8, micro_batch_size=2), 2)
