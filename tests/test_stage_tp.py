"""Pipeline stages with their own tensor-parallel degrees (--stage-tp) train like one process.

Same reference as the other equivalence tests: a world of one on the whole global batch; losses
and eval loss within 1e-5 relative, gradient norms (tied embedding/head counted once, slices summed
over each stage's tp ranks) within 1e-4, whole parameters within 1e-5. One pool per world size,
2 steps each. The boundary transfer is pipeline/hetero_boundary.py's: whole tensor, modular routing, or
(--boundary) planned resharding, run for 2 -> 4 scatter-gather, 4 -> 2 broadcast and the uniform
2 -> 2 scatter-gather (Megatron's trick, through the same transport in place of P2P).
"""

from __future__ import annotations

import pytest

import autopar
from autopar.errors import ConfigError
from autopar.cli import build_parser, cmd_plan, main
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
        _references[model]["run_dir"] = out
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
    # planned boundaries (resharding/ through HeteroBoundary): both directions, 2 -> 4 and 4 -> 2
    ("gpt-tiny", 6, {"stage_tp": "2,4", "boundary": "scatter_gather"}),
    ("gpt-tiny", 6, {"stage_tp": "4,2", "boundary": "broadcast", "schedule": "eager-1f1b"}),
    # equal degrees are the uniform --tp 2 --pp 2 pipeline; planned boundaries move 1/2 per link (Megatron)
    ("gpt-tiny", 4, {"stage_tp": "2,2", "boundary": "scatter_gather"}),
]


@pytest.mark.parametrize("model,world,strategy", LAYOUTS,
                         ids=[f"{m}-tp{s['stage_tp'].replace(',', '_')}-{s.get('schedule', '1f1b')}-{s.get('boundary', 'direct')}"
                              for m, _, s in LAYOUTS])
def test_stage_tp_matches_single_process(rank_pool, tmp_path, tmp_path_factory, model, world, strategy):
    expected = reference(rank_pool, tmp_path_factory, model)
    results = rank_pool(world).run(train_builtin, model, str(tmp_path), model_args=MODELS[model], steps=STEPS,
                                   strategy=strategy, global_batch_size=GLOBAL_BATCH, micro_batch_size=1)
    assert_matches(expected, results)
    method = strategy.get("boundary", "direct")
    for rank, got in enumerate(results):  # the planned transfers really ran (and only with --boundary)
        assert bool(got["boundary_plans"]) == (method != "direct"), (rank, got["boundary_plans"])
        for used, max_link, nbytes, src_tp, dst_tp in got["boundary_plans"]:
            assert used == method, (rank, used)
            if method == "scatter_gather":  # 1/t of the tensor on each link (sender links and the ring hops)
                assert max_link * dst_tp <= nbytes * max(1, dst_tp - 1), (rank, max_link, nbytes, dst_tp)
                if src_tp == dst_tp:
                    assert max_link * dst_tp == nbytes, (rank, max_link, nbytes)


def whole_checkpoint(run_dir: str) -> dict:
    """The run's last checkpoint as whole tensors by name."""
    from pathlib import Path

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    folder = sorted((Path(run_dir) / "checkpoints").glob("step_*"))[-1]
    dcp_to_torch_save(folder, folder.parent / "whole.pt")
    return torch.load(folder.parent / "whole.pt", weights_only=False)["model"]


def test_stage_tp_with_dp_matches_and_checkpoints_whole_tensors(rank_pool, tmp_path, tmp_path_factory):
    """1 -> 2 replicated twice (dp=2, 6 ranks) trains as one process, and its checkpoint is the
    single-process checkpoint (same names, whole tensors; the tp=2 stage's slices gathered)."""
    expected = reference(rank_pool, tmp_path_factory, "gpt-tiny")
    results = rank_pool(6).run(train_builtin, "gpt-tiny", str(tmp_path), model_args=MODELS["gpt-tiny"], steps=STEPS,
                               strategy={"stage_tp": "1,2", "dp": 2}, global_batch_size=GLOBAL_BATCH,
                               micro_batch_size=1)
    assert_matches(expected, results)
    got, single = whole_checkpoint(str(tmp_path)), whole_checkpoint(expected["run_dir"])
    assert got.keys() == single.keys()
    for name, value in got.items():
        assert value.shape == single[name].shape, name
        assert (value - single[name]).abs().max() < 1e-5, name


