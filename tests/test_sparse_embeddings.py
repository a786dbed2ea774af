"""Sparse-embedding communication (EmbRace): every mode trains exactly like one process.

- sharded lookups (column- and row-wise) equal nn.Embedding, gradients included: duplicate
  ids, a rank with an empty batch, a width (6) the world size (4) does not divide;
- k steps with SGD, Adagrad and SparseAdam in dense / allgather / embrace (column, row)
  modes at 2 and 4 ranks equal a plain single-process torch loop on the global batch;
- 2D scheduling gives bit-identical parameters to the unscheduled exchange, really defers
  rows, and its per-row version check catches a schedule that ignores priorities;
- bytes each rank receives per step equal the cost formulas of the EmbRace analysis;
- the Trainer path (word tokenizer, word-lstm, clipping, LR schedule, checkpoint) matches dp=1;
- bad input gets clear errors on every rank.
"""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.errors import ConfigError
from autopar.sparse.schedule import RowPriorityQueue, RowVersions, StaleRowError
from sparse_helpers import (DIM, VOCAB, embrace_small_table, embrace_without_table, lookup_matches_embedding,
                            reference_training, train_sparse, train_word_lm)

OPTIMIZERS = ["sgd", "adagrad", "sparse-adam"]
MODES = [("dense", "column"), ("allgather", "column"), ("embrace", "column"), ("embrace", "row")]
_references: dict = {}


def reference(optimizer: str) -> dict:
    if optimizer not in _references:
        _references[optimizer] = reference_training(optimizer)
    return _references[optimizer]


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize("sharding", ["column", "row"])
def test_sharded_lookup_matches_embedding(rank_pool, sharding):
    rows = [3, 0, 5, 1]  # rank 1 has an empty batch; zipf ids repeat
    results = rank_pool(4).run(lookup_matches_embedding, sharding, rows)
    for rank, got in enumerate(results):
        assert got["shape"] == got["expected_shape"], rank
        assert got["lookup_error"] == 0.0, rank  # exact: a lookup copies rows, no arithmetic
        assert got["grad_error"] < 1e-6, rank
        assert got["gather_error"] == 0.0, rank  # exact: an all-gather copies
    assert any(got["grad_nonzero"] for got in results)  # (row-wise, a tail shard may get no gradient)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("mode,sharding", MODES, ids=lambda v: str(v))
@pytest.mark.parametrize("world,micro", [(2, 2), (4, 1)], ids=["dp2-accumulate", "dp4"])
def test_training_matches_single_process(rank_pool, world, micro, mode, sharding, optimizer):
    expected = reference(optimizer)
    results = rank_pool(world).run(train_sparse, mode, optimizer, sharding=sharding, micro=micro)
    for rank, got in enumerate(results):
        assert got["sparse"] == [True, False], got["description"]  # input table sparse, position table dense
        assert max_difference(expected["params"], got["params"]) < 1e-5, (rank, mode, optimizer)
        assert max(abs(x - y) for x, y in zip(expected["losses"], got["losses"])) < 1e-5, rank
    assert expected["losses"][-1] < expected["losses"][0]  # it trains, so equality means something


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("sharding", ["column", "row"])
def test_scheduled_equals_unscheduled(rank_pool, sharding, optimizer):
    pool = rank_pool(4)
    plain = pool.run(train_sparse, "embrace", optimizer, sharding=sharding, micro=2, steps=5)
    scheduled = pool.run(train_sparse, "embrace", optimizer, sharding=sharding, micro=2, steps=5, scheduled=True)
    for rank, (a, b) in enumerate(zip(plain, scheduled)):
        assert max_difference(a["params"], b["params"]) == 0.0, rank  # bitwise: scheduling reorders no arithmetic
        assert a["losses"] == b["losses"], rank  # (the same)
        assert b["reads_checked"] > 0, rank  # the version check looked at every read
    assert sum(b["rows_deferred"] for b in scheduled) > 0  # and rows really were deferred past their step


