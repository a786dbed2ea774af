"""Sub-pipelined tensor parallelism (--tp-subbatches K) trains exactly like one process.

The K sub-batches are independent rows, so K > 1 must give the single-process losses,
gradient norms and parameters (same reference and tolerances as test_tp_equivalence.py).
The interleaving itself is checked on the built graph: copy j's all-reduce is started,
then copy j+1's compute of the same segment runs, and only then does copy j wait.
"""

from __future__ import annotations

import pytest

import autopar
from autopar.errors import ConfigError
from autopar.tensor_parallel.subpipeline import START, WAIT
from helpers import train_builtin
from test_tp_equivalence import GLOBAL_BATCH, MODELS, STEPS, assert_matches, reference

# (model, world, strategy, micro-batch size)
LAYOUTS = [
    ("gpt-tiny", 2, {"tp": 2, "tp_subbatches": 2}, 2),
    ("gpt-tiny", 2, {"tp": 2, "tp_subbatches": 4}, 4),
    ("hf:llama", 2, {"tp": 2, "tp_subbatches": 2}, 4),
    ("gpt-tiny", 4, {"tp": 2, "pp": 2, "schedule": "1f1b", "tp_subbatches": 2}, 2),
    ("hf:llama", 4, {"tp": 2, "pp": 2, "schedule": "1f1b", "tp_subbatches": 2}, 2),
    ("gpt-tiny", 4, {"tp": 2, "pp": 2, "schedule": "1f1b", "recompute": "all", "tp_subbatches": 2}, 2),
]


@pytest.mark.parametrize("model,world,strategy,micro", LAYOUTS, ids=lambda v: str(v))
def test_sub_pipelined_tp_matches_single_process(rank_pool, tmp_path, tmp_path_factory, model, world, strategy, micro):
    expected = reference(rank_pool, tmp_path_factory, model)
    results = rank_pool(world).run(train_builtin, model, str(tmp_path), model_args=MODELS[model], steps=STEPS,
                                   strategy=strategy, global_batch_size=GLOBAL_BATCH, micro_batch_size=micro)
    assert_matches(expected, results)


def _interleaving(model: str, k: int, micro: int) -> list[list[tuple[str, int, str]]]:
    """(kind, sub-batch, reduce) for every start / wait / compute node of this rank's built stage graph."""
    from autopar.models import build_model
    from helpers import small_data
    from autopar.data import padded_vocab_size

    net, info = build_model(model, MODELS[model], vocab_size=padded_vocab_size(258), device="meta")
    train_data, _ = small_data(info.task, 32)
    config = autopar.TrainConfig(steps=1, global_batch_size=micro, micro_batch_size=micro, out=None, progress=False,
                                 timeout_s=60)
    trainer = autopar.Trainer(net, train_data, strategy=autopar.Strategy(tp=2, tp_subbatches=k), config=config)
    trainer._setup()
    (stage,) = trainer.engine.stages.values()
    (piece,) = stage._pieces
    order = []
    for node in piece.graph.nodes:
        if node.op == "call_module" and node.target in (START, WAIT):
            order.append((node.target, node.meta["subbatch"], node.args[0].name if node.target == START else
                          node.name.removeprefix(WAIT + "_").rsplit("_sub", 1)[0]))
        elif "subbatch" in node.meta:
            order.append(("compute", node.meta["subbatch"], ""))
    trainer.engine.close()
    return order


def test_sub_batches_are_interleaved(rank_pool):
    k = 2
    order = rank_pool(2).run(_interleaving, "gpt-tiny", k, 4)[0]
    starts = [(i, j, name) for i, (kind, j, name) in enumerate(order) if kind == START]
    waits = {(j, name): i for i, (kind, j, name) in enumerate(order) if kind == WAIT}
    assert len(starts) == k * 2 * MODELS["gpt-tiny"]["n_layer"]  # attention + MLP reduce per layer, per copy
    reduce_of_start = {}  # (copy, n-th reduce of that copy) -> position; copies start their reduces in one order
    for i, j, _ in starts:
        reduce_of_start[(j, sum(1 for s in starts if s[1] == j and s[0] < i))] = i
    waits_by_copy = {j: sorted(i for (jj, _), i in waits.items() if jj == j) for j in range(k)}
    for j in range(k):
        assert len(waits_by_copy[j]) == 2 * MODELS["gpt-tiny"]["n_layer"]
    for (j, n), start in reduce_of_start.items():
        wait = waits_by_copy[j][n]
        assert start < wait
        between = {order[i][1] for i in range(start + 1, wait) if order[i][0] == "compute"}
        # another sub-batch computes while this one's all-reduce is in flight
        assert between - {j}, (j, n, start, wait)
        if j == 0:  # copy 1 starts its reduce of the same layer before copy 0 waits on its own
            assert reduce_of_start[(1, n)] < wait


def test_bad_tp_subbatches_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="tp_subbatches"):
        autopar.Strategy(tp=2, tp_subbatches=0).resolved(2)
    from autopar.tensor_parallel.subpipeline import check_tp_subbatches
    with pytest.raises(ConfigError, match=r"tp_subbatches=3 does not divide micro_batch_size=4.*\[1, 2, 4\]"):
        check_tp_subbatches(autopar.Strategy(tp=2, tp_subbatches=3), 4)
    with pytest.raises(ConfigError, match="tp=1"):
        check_tp_subbatches(autopar.Strategy(tp=1, tp_subbatches=2), 4)


def _setup_error(k: int, micro: int) -> str:
    from autopar.models import build_model
    from autopar.data import padded_vocab_size
    from helpers import small_data

    net, info = build_model("gpt-tiny", MODELS["gpt-tiny"], vocab_size=padded_vocab_size(258), device="meta")
    config = autopar.TrainConfig(steps=1, global_batch_size=2 * micro, micro_batch_size=micro, out=None,
                                 progress=False, timeout_s=60)
    trainer = autopar.Trainer(net, small_data(info.task, 32)[0], strategy=autopar.Strategy(tp=2, tp_subbatches=k),
                              config=config)
    try:
        trainer.train()
    except ConfigError as exc:
        return str(exc)
    return "no error"


def test_trainer_refuses_a_k_that_does_not_divide_the_micro_batch_on_every_rank(rank_pool):
    for message in rank_pool(2).run(_setup_error, 3, 4):
        assert "tp_subbatches=3 does not divide micro_batch_size=4" in message, message
