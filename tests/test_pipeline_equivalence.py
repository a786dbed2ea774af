"""Pipeline parallelism trains like one process: every schedule, pp in {2, 4}, with dp and recomputation.

Same reference as tests/test_equivalence.py: a world of one on the whole global batch.
Losses within 1e-5 relative over 10 steps, same gradient norms, and the same parameters
(gathered from the stages by name).
"""

from __future__ import annotations

import pytest

from helpers import max_relative_difference, train_builtin

STEPS = 10
GLOBAL_BATCH = 8
MODELS = {"gpt-tiny": {"n_layer": 3}, "hf:llama": {"num_hidden_layers": 3}}
_references: dict = {}


def reference(rank_pool, tmp_path_factory, model: str) -> dict:
    if model not in _references:
        out = str(tmp_path_factory.mktemp("reference"))
        _references[model] = rank_pool(1).run(train_builtin, model, out, model_args=MODELS[model], steps=STEPS,
                                               global_batch_size=GLOBAL_BATCH, micro_batch_size=GLOBAL_BATCH)[0]
    return _references[model]


# (world, strategy, micro-batch size)
LAYOUTS = [
    (2, {"pp": 2, "schedule": "gpipe"}, 2),
    (2, {"pp": 2, "schedule": "1f1b"}, 2),
    (2, {"pp": 2, "schedule": "eager-1f1b"}, 2),
    (2, {"pp": 2, "schedule": "zb-h1"}, 2),
    (2, {"pp": 2, "schedule": "scp", "recompute": "all-but-last"}, 2),
    (2, {"pp": 2, "schedule": "1f1b", "recompute": "all"}, 2),
    (2, {"pp": 2, "schedule": "scp", "recompute": "all"}, 2),  # scp never recomputes the last stage
    (2, {"pp": 2, "schedule": "1f1b", "memory_budget_mb": 3.0}, 2),  # stage-aware: some blocks recompute
    (2, {"pp": 2, "schedule": "interleaved-1f1b", "chunks": 2}, 2),
    (4, {"pp": 4, "schedule": "1f1b"}, 1),
    (4, {"pp": 4, "schedule": "gpipe", "partition": "uniform"}, 2),
    (4, {"pp": 2, "dp": 2, "schedule": "1f1b"}, 1),
    (4, {"pp": 2, "dp": 2, "schedule": "zb-h1", "recompute": "all"}, 2),
    (4, {"pp": 2, "dp": 2, "schedule": "scp", "recompute": "all-but-last", "memory_budget_mb": 3.0}, 2),
    (4, {"pp": 4, "schedule": "eager-1f1b"}, 1),
    (4, {"pp": 4, "schedule": "zb-h1"}, 1),
    (4, {"pp": 4, "schedule": "scp", "recompute": "all"}, 1),
]


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("world,strategy,micro", LAYOUTS, ids=lambda v: str(v))
def test_pipeline_matches_single_process(rank_pool, tmp_path, tmp_path_factory, model, world, strategy, micro):
    expected = reference(rank_pool, tmp_path_factory, model)
    results = rank_pool(world).run(train_builtin, model, str(tmp_path), model_args=MODELS[model], steps=STEPS,
                                   strategy=strategy, global_batch_size=GLOBAL_BATCH, micro_batch_size=micro)
    for rank, got in enumerate(results):
        assert max_relative_difference(expected["losses"], got["losses"]) < 1e-5, (rank, expected["losses"], got["losses"])
        assert max_relative_difference(expected["grad_norms"], got["grad_norms"]) < 1e-4, rank
        assert abs(expected["eval_loss"] - got["eval_loss"]) / expected["eval_loss"] < 1e-5, rank
        for name, value in got["params"].items():  # each stage's parameters, by the model's own names
            assert (value - expected["params"][name]).abs().max() < 1e-5, (rank, name)
    owned = set().union(*(r["params"] for r in results))
    assert owned <= set(expected["params"])  # stages use the model's own names
    assert set(expected["params"]) - owned <= {"lm_head.weight"}  # only the tied alias is not separate
    assert expected["losses"][-1] < expected["losses"][0]


def test_interleaved_with_four_ranks(rank_pool, tmp_path, tmp_path_factory):
    """pp=4 x 2 chunks = 8 stages: a 6-layer model (8 blocks), 8 micro-batches."""
    args = {"n_layer": 6}
    expected = rank_pool(1).run(train_builtin, "gpt-tiny", str(tmp_path_factory.mktemp("ref6")), model_args=args,
                                steps=STEPS, global_batch_size=GLOBAL_BATCH, micro_batch_size=GLOBAL_BATCH)[0]
    results = rank_pool(4).run(train_builtin, "gpt-tiny", str(tmp_path), model_args=args, steps=STEPS,
                               strategy={"pp": 4, "schedule": "interleaved-1f1b", "chunks": 2},
                               global_batch_size=GLOBAL_BATCH, micro_batch_size=1)
    for got in results:
        assert max_relative_difference(expected["losses"], got["losses"]) < 1e-5
        assert max_relative_difference(expected["grad_norms"], got["grad_norms"]) < 1e-4