@pytest.mark.parametrize("sharding", ["column", "row"])
def test_version_check_catches_a_schedule_that_ignores_priority(rank_pool, sharding):
    with pytest.raises(AssertionError) as failure:  # the pool re-raises the ranks' error
        rank_pool(4).run(train_sparse, "embrace", "sgd", sharding=sharding, scheduled=True, break_priority=True,
                         timeout=60)
    assert "StaleRowError" in str(failure.value)
    assert "failed on rank(s) [0, 1, 2, 3]" in str(failure.value)  # every rank stops: no hang


def test_row_versions_and_priority_queue():
    versions = RowVersions(5)
    versions.mark_produced(torch.tensor([1, 3]), step=0)
    versions.mark_applied(torch.tensor([1]), step=0)
    versions.check_read(torch.tensor([0, 1, 2]), table="t", step=1)
    with pytest.raises(StaleRowError, match="row"):
        versions.check_read(torch.tensor([2, 3]), table="t", step=1)
    queue = RowPriorityQueue(torch.tensor([4, 7]), num_rows=10, step=3, deferred_chunks=2)
    ids = torch.tensor([7, 1, 4, 9, 4])
    urgent = queue.pop()
    assert urgent.key == 4 and urgent.select(ids).tolist() == [True, False, True, False, True]
    rest = [queue.pop().select(ids).tolist() for _ in range(len(queue))]
    assert rest == [[False, True, False, False, False], [False, False, False, True, False]]


@pytest.mark.parametrize("world", [2, 4])
def test_bytes_per_step_match_cost_formulas(rank_pool, world):
    pool = rank_pool(world)
    b = 8 // world * 8  # tokens per rank per step (8 sequences of 8 tokens per global batch)
    embrace = pool.run(train_sparse, "embrace", "sgd", steps=2)
    for got in embrace:
        for ledger in got["ledgers"]:
            # forward: my b tokens' other columns; backward: every other rank's b tokens in my columns
            assert ledger["lookup"] + ledger["grad"] == b * DIM + (world - 2) * b * got["shard_width"]
            assert ledger["ids"] == (world - 1) * b
    for step in range(2):  # averaged over ranks (column widths differ when d % N != 0): 2 (N-1)/N b d
        mean = sum(g["ledgers"][step]["lookup"] + g["ledgers"][step]["grad"] for g in embrace) / world
        assert mean == pytest.approx(2 * (world - 1) / world * b * DIM, rel=1e-12)
    allgather = pool.run(train_sparse, "allgather", "sgd", steps=2)
    for rank, got in enumerate(allgather):
        for step, ledger in enumerate(got["ledgers"]):
            others = sum(g["local_unique"][step] for r, g in enumerate(allgather) if r != rank)
            assert ledger["ids"] + ledger["rows"] == others * (DIM + 1)  # (N-1) u (d+1) with per-rank u
    dense = pool.run(train_sparse, "dense", "sgd", steps=1)
    table = VOCAB * DIM
    for got in dense:  # the table rides in the all-reduce: 2 (N-1)/N V d of it (ring model)
        assert got["ledgers"][0]["allreduce"] == round(2 * (world - 1) / world * got["dense_elements"])
        assert got["dense_elements"] == allgather[0]["dense_elements"] + table