@pytest.mark.parametrize("fields,world,message", [
    ({"stage_tp": "1,2"}, 4, "needs dp * 3 processes (one pipeline is 1+2 = 3 ranks), but nproc is 4"),
    ({"stage_tp": "1,2", "pp": 3}, 3, "lists 2 stages but --pp is 3"),
    ({"stage_tp": "1,2", "tp": 2}, 3, "--tp 2 beside it is ambiguous"),
    ({"stage_tp": "1,2", "chunks": 2, "schedule": "interleaved-1f1b"}, 3, "cannot be combined with --chunks 2"),
    ({"stage_tp": "1,2", "schedule": "zb-h1"}, 3, "cannot be combined with --schedule zb-h1"),
    ({"stage_tp": "1,2", "dp": 2}, 3, "with dp=2"),
    ({"stage_tp": "2,x"}, 3, "must list positive tp degrees"),
    ({"stage_tp": "0,2"}, 2, "must list positive tp degrees"),
    ({"stage_tp": "1,2", "boundary": "scatter"}, 3, "strategy.boundary (--boundary) must be one of"),
    ({"tp": 2, "boundary": "scatter_gather"}, 2, "needs a pipeline, got pp=1"),
    ({"pp": 2, "chunks": 2, "schedule": "interleaved-1f1b", "boundary": "auto"}, 2, "cannot be combined with --chunks 2"),
    ({"tp": 2, "pp": 2, "schedule": "zb-h1", "boundary": "broadcast"}, 4, "cannot be combined with --schedule zb-h1"),
])
def test_stage_tp_bad_layouts_are_refused(fields, world, message):
    from autopar.strategies import resolve
    with pytest.raises(ConfigError, match=None) as caught:
        resolve(autopar.Strategy(**fields), autopar.TrainConfig(global_batch_size=8, micro_batch_size=2), world)
    assert message in str(caught.value), str(caught.value)


def test_stage_tp_resolves_dp_and_uniform_degrees_to_plain_tp():
    hetero = autopar.Strategy(stage_tp="2,4").resolved(12)
    assert (hetero.dp, hetero.pp, hetero.stage_tps) == (2, 2, (2, 4))
    uniform = autopar.Strategy(stage_tp=(2, 2)).resolved(8)  # all equal: the --tp code path
    assert (uniform.dp, uniform.tp, uniform.pp, uniform.stage_tp) == (2, 2, 2, None)
    planned = autopar.Strategy(stage_tp="2,2", boundary="scatter_gather").resolved(4)  # keeps its planned boundary
    assert (planned.tp, planned.pp, planned.stage_tp, planned.pipeline.boundary) == (2, 2, None, "scatter_gather")


def test_plan_shows_stage_degrees_ranks_and_boundaries(capsys):
    assert main(["plan", "--model", "gpt-tiny", "--stage-tp", "2,4", "--nproc", "12", "--seq-len", "16"]) == 0
    out = capsys.readouterr().out
    assert "stage 0: tp=2, ranks [[0, 1], [2, 3]]" in out and "stage 1: tp=4, ranks [[4, 5, 6, 7], [8, 9, 10, 11]]" in out
    assert "boundary 0 -> 1: activations tp 2 -> tp 4" in out and "0->0, 1->1, 0->2, 1->3" in out
    assert "(2 sender rank(s) idle)" in out  # gradients 4 -> 2
    assert main(["plan", "--model", "gpt-tiny", "--stage-tp", "2,4", "--seq-len", "16", "--micro-batch-size", "2",
                 "--boundary", "scatter_gather"]) == 0
    # one plan per direction: [2, 16, 64] fp32 is 8 KiB; its busiest link is a receiver's all-gather ring
    # hop (3 parts of 2 KiB), sender links carry 1/4 each
    out = capsys.readouterr().out
    assert "activation add_2: reshard [2, 16, 64] x4 B (8.0 KiB) tp2 [0, 1] replicated -> tp4 [2, 3, 4, 5] " \
           "replicated: scatter_gather, 1 tile(s), max 6.0 KiB per link, predicted" in out, out
    assert "gradient   add_2: reshard [2, 16, 64] x4 B (8.0 KiB) tp4 [2, 3, 4, 5] replicated -> tp2 [0, 1]" in out
    assert "times are cost-model predictions" in out
    ns = build_parser().parse_args(["plan", "--model", "gpt-tiny", "--stage-tp", "1,3", "--seq-len", "16"])
    with pytest.raises(ConfigError, match="tp=3 does not divide the 4 heads"):  # main() would exit the process
        cmd_plan(ns)