@pytest.mark.parametrize("pp", [2, 4])
def test_zbv_matches_single_process(rank_pool, tmp_path, tmp_path_factory, pp):
    """zbv: 2 chunks per rank as a V (rank 0 holds the embedding and the tied head), I/W split;
    a 6-layer model (8 blocks: enough for pp=4 x 2 chunks), 2 steps."""
    args, steps = {"n_layer": 6}, 2
    if "zbv" not in _references:
        _references["zbv"] = rank_pool(1).run(train_builtin, "gpt-tiny", str(tmp_path_factory.mktemp("ref-zbv")),
                                              model_args=args, steps=steps, global_batch_size=GLOBAL_BATCH,
                                              micro_batch_size=GLOBAL_BATCH)[0]
    expected = _references["zbv"]
    results = rank_pool(pp).run(train_builtin, "gpt-tiny", str(tmp_path), model_args=args, steps=steps,
                                strategy={"pp": pp, "schedule": "zbv", "chunks": 2},
                                global_batch_size=GLOBAL_BATCH, micro_batch_size=1)
    for rank, got in enumerate(results):
        assert max_relative_difference(expected["losses"], got["losses"]) < 1e-5, (rank, got["losses"])
        assert max_relative_difference(expected["grad_norms"], got["grad_norms"]) < 1e-4, rank
        for name, value in got["params"].items():
            assert (value - expected["params"][name]).abs().max() < 1e-5, (rank, name)
    assert {"tok_emb.weight", "ln_f.weight"} <= set(results[0]["params"])  # the V: first and last stage on rank 0


def test_cuts_balanced_on_device_speed_match_single_process(rank_pool, tmp_path, tmp_path_factory):
    """A --cluster whose second device runs at a quarter of the first's rate: --partition time gives the slow
    stage less work (uneven stages), and training still equals one process."""
    from test_hetero_cluster import BASE
    cluster = tmp_path / "mixed.toml"
    cluster.write_text(BASE.replace("num_devices = 4", "num_devices = 2").replace("devices_per_node = 4",
                                                                                  "devices_per_node = 2")
                       + "[[devices]]\nspeed = 1.0\n[[devices]]\nspeed = 0.25\n")
    expected = reference(rank_pool, tmp_path_factory, "gpt-tiny")
    runs = {name: rank_pool(2).run(train_builtin, "gpt-tiny", str(tmp_path / name), model_args=MODELS["gpt-tiny"],
                                   steps=STEPS, strategy={"pp": 2, **extra}, global_batch_size=GLOBAL_BATCH,
                                   micro_batch_size=2)
            for name, extra in (("aware", {"cluster": str(cluster)}), ("even", {}))}
    aware, even = ([r["local_numel"] for r in runs[name]] for name in ("aware", "even"))
    assert aware[1] < even[1] and aware[0] > even[0], (aware, even)  # the slow stage holds less
    for got in runs["aware"]:
        assert max_relative_difference(expected["losses"], got["losses"]) < 1e-5
        assert max_relative_difference(expected["grad_norms"], got["grad_norms"]) < 1e-4


def test_pipelines_with_uneven_shares_match_single_process(rank_pool, tmp_path, tmp_path_factory):
    """pp=2 x dp=2 with --dp-shares 3,1: the first pipeline runs 6 micro-batches, the second 2, and their summed
    gradients are one process's (eval too splits the batch by the same shares)."""
    expected = reference(rank_pool, tmp_path_factory, "gpt-tiny")
    results = rank_pool(4).run(train_builtin, "gpt-tiny", str(tmp_path), model_args=MODELS["gpt-tiny"], steps=STEPS,
                               strategy={"pp": 2, "dp": 2, "dp_shares": "3,1"}, global_batch_size=GLOBAL_BATCH,
                               micro_batch_size=1)
    assert [got["local_micro_batches"] for got in results] == [6, 2, 6, 2]  # ranks (stage, replica) in mesh order
    for got in results:
        assert max_relative_difference(expected["losses"], got["losses"]) < 1e-5
        assert max_relative_difference(expected["grad_norms"], got["grad_norms"]) < 1e-4
        assert abs(expected["eval_loss"] - got["eval_loss"]) / expected["eval_loss"] < 1e-5