def test_trainer_word_lm_embrace_and_allgather_match_dp1(rank_pool, tmp_path):
    clip = dict(grad_clip=0.1)  # small enough that clipping acts: the sharded norm must be right
    expected = rank_pool(1).run(train_word_lm, str(tmp_path / "ref"), strategy={}, **clip)[0]
    assert expected["records"][0]["grad_norm"] > 0.1
    for name, strategy in {"embrace": {"sparse_embeddings": "embrace"},
                           "row": {"sparse_embeddings": "embrace", "sparse_sharding": "row"},
                           "allgather": {"sparse_embeddings": "allgather"}}.items():
        results = rank_pool(2).run(train_word_lm, str(tmp_path / name), strategy=strategy, **clip)
        for rank, got in enumerate(results):
            assert "embed.weight: 1024 x 8" in got["description"] and "SPARSE" in got["description"]
            assert max(abs(x - y) / x for x, y in zip(expected["losses"], got["losses"])) < 1e-5, (name, rank)
            assert max_difference(expected["params"], got["params"]) < 1e-5, (name, rank)
            assert abs(expected["eval_loss"] - got["eval_loss"]) < 1e-5
            assert got["records"][-1]["comm_bytes"] > 0
    assert expected["losses"][-1] < expected["losses"][0]


@pytest.mark.parametrize("model", ["word-lstm", "word-gpt"])  # word-gpt: its position table is sparse too
def test_trainer_scheduled_sparse_adam_matches_dp1(rank_pool, tmp_path, model):
    kwargs = dict(grad_clip=0.0, optimizer="sparse-adam", lr=0.01, eval_every=2,  # evals between prefetch and use
                  model=model)
    expected = rank_pool(1).run(train_word_lm, str(tmp_path / "ref"), strategy={}, **kwargs)[0]
    results = rank_pool(2).run(train_word_lm, str(tmp_path / "sched"), strategy={
        "sparse_embeddings": "embrace", "sparse_schedule": True}, **kwargs)
    for got in results:
        assert max_difference(expected["params"], got["params"]) < 1e-5
        assert abs(expected["eval_loss"] - got["eval_loss"]) < 1e-5
        evals = [r["eval_loss"] for r in got["records"] if "eval_loss" in r]
        assert len(evals) == 3 and evals == pytest.approx([r["eval_loss"] for r in expected["records"]
                                                           if "eval_loss" in r], rel=1e-5)
        assert "2D scheduled" in got["description"]
        if model == "word-gpt":  # read with positions, not token ids: its next reads are unknown
            assert "pos_emb.weight is not read with the batch's token ids" in got["description"]


def test_bad_input_gets_clear_errors(rank_pool):
    for bad in (-0.1, 1.5):
        with pytest.raises(ConfigError, match=r"sparse_threshold .* must be in \[0, 1\], got"):
            autopar.Strategy(sparse_threshold=bad).resolved(2)
    from autopar.strategies import resolve  # combinations: the rule table
    batch = autopar.TrainConfig(global_batch_size=8, micro_batch_size=2)
    with pytest.raises(ConfigError, match="data parallelism only"):
        resolve(autopar.Strategy(sparse_embeddings="embrace", pp=2), batch, 2)
    with pytest.raises(ConfigError, match="needs --sparse-embeddings embrace"):
        resolve(autopar.Strategy(sparse_embeddings="allgather", sparse_schedule=True), batch, 2)
    with pytest.raises(ConfigError, match="sparse_sharding"):
        autopar.Strategy(sparse_sharding="diagonal").resolved(2)
    pool = rank_pool(4)
    assert all("needs a model with an nn.Embedding" in m for m in pool.run(embrace_without_table))
    small = pool.run(embrace_small_table, 3, 8)
    assert all("fewer than the 4 data-parallel ranks" in m and "3 rows" in m for m in small)
    assert all("narrower than the 4 ranks" in m for m in pool.run(embrace_small_table, 50, 2))
    assert all(m == "" for m in pool.run(embrace_small_table, 50, 2, "row"))  # row sharding is fine there
    assert all("not row-separable" in m for m in pool.run(embrace_small_table, 50, 8, "column", "adamw"))
    with pytest.raises(ConfigError, match="--grad-clip 0"):  # clipping beside the 2D schedule: before any rank
        resolve(autopar.Strategy(sparse_embeddings="embrace", sparse_schedule=True),
                autopar.TrainConfig(optimizer="sgd", grad_clip=1.0, global_batch_size=8, micro_batch_size=2), 2)
